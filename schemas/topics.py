"""Names and sizes of every persistent part of the log and the stores.

Changelog, consumer-group and table names derive from these, so they are schema: change one and the
old data is orphaned. Nothing else in the project spells a topic or table name as a string.

Data flow::

    edge, workers, timers --COMMANDS(user_id)--> admission processor --LEDGER(user_id)--> read models, audit
                                                        |--DISPATCH.<pool>.<tier>(generation_id)--> workers
                                                        |--WORKER_CONTROL(partition per worker)--> owning worker
                                                        |--EDGE_INBOX(partition per edge)--> edge (decisions)
                                                        `--USAGE(user_id)--> analysts
    workers --EDGE_INBOX--> edge (deltas);  workers --CAPACITY--> edge admission
    workers --ANSWERS(user_id)--> history writer --Cassandra, then CommitAnswer--> COMMANDS
    edges --EDGE_PRESENCE--> admission processors (liveness leases of the edges holding readers)
    edges --OUTCOMES(edge_id)--> projections.reports.slo (content-free outcomes, one per admission request, many to a record)
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

# Partition counts. COMMANDS and LEDGER (and the processor's changelog) must have the same count:
# the processor asserts that co-partitioning at start-up.
USER_PARTITIONS = 8
DISPATCH_PARTITIONS = 4
WORKER_CONTROL_PARTITIONS = 16
EDGE_INBOX_PARTITIONS = 8
CAPACITY_PARTITIONS = 1
EDGE_PRESENCE_PARTITIONS = 1
DEAD_LETTER_PARTITIONS = 1
OUTCOMES_PARTITIONS = 4

DAY_MS = 24 * 3600 * 1000
HOUR_MS = 3600 * 1000


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """One topic: its name, partition count, retention and cleanup policy (docs/retention.md).

    Kafka deletes (or compacts) whole closed segments only, so ``retention.ms`` alone does not bound
    how long a record stays on a quiet topic: the active segment rolls after ``segment.ms`` (broker
    default 7 days). Topics whose retention is a promise about content or fingerprints set
    ``segment_ms``; a record is then gone within retention_ms + segment_ms + the broker's
    ``log.retention.check.interval.ms``. The compacted changelog sets ``max_compaction_lag_ms`` so a
    superseded value (e.g. a state that still held a purged request's fingerprint) is compacted away
    within that lag (plus the cleaner's run).
    """

    name: str
    partitions: int
    retention_ms: int
    cleanup_policy: str = "delete"
    segment_ms: int | None = None
    max_compaction_lag_ms: int | None = None

    def configs(self) -> dict[str, str]:
        """The topic configs to create it with (and re-apply to an existing topic)."""
        out = {"retention.ms": str(self.retention_ms), "cleanup.policy": self.cleanup_policy}
        if self.segment_ms is not None:
            out["segment.ms"] = str(self.segment_ms)
        if self.max_compaction_lag_ms is not None:
            out["max.compaction.lag.ms"] = str(self.max_compaction_lag_ms)
        return out


MINUTE_MS = 60 * 1000
# Segment roll of the short-lived content topics: a record is deleted within retention + this + the
# broker's retention check interval (docs/retention.md).
CONTENT_SEGMENT_MS = 10 * MINUTE_MS
# Segment roll of the topics that hold fingerprints for days (commands, dead letter).
FINGERPRINT_SEGMENT_MS = 1 * DAY_MS
# The changelog's superseded values (with purged requests' fingerprints) are compacted within this.
CHANGELOG_MAX_COMPACTION_LAG_MS = 1 * DAY_MS

# Holds SubmitGeneration fingerprints (no prompt text): kept a week for replay after an outage.
COMMANDS = TopicSpec("chatplane.commands", USER_PARTITIONS, 7 * DAY_MS, segment_ms=FINGERPRINT_SEGMENT_MS)
LEDGER = TopicSpec("chatplane.ledger", USER_PARTITIONS, -1)  # the audit record: kept (see docs/retention.md)
USAGE = TopicSpec("chatplane.usage", USER_PARTITIONS, 400 * DAY_MS)
# Carries prompt payloads from edges to workers: short retention by design.
WORKER_CONTROL = TopicSpec(
    "chatplane.worker-control", WORKER_CONTROL_PARTITIONS, 1 * HOUR_MS, segment_ms=CONTENT_SEGMENT_MS
)
# Holds generated text in flight: short retention by design.
EDGE_INBOX = TopicSpec("chatplane.edge-inbox", EDGE_INBOX_PARTITIONS, 1 * HOUR_MS, segment_ms=CONTENT_SEGMENT_MS)
CAPACITY = TopicSpec("chatplane.capacity", CAPACITY_PARTITIONS, 1 * HOUR_MS)
# Edge liveness (EdgePresence, about one record per edge per second): read from its end by every
# processor, so only minutes of it are ever needed.
EDGE_PRESENCE = TopicSpec(
    "chatplane.edge-presence", EDGE_PRESENCE_PARTITIONS, 1 * HOUR_MS, segment_ms=CONTENT_SEGMENT_MS
)
# Up to 4 KiB of an undecodable record (which may be a command or ledger entry with a fingerprint).
DEAD_LETTER = TopicSpec(
    "chatplane.dead-letter", DEAD_LETTER_PARTITIONS, 14 * DAY_MS, segment_ms=FINGERPRINT_SEGMENT_MS
)

# One EdgeOutcome per admission request, sent many to an EdgeOutcomeBatch record (schemas/outcomes.py:
# ids, codes, durations; no text), read by the SLO report (projections/reports/slo, docs/slo.md): kept past a 30-day objective window.
OUTCOMES = TopicSpec("chatplane.outcomes", OUTCOMES_PARTITIONS, 35 * DAY_MS)

# Tiers: one dispatch topic per (pool, tier); the pools are the model catalog's
# (infra.models.catalog), one per model version unless the catalog says otherwise.
TIERS = ("paid", "free")


def dispatch_topic(pool: str, tier: str) -> TopicSpec:
    """The dispatch topic of one model pool and tier (key: generation_id)."""
    return TopicSpec(f"chatplane.dispatch.{pool}.{tier}", DISPATCH_PARTITIONS, 6 * HOUR_MS)


# How long a published prompt is kept: far past the 15 s queue wait, so a worker that takes its
# dispatch finds it; content, so its segments roll like the other content topics'.
PROMPTS_RETENTION_MS = 15 * MINUTE_MS


def prompts_topic(pool: str) -> TopicSpec:
    """The prompts an edge publishes beside its submits to one model pool (``PromptPublished``; key:
    the generation id the submit will have). Co-partitioned with the pool's dispatch topics (same key,
    same partition count), so a worker reads the prompt partitions matching the dispatch partitions
    it holds and has the prompt when it takes the dispatch (workers/prompts.py)."""
    return TopicSpec(f"chatplane.prompts.{pool}", DISPATCH_PARTITIONS, PROMPTS_RETENTION_MS, segment_ms=CONTENT_SEGMENT_MS)


# Conversation turns' answers, spooled by their workers (AnswerSpooled; key user_id) before they
# report the end; the history writer stores each in Cassandra, then commits it (CommitAnswer). The
# recoverable copy of an answer not yet stored: kept a day, far past any Cassandra outage the writer
# rides out (it holds its offsets until the writes succeed); content, so segments roll.
ANSWERS = TopicSpec("chatplane.answers", USER_PARTITIONS, 1 * DAY_MS, segment_ms=CONTENT_SEGMENT_MS)

# The processor's faust app id and its table; the changelog topic name faust derives is
# "<app id>-<table>-changelog", and it must also have USER_PARTITIONS partitions.
PROCESSOR_APP_ID = "chatplane-admission"
USER_TO_LEDGER_TABLE = "user_to_ledger"


def worker_control_partition(worker_id: str) -> int:
    """The control partition a worker reads; stable for a worker id (several workers may share one)."""
    digest = hashlib.blake2b(worker_id.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % WORKER_CONTROL.partitions


# Cassandra.
KEYSPACE = "chatplane"
GENERATIONS_TABLE = "generations_by_id"
# Conversation history (infra/stores/history.py; docs/conversations.md).
CONVERSATIONS_TABLE = "conversations"
CONVERSATIONS_BY_USER_TABLE = "conversations_by_user"
MESSAGES_TABLE = "messages"
TURN_INPUTS_TABLE = "turn_inputs"
RESULTS_TABLE = "results_by_generation"
# Every text delta of a generation, by sequence, for replay (infra/stores/replay.py).
REPLAY_TABLE = "generation_events"


@dataclass(frozen=True, slots=True)
class Topology:
    """Every topic name of one deployment.

    The default deployment uses the constants above. A ``namespace`` prefixes every name (and the
    processor's app id, hence its changelog and consumer group), so isolated deployments, such as each
    integration test, share one cluster without sharing data.
    """

    namespace: str = ""

    def _spec(self, spec: TopicSpec) -> TopicSpec:
        if not self.namespace:
            return spec
        return dataclasses.replace(spec, name=f"{self.namespace}.{spec.name}")

    @property
    def commands(self) -> TopicSpec:
        return self._spec(COMMANDS)

    @property
    def ledger(self) -> TopicSpec:
        return self._spec(LEDGER)

    @property
    def usage(self) -> TopicSpec:
        return self._spec(USAGE)

    @property
    def worker_control(self) -> TopicSpec:
        return self._spec(WORKER_CONTROL)

    @property
    def edge_inbox(self) -> TopicSpec:
        return self._spec(EDGE_INBOX)

    @property
    def capacity(self) -> TopicSpec:
        return self._spec(CAPACITY)

    @property
    def edge_presence(self) -> TopicSpec:
        return self._spec(EDGE_PRESENCE)

    @property
    def dead_letter(self) -> TopicSpec:
        return self._spec(DEAD_LETTER)

    @property
    def answers(self) -> TopicSpec:
        return self._spec(ANSWERS)

    @property
    def outcomes(self) -> TopicSpec:
        return self._spec(OUTCOMES)

    def dispatch(self, pool: str, tier: str) -> TopicSpec:
        return self._spec(dispatch_topic(pool, tier))

    def prompts(self, pool: str) -> TopicSpec:
        return self._spec(prompts_topic(pool))

    @property
    def processor_app_id(self) -> str:
        return f"{self.namespace}.{PROCESSOR_APP_ID}" if self.namespace else PROCESSOR_APP_ID

    @property
    def changelog(self) -> TopicSpec:
        return TopicSpec(
            f"{self.processor_app_id}-{USER_TO_LEDGER_TABLE}-changelog", USER_PARTITIONS, -1, cleanup_policy="compact",
            max_compaction_lag_ms=CHANGELOG_MAX_COMPACTION_LAG_MS,
        )

    def all(self, pools: Iterable[str]) -> tuple[TopicSpec, ...]:
        """Every topic of this deployment for the catalog's ``pools``, created explicitly (never by
        broker auto-creation): ``infra.runtime.kafka_admin.deployment_topics``."""
        dispatch = tuple(self.dispatch(p, t) for p in sorted(set(pools)) for t in TIERS)
        prompts = tuple(self.prompts(p) for p in sorted(set(pools)))
        return (
            self.commands,
            self.ledger,
            self.usage,
            self.worker_control,
            self.edge_inbox,
            self.capacity,
            self.edge_presence,
            self.dead_letter,
            self.answers,
            self.outcomes,
            self.changelog,
            *dispatch,
            *prompts,
        )
