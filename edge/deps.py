"""FastAPI dependencies of the edge routes, as ``Annotated`` aliases (one place to see what a route needs).

All are ``async def``: FastAPI runs a plain ``def`` dependency in a thread pool, and the hand-off to a
thread (and back, under the GIL) per request was the edge's largest cost at a few hundred requests/s.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Depends, Header, Request

from edge.auth import Principal
from edge.errors import ApiError
from schemas.codes import RejectionCode

IDEMPOTENCY_KEY_CHARS_MAX = 255


class EdgeState:
    """Everything the routes use, built once by ``edge.app.create_app`` (see there)."""


async def edge_state(request: Request):  # -> edge.app.Edge (not imported: avoids a cycle)
    return request.app.state.edge


async def principal(request: Request, authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> Principal:
    """The bearer token's principal (declared in the spec as the ``bearer`` security scheme)."""
    return await request.app.state.edge.auth.authenticate_async(authorization)


async def idempotency_key(idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None) -> str:
    key = (idempotency_key or "").strip()
    if not key or len(key) > IDEMPOTENCY_KEY_CHARS_MAX or not key.isprintable() or not key.isascii():
        raise ApiError(RejectionCode.INVALID_REQUEST, field="Idempotency-Key")
    return key


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


CurrentPrincipal = Annotated[Principal, Depends(principal)]
IdempotencyKey = Annotated[str, Depends(idempotency_key)]
EdgeDep = Annotated[object, Depends(edge_state)]
