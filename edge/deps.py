"""FastAPI dependencies of the edge routes, as ``Annotated`` aliases (one place to see what a route needs).

All are ``async def``: FastAPI runs a plain ``def`` dependency in a thread pool, and the hand-off to a
thread (and back, under the GIL) per request was the edge's largest cost at a few hundred requests/s.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Depends, Header, Request

from edge.auth import Principal
from edge.body import refuse_body, refuses_body_itself, takes_body
from edge.errors import ApiError
from edge.outcomes import note_user
from edge.state import Edge, edge_of
from schemas.codes import RateLimitScope, RejectionCode
from schemas.messages import RejectionDetails

IDEMPOTENCY_KEY_CHARS_MAX = 255


def edge_state(request: Request) -> Edge:
    """The app's ``Edge`` (edge/state.py), typed: for code that holds a request but is no route
    handler (a route takes ``EdgeDep``)."""
    return edge_of(request.app)


async def current_edge(request: Request) -> Edge:
    """``EdgeDep``'s dependency: the app's ``Edge``."""
    return edge_of(request.app)


@refuses_body_itself
async def principal(request: Request, authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> Principal:
    """The bearer token's principal (declared in the spec as the ``bearer`` security scheme).

    First the client address's burst bucket (edge/client_ip.py), before any work on the token: a
    flood of bad tokens or new accounts from one address is refused for the price of a look-up."""
    edge = edge_state(request)
    wait_s = edge.ip_limiter.take(request.scope)
    if wait_s > 0:
        raise ApiError(
            RejectionCode.RATE_LIMITED, RejectionDetails(retry_after_ms=int(wait_s * 1000)), scope=RateLimitScope.IP
        )
    found = await edge.auth.authenticate_async(authorization)
    note_user(request, found.user_id)  # the outcome record's opaque user reference (edge/outcomes.py)
    if not takes_body(request):
        await refuse_body(request)  # after the token, as the body routes check their bodies (edge/body.py)
    return found


async def idempotency_key(idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None) -> str:
    key = (idempotency_key or "").strip()
    if not key or len(key) > IDEMPOTENCY_KEY_CHARS_MAX or not key.isprintable() or not key.isascii():
        raise ApiError(RejectionCode.INVALID_REQUEST, field="Idempotency-Key")
    return key


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


CurrentPrincipal = Annotated[Principal, Depends(principal)]
IdempotencyKey = Annotated[str, Depends(idempotency_key)]
EdgeDep = Annotated[Edge, Depends(current_edge)]
