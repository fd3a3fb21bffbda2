"""The one place where a ``RejectionCode`` becomes an HTTP response (via ``schemas.codes.REJECTIONS``).

Routes and helpers raise ``ApiError(code, details)``; the exception handler registered in
``edge.app`` renders the seed's error body (section 5)::

    {"error": {"code", "message", "retryable", "action", "request_id", "details"}}

with ``Retry-After`` (whole seconds, rounded up) on 429 and 503 answers. After streaming headers
have gone out, the same codes travel as ``generation.error`` events instead (``edge.sse``).
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from edge.outcomes import note_refusal
from schemas.codes import REJECTIONS, RateLimitScope, RejectionCode
from schemas.messages import RejectionDetails

# Statuses whose answers carry Retry-After when the decision gave a delay (RFC 9110 10.2.3).
_RETRY_AFTER_STATUSES = frozenset({429, 503})
# Retry-After for a fail-closed admission when nothing better is known.
QUOTA_SERVICE_RETRY_AFTER_S = 2
# Retry-After while this replica drains (the load balancer routes the retry elsewhere).
DRAINING_RETRY_AFTER_S = 1
# Retry-After of a 429/503 whose decision carried no delay (every such answer has the header).
DEFAULT_RETRY_AFTER_S = 1


def iso_utc(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """A typed refusal; rendered by ``error_response``. ``details`` never carries content."""

    def __init__(
        self,
        code: RejectionCode,
        details: RejectionDetails | None = None,
        *,
        field: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        scope: RateLimitScope | None = None,
    ) -> None:
        super().__init__(code.value)
        self.code = code
        self.details = details or RejectionDetails()
        self.field = field if field is not None else self.details.field
        self.retry_after_s = retry_after_s
        self.headers = headers or {}
        self.extra = extra or {}
        # rate_limited: which bucket refused (details.scope), the user's or the client address's.
        self.scope = scope


def details_json(details: RejectionDetails, field: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if details.limit is not None:
        out["limit"] = details.limit
    if details.remaining is not None:
        out["remaining"] = details.remaining
    if details.reset_at_ms is not None:
        out["reset_at"] = iso_utc(details.reset_at_ms)
    if details.retry_after_ms is not None:
        out["retry_after_ms"] = details.retry_after_ms
    if details.revision is not None:
        out["revision"] = details.revision
    if details.kind is not None:
        out["kind"] = details.kind  # which limit refused: "tokens" (absent: the message quota or slots)
    if field is not None:
        out["field"] = field
    return out


def error_body(code: RejectionCode, request_id: str, details: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = REJECTIONS[code]
    error: dict[str, Any] = {
        "code": code.value,
        "message": spec.message,
        "retryable": spec.retryable,
        "action": spec.action.value,
        "request_id": request_id,
        "details": details,
    }
    if extra:
        error.update(extra)
    return {"error": error}


def error_response(err: ApiError, request_id: str) -> Response:
    spec = REJECTIONS[err.code]
    details = details_json(err.details, err.field)
    if err.scope is not None:
        details["scope"] = err.scope.value
    headers = {"Cache-Control": "no-store", "X-Request-Id": request_id, **err.headers}
    retry_after_s = err.retry_after_s
    if retry_after_s is None and err.details.retry_after_ms is not None:
        retry_after_s = err.details.retry_after_ms / 1000
    if spec.http_status in _RETRY_AFTER_STATUSES:
        if retry_after_s is None and err.code is RejectionCode.QUOTA_SERVICE_UNAVAILABLE:
            retry_after_s = QUOTA_SERVICE_RETRY_AFTER_S
        if retry_after_s is None and err.details.reset_at_ms is not None:
            # quota_exhausted: the window reset is the earliest moment a new request can pass.
            retry_after_s = max(0.0, (err.details.reset_at_ms - _now_ms()) / 1000)
        if retry_after_s is None:
            retry_after_s = DEFAULT_RETRY_AFTER_S
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
        details.setdefault("retry_after_ms", int(retry_after_s * 1000))
    if err.code is RejectionCode.UNAUTHORIZED:
        headers["WWW-Authenticate"] = 'Bearer realm="chatplane"'
    return Response(
        orjson.dumps(error_body(err.code, request_id, details, err.extra)),
        status_code=spec.http_status,
        media_type="application/json",
        headers=headers,
    )


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def request_id_of(request: Request) -> str:
    rid = getattr(request.state, "request_id", None)
    return rid if isinstance(rid, str) else "req_unknown"


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    note_refusal(request, exc.code)
    return error_response(exc, request_id_of(request))


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    where = "body"
    if errors:
        loc = [str(p) for p in errors[0].get("loc", ()) if p not in ("body",)]
        where = ".".join(loc) or "body"
    note_refusal(request, RejectionCode.INVALID_REQUEST)
    return error_response(ApiError(RejectionCode.INVALID_REQUEST, field=where), request_id_of(request))


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Framework-level errors (unknown route, wrong method) keep the typed body too."""
    assert isinstance(exc, StarletteHTTPException)
    code = RejectionCode.NOT_FOUND if exc.status_code == 404 else RejectionCode.INVALID_REQUEST
    err = ApiError(code, field=None if code is RejectionCode.NOT_FOUND else "method")
    resp = error_response(err, request_id_of(request))
    if exc.status_code == 405:
        resp.status_code = 405
    return resp


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    """A bug must not leak a stack trace; it is logged (ids only) and answered as a typed 503."""
    import logging

    logging.getLogger("chatplane.edge").exception("unhandled error request_id=%s", request_id_of(request))
    edge = getattr(request.app.state, "edge", None)
    if edge is not None:
        edge.metrics.unhandled_errors.inc()
    return error_response(ApiError(RejectionCode.QUOTA_SERVICE_UNAVAILABLE), request_id_of(request))
