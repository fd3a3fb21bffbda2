"""Settings every process shares: the admission policy (read by the processor and the edge)."""

from __future__ import annotations

import os

from control_plane.policy import Policy
from schemas.codes import Tier


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw in (None, "") else int(raw)


def policy_from_env() -> Policy:
    """The admission policy; every limit can be set by a ``CHATPLANE_*`` variable."""
    base = Policy()
    return Policy(
        quota_limit_by_tier={
            Tier.FREE: _int("CHATPLANE_QUOTA_FREE_PER_WINDOW", base.quota_limit_by_tier[Tier.FREE]),
            Tier.PAID: _int("CHATPLANE_QUOTA_PAID_PER_WINDOW", base.quota_limit_by_tier[Tier.PAID]),
        },
        concurrency_limit=_int("CHATPLANE_CONCURRENCY_LIMIT", base.concurrency_limit),
        queue_wait_max_ms=_int("CHATPLANE_QUEUE_WAIT_MAX_MS", base.queue_wait_max_ms),
        queue_budget_ms=_int("CHATPLANE_QUEUE_BUDGET_MS", base.queue_budget_ms),
        reconcile_grace_ms=_int("CHATPLANE_RECONCILE_GRACE_MS", base.reconcile_grace_ms),
        lease_ms=_int("CHATPLANE_LEASE_MS", base.lease_ms),
        generation_duration_max_ms=_int("CHATPLANE_GENERATION_DURATION_MAX_MS", base.generation_duration_max_ms),
        dedup_retention_ms=_int("CHATPLANE_DEDUP_RETENTION_MS", base.dedup_retention_ms),
        result_ttl_ms=_int("CHATPLANE_RESULT_TTL_MS", base.result_ttl_ms),
        max_output_tokens_max=_int("CHATPLANE_MAX_OUTPUT_TOKENS_MAX", base.max_output_tokens_max),
    )
