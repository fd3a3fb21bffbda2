"""The web chat page and what it needs besides the API (issue 17, part 1).

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
  the server-side TTFT. Only a number travels; the caller is authenticated so strangers cannot skew it.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Literal

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from edge.auth import mint
from edge.deps import CurrentPrincipal
from edge.errors import ApiError
from schemas.codes import RejectionCode, Tier

UI_DIR = resources.files("edge") / "ui"
# A development token lives this long; the page asks for a new one when a call answers 401.
DEV_TOKEN_TTL_S = 8 * 3600
DEV_USER_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
# The beacon's range: a figure outside it is refused (a clock jump, a tab asleep), never recorded.
CLIENT_FIRST_TOKEN_MS_MAX = 600_000

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


class ClientMetrics(BaseModel):
    """What the page reports: one figure, no content."""

    model_config = _STRICT
    first_token_ms: float | int = Field(ge=0, le=CLIENT_FIRST_TOKEN_MS_MAX)


router = APIRouter(tags=["ui"])


@router.get("/", include_in_schema=False)
async def page() -> Response:
    return FileResponse(str(UI_DIR / "index.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@router.post(
    "/v1/client-metrics", status_code=204, summary="The web page's first-token beacon (a number, no content)",
)
async def client_metrics(request: Request, principal: CurrentPrincipal, body: ClientMetrics) -> Response:
    request.app.state.edge.metrics.client_first_token.observe(float(body.first_token_ms) / 1000.0)
    return Response(status_code=204)


dev_router = APIRouter(prefix="/dev", include_in_schema=False)


@dev_router.get("")
async def dev_info() -> Response:
    return JSONResponse({"dev_mode": True, "tiers": [t.value for t in Tier]}, headers={"Cache-Control": "no-store"})


@dev_router.post("/token")
async def dev_token(request: Request, body: DevTokenRequest) -> Response:
    if not DEV_USER_RE.match(body.user):
        raise ApiError(RejectionCode.INVALID_REQUEST, field="user")
    token = mint(request.app.state.edge.settings, body.user, Tier(body.tier), DEV_TOKEN_TTL_S)
    return JSONResponse(
        {"token": token, "token_type": "bearer", "expires_in": DEV_TOKEN_TTL_S, "user": body.user, "tier": body.tier},
        headers={"Cache-Control": "no-store"},
    )


def install(app: FastAPI, dev_mode: bool) -> None:
    app.include_router(router)
    if dev_mode:
        app.include_router(dev_router)
    app.mount("/ui", StaticFiles(directory=str(UI_DIR)), name="ui")
