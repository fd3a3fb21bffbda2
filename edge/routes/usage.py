"""``GET /v1/usage``: the caller's quota, burst bucket and concurrency.

The quota and concurrency figures are the processor's own state, not a projection: the edge sends a
``QueryUsage`` command on the caller's partition and the processor answers from the user's ledger
aggregate without deciding or storing anything. Riding the user's partition, the query is read after
every command of the user appended before it, so a client that just sent a message sees it counted
(reserved, then used). ``as_of`` is the query's issue time: the figures include everything the
processor had read of this user by then. The burst bucket is this edge's (docs/edge.md, "The burst
bucket"). A processor that does not answer in time is ``503 quota_service_unavailable``, as for a
submit.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from edge.deps import CurrentPrincipal, EdgeDep
from edge.errors import ApiError, iso_utc
from infra.runtime.command_client import DecisionTimeout, TooManyPending
from schemas.codes import RejectionCode
from schemas.commands import QueryUsage
from schemas.messages import Outcome

router = APIRouter(prefix="/v1", tags=["usage"])


@router.get("/usage", summary="The caller's quota window, burst bucket and concurrency, from the processor's state")
async def usage(request: Request, principal: CurrentPrincipal, edge: EdgeDep) -> Response:
    issued_at_ms = int(time.time() * 1000)
    command = QueryUsage(
        command_id=uuid.uuid4().hex, user_id=principal.user_id, issued_at_ms=issued_at_ms, tier=principal.tier,
        risk_class=principal.risk_class, reply_to=edge.client.reply_to(request.state.request_id),
    )
    try:
        outcome: Outcome = await edge.client.decide(command, timeout_s=edge.settings.decision_timeout_s)
    except (DecisionTimeout, TooManyPending):
        raise ApiError(RejectionCode.QUOTA_SERVICE_UNAVAILABLE) from None
    u = outcome.usage
    if u is None:  # a processor that does not know the query (an older version)
        raise ApiError(RejectionCode.QUOTA_SERVICE_UNAVAILABLE)
    buckets = edge.buckets
    doc = {
        "quota": {
            "limit": u.limit, "used": u.used, "reserved": u.reserved, "remaining": u.remaining,
            "window_start": iso_utc(u.window_start_ms), "reset_at": iso_utc(u.window_end_ms),
        },
        "burst": {
            "capacity": int(buckets.capacity_tokens), "available": int(buckets.available(principal.user_id)),
            "refill_interval_s": buckets.refill_interval_s,
        },
        # The token budget of the same window (docs/core.md, "Token budget"): "limit" null when no
        # budget applies; "used" is settled usage, "reserved" what running or queued generations hold.
        "tokens": {
            "limit": u.token_limit or None, "used": u.tokens_used, "reserved": u.tokens_reserved,
            "remaining": u.tokens_remaining if u.token_limit else None,
        },
        "risk_class": u.risk_class or None,
        "concurrency": {"limit": u.concurrency_limit, "active": u.active},
        "as_of": iso_utc(issued_at_ms),
    }
    return JSONResponse(doc, headers={"Cache-Control": "no-store"})
