"""Admission policy and the models it admits: the configuration ``decide`` is a pure function of.

Every limit is a named, configurable value with its unit in the name. The processor builds one
``Policy`` at start-up from settings; the core never reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.codes import Tier

WINDOW_MS = 3 * 3600 * 1000  # UTC-aligned fixed 3-hour quota windows
HOUR_MS = 3600 * 1000


# An accepted attempt's lease, the processor's and the workers' default (CHATPLANE_LEASE_MS): the
# worker renews it at a fraction of this, and a worker silent for that long is judged lost.
LEASE_MS_DEFAULT = 10_000


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One alias of the catalog: the version it resolves to and who may use it."""

    alias: str
    version: str  # e.g. "smollm2-135m-instruct-q4_1@sha256:<digest>"
    pool: str
    tiers: frozenset[Tier] = frozenset({Tier.FREE, Tier.PAID})


@dataclass(frozen=True, slots=True)
class RiskLimits:
    """The limits of one account risk class; each applies as a ceiling on the tier's (the stricter
    wins). ``None`` leaves the tier's limit as it is."""

    quota_limit: int | None = None  # messages per window
    token_budget: int | None = None  # tokens per window (input + output)
    concurrency_limit: int | None = None  # active generations (the burst an account may start)


# Shipped risk classes (``CHATPLANE_RISK_CLASSES`` replaces them).
DEFAULT_RISK_CLASSES: dict[str, RiskLimits] = {
    "elevated": RiskLimits(quota_limit=10, token_budget=20_000, concurrency_limit=1),
}


@dataclass(frozen=True, slots=True)
class Policy:
    quota_limit_by_tier: dict[Tier, int] = field(default_factory=lambda: {Tier.FREE: 40, Tier.PAID: 200})
    window_ms: int = WINDOW_MS
    concurrency_limit: int = 2  # active generations per user; queued work counts
    queue_wait_max_ms: int = 15_000  # hard stop: a dispatch older than this is never accepted
    queue_budget_ms: int = 2_000  # expected wait above this is refused with capacity_exhausted
    reconcile_grace_ms: int = 5_000  # after the queue deadline, before the timer fences a queued attempt
    lease_ms: int = LEASE_MS_DEFAULT  # an accepted attempt's lease; the worker renews it
    generation_duration_max_ms: int = 120_000
    run_deadline_grace_ms: int = 5_000
    dedup_retention_ms: int = 24 * HOUR_MS  # request records, after terminal (never while active)
    result_ttl_ms: int = 1 * HOUR_MS  # the result store's content TTL
    # Request records per user (active and settled). A record is never forgotten within its retention:
    # at the bound a new key is refused (idempotency_keys_exhausted) until the oldest one leaves it.
    # 8,192 new keys a day is 5 times the paid tier's quota (1,600), so a client within its quota that
    # retries with the same key never meets it; each record costs ~1 KB of table and ~2 KB of the
    # processor's memory (docs/retention.md, "The bound on request records").
    dedup_records_per_user_max: int = 8_192
    # A keyless request that says it is a retry (the OpenAI-compatible route) attaches to the newest
    # running or completed generation of the same user and fingerprint admitted this long before it
    # (``RetryAttach``; 0 = never). Two minutes covers the official client's retries (at most a few,
    # each after its own timeout and a backoff of seconds) with room; a longer window would merge
    # more deliberate repeats of the same question into one answer.
    openai_retry_attach_ms: int = 120_000
    max_output_tokens_max: int = 4_096
    # Conversations in a user's hot state (docs/conversations.md, "Bounded ledger state"). Beyond
    # this, creating one parks the least recently used idle conversation (no generation running,
    # idle at least ``conversation_park_min_idle_ms``), or is refused rate_limited if none is.
    conversations_hot_max: int = 64
    conversation_idle_park_ms: int = 1 * HOUR_MS  # the timer parks a conversation idle this long
    # A conversation is never parked sooner after its last change: far longer than any command's
    # decision deadline, so a restore read from a stored row cannot race a park after a restore.
    conversation_park_min_idle_ms: int = 10 * 60 * 1000
    # Deleted conversations' tombstones: kept this long (a restore read before the delete is refused),
    # at most this many (beyond, the oldest past the park minimum goes early).
    conversation_tombstone_ms: int = 1 * HOUR_MS
    conversation_tombstones_max: int = 256
    # The model catalog's core view (alias -> version, pool, tiers). Empty here: the processes fill it
    # from the one catalog file (infra.models.catalog), tests and the simulator from their own.
    models: dict[str, ModelEntry] = field(default_factory=dict)
    # Token budget per tier and window, in tokens (input + output); 0 = off. Off by default for every
    # tier: the message quota alone is today's contract, and a budget changes who gets refused, so an
    # operator turns it on (CHATPLANE_TOKEN_BUDGET_FREE / _PAID). docs/core.md, "Token budget".
    token_budget_by_tier: dict[Tier, int] = field(default_factory=lambda: {Tier.FREE: 0, Tier.PAID: 0})
    # A finished attempt's report above its reservation is charged in full up to this many tokens past
    # it (recorded as overshoot); a report beyond is charged at the bound (its generated count is kept).
    token_overshoot_max: int = 256
    # A reservation whose report was lost (lease or run deadline, worker gone) settles at the input +
    # the last renewal's output tokens + this bound, at most the reservation: what a worker may have
    # generated after its last renewal (one renewal interval of decoding).
    token_lost_report_bound: int = 512
    # Account risk classes (name -> stricter limits), and the per-account setting naming an account's
    # class (user id -> class); a submit's claim may name one too. Both apply (the stricter wins).
    risk_classes: dict[str, RiskLimits] = field(default_factory=lambda: dict(DEFAULT_RISK_CLASSES))
    risk_class_by_user: dict[str, str] = field(default_factory=dict)

    def quota_limit(self, tier: Tier) -> int:
        return self.quota_limit_by_tier[tier]

    def token_budget(self, tier: Tier) -> int:
        return self.token_budget_by_tier.get(tier, 0)

    def risk_limits(self, user_id: str, claimed: str) -> tuple[str, RiskLimits | None]:
        """The risk class that applies to this account and its limits (the stricter of the claim's
        class and the per-account setting's); ("", None) when neither names a known class."""
        if not claimed and not self.risk_class_by_user:
            return "", None
        names = [n for n in (claimed, self.risk_class_by_user.get(user_id, "")) if n and n in self.risk_classes]
        if not names:
            return "", None
        if len(names) == 1 or names[0] == names[1]:
            return names[0], self.risk_classes[names[0]]
        a, b = (self.risk_classes[n] for n in names)
        return "+".join(sorted(names)), RiskLimits(
            quota_limit=_stricter(a.quota_limit, b.quota_limit),
            token_budget=_stricter(a.token_budget, b.token_budget),
            concurrency_limit=_stricter(a.concurrency_limit, b.concurrency_limit),
        )

    def window_start_ms(self, at_ms: int) -> int:
        """Start of the UTC-aligned window containing ``at_ms`` (epoch ms are UTC)."""
        return at_ms - at_ms % self.window_ms


def _stricter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)
