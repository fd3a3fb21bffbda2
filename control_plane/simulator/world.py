"""The simulated world the actors live in: one seeded ``SeededRandom``, one simulated clock, one heap
of pending deliveries, the lossy network and the logs as they are observed (and audited) on arrival.

Data flow: an actor schedules work with ``at`` (a callback at a simulated time) and talks to the
others only through the world: ``send`` (a network hop that may drop, duplicate, delay or reorder),
``append_command`` (a producer's append to the commands log, which may be lost or doubled) and
``history_writer_commit`` (the history writer's ``CommitAnswer``). The processor's outputs come back
here: ledger entries through ``commit_ledger`` (each audited by the ``InvariantMonitor`` as one
command's atomic change, de-duplicated by event id, then folded into the views the actors and the
end checks read: ``ledger``, ``read_stamps``, ``accepted_by``, ``key_to_generation``, ``parked``),
usage records through ``deliver_usage``. ``step`` pops the next delivery and runs it.

``World`` knows no actor: the last hop to them (``to_commands_log``, ``track_output``,
``deliver_dispatch``, ``deliver_message``) is abstract here and wired by ``simulation.Simulation``,
so the actor modules import this one and never the other way round.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from control_plane.invariants import InvariantMonitor, Violation
from control_plane.prng import SeededRandom
from control_plane.simulator.config import T0_MS, SimConfig, Stats, sim_policy
from schemas import commands as cmd
from schemas import events as ev
from schemas import topics
from schemas.codes import Tier
from schemas.messages import DispatchAuthorized
from schemas.wire import decode_event, decode_ledger_entry, encode


class SimulationFailed(AssertionError):
    pass


class World(ABC):
    """The clock, the pending deliveries, the network and the logs; the actors are ``Simulation``'s."""

    def __init__(self, seed: int, config: SimConfig | None = None) -> None:
        self.seed = seed
        self.config = config or SimConfig()
        self.policy = sim_policy(self.config)
        self.rng = SeededRandom(seed)
        self.now_ms = T0_MS + self.rng.randrange(0, 3 * 3600_000)
        self.topology = topics.Topology()
        self.stats = Stats()
        self._heap: list[tuple[int, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self._cancelled: set[int] = set()  # heap sequence numbers of deliveries lost in a crash
        self.monitor = InvariantMonitor(
            concurrency_limit=self.config.concurrency_limit,
            dedup_retention_ms=self.policy.dedup_retention_ms,
            records_max=self.policy.dedup_records_per_user_max,
            token_overshoot_max=self.policy.token_overshoot_max,
        )
        self.ledger: dict[str, ev.Event] = {}  # event id -> event, de-duplicated, in append order
        self.usage_topic: dict[str, ev.UsageRecorded] = {}
        # command id -> the read stamp on the first of its ledger entries that landed.
        self.read_stamps: dict[str, int] = {}
        self.dispatch_queue: deque[DispatchAuthorized] = deque()
        self.users = [f"u{i}" for i in range(self.config.users)]
        self.accepted_by: dict[tuple[str, int], str] = {}  # (generation, epoch) -> worker, from the ledger
        self.key_to_generation: dict[tuple[str, str], str] = {}  # within retention, from the ledger
        self.dispatch_topics = {
            self.topology.dispatch(m.pool, tier).name for m in self.policy.models.values() for tier in Tier
        }
        self.started: list[tuple[str, int, str]] = []
        self.draining = False
        # What the history writer stores of parks (the conversation row's parked revision), from the
        # ledger: an edge restores a parked conversation from it.
        self.parked: dict[str, int] = {}
        # Generations whose CommitAnswer the history writer has sent and the processor not yet read
        # (a run cut off without a drain ends with some).
        self.commits_outstanding: Counter[str] = Counter()

    # --- the last hop to the actors (wired by Simulation) ----------------------------------------

    @abstractmethod
    def to_commands_log(self, data: bytes) -> None:
        """A command record reaches the commands log (the processor's)."""

    @abstractmethod
    def track_output(self, origin: int, seqs: list[int]) -> None:
        """Deliveries ``seqs`` carry an output of the command at offset ``origin`` (a crash may lose them)."""

    @abstractmethod
    def deliver_dispatch(self, value: bytes) -> None:
        """A ``DispatchAuthorized`` reaches the dispatch queue the workers pull from."""

    @abstractmethod
    def deliver_message(self, value: bytes) -> None:
        """An outcome, a ``StopAttempt`` or a ``GenerationFinalized`` reaches the edge or a worker."""

    # --- the clock and the pending deliveries -----------------------------------------------------

    def at(self, delay_ms: int, fn: Callable[..., None], *args: Any) -> int:
        seq = next(self._seq)
        heapq.heappush(self._heap, (self.now_ms + max(0, delay_ms), seq, fn, args))
        return seq

    def lose(self, seq: int) -> None:
        """The delivery ``seq`` (scheduled by ``at``) never happens: it was lost in a crash."""
        self._cancelled.add(seq)

    def step(self) -> None:
        """Deliver the next pending event (skipping one lost in a crash) at its time."""
        when, seq, fn, args = heapq.heappop(self._heap)
        if seq in self._cancelled:
            self._cancelled.discard(seq)
            return
        self.now_ms = max(self.now_ms, when)
        self.stats.steps += 1
        fn(*args)

    def fail(self, what: str | Violation | list[Violation]) -> None:
        if isinstance(what, list):
            what = "; ".join(str(v) for v in what)
        raise SimulationFailed(f"SIMULATOR FAILED seed={self.seed} step={self.stats.steps}: {what}")

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(bounds[0], bounds[1])

    def skew(self) -> int:
        return self.rng.randint(-self.config.clock_skew_ms, self.config.clock_skew_ms)

    # --- the network and the producers ------------------------------------------------------------

    def net_delay(self) -> int:
        if self.rng.random() < self.config.net_slow_p:
            return self.between(self.config.net_slow_ms)
        return self.between(self.config.net_delay_ms)

    def send(self, fn: Callable[..., None], payload: Any, origin: int | None = None) -> list[int]:
        """Send one message over a lossy network: dropped, delivered, or delivered twice."""
        self.stats.messages_sent += 1
        if self.rng.random() < self.config.net_drop_p:
            self.stats.messages_dropped += 1
            return []
        seqs = [self.at(self.net_delay(), fn, payload)]
        if self.rng.random() < self.config.net_dup_p:
            self.stats.messages_duplicated += 1
            seqs.append(self.at(self.net_delay(), fn, payload))
        if origin is not None:
            self.track_output(origin, seqs)
        return seqs

    def append_command(self, command: cmd.Command) -> None:
        """A producer appends to the commands log: after a delay, maybe not at all, maybe twice."""
        data = encode(command)
        if self.rng.random() < self.config.append_fail_p:
            self.stats.commands_lost += 1
            return
        self.at(self.net_delay(), self.to_commands_log, data)
        if self.rng.random() < self.config.net_dup_p:
            # The producer retried after a lost acknowledgement: the same record, shortly after.
            self.at(self.between(self.config.net_delay_ms), self.to_commands_log, data)

    def history_writer_commit(self, d: DispatchAuthorized) -> None:
        """The history writer stored a spooled answer: ``CommitAnswer``, appended reliably (the writer
        keeps its spool offset until the append is acknowledged), sometimes twice (a redelivery)."""
        command = cmd.CommitAnswer(
            command_id=self.new_id(f"commit:{d.user_id}"), user_id=d.user_id, issued_at_ms=self.now_ms,
            conversation_id=d.conversation_id, generation_id=d.generation_id, epoch=d.epoch,
        )
        self.at(self.net_delay(), self.to_commands_log, encode(command))
        if self.rng.random() < self.config.net_dup_p:
            self.commits_outstanding[d.generation_id] += 1
            again = dataclasses.replace(command, command_id=self.new_id("commit-again"))
            self.at(self.net_delay(), self.to_commands_log, encode(again))

    def reconcile_command(self, user: str, skew_ms: int = 0) -> cmd.ReconcileDue:
        at_ms = self.now_ms + skew_ms
        return cmd.ReconcileDue(
            command_id=self.new_id(f"reconcile:{user}"), user_id=user, issued_at_ms=at_ms, as_of_ms=at_ms
        )

    # --- the logs, as they arrive -----------------------------------------------------------------

    def commit_ledger(self, value: bytes) -> None:
        """A ledger entry reached the log: audit it as one command's atomic change, de-duplicated by id."""
        entry = decode_ledger_entry(value)
        if entry.read_at_ms:
            self.read_stamps.setdefault(entry.command_id, entry.read_at_ms)
        violations = self.monitor.observe_batch(entry.events)
        if violations:
            self.fail(violations)
        for e in entry.events:
            if e.event_id in self.ledger:
                continue
            self.ledger[e.event_id] = e
            if isinstance(e, ev.AttemptAccepted):
                self.accepted_by[(e.generation_id, e.epoch)] = e.worker_id
            elif isinstance(e, (ev.GenerationAdmitted, ev.AdmissionRejected)):
                named = self.key_to_generation.setdefault((e.user_id, e.idempotency_key), e.generation_id)
                if named != e.generation_id:
                    self.fail(f"key {e.user_id}/{e.idempotency_key} names {named} and {e.generation_id}")
            elif isinstance(e, ev.DedupRecordPurged):
                self.key_to_generation.pop((e.user_id, e.idempotency_key), None)
            elif isinstance(e, ev.ConversationParked):
                self.parked[e.conversation_id] = e.revision
            elif isinstance(e, (ev.ConversationRestored, ev.ConversationDeleted)):
                self.parked.pop(e.conversation_id, None)

    def deliver_usage(self, value: bytes) -> None:
        e = decode_event(value)
        if self.usage_topic.setdefault(e.event_id, e) != e:
            self.fail(f"usage record {e.event_id} re-sent with different content")
