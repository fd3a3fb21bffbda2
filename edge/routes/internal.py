"""``GET /internal/route-key``: the proxy asks which user a bearer token belongs to, to pin the user.

Where this sits: nginx in front of the edges (infra/nginx/, docs/fleet.md) hashes each request onto
an edge by user, so that a user's burst bucket (docs/edge.md, "The burst bucket") lives on one edge.
Stock nginx cannot read a JWT, so before it passes a request on it makes one ``auth_request``
subrequest here, with the client's ``Authorization`` header and no body, and caches the answer per
token for a minute. Any edge can answer (the key depends only on the token and the fleet's shared
fingerprint key), so the proxy sends these round-robin, apart from the sticky upstream.

The answer is always ``204``, so that nginx always goes on to the real request:

- a token this edge accepts (verified exactly as every route verifies it, ``edge.auth``): the header
  ``X-Chatplane-Route-Key`` holds a keyed digest of the user id, hex only, so no text from the
  client reaches a header and the user id itself never leaves the edge;
- a missing or refused token: no header. The proxy then hashes the token itself, and the real
  request gets the route's typed ``401`` from whichever edge it reaches;
- the client address's bucket (edge/client_ip.py) empty: no header, and ``X-Accel-Expires: 0`` so
  nginx does not cache that answer. The bucket is only peeked at, never taken from: the look-up must
  not spend the client's requests, but a flood of fresh bad tokens from one address must not buy a
  signature check each once its real requests are being refused for the price of a look-up.

No burst bucket is taken and no command is sent: the look-up costs a dictionary read for a token
verified before (``edge.auth`` remembers verified tokens) and one signature check otherwise. The route
is left out of the OpenAPI document: it is for the proxy, and the public site does not pass it on.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import APIRouter, Header, Request
from starlette.responses import Response

from edge.deps import EdgeDep
from edge.errors import ApiError

ROUTE_KEY_PATH = "/internal/route-key"
ROUTE_KEY_HEADER = "X-Chatplane-Route-Key"
# Digest size of the route key (bytes): 128 bits keep two users' keys apart; the proxy only hashes it.
ROUTE_KEY_DIGEST_BYTES = 16
# The BLAKE2b personalization: the same user's key here never equals its reference in the outcome
# records (schemas.outcomes.user_ref), so the proxy's cache and the SLO report cannot be joined.
ROUTE_KEY_PERSON = b"chatplane-route"
# nginx's header that overrides its cache validity for one response; "0": do not cache it.
NO_CACHE_HEADERS = {"X-Accel-Expires": "0"}

router = APIRouter(prefix="/internal", include_in_schema=False)


def route_key(user_id: str, key: str) -> str:
    """The user's route key: a digest keyed with the fleet's fingerprint key, so that every edge
    gives one user the same key and a guessed user id cannot be checked against it without the key."""
    mac_key = hashlib.sha256(key.encode()).digest()
    return hashlib.blake2b(
        user_id.encode(), digest_size=ROUTE_KEY_DIGEST_BYTES, key=mac_key, person=ROUTE_KEY_PERSON
    ).hexdigest()


@router.get("/route-key", status_code=204)
async def user_route_key(
    request: Request, edge: EdgeDep, authorization: Annotated[str | None, Header(include_in_schema=False)] = None
) -> Response:
    if not edge.ip_limiter.has_token(request.scope):
        return Response(status_code=204, headers=NO_CACHE_HEADERS)
    try:
        principal = await edge.auth.authenticate_async(authorization)
    except ApiError:
        return Response(status_code=204)
    return Response(status_code=204, headers={ROUTE_KEY_HEADER: route_key(principal.user_id, edge.settings.fingerprint_key)})
