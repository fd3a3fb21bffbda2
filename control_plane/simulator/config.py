"""The simulation's numbers: its start time and model, ``SimConfig`` (sizes and fault rates), the
policy it runs the core under (``sim_policy``) and ``Stats``, the counters a run accumulates.

Data flow: read by every other module of the simulator (``world`` builds the policy and the stats
from a ``SimConfig``; the actors read their rates from it); ``Stats`` is written by the world and the
actors as things happen and read by the command line. Nothing here imports another simulator module.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from control_plane.policy import ModelEntry, Policy
from schemas.codes import Tier

T0_MS = 1_762_441_200_000  # 2026-11-06T15:00:00Z, the start of a UTC 3-hour window
MODEL_ALIAS = "fast-text-model"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Sizes and fault rates. Probabilities are per message, per command or per step as named."""

    users: int = 4
    workers: int = 3
    worker_slots: int = 2
    quota_limit: int = 12  # per window, free tier (paid: twice that)
    window_ms: int = 120_000
    dedup_retention_ms: int = 10 * 60_000
    # Request records per user: about what a user holds at steady state here (a new key every ~6 s
    # kept 10 minutes after its end), so new keys meet the bound now and then and are refused.
    dedup_records_per_user_max: int = 56
    result_ttl_ms: int = 2 * 60_000
    concurrency_limit: int = 2
    request_gap_ms: tuple[int, int] = (300, 12_000)  # between one user's new requests
    net_delay_ms: tuple[int, int] = (1, 30)
    net_slow_p: float = 0.03  # a message takes the slow path (reordering)
    net_slow_ms: tuple[int, int] = (200, 4_000)
    net_drop_p: float = 0.03
    net_dup_p: float = 0.03
    append_fail_p: float = 0.02  # a command append is lost; the issuer's timeout covers it
    processor_crash_p: float = 0.003  # per processed command
    processor_restart_ms: tuple[int, int] = (100, 3_000)
    commit_every: tuple[int, int] = (1, 8)  # commands between offset commits
    crash_drop_p: float = 0.5  # an in-flight output of an uncommitted command is lost in a crash
    # A command's outputs other than its ledger entry leave only once that entry landed (the
    # processor's drain). False models the previous design, which sent them beside the entry.
    outputs_after_ledger: bool = True
    worker_crash_p: float = 0.002  # per decode step
    worker_restart_ms: tuple[int, int] = (500, 8_000)
    edge_timeout_ms: int = 700
    # A submit's decision deadline is this much before the edge stops waiting; the edge's and the
    # processor's clocks agree within decision_clock_skew_ms for it (the skew above tests the core's
    # use of issuer time; a deadline is only meaningful between clocks kept in step, such as by NTP).
    edge_decision_margin_ms: int = 250
    decision_clock_skew_ms: int = 100
    edge_retries_max: int = 4
    cancel_p: float = 0.2
    conflict_p: float = 0.03  # a client reuses a key with different content
    reuse_p: float = 0.05  # a client resubmits an earlier key with the same content
    reply_timeout_ms: int = 600  # a worker's wait for an outcome before it retries
    worker_retries_max: int = 3
    decode_step_ms: tuple[int, int] = (30, 300)
    output_tokens: tuple[int, int] = (1, 200)
    fail_p: float = 0.03  # the engine fails
    renew_every_ms: int = 3_000
    timer_period_ms: int = 1_000
    pause_p: float = 0.0003  # per step: everything pauses and the clock jumps
    pause_ms: tuple[int, ...] = (11_000, 16_000, 30_000, 130_000, 11 * 60_000, 25 * 3600_000)
    poll_every_ms: int = 2_000  # a worker with a free slot also polls when dispatch arrives
    clock_skew_ms: int = 2_000  # each issuer's clock is off the true time by up to this, either way
    drain_ms: int = 10 * 60_000  # how long the system runs without new requests before the final reconcile
    # Conversations (docs/conversations.md): the share of a user's new requests that are about a
    # conversation (create, delete, a turn or a regeneration, sometimes against a stale revision as a
    # second device would), and the share of spooled answers (the rest end without a spool).
    conversation_p: float = 0.35
    stale_revision_p: float = 0.15
    answer_spooled_p: float = 0.9
    # Token budget per window, free tier (paid: twice that); 0 = off, the policy's default. Tokens are
    # reserved and settled either way (invariants 12 and 13 hold in every run); with a budget the
    # refusals by tokens happen too (docs/core.md, "Token budget").
    token_budget: int = 0
    token_overshoot_max: int = 64
    token_lost_report_bound: int = 32
    # A worker's report counts more output tokens than the request's max (a tokenizer disagreeing):
    # by up to twice the overshoot bound, so the bound is met as well. 0 draws nothing (seeds replay
    # as before this existed).
    token_overshoot_p: float = 0.0


def sim_policy(config: SimConfig) -> Policy:
    """The default policy with short windows and retention, so that a run crosses many of both.

    The core's window and retention logic does not depend on their lengths; the rates are sized so
    that quota_exhausted, concurrency_limited, window retirement and dedup purges all happen often.
    """
    return Policy(
        quota_limit_by_tier={Tier.FREE: config.quota_limit, Tier.PAID: 2 * config.quota_limit},
        window_ms=config.window_ms,
        concurrency_limit=config.concurrency_limit,
        dedup_retention_ms=config.dedup_retention_ms,
        dedup_records_per_user_max=config.dedup_records_per_user_max,
        result_ttl_ms=config.result_ttl_ms,
        token_budget_by_tier={Tier.FREE: config.token_budget, Tier.PAID: 2 * config.token_budget},
        token_overshoot_max=config.token_overshoot_max,
        token_lost_report_bound=config.token_lost_report_bound,
        models={MODEL_ALIAS: ModelEntry(MODEL_ALIAS, "simulated-model-v1", "simulated", frozenset(Tier))},
    )


@dataclass
class Stats:
    steps: int = 0
    commands_appended: int = 0
    commands_consumed: int = 0
    commands_redelivered: int = 0  # answered from the aggregate's memory
    commands_lost: int = 0
    messages_sent: int = 0
    messages_dropped: int = 0
    messages_duplicated: int = 0
    processor_crashes: int = 0
    worker_crashes: int = 0
    pauses: int = 0
    inferences_started: int = 0
    edge_timeouts: int = 0
    submits_read_late: int = 0  # submits the processor read after their decision deadline
    detaches: int = 0  # DetachReader sent (a client went away instead of cancelling)
    attaches: int = 0  # AttachReader sent (a client came back, on this or another edge)
    outcomes: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)  # refusal codes, redeliveries included
