"""The seed's four service objectives (section 11) as pure functions over recorded records.

Where this sits (docs/slo.md)::

    OUTCOMES (EdgeOutcome per request, from batches)   --+
    LEDGER (LedgerEntry: AttemptAccepted, terminals,   --+--> compute(...) --> Report (overall, per bucket)
            UsageRecorded)                                      (no Kafka, no clock: tests feed a recorded file)

The definitions, each in one place below and documented in docs/slo.md:

- **Admission response contract** (target 99.95 %): of the valid admission requests (every edge
  outcome except the refusals in ``INVALID_CODES``), the share answered with a typed decision
  (admitted, existing, or a refusal with its code) within ``DECISION_MS_MAX`` of arrival. A quick 503
  counts; a refusal after a decision timeout (~2 s) does not, nor a request with no typed answer.
- **Eligible admission availability** (99.9 %): of the eligible requests, the share admitted.
  Eligible excludes invalid requests, genuine entitlement exhaustion (``quota_exhausted``,
  ``model_not_allowed``), the user's own demand envelope (``rate_limited``, ``concurrency_limited``,
  ``idempotency_keys_exhausted``), answers about a request's existing state (conflicts, in progress,
  expired result) and same-key retries answered with existing work. The service's own refusals
  (``capacity_exhausted`` including shedding and drain, ``quota_service_unavailable`` including
  decision timeouts, ``history_unavailable``, ``store_unavailable``, ``internal_error``) and requests with no typed answer are failures.
- **Time to first text token** (p95 < 2 s): nearest-rank p95 over admitted generations that produced
  text, of the edge-side time (POST received -> first text delta forwarded) when the edge recorded
  one, else the worker-side ``UsageRecorded.ttft_ms`` (acceptance -> first token; shorter: no
  admission or queueing), counted apart so the report says which it used.
- **Accepted generation completion** (99.5 %): of the generations whose acceptance
  (``AttemptAccepted``) is in the window, excluding only explicit user cancellations, the share that
  completed. Cancellations for any other reason (client disconnect, slow consumer, drain, a lost
  edge) and failures (deadlines, worker failures) count against it; a generation with no terminal
  event yet is "open", reported and left out.

A record is in a window by its arrival (``EdgeOutcome.received_at_ms``) or its acceptance
(``AttemptAccepted.occurred_at_ms``); windows are half-open ``[start_ms, end_ms)``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.codes import CancelReason
from schemas.events import (
    AttemptAccepted,
    GenerationCancelled,
    GenerationCompleted,
    GenerationFailed,
    LedgerEntry,
    UsageRecorded,
)
from schemas.outcomes import AdmissionResult, EdgeOutcome

# Targets (seed section 11: proposed objectives).
CONTRACT_TARGET = 0.9995
AVAILABILITY_TARGET = 0.999
TTFT_P95_TARGET_MS = 2000.0
COMPLETION_TARGET = 0.995
# A typed decision counts for the contract when it came within this long of the request's arrival.
DECISION_MS_MAX = 500.0
# Most buckets one report computes (a 30-day window in 5-minute buckets is 8,640).
BUCKETS_MAX = 20_000
TTFT_PERCENTILE = 95

# How each refusal code counts. Strings, not enum members, so a code another part adds later still
# reads here; a code in none of the sets counts as the service's failure (visible, never hidden).
# Not valid requests: out of every objective.
INVALID_CODES = frozenset({"invalid_request", "unauthorized", "prompt_refused"})
# Genuine entitlement exhaustion: the user has no right to more (seed: excluded from availability).
ENTITLEMENT_CODES = frozenset({"quota_exhausted", "model_not_allowed"})
# Beyond the agreed demand envelope: the user's own burst, concurrency and key limits.
DEMAND_ENVELOPE_CODES = frozenset({"rate_limited", "concurrency_limited", "idempotency_keys_exhausted"})
# Answers about the request's existing state, not admission decisions about new work.
REQUEST_STATE_CODES = frozenset(
    {"idempotency_conflict", "generation_in_progress", "result_unavailable", "result_pending", "conversation_conflict", "not_found",
     "stale_attempt"}
)
# The service's own refusals: availability failures.
SERVICE_CODES = frozenset(
    {"capacity_exhausted", "quota_service_unavailable", "history_unavailable", "store_unavailable", "internal_error"}
)
# Failures of admitted work (a non-streaming answer that failed after admission): the generation's end.
GENERATION_CODES = frozenset({"model_backend_error", "generation_timeout", "output_refused"})

OBJECTIVES = (
    "admission_response_contract",
    "eligible_admission_availability",
    "time_to_first_text_token_p95",
    "accepted_generation_completion",
)


def refusal_class(code: str | None) -> str:
    """The class a refusal's code counts under (``INVALID_CODES`` ... ``SERVICE_CODES``)."""
    for name, codes in (
        ("invalid", INVALID_CODES),
        ("entitlement", ENTITLEMENT_CODES),
        ("demand_envelope", DEMAND_ENVELOPE_CODES),
        ("request_state", REQUEST_STATE_CODES),
        ("service", SERVICE_CODES),
    ):
        if code in codes:
            return name
    return "service"


@dataclass(slots=True)
class Ratio:
    """One share objective: ``good`` of ``total`` against ``target``; what was left out, and why."""

    target: float
    good: int = 0
    total: int = 0
    excluded: Counter[str] = field(default_factory=Counter)
    misses: Counter[str] = field(default_factory=Counter)

    @property
    def value(self) -> float | None:
        return self.good / self.total if self.total else None

    @property
    def met(self) -> bool | None:
        value = self.value
        return None if value is None else value >= self.target

    def count(self, good: bool, miss_reason: str) -> None:
        self.total += 1
        if good:
            self.good += 1
        else:
            self.misses[miss_reason] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target, "value": self.value, "good": self.good, "total": self.total, "met": self.met,
            "misses": dict(sorted(self.misses.items())), "excluded": dict(sorted(self.excluded.items())),
        }


@dataclass(slots=True)
class Percentile:
    """The TTFT objective: the nearest-rank percentile of the samples, below ``target_ms``."""

    target_ms: float
    samples_ms: list[float] = field(default_factory=list)
    sources: Counter[str] = field(default_factory=Counter)

    @property
    def value(self) -> float | None:
        return nearest_rank(self.samples_ms, TTFT_PERCENTILE)

    @property
    def met(self) -> bool | None:
        value = self.value
        return None if value is None else value < self.target_ms

    def as_dict(self) -> dict[str, Any]:
        return {
            "target_ms": self.target_ms, "percentile": TTFT_PERCENTILE, "value_ms": self.value, "count": len(self.samples_ms),
            "met": self.met, "sources": dict(sorted(self.sources.items())),
        }


def nearest_rank(values: Sequence[float], percentile: int) -> float | None:
    """The nearest-rank percentile: the smallest value with at least ``percentile`` % of the values at
    or below it (sorted ``values[ceil(p/100 * n) - 1]``); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(percentile / 100 * len(ordered))) - 1]


@dataclass(slots=True)
class Objectives:
    contract: Ratio = field(default_factory=lambda: Ratio(CONTRACT_TARGET))
    availability: Ratio = field(default_factory=lambda: Ratio(AVAILABILITY_TARGET))
    ttft: Percentile = field(default_factory=lambda: Percentile(TTFT_P95_TARGET_MS))
    completion: Ratio = field(default_factory=lambda: Ratio(COMPLETION_TARGET))

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(OBJECTIVES, (self.contract.as_dict(), self.availability.as_dict(), self.ttft.as_dict(), self.completion.as_dict())))


@dataclass(slots=True)
class Report:
    start_ms: int
    end_ms: int
    bucket_ms: int | None
    overall: Objectives
    buckets: list[tuple[int, Objectives]]
    outcome_records: int
    ledger_entries: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "from_ms": self.start_ms, "to_ms": self.end_ms, "bucket_ms": self.bucket_ms,
            "records": {"outcomes": self.outcome_records, "ledger_entries": self.ledger_entries},
            "objectives": self.overall.as_dict(),
            "buckets": [{"start_ms": start, "objectives": o.as_dict()} for start, o in self.buckets],
        }


@dataclass(slots=True)
class _Generation:
    """What the ledger says of one generation: its first acceptance, its end, the worker's TTFT."""

    accepted_at_ms: int | None = None
    end: str | None = None  # "completed", "cancelled:<reason>", "failed:<code>"
    worker_ttft_ms: float | None = None


def _generations(entries: Iterable[LedgerEntry]) -> dict[str, _Generation]:
    out: dict[str, _Generation] = {}
    for entry in entries:
        for event in entry.events:
            match event:
                case AttemptAccepted():
                    g = out.setdefault(event.generation_id, _Generation())
                    if g.accepted_at_ms is None or event.occurred_at_ms < g.accepted_at_ms:
                        g.accepted_at_ms = event.occurred_at_ms
                case GenerationCompleted():
                    out.setdefault(event.generation_id, _Generation()).end = "completed"
                case GenerationCancelled():
                    out.setdefault(event.generation_id, _Generation()).end = f"cancelled:{event.reason.value}"
                case GenerationFailed():
                    out.setdefault(event.generation_id, _Generation()).end = f"failed:{event.code.value}"
                case UsageRecorded():
                    ttft = getattr(event, "ttft_ms", None)
                    if ttft is not None:
                        out.setdefault(event.generation_id, _Generation()).worker_ttft_ms = float(ttft)
                case _:
                    pass
    return out


def _admission(o: EdgeOutcome, objectives: Objectives) -> None:
    """Count one edge outcome in the contract and availability objectives."""
    code = o.code.value if o.code is not None else None
    refused = o.result is AdmissionResult.REFUSED
    klass = refusal_class(code) if refused else None
    if klass == "invalid":
        objectives.contract.excluded[f"invalid:{code}"] += 1
        objectives.availability.excluded[f"invalid:{code}"] += 1
        return
    typed = o.result is not AdmissionResult.NONE and o.decision_ms is not None
    in_time = typed and o.decision_ms is not None and o.decision_ms <= DECISION_MS_MAX
    objectives.contract.count(in_time, "no_typed_decision" if not typed else f"late:{code or o.result.value}")
    if o.result is AdmissionResult.EXISTING:
        objectives.availability.excluded["existing"] += 1
    elif o.result is AdmissionResult.ADMITTED:
        objectives.availability.count(True, "")
    elif o.result is AdmissionResult.NONE:
        objectives.availability.count(False, "no_typed_decision")
    elif klass == "service":
        objectives.availability.count(False, f"refused:{code}")
    else:
        objectives.availability.excluded[f"{klass}:{code}"] += 1


def _in(ms: int, start_ms: int, end_ms: int) -> bool:
    return start_ms <= ms < end_ms


def _edge_ttft_ids(outcomes: Iterable[EdgeOutcome]) -> frozenset[str]:
    """The generations the edge measured a first-token time for (the worker's is then not used)."""
    return frozenset(o.generation_id for o in outcomes if o.result is AdmissionResult.ADMITTED and o.ttft_ms is not None)


def _fill(
    objectives: Objectives,
    outcomes: Sequence[EdgeOutcome],
    gens: dict[str, _Generation],
    start_ms: int,
    end_ms: int,
    edge_measured: frozenset[str],
) -> None:
    edge_ttft: dict[str, float] = {}
    for o in outcomes:
        if not _in(o.received_at_ms, start_ms, end_ms):
            continue
        _admission(o, objectives)
        if o.result is AdmissionResult.ADMITTED and o.ttft_ms is not None:
            edge_ttft[o.generation_id or o.request_id] = o.ttft_ms
    for ttft in edge_ttft.values():
        objectives.ttft.samples_ms.append(ttft)
        objectives.ttft.sources["edge"] += 1
    for generation_id, g in gens.items():
        if g.accepted_at_ms is None or not _in(g.accepted_at_ms, start_ms, end_ms):
            continue
        if g.worker_ttft_ms is not None and generation_id not in edge_measured:
            objectives.ttft.samples_ms.append(g.worker_ttft_ms)
            objectives.ttft.sources["worker"] += 1
        if g.end is None:
            objectives.completion.excluded["open"] += 1
        elif g.end == f"cancelled:{CancelReason.USER.value}":
            objectives.completion.excluded["user_cancelled"] += 1
        else:
            objectives.completion.count(g.end == "completed", g.end)


def compute(
    outcomes: Sequence[EdgeOutcome],
    entries: Sequence[LedgerEntry],
    start_ms: int,
    end_ms: int,
    bucket_ms: int | None = None,
) -> Report:
    """The four objectives over ``[start_ms, end_ms)``, overall and per bucket of ``bucket_ms``.

    ``entries`` may reach past ``end_ms`` (the terminals of generations accepted in the window)."""
    if end_ms <= start_ms:
        raise ValueError("the window is empty: end_ms must be after start_ms")
    gens = _generations(entries)
    edge_measured = _edge_ttft_ids(outcomes)
    overall = Objectives()
    _fill(overall, outcomes, gens, start_ms, end_ms, edge_measured)
    buckets: list[tuple[int, Objectives]] = []
    if bucket_ms:
        count = math.ceil((end_ms - start_ms) / bucket_ms)
        if count > BUCKETS_MAX:
            raise ValueError(f"{count} buckets of {bucket_ms} ms exceed {BUCKETS_MAX}: choose a larger bucket")
        # Each record goes to its bucket once (not one pass over every record per bucket).
        by_bucket_outcomes: dict[int, list[EdgeOutcome]] = {}
        for o in outcomes:
            if _in(o.received_at_ms, start_ms, end_ms):
                by_bucket_outcomes.setdefault((o.received_at_ms - start_ms) // bucket_ms, []).append(o)
        by_bucket_gens: dict[int, dict[str, _Generation]] = {}
        for generation_id, g in gens.items():
            if g.accepted_at_ms is not None and _in(g.accepted_at_ms, start_ms, end_ms):
                by_bucket_gens.setdefault((g.accepted_at_ms - start_ms) // bucket_ms, {})[generation_id] = g
        for i in range(count):
            b_start = start_ms + i * bucket_ms
            o = Objectives()
            _fill(o, by_bucket_outcomes.get(i, []), by_bucket_gens.get(i, {}), b_start, min(b_start + bucket_ms, end_ms), edge_measured)
            buckets.append((b_start, o))
    return Report(start_ms, end_ms, bucket_ms, overall, buckets, len(outcomes), len(entries))
