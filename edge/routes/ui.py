"""The web chat page and what it needs besides the API.

- ``GET /`` is the page; its scripts and styles are static files of the package (``edge/ui/``,
  served under ``/ui/``; plain JavaScript modules, no build step). The page's Content-Security-Policy
  allows scripts, styles and connections from this origin only: rendered answers are built as DOM
  text nodes (edge/ui/markdown.js), and the policy is the second wall against an injected element.
- ``GET /dev`` and ``POST /dev/token`` exist only in development mode (``CHATPLANE_DEV_MODE=1``, the
  one switch that also allows the built-in secrets; ``make up`` sets it): a token for a user name, so
  a person can try the page without an identity provider. Elsewhere both are a typed ``404`` like any
  unknown route, and the page asks for a bearer token instead (docs/edge.md, "The web page").
- ``POST /v1/client-metrics`` is the page's content-free beacon: the first-token time it observed
  (Enter to first rendered token), exported as ``chatplane_edge_client_first_token_seconds`` beside
  the server-side TTFT. Only a number travels; the caller is authenticated so strangers cannot skew it,
  a figure past the latest a first token can come (the processor's deadlines) is refused, and each
  user's beacons take a bucket of their own (never the generation bucket).

Both bodies are read by ``edge.body`` like every other (capped while reading, parsed strictly here).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Literal

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from control_plane.policy import Policy
from edge.auth import mint
from edge.body import read_json
from edge.deps import CurrentPrincipal, EdgeDep
from edge.errors import ApiError
from edge.routes.generations import validated
from schemas.codes import RateLimitScope, RejectionCode, Tier
from schemas.messages import RejectionDetails

UI_DIR = resources.files("edge") / "ui"
# A development token lives this long; the page asks for a new one when a call answers 401.
DEV_TOKEN_TTL_S = 8 * 3600
DEV_USER_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
# The bodies of these routes are a number and a name: far below the generation routes' cap.
CLIENT_METRICS_BODY_BYTES_MAX = 1024
DEV_TOKEN_BODY_BYTES_MAX = 1024

PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

_STRICT = ConfigDict(extra="forbid", strict=True)


class DevTokenRequest(BaseModel):
    model_config = _STRICT
    user: str = Field(min_length=1, max_length=64)
    tier: Literal["free", "paid"] = "free"


def first_token_ms_max(policy: Policy) -> int:
    """The latest a first token can come after its request: a dispatch is accepted within the queue
    wait, and an accepted attempt runs at most its duration plus the grace (the processor's deadlines).
    A beacon beyond it reports a token no generation produced (a clock jump, a tab asleep)."""
    return policy.queue_wait_max_ms + policy.generation_duration_max_ms + policy.run_deadline_grace_ms


@functools.cache
def client_metrics_model(first_token_ms_max: int) -> type[BaseModel]:
    """What the page reports: one figure, no content, within the bound (the document states it)."""
    return create_model(
        "ClientMetrics",
        __config__=_STRICT,
        __doc__="What the page reports: one figure (milliseconds from Enter to the first token shown), no content.",
        # Strict float: a JSON integer is taken, a string or a boolean is not.
        first_token_ms=(float, Field(ge=0, le=first_token_ms_max, allow_inf_nan=False)),
    )


def client_metrics_model_for(policy: Policy) -> type[BaseModel]:
    return client_metrics_model(first_token_ms_max(policy))


router = APIRouter(tags=["ui"])


@router.get("/", include_in_schema=False)
async def page() -> Response:
    return FileResponse(str(UI_DIR / "index.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@router.post(
    "/v1/client-metrics", status_code=204, summary="The web page's first-token beacon (a number, no content)",
)
async def client_metrics(request: Request, principal: CurrentPrincipal, edge: EdgeDep) -> Response:
    report = validated(await read_json(request, CLIENT_METRICS_BODY_BYTES_MAX), client_metrics_model_for(edge.settings.policy))
    wait_s = edge.beacon_buckets.take(principal.user_id)
    if wait_s > 0:
        raise ApiError(
            RejectionCode.RATE_LIMITED, RejectionDetails(retry_after_ms=int(wait_s * 1000)), scope=RateLimitScope.CLIENT_METRICS
        )
    edge.metrics.client_first_token.observe(float(report.first_token_ms) / 1000.0)
    return Response(status_code=204)


dev_router = APIRouter(prefix="/dev", include_in_schema=False)


@dev_router.get("")
async def dev_info() -> Response:
    return JSONResponse({"dev_mode": True, "tiers": [t.value for t in Tier]}, headers={"Cache-Control": "no-store"})


@dev_router.post("/token")
async def dev_token(request: Request, edge: EdgeDep) -> Response:
    body = validated(await read_json(request, DEV_TOKEN_BODY_BYTES_MAX), DevTokenRequest)
    if not DEV_USER_RE.match(body.user):
        raise ApiError(RejectionCode.INVALID_REQUEST, field="user")
    token = mint(edge.settings, body.user, Tier(body.tier), DEV_TOKEN_TTL_S)
    return JSONResponse(
        {"token": token, "token_type": "bearer", "expires_in": DEV_TOKEN_TTL_S, "user": body.user, "tier": body.tier},
        headers={"Cache-Control": "no-store"},
    )


def install(app: FastAPI, dev_mode: bool) -> None:
    app.include_router(router)
    if dev_mode:
        app.include_router(dev_router)
    app.mount("/ui", StaticFiles(directory=str(UI_DIR)), name="ui")
