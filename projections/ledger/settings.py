"""Settings of the admission processor (``python -m projections.ledger.processor``), read from the
environment once at start-up by the shared loader (``infra.runtime.settings``)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from control_plane.policy import Policy
from infra.runtime.gc_tuning import GC_GEN0_THRESHOLD_DEFAULT
from infra.runtime.metrics_http import METRICS_HOST_DEFAULT, METRICS_HOST_ENV
from infra.runtime.settings import kafka_bootstrap_setting, policy_from_env, setting
from schemas.topics import Topology


def _pairs(raw: str) -> frozenset[tuple[int, int]]:
    """``"0:5,1:9"`` -> ``{(0, 5), (1, 9)}``; raises ValueError on anything else."""
    pairs = (item.split(":") for item in raw.split(",") if item.strip())
    return frozenset((int(a), int(b)) for a, b in pairs)


FAULT_POINTS = ("before-ledger-ack", "after-ledger-ack")


def _fault_point(raw: str) -> tuple[str, int] | None:
    if not raw:
        return None
    point, _, n = raw.partition(":")
    if point not in FAULT_POINTS or not n.isdigit() or int(n) < 1:
        raise ValueError(raw)
    return point, int(n)


@dataclass(frozen=True)
class ProcessorSettings:
    kafka_bootstrap: str = kafka_bootstrap_setting()
    topology: Topology = setting("CHATPLANE_NAMESPACE", Topology(""), parse=Topology, expected="a namespace")
    # Stable across restarts of the same instance (it is the consumer group's static member id).
    instance_id: str = setting("CHATPLANE_PROCESSOR_ID", kind=str, default_factory=socket.gethostname)
    # A member that stops heartbeating for this long loses its partitions to the others.
    session_timeout_s: float = setting("CHATPLANE_PROCESSOR_SESSION_TIMEOUT_S", 10.0, gt=0)
    # How often consumed offsets are committed; commands after the last commit are redelivered
    # after a crash (and answered from the aggregates' decision memory).
    commit_interval_s: float = setting("CHATPLANE_PROCESSOR_COMMIT_INTERVAL_S", 1.0, gt=0)
    reconcile_tick_s: float = setting("CHATPLANE_RECONCILE_TICK_S", 0.5, gt=0)
    # ReconcileDue commands the timer appends per tick at most: a burst of due deadlines (a worker
    # pool outage lets every queued attempt expire together; a recovery) is spread over ticks, so
    # the commands behind it on the same partitions (new submits) are not starved.
    reconcile_commands_per_tick_max: int = setting("CHATPLANE_RECONCILE_PER_TICK_MAX", 500, ge=1)
    # After the timer appended a ReconcileDue for a user, it waits this long before appending another.
    reconcile_resend_ms: int = setting("CHATPLANE_RECONCILE_RESEND_MS", 5_000, ge=0)
    # Commands decided but not yet durable (their outputs unacknowledged by Kafka, their state not
    # yet written to the table); the agent waits for the oldest one when this many are in flight.
    pending_commands_max: int = setting("CHATPLANE_PROCESSOR_PENDING_MAX", 2_000, ge=1)
    # Cyclic GC: allocations before a young-generation collection (Python's default 700); 0 keeps
    # Python's settings and skips freezing the start-up objects (see processor.tune_gc).
    gc_gen0_threshold: int = setting("CHATPLANE_PROCESSOR_GC_GEN0_THRESHOLD", GC_GEN0_THRESHOLD_DEFAULT, ge=0)
    # Reading commands faust skipped (see AdmissionProcessor._fill_gap): the whole read, and the
    # records per fetch; the processor stops rather than go on past a hole it could not read.
    gap_fill_timeout_s: float = setting("CHATPLANE_PROCESSOR_GAP_FILL_TIMEOUT_S", 30.0, gt=0)
    gap_fill_batch_max: int = setting("CHATPLANE_PROCESSOR_GAP_FILL_BATCH_MAX", 500, ge=1)
    # Fault injection for tests only: "partition:offset,..." deliveries the agent drops once, as
    # faust-streaming itself was seen to (see AdmissionProcessor._fill_gap). Empty in production.
    fault_skip_deliveries: frozenset[tuple[int, int]] = setting(
        "CHATPLANE_FAULT_SKIP_DELIVERIES", frozenset(), parse=_pairs, expected="partition:offset pairs, comma-separated"
    )
    # Fault injection for tests only: "<point>:<n>" exits the process (as kill -9 would: no flush, no
    # commit) when the n-th batch of decided commands reaches <point> in the drain: "before-ledger-ack"
    # (their ledger entries handed to the producer, not acknowledged) or "after-ledger-ack" (entries
    # acknowledged, no other output sent). Empty in production.
    fault_exit_at: tuple[str, int] | None = setting(
        "CHATPLANE_FAULT_EXIT_AT", None, parse=_fault_point, expected="before-ledger-ack:N or after-ledger-ack:N"
    )
    # Table recovery after a rebalance: a changelog partition recovery still needs records of but has
    # received none of for this long is sought again from the last record recovery applied (see
    # faust_adapter.restart_stalled_recovery); checked every ``recovery_check_s``.
    recovery_stall_s: float = setting("CHATPLANE_PROCESSOR_RECOVERY_STALL_S", 15.0, gt=0)
    recovery_check_s: float = setting("CHATPLANE_PROCESSOR_RECOVERY_CHECK_S", 1.0, gt=0)
    # Fault injection for tests only: the first table recovery's changelog partitions are sought to
    # their ends right after recovery sought them to where it starts reading, so it receives nothing
    # (what faust-streaming was seen doing once a processor left under load). False in production.
    fault_stall_first_recovery: bool = setting("CHATPLANE_FAULT_STALL_FIRST_RECOVERY", False)
    # Decided commands whose outputs one drain step sends after a single wait for their ledger
    # entries' acknowledgements: the extra round trip is paid per batch, not per command.
    output_batch_max: int = setting("CHATPLANE_PROCESSOR_OUTPUT_BATCH_MAX", 500, ge=1)
    # Ledger entries read back per assigned partition at assignment, for the read stamps of commands a
    # crashed processor decided but did not make durable (projections/ledger/read_stamps.py); at least
    # twice the pending bound above, since those decisions are all at the end of the partition.
    stamp_recall_entries_max: int = setting("CHATPLANE_PROCESSOR_STAMP_RECALL_ENTRIES_MAX", 5_000, ge=0)
    # Edge liveness (projections/ledger/presence.py): an edge unheard for this long (or three of its
    # presence intervals, if longer) is lost, and the generations it was reading are detached; a
    # detached generation no reader reattaches to within the grace is cancelled (reason edge_lost).
    edge_lease_ms: int = setting("CHATPLANE_EDGE_PRESENCE_LEASE_MS", 3_000, ge=100)
    edge_lost_grace_ms: int = setting("CHATPLANE_EDGE_LOST_GRACE_MS", 5_000, ge=0, le=3_600_000)
    # Edges the presence view remembers, and users whose readers the timer watches (beyond these, the
    # least recently heard edge is forgotten, and readers of users past the bound go unwatched: their
    # generations still end by their own deadlines).
    edges_tracked_max: int = setting("CHATPLANE_PROCESSOR_EDGES_TRACKED_MAX", 10_000, ge=1)
    readers_tracked_max: int = setting("CHATPLANE_PROCESSOR_READERS_TRACKED_MAX", 1_000_000, ge=1)
    data_dir: str = setting("CHATPLANE_DATA_DIR", "var/processor")
    # Prometheus /metrics (docs/metrics.md): the port (0: not served) and the address it binds; and
    # the reservations whose age the metrics track (beyond, new ones are only counted as untracked).
    metrics_port: int = setting("CHATPLANE_PROCESSOR_METRICS_PORT", 0, ge=0, le=65_535)
    metrics_host: str = setting(METRICS_HOST_ENV, METRICS_HOST_DEFAULT)
    metrics_reservations_max: int = setting("CHATPLANE_PROCESSOR_METRICS_RESERVATIONS_MAX", 100_000, ge=0)
    policy: Policy = field(default_factory=policy_from_env)
