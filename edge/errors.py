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
        message: str | None = None,
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
        # The answer's message when the table's is too general to name what is wrong (message_of).
        self.message = message


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


# What an invalid_request message says about a field the client can fix; any other field is named
# in the general form of message_of. Names only: the client's values are never echoed.
_FIELD_MESSAGES = {
    "model": "The request's model is not a model of this service; GET /v1/models lists the ones you may use.",
    "method": "This route does not take this method.",
    "Idempotency-Key": "The Idempotency-Key header is missing or invalid: 1 to 255 printable ASCII characters.",
}
# Which thing a 404 is about, by the path parameter of the route that answered it.
_NOT_FOUND_MESSAGES = {
    "generation_id": "No such generation.",
    "conversation_id": "No such conversation.",
}
NO_SUCH_ROUTE = "No such route."
# A field name is the client's own key for an unknown field; the message quotes at most this much of it.
_FIELD_CHARS_IN_MESSAGE_MAX = 64


def message_of(err: ApiError) -> str:
    """The answer's message: the error's own, else one naming the field at fault (invalid_request),
    else the table's."""
    if err.message is not None:
        return err.message
    if err.code is RejectionCode.INVALID_REQUEST and err.field:
        if err.field == "body" and err.details.limit is not None:
            return f"The request body is over its limit of {err.details.limit} bytes."
        known = _FIELD_MESSAGES.get(err.field)
        if known is not None:
            return known
        field = err.field if len(err.field) <= _FIELD_CHARS_IN_MESSAGE_MAX else err.field[:_FIELD_CHARS_IN_MESSAGE_MAX] + "..."
        bound = f" (limit {err.details.limit})" if err.details.limit is not None else ""
        return f"The request's {field} is invalid{bound}; fix it before retrying."
    return REJECTIONS[err.code].message


def not_found_message(route_path: str | None) -> str:
    """A 404's message naming its thing: the route's id parameter, or no route at all."""
    if route_path is None:
        return NO_SUCH_ROUTE
    for param, message in _NOT_FOUND_MESSAGES.items():
        if "{" + param + "}" in route_path:
            return message
    return REJECTIONS[RejectionCode.NOT_FOUND].message


def error_body(
    code: RejectionCode, request_id: str, details: dict[str, Any], extra: dict[str, Any] | None = None,
    message: str | None = None,
) -> dict[str, Any]:
    spec = REJECTIONS[code]
    error: dict[str, Any] = {
        "code": code.value,
        "message": message if message is not None else spec.message,
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
        orjson.dumps(error_body(err.code, request_id, details, err.extra, message_of(err))),
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


def route_path_of(request: Request) -> str | None:
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else None


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    note_refusal(request, exc.code)
    if exc.code is RejectionCode.NOT_FOUND and exc.message is None:
        exc.message = not_found_message(route_path_of(request))
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
    """Framework-level errors (unknown route, wrong method) keep the typed body too.

    No route reads its body through FastAPI (edge/body.py), so these are the router's own answers:
    404 for a path no route serves (a trailing slash included: the app never redirects), 405 for a
    method the route does not take; anything else names the request as a whole."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        err = ApiError(RejectionCode.NOT_FOUND, message=not_found_message(route_path_of(request)))
    else:
        err = ApiError(RejectionCode.INVALID_REQUEST, field="method" if exc.status_code == 405 else "request")
    resp = error_response(err, request_id_of(request))
    if exc.status_code == 405:
        resp.status_code = 405
    return resp


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    """A bug must not leak a stack trace; it is logged (ids only) and answered as a typed 500
    ``internal_error``, apart from admission's ``quota_service_unavailable`` so dashboards tell them apart."""
    import logging

    logging.getLogger("chatplane.edge").exception("unhandled error request_id=%s", request_id_of(request))
    edge = getattr(request.app.state, "edge", None)
    if edge is not None:
        edge.metrics.unhandled_errors.inc()
    return error_response(ApiError(RejectionCode.INTERNAL_ERROR), request_id_of(request))
