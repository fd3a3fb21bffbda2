"""The one reader of request bodies: every route's body is counted while it is read and refused at its cap.

Where this sits: between uvicorn (which hands the app a body in pieces, ``http.request`` messages) and
the routes. No route binds a body through FastAPI (a ``BaseModel`` parameter reads the whole body
before any check, however large): a route that takes a body calls ``read_body`` with its cap, after
its cheaper checks (authentication first), then parses the bytes strictly itself. A route that takes
none gets ``refuse_unexpected_body`` as an app-wide dependency: an empty body (no ``Content-Length``,
``Content-Length: 0``, or an empty chunked one) passes, any other is refused after at most one piece
was read. ``BODY_ROUTES`` lists the routes that take one; a unit test holds it to the served routes.

A refusal is ``400 invalid_request`` with ``details.field = "body"`` and ``details.limit`` (the route's
cap in bytes; 0 for a route that takes no body). The app reads nothing past the cap; uvicorn reads and
drops the rest of a body the client goes on sending (closing at once would send the client a reset,
which can destroy the answer before it is read), and the connection then serves the next request.
"""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from fastapi.dependencies.models import Dependant
from starlette.requests import Request

from edge.errors import ApiError
from schemas.codes import RejectionCode
from schemas.messages import RejectionDetails

# (method, route path) of every route that reads a body; every other route refuses one.
BODY_ROUTES = frozenset(
    {
        ("POST", "/v1/generations"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/conversations"),
        ("POST", "/v1/client-metrics"),
        ("POST", "/dev/token"),
    }
)
BODY_FIELD = "body"

_Call = TypeVar("_Call")


def body_too_large(limit_bytes: int) -> ApiError:
    return ApiError(RejectionCode.INVALID_REQUEST, RejectionDetails(limit=limit_bytes), field=BODY_FIELD)


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The body, counted while it is read: a larger declared ``Content-Length`` is refused unread, and
    a chunked body is refused at the first piece that passes the cap, never buffered whole."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit_bytes):
        raise body_too_large(limit_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise body_too_large(limit_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit_bytes: int) -> Any:
    """``read_body`` parsed as one JSON document; anything else is the same 400 naming the body."""
    body = await read_body(request, limit_bytes)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ApiError(RejectionCode.INVALID_REQUEST, field=BODY_FIELD) from None


def takes_body(request: Request) -> bool:
    route = request.scope.get("route")
    return (request.method, getattr(route, "path", None)) in BODY_ROUTES


async def refuse_body(request: Request) -> None:
    """A route that takes no body accepts an empty one and refuses any other (at most one piece read).

    A request with neither ``Content-Length`` nor ``Transfer-Encoding`` has no body (RFC 9112 6.3),
    so it passes without a read."""
    headers = request.headers
    if "content-length" not in headers and "transfer-encoding" not in headers:
        return
    await read_body(request, 0)


# The dependencies that call ``refuse_body`` themselves (``edge.deps.principal``, after authentication),
# marked by ``refuses_body_itself``: edge.deps imports this module, so this one names none of its own.
_REFUSING_DEPENDENCIES: list[Any] = []


def refuses_body_itself(call: _Call) -> _Call:
    """Marks a dependency that calls ``refuse_body`` itself: ``refuse_unexpected_body`` leaves a route
    that depends on it to that dependency."""
    _REFUSING_DEPENDENCIES.append(call)
    return call


def _depends_on_refusing(dependant: Dependant) -> bool:
    # A route's tree is a handful of nodes (principal, key, path and query parameters): walked per request.
    return any(
        any(d.call is call for call in _REFUSING_DEPENDENCIES) or _depends_on_refusing(d) for d in dependant.dependencies
    )


async def refuse_unexpected_body(request: Request) -> None:
    """App-wide dependency: ``refuse_body`` for a route that takes no body and does not authenticate.

    A route that authenticates refuses a body after authentication instead (``edge.deps.principal``
    calls ``refuse_body``), in the documented order of the checks: the client address's bucket, the
    token, then the body."""
    if takes_body(request):
        return
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is not None and _depends_on_refusing(dependant):
        return
    await refuse_body(request)
