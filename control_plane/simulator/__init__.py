"""Seeded deterministic simulation of the edge, the admission processor, its timer and the workers.

A discrete-event simulation (one seeded ``SeededRandom``, one simulated clock, one heap of pending
deliveries) of the whole request lifecycle around the pure core, with the faults the real system
must survive. Nothing here is a fake of something we run in production: it drives the real
``handle`` and the real ``route``, and every message crosses the real wire codec::

    clients -> edge --Submit/Cancel--------------.
    workers --Accept/Decline/Renew/Report--------+--> [commands log] --> processor: handle + route
    timer   --ReconcileDue (next_deadline_ms)----'                          |
                                                   ledger entries  <--------+  (audited: InvariantMonitor)
                                       outcomes --> edge / workers <--------+
                         DispatchAuthorized --> dispatch queue --> workers  |
                         StopAttempt --> the owning worker <----------------+
                         GenerationFinalized --> edge <---------------------'

Faults: every network hop may drop, duplicate (a producer retry), delay or reorder a message; a
command append may fail (the issuer times out and retries with the same idempotency key); the
processor crashes and restarts from its last committed table snapshot and re-consumes every command
after the committed offset (at-least-once: its ledger appends and output sends from uncommitted
commands may or may not have gone out before the crash); workers crash mid-generation (their leases
then expire and the timer's ``ReconcileDue`` fences them); clients cancel; the whole system pauses
(the clock jumps past deadlines, window boundaries and the dedup retention).

Submits carry the edge's decision deadline and the processor stamps when it read each one, as the
real processor does; a slow append, a processor restart or a pause makes it read some of them after
their deadline (they are refused, holding nothing). After a crash the processor gives a re-read
command the stamp recorded on its ledger entry, if that entry landed (``read_stamps`` in the real one).

Checks, after every step: the ``InvariantMonitor`` over the ledger entries actually appended
(de-duplicated by event id) and ``check_state`` on the processor's live state. After draining (every
deadline passed and reconciled): no reservation RESERVED, no slot held, no active generation, the
processor's state equals the fold of the ledger, every idempotency key named one generation within
retention, no usage recorded twice, no worker computed without a committed acceptance, and no two
workers ever computed the same generation at once.

A failure raises ``SimulationFailed("SIMULATOR FAILED seed=<n> step=<k>: <what>")``; rerun with
``python -m control_plane.simulator --seed <n> --steps <k>`` to reproduce it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from control_plane.aggregate import Aggregate, handle
from control_plane.decide import next_deadline_ms, read_past_deadline
from control_plane.evolve import evolve_all
from control_plane.invariants import InvariantMonitor, Violation, check_state
from control_plane.policy import ModelEntry, Policy
from control_plane.prng import SeededRandom
from control_plane.routing import route
from control_plane.state import UserLedger
from schemas import commands as cmd
from schemas import events as ev
from schemas import topics
from schemas.codes import CancelReason, FinishOutcome, RejectionCode, RequestStatus, Tier
from schemas.messages import DispatchAuthorized, GenerationFinalized, Outcome, OutcomeKind, StopAttempt
from schemas.wire import decode_command, decode_event, decode_ledger_entry, decode_message, encode

T0_MS = 1_762_441_200_000  # 2026-11-06T15:00:00Z, the start of a UTC 3-hour window
MODEL_ALIAS = "fast-text-model"


class SimulationFailed(AssertionError):
    pass


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


# --- the simulation ---------------------------------------------------------------------------


class Simulation:
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
        self.processor = Processor(self)
        self.edge = Edge(self)
        self.workers = [Worker(self, f"w{i}") for i in range(self.config.workers)]
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

    # --- plumbing ------------------------------------------------------------------------------

    def fail(self, what: str | Violation | list[Violation]) -> None:
        if isinstance(what, list):
            what = "; ".join(str(v) for v in what)
        raise SimulationFailed(f"SIMULATOR FAILED seed={self.seed} step={self.stats.steps}: {what}")

    def at(self, delay_ms: int, fn: Callable[..., None], *args: Any) -> int:
        seq = next(self._seq)
        heapq.heappush(self._heap, (self.now_ms + max(0, delay_ms), seq, fn, args))
        return seq

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(bounds[0], bounds[1])

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
            self.processor.track(origin, seqs)
        return seqs

    def append_command(self, command: cmd.Command) -> None:
        """A producer appends to the commands log: after a delay, maybe not at all, maybe twice."""
        data = encode(command)
        if self.rng.random() < self.config.append_fail_p:
            self.stats.commands_lost += 1
            return
        self.at(self.net_delay(), self.processor.append, data)
        if self.rng.random() < self.config.net_dup_p:
            # The producer retried after a lost acknowledgement: the same record, shortly after.
            self.at(self.between(self.config.net_delay_ms), self.processor.append, data)

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

    def history_writer_commit(self, d: DispatchAuthorized) -> None:
        """The history writer stored a spooled answer: ``CommitAnswer``, appended reliably (the writer
        keeps its spool offset until the append is acknowledged), sometimes twice (a redelivery)."""
        command = cmd.CommitAnswer(
            command_id=self.new_id(f"commit:{d.user_id}"), user_id=d.user_id, issued_at_ms=self.now_ms,
            conversation_id=d.conversation_id, generation_id=d.generation_id, epoch=d.epoch,
        )
        self.at(self.net_delay(), self.processor.append, encode(command))
        if self.rng.random() < self.config.net_dup_p:
            self.commits_outstanding[d.generation_id] += 1
            again = dataclasses.replace(command, command_id=self.new_id("commit-again"))
            self.at(self.net_delay(), self.processor.append, encode(again))

    def deliver_usage(self, value: bytes) -> None:
        e = decode_event(value)
        if self.usage_topic.setdefault(e.event_id, e) != e:
            self.fail(f"usage record {e.event_id} re-sent with different content")

    def deliver_dispatch(self, value: bytes) -> None:
        self.dispatch_queue.append(decode_message(value))
        idle = [w for w in self.workers if w.up and len(w.runs) < self.config.worker_slots]
        if idle:
            worker = self.rng.choice(idle)
            self.at(self.between((0, 10)), worker.poll, worker.incarnation, False)

    def deliver_message(self, value: bytes) -> None:
        message = decode_message(value)
        match message:
            case Outcome():
                owner = (message.request_id or "").split(":", 1)[0]
                if owner == "edge":
                    self.edge.on_outcome(message)
                else:
                    self.workers[int(owner.removeprefix("w"))].on_outcome(message)
            case StopAttempt():
                self.workers[int(message.worker_id.removeprefix("w"))].on_stop(message)
            case GenerationFinalized():
                self.edge.on_finalized(message)
            case _:
                self.fail(f"unexpected message {type(message).__name__}")

    # --- running -------------------------------------------------------------------------------

    def run(self, steps: int) -> Stats:
        """Start, take ``steps`` steps (with random pauses), then drain and check the end state."""
        self.start()
        while self.stats.steps < steps and self._heap:
            self.step()
            if self.rng.random() < self.config.pause_p:
                self.stats.pauses += 1
                self.now_ms += self.rng.choice(self.config.pause_ms)
        self.drain()
        return self.stats

    def start(self) -> None:
        for user in self.users:
            self.at(self.between(self.config.request_gap_ms), self.edge.new_request, user)
        self.at(self.config.timer_period_ms, self.processor.timer_tick)
        for worker in self.workers:
            self.at(self.between((1, 50)), worker.poll, worker.incarnation)

    def step(self) -> None:
        """Deliver the next pending event (skipping one lost in a crash) at its time."""
        when, seq, fn, args = heapq.heappop(self._heap)
        if seq in self._cancelled:
            self._cancelled.discard(seq)
            return
        self.now_ms = max(self.now_ms, when)
        self.stats.steps += 1
        fn(*args)

    def drain(self) -> None:
        """Stop new requests, let the system run past every deadline, reconcile, and check the end state."""
        self.draining = True
        horizon = self.now_ms + self.config.drain_ms
        while self._heap and self._heap[0][0] <= horizon:
            self.step()
        self._heap.clear()
        # Past every queue, lease and run deadline: one reconcile per user, after everything already
        # in the commands log, settles them all.
        self.now_ms += self.policy.generation_duration_max_ms + self.policy.run_deadline_grace_ms + 60_000
        for user in self.users:
            self.processor.log.append(encode(self.reconcile_command(user)))
        self.processor.process_all()
        # The usage records of that last reconcile are flushed with it; nothing else is delivered.
        for _, seq, fn, args in sorted(self._heap, key=lambda item: item[:2]):
            if fn == self.deliver_usage and seq not in self._cancelled:
                fn(*args)
        self._heap.clear()
        self.check_end()

    def reconcile_command(self, user: str, skew_ms: int = 0) -> cmd.ReconcileDue:
        at_ms = self.now_ms + skew_ms
        return cmd.ReconcileDue(
            command_id=self.new_id(f"reconcile:{user}"), user_id=user, issued_at_ms=at_ms, as_of_ms=at_ms
        )

    def skew(self) -> int:
        return self.rng.randint(-self.config.clock_skew_ms, self.config.clock_skew_ms)

    def check_end(self) -> None:
        for user in self.users:
            state = self.processor.aggregates.get(user, Aggregate.empty(user)).ledger
            violations = check_state(state, self.config.concurrency_limit)
            if violations:
                self.fail(violations)
            for r in state.reservations.values():  # the state holds only RESERVED ones
                self.fail(f"reservation {r.reservation_id} still RESERVED after every deadline passed")
            if state.slots:
                self.fail(f"{user} still holds slots {state.slots} after draining")
            for record in state.requests.values():
                if record.status.active:
                    self.fail(f"{record.generation_id} still {record.status} after every deadline passed")
            for cid, conversation in state.conversations.items():
                if conversation.in_flight and not self.commits_outstanding[conversation.in_flight]:
                    self.fail(f"{cid} still waits for the answer of {conversation.in_flight} after draining")
            events = [e for e in self.ledger.values() if e.user_id == user]
            if evolve_all(UserLedger(user), events) != state:
                self.fail(f"{user}: the processor's state is not the fold of the ledger")
        violations = self.monitor.check_all_states()
        if violations:
            self.fail(violations)
        unsettled = self.monitor.unsettled_token_reservations()
        if unsettled:
            self.fail(f"token reservations never settled after draining: {sorted(unsettled)[:3]}")
        usage = Counter((e.generation_id, e.epoch) for e in self.ledger.values() if isinstance(e, ev.UsageRecorded))
        twice = [k for k, n in usage.items() if n > 1]
        if twice:
            self.fail(f"usage recorded twice for {twice[:3]}")
        topic_usage = Counter((e.generation_id, e.epoch) for e in self.usage_topic.values())
        if topic_usage != usage:
            self.fail("the usage topic and the ledger's usage records disagree")
        for generation_id, epoch, worker_id in self.started:
            if self.accepted_by.get((generation_id, epoch)) != worker_id:
                self.fail(f"{worker_id} computed {generation_id} epoch {epoch} without a committed acceptance")

    def summary(self) -> dict[str, Any]:
        terminal: Counter[str] = Counter()
        for e in self.ledger.values():
            if isinstance(e, ev.TERMINAL_EVENT_TYPES):
                terminal[type(e).__name__.removeprefix("Generation").lower()] += 1
        settled: Counter[str] = Counter(
            type(e).__name__ for e in self.ledger.values() if isinstance(e, (ev.ReservationConsumed, ev.ReservationReleased))
        )
        conversation_events: Counter[str] = Counter(
            type(e).__name__.removeprefix("Conversation") for e in self.ledger.values() if type(e).__name__.startswith("Conversation")
        )
        return {
            "conversations": dict(conversation_events),
            "events": len(self.ledger),
            "admitted": sum(isinstance(e, ev.GenerationAdmitted) for e in self.ledger.values()),
            "terminal": dict(terminal),
            "messages_consumed": settled["ReservationConsumed"],
            "messages_released": settled["ReservationReleased"],
        }


# --- the admission processor ------------------------------------------------------------------


class Processor:
    """One partition's single writer: a commands log, a table of aggregates, committed snapshots."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.log: list[bytes] = []
        self.offset = 0
        self.committed_offset = 0
        self.aggregates: dict[str, Aggregate] = {}
        self.snapshot: dict[str, Aggregate] = {}
        self.up = True
        self.scheduled = False
        self.since_commit = 0
        self.commit_after = sim.between(sim.config.commit_every)
        self.pending_ledger: list[tuple[int, bytes]] = []  # (offset, entry) not yet on the ledger log
        self.clock_skew_ms = sim.skew()  # the timer's clock
        # The clock it stamps reads with, and the stamps it read back from the ledger at its last start.
        self.read_clock_skew_ms = sim.rng.randint(-sim.config.decision_clock_skew_ms, sim.config.decision_clock_skew_ms)
        self.recalled: dict[str, int] = {}
        self.in_flight: list[tuple[int, list[int]]] = []  # (offset, heap seqs) of outputs still travelling

    def track(self, origin: int, seqs: list[int]) -> None:
        if origin >= self.committed_offset:
            self.in_flight.append((origin, seqs))

    def append(self, data: bytes) -> None:
        self.log.append(data)
        self.sim.stats.commands_appended += 1
        self.schedule()

    def schedule(self) -> None:
        if self.up and not self.scheduled and self.offset < len(self.log):
            self.scheduled = True
            self.sim.at(0, self.process_next)

    def process_next(self) -> None:
        self.scheduled = False
        if not self.up or self.offset >= len(self.log):
            return
        offset = self.offset
        self.offset += 1
        self.consume(decode_command(self.log[offset]), offset)
        self.since_commit += 1
        if self.since_commit >= self.commit_after:
            self.commit()
        if not self.sim.draining and self.sim.rng.random() < self.sim.config.processor_crash_p:
            self.crash()
        self.schedule()

    def consume(self, command: cmd.Command, origin: int) -> None:
        sim = self.sim
        if isinstance(command, cmd.SubmitGeneration) and command.decide_by_ms:
            read_at = self.recalled.get(command.command_id, sim.now_ms + self.read_clock_skew_ms)
            command = dataclasses.replace(command, read_at_ms=read_at)
            sim.stats.submits_read_late += read_past_deadline(command)
        user = command.user_id
        if isinstance(command, cmd.CommitAnswer) and sim.commits_outstanding[command.generation_id] > 0:
            sim.commits_outstanding[command.generation_id] -= 1
        before = self.aggregates.get(user) or Aggregate.empty(user)
        after, decision, redelivered = handle(before, command, sim.policy)
        sim.stats.commands_consumed += 1
        sim.stats.commands_redelivered += redelivered
        sim.stats.outcomes[decision.outcome.kind.value] += 1
        if decision.outcome.code is not None:
            sim.stats.rejections[decision.outcome.code.value] += 1
            if decision.outcome.details.kind:
                sim.stats.rejections[f"{decision.outcome.code.value}:{decision.outcome.details.kind}"] += 1
        self.aggregates[user] = after
        violations = check_state(after.ledger, sim.config.concurrency_limit)
        if violations:
            sim.fail(violations)
        for out in route(sim.topology, before.ledger, after.ledger, command, decision, 0):
            if out.topic == sim.topology.ledger.name:
                self.pending_ledger.append((origin, out.value))
                sim.at(sim.between(sim.config.net_delay_ms), self.flush_one, out.value)
            elif out.topic == sim.topology.usage.name:
                self.track(origin, [sim.at(sim.between(sim.config.net_delay_ms), sim.deliver_usage, out.value)])
            elif out.topic in sim.dispatch_topics:
                sim.send(sim.deliver_dispatch, out.value, origin)
            else:
                sim.send(sim.deliver_message, out.value, origin)

    def flush_one(self, value: bytes) -> None:
        """The producer keeps a partition's order: this entry lands with every entry sent before it."""
        if not any(pending is value for _, pending in self.pending_ledger):
            return  # already flushed by a commit, or lost in a crash
        while self.pending_ledger:
            _, pending = self.pending_ledger.pop(0)
            self.sim.commit_ledger(pending)
            if pending is value:
                return

    def commit(self) -> None:
        """Flush the producer (every pending ledger entry lands), then snapshot the table and the offset."""
        for _, value in self.pending_ledger:
            self.sim.commit_ledger(value)
        self.pending_ledger.clear()
        self.in_flight.clear()
        self.snapshot = dict(self.aggregates)
        self.committed_offset = self.offset
        self.since_commit = 0
        self.commit_after = self.sim.between(self.sim.config.commit_every)

    def crash(self) -> None:
        sim = self.sim
        sim.stats.processor_crashes += 1
        self.up = False
        # Sends of uncommitted commands may or may not have left the process before it died.
        # The producer keeps order, so what got out is a prefix of what was pending.
        pending, self.pending_ledger = self.pending_ledger, []
        sent = sim.rng.randint(0, len(pending)) if pending else 0
        for _, value in pending[:sent]:
            sim.commit_ledger(value)
        for _, seqs in self.in_flight:
            for seq in seqs:
                if sim.rng.random() < sim.config.crash_drop_p:
                    sim._cancelled.add(seq)
        self.in_flight.clear()
        self.aggregates = dict(self.snapshot)
        self.offset = self.committed_offset
        self.since_commit = 0
        sim.at(sim.between(sim.config.processor_restart_ms), self.restart)

    def restart(self) -> None:
        self.up = True
        # What the real processor reads back from the ledger's tail when its partitions are assigned.
        self.recalled = dict(self.sim.read_stamps)
        self.schedule()

    def process_all(self) -> None:
        """Restart if down, consume the rest of the log without faults, and commit."""
        if not self.up:
            self.recalled = dict(self.sim.read_stamps)
        self.up = True
        while self.offset < len(self.log):
            self.offset += 1
            self.consume(decode_command(self.log[self.offset - 1]), self.offset - 1)
        self.commit()

    def timer_tick(self) -> None:
        """The deadline timer: append ReconcileDue for every user whose next deadline has passed."""
        sim = self.sim
        if self.up:
            for user, aggregate in self.aggregates.items():
                deadline = next_deadline_ms(aggregate.ledger, sim.policy)
                if deadline is not None and deadline <= sim.now_ms + self.clock_skew_ms:
                    sim.append_command(sim.reconcile_command(user, self.clock_skew_ms))
        sim.at(sim.config.timer_period_ms, self.timer_tick)


# --- the edge and its clients ------------------------------------------------------------------


@dataclass
class Request:
    """One logical client request: an idempotency key and its content, across retries."""

    user: str
    key: str
    fingerprint: str
    tier: Tier
    max_output_tokens: int
    tries: int = 0
    admission_retries: int = 0
    generation_id: str | None = None
    cancel_tries: int = 0
    conversation_id: str = ""
    expected_revision: int = 0
    regenerate: bool = False


# Readers: every submit names the simulated edge; a share of cancels are a client going away
# instead (DetachReader with a random grace), some of which come back (AttachReader).
READER_ID = "sim-edge"
DETACH_P = 0.4
DETACH_GRACE_MS_MAX = 3_000
REATTACH_P = 0.3


class Edge:
    """The HTTP edge and its clients: submits with timeouts and same-key retries, cancels."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.pending: dict[str, tuple[str, Request]] = {}  # request id -> (kind, request) awaiting an outcome
        self.by_generation: dict[str, Request] = {}
        self.history: dict[str, list[Request]] = defaultdict(list)
        self.fingerprints: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.clock_skew_ms = sim.skew()
        # The client's view of its conversations: id -> the revision it believes committed.
        self.conversations: dict[str, dict[str, int]] = defaultdict(dict)
        self.deadline_clock_skew_ms = sim.rng.randint(-sim.config.decision_clock_skew_ms, sim.config.decision_clock_skew_ms)

    def decide_by_ms(self) -> int:
        """A submit's decision deadline: the margin before this edge stops waiting, on its deadline clock."""
        config = self.sim.config
        return self.sim.now_ms + self.deadline_clock_skew_ms + config.edge_timeout_ms - config.edge_decision_margin_ms

    def reply_to(self) -> tuple[str, cmd.ReplyTo]:
        request_id = self.sim.new_id("edge:r")
        return request_id, cmd.ReplyTo(topic=self.sim.topology.edge_inbox.name, partition=0, request_id=request_id)

    def new_request(self, user: str) -> None:
        sim, config = self.sim, self.sim.config
        if sim.draining:
            return
        sim.at(sim.between(config.request_gap_ms), self.new_request, user)
        if sim.rng.random() < config.conversation_p:
            self.conversation_request(user)
            return
        earlier = self.history[user]
        roll = sim.rng.random()
        if earlier and roll < config.conflict_p:
            old = sim.rng.choice(earlier)
            request = Request(user, old.key, old.fingerprint + "-x", old.tier, old.max_output_tokens)
        elif earlier and roll < config.conflict_p + config.reuse_p:
            old = sim.rng.choice(earlier)
            request = Request(user, old.key, old.fingerprint, old.tier, old.max_output_tokens)
        else:
            key = sim.new_id(f"{user}-key")
            tier = Tier.PAID if sim.rng.random() < 0.1 else Tier.FREE
            request = Request(user, key, f"fp-{key}-{sim.rng.randrange(10**6)}", tier, sim.rng.choice((16, 64, 256)))
            earlier.append(request)
            if len(earlier) > 50:
                earlier.pop(0)
        self.submit(request)

    def conversation_request(self, user: str) -> None:
        """Create, delete, or a turn (maybe a regeneration, maybe at a stale revision) in a conversation."""
        sim = self.sim
        mine = self.conversations[user]
        roll = sim.rng.random()
        if len(mine) < 2 or roll < 0.05:
            cid = sim.new_id(f"conv-{user}")
            mine[cid] = 0
            request_id, reply_to = self.reply_to()
            self.pending[request_id] = ("create", Request(user, cid, "", Tier.FREE, 0, conversation_id=cid))
            sim.append_command(
                cmd.CreateConversation(
                    command_id=sim.new_id(f"create:{user}"), user_id=user, issued_at_ms=sim.now_ms + self.clock_skew_ms,
                    conversation_id=cid, reply_to=reply_to,
                )
            )
            return
        cid = sim.rng.choice(sorted(mine))
        if roll < 0.08:
            del mine[cid]
            request_id, reply_to = self.reply_to()
            sim.append_command(
                cmd.DeleteConversation(
                    command_id=sim.new_id(f"delete:{user}"), user_id=user, issued_at_ms=sim.now_ms + self.clock_skew_ms,
                    conversation_id=cid, restore_revision=sim.parked.get(cid, -1), reply_to=reply_to,
                )
            )
            return
        revision = mine[cid]
        if sim.rng.random() < sim.config.stale_revision_p:
            revision = max(0, revision - sim.rng.randint(1, 2))  # a second device that has not caught up
        regenerate = revision >= 2 and sim.rng.random() < 0.15
        key = sim.new_id(f"{user}-turn")
        request = Request(
            user, key, f"fp-{key}", Tier.FREE, sim.rng.choice((16, 64)),
            conversation_id=cid, expected_revision=revision, regenerate=regenerate,
        )
        self.submit(request)

    def submit(self, request: Request) -> None:
        sim = self.sim
        request.tries += 1
        request_id, reply_to = self.reply_to()
        self.fingerprints[(request.user, request.key)].add(request.fingerprint)
        command = cmd.SubmitGeneration(
            command_id=sim.new_id(f"submit:{request.user}"),
            user_id=request.user,
            issued_at_ms=sim.now_ms + self.clock_skew_ms,
            idempotency_key=request.key,
            fingerprint=request.fingerprint,
            model_alias=MODEL_ALIAS,
            tier=request.tier,
            stream=True,
            max_output_tokens=request.max_output_tokens,
            input_tokens=sim.rng.randint(1, 500),
            estimated_queue_wait_ms=5_000 if sim.rng.random() < 0.03 else 0,
            decide_by_ms=self.decide_by_ms(),
            reader_id=READER_ID,
            reply_to=reply_to,
            conversation_id=request.conversation_id,
            expected_revision=request.expected_revision,
            regenerate=request.regenerate,
            restore_revision=sim.parked.get(request.conversation_id, -1) if request.conversation_id else -1,
        )
        self.pending[request_id] = ("submit", request)
        sim.append_command(command)
        sim.at(sim.config.edge_timeout_ms, self.timeout, request_id)

    def cancel(self, request: Request) -> None:
        sim = self.sim
        if request.generation_id is None or sim.draining:
            return
        if request.cancel_tries == 0 and sim.rng.random() < DETACH_P:
            self.detach(request)
            return
        request.cancel_tries += 1
        request_id, reply_to = self.reply_to()
        reason = sim.rng.choice((CancelReason.USER, CancelReason.CLIENT_DISCONNECT))
        command = cmd.CancelGeneration(
            command_id=sim.new_id(f"cancel:{request.user}"),
            user_id=request.user,
            issued_at_ms=sim.now_ms + self.clock_skew_ms,
            generation_id=request.generation_id,
            reason=reason,
            reply_to=reply_to,
        )
        self.pending[request_id] = ("cancel", request)
        sim.append_command(command)
        sim.at(sim.config.edge_timeout_ms, self.timeout, request_id)

    def detach(self, request: Request) -> None:
        """The client goes away: its generation is detached (a lost command is a lost detach: the
        generation then ends by its own deadlines); sometimes a reader comes back within the grace."""
        sim = self.sim
        assert request.generation_id is not None
        request.cancel_tries += 1
        grace_ms = sim.rng.randint(0, DETACH_GRACE_MS_MAX)
        sim.stats.detaches += 1
        sim.append_command(
            cmd.DetachReader(
                command_id=sim.new_id(f"detach:{request.user}"),
                user_id=request.user,
                issued_at_ms=sim.now_ms + self.clock_skew_ms,
                generation_id=request.generation_id,
                reader_id=READER_ID,
                grace_ms=grace_ms,
                reason=sim.rng.choice((CancelReason.CLIENT_DISCONNECT, CancelReason.EDGE_LOST)),
            )
        )
        if sim.rng.random() < REATTACH_P:
            sim.at(sim.rng.randint(0, 2 * grace_ms + 1), self.attach, request)

    def attach(self, request: Request) -> None:
        sim = self.sim
        if request.generation_id is None or sim.draining:
            return
        sim.stats.attaches += 1
        sim.append_command(
            cmd.AttachReader(
                command_id=sim.new_id(f"attach:{request.user}"),
                user_id=request.user,
                issued_at_ms=sim.now_ms + self.clock_skew_ms,
                generation_id=request.generation_id,
                reader_id=f"{READER_ID}-again",
            )
        )

    def timeout(self, request_id: str) -> None:
        entry = self.pending.pop(request_id, None)
        if entry is None or self.sim.draining:
            return
        self.sim.stats.edge_timeouts += 1
        kind, request = entry
        # No answer in time: the client saw 503 and retries with the same key. A submit read after its
        # deadline holds nothing; one decided in time whose answer was lost is found by the retry.
        self.retry(kind, request)

    def retry(self, kind: str, request: Request) -> None:
        if kind == "submit" and request.tries < self.sim.config.edge_retries_max:
            self.sim.at(self.sim.between((50, 1_000)), self.submit, request)
        elif kind == "cancel" and request.cancel_tries < self.sim.config.edge_retries_max:
            self.sim.at(self.sim.between((50, 1_000)), self.cancel, request)

    def on_outcome(self, outcome: Outcome) -> None:
        entry = self.pending.pop(outcome.request_id or "", None)
        if entry is None:
            return  # a duplicate, or a late answer to a request that already timed out
        kind, request = entry
        sim = self.sim
        if kind == "create":
            if outcome.code is RejectionCode.NOT_FOUND or outcome.code is RejectionCode.RATE_LIMITED:
                self.conversations[request.user].pop(request.conversation_id, None)
            return
        if request.conversation_id:
            mine = self.conversations[request.user]
            if outcome.code is RejectionCode.CONVERSATION_CONFLICT and outcome.details.revision is not None:
                if request.conversation_id in mine:
                    mine[request.conversation_id] = outcome.details.revision
            elif outcome.code is RejectionCode.NOT_FOUND:
                mine.pop(request.conversation_id, None)
        if kind == "cancel":
            if outcome.kind is OutcomeKind.CANCEL_REQUESTED and sim.rng.random() < 0.3:
                sim.at(sim.between((500, 3_000)), self.cancel, request)  # the impatient second click
            return
        code = outcome.code
        if code is RejectionCode.IDEMPOTENCY_CONFLICT:
            if len(self.fingerprints[(request.user, request.key)]) < 2:
                sim.fail(f"idempotency_conflict for {request.user}/{request.key}, never sent with other content")
            return
        if outcome.kind is OutcomeKind.ADMITTED or code is RejectionCode.GENERATION_IN_PROGRESS:
            if outcome.generation_id is None:
                sim.fail(f"{outcome.kind} without a generation id")
            request.generation_id = outcome.generation_id
            self.by_generation[outcome.generation_id] = request
            if sim.rng.random() < sim.config.cancel_p:
                sim.at(sim.between((0, 6_000)), self.cancel, request)
        elif code is RejectionCode.QUOTA_SERVICE_UNAVAILABLE:
            self.retry(kind, request)  # read after its deadline: the edge answers 503, as on a timeout
        elif code is RejectionCode.IDEMPOTENCY_KEYS_EXHAUSTED:
            # Nothing was recorded, so a same-key retry after the delay is decided afresh. Only some
            # clients retry: every refused request of the user is told the same moment.
            if request.admission_retries == 0 and sim.rng.random() < 0.3:
                request.admission_retries += 1
                request.tries = 0
                wait = outcome.details.retry_after_ms or 1_000
                sim.at(wait + sim.between((0, 30_000)), self.submit, request)
        elif code in (RejectionCode.CONCURRENCY_LIMITED, RejectionCode.CAPACITY_EXHAUSTED):
            if request.admission_retries < 3:
                request.admission_retries += 1
                request.tries = 0
                wait = outcome.details.retry_after_ms or 1_000
                sim.at(wait + sim.between((0, 1_000)), self.submit, request)

    def on_finalized(self, message: GenerationFinalized) -> None:
        request = self.by_generation.get(message.generation_id)
        sim = self.sim
        if request is None or sim.draining:
            return
        if request.conversation_id:
            # The answer committed: the next turn goes after it (the client learns the revision here).
            mine = self.conversations[request.user]
            if request.conversation_id in mine:
                base = request.expected_revision if request.regenerate else request.expected_revision + 1
                mine[request.conversation_id] = max(mine[request.conversation_id], base + 1)
            return
        if message.status is RequestStatus.ADMISSION_RETRYABLE and sim.rng.random() < 0.7:
            # Proven never started: the client's retry reserves afresh under the same key.
            request.tries = 0
            sim.at(sim.between((100, 2_000)), self.submit, request)


# --- the workers ------------------------------------------------------------------------------


@dataclass
class Run:
    """One attempt a worker holds: accepting, running (inference) or reporting."""

    dispatch: DispatchAuthorized
    target_tokens: int
    phase: str = "accepting"
    tries: int = 0
    tokens: int = 0
    cancel: bool = False
    lease_until_ms: int = 0
    last_renew_ms: int = 0
    outcome: FinishOutcome = FinishOutcome.COMPLETED
    spooled: bool = False
    extra_tokens: int = 0  # reported beyond what it generated (``SimConfig.token_overshoot_p``)


class Worker:
    """Pulls dispatch when it has a free slot, commits acceptance before computing, renews, reports."""

    def __init__(self, sim: Simulation, worker_id: str) -> None:
        self.sim = sim
        self.worker_id = worker_id
        self.up = True
        self.incarnation = 0
        self.runs: dict[tuple[str, int], Run] = {}
        self.pending: dict[str, tuple[tuple[str, int], str, int]] = {}  # request id -> (run, kind, sent at)
        self.partition = topics.worker_control_partition(worker_id)
        self.clock_skew_ms = sim.skew()

    def clock(self) -> int:
        """This worker's clock (skewed): it stamps commands and judges deadlines with it."""
        return self.sim.now_ms + self.clock_skew_ms

    def poll(self, incarnation: int, again: bool = True) -> None:
        sim = self.sim
        if incarnation != self.incarnation:
            return
        if again:
            sim.at(sim.config.poll_every_ms, self.poll, incarnation)
        if self.up and len(self.runs) < sim.config.worker_slots and sim.dispatch_queue:
            self.take(sim.dispatch_queue.popleft())

    def send(self, key: tuple[str, int], kind: str, command_cls: Any, **fields: Any) -> None:
        sim = self.sim
        request_id = sim.new_id(f"{self.worker_id}:r")
        d = self.runs[key].dispatch if key in self.runs else fields.pop("dispatch")
        command = command_cls(
            command_id=sim.new_id(f"{kind}:{self.worker_id}"),
            user_id=d.user_id,
            issued_at_ms=self.clock(),
            generation_id=d.generation_id,
            epoch=d.epoch,
            worker_id=self.worker_id,
            reply_to=cmd.ReplyTo(topic=sim.topology.worker_control.name, partition=self.partition, request_id=request_id),
            **fields,
        )
        self.pending[request_id] = (key, kind, self.clock())
        sim.append_command(command)
        sim.at(sim.config.reply_timeout_ms, self.timeout, request_id, self.incarnation)

    def take(self, d: DispatchAuthorized) -> None:
        sim = self.sim
        key = (d.generation_id, d.epoch)
        if key in self.runs:
            return  # a duplicate delivery of a dispatch this worker already holds
        if self.clock() > d.queue_deadline_ms:
            # Too old to start: prove it never will (the processor releases the reservation).
            self.send(key, "decline", cmd.DeclineAttempt, dispatch=d, reason="queue_deadline")
            return
        self.runs[key] = Run(d, target_tokens=sim.rng.randint(1, min(d.max_output_tokens, sim.config.output_tokens[1])))
        if sim.config.token_overshoot_p and sim.rng.random() < sim.config.token_overshoot_p:
            run = self.runs[key]
            run.extra_tokens = d.max_output_tokens - run.target_tokens + sim.rng.randint(1, 2 * sim.config.token_overshoot_max)
        self.accept(key)

    def accept(self, key: tuple[str, int]) -> None:
        self.runs[key].tries += 1
        self.send(key, "accept", cmd.AcceptAttempt)

    def report(self, key: tuple[str, int]) -> None:
        run = self.runs[key]
        run.tries += 1
        failed = run.outcome is FinishOutcome.FAILED
        self.send(
            key,
            "report",
            cmd.ReportAttemptFinished,
            outcome=run.outcome,
            input_tokens=run.dispatch.input_tokens,
            output_tokens=run.tokens + run.extra_tokens,
            finish_reason="stop" if run.outcome is FinishOutcome.COMPLETED else "",
            error_code=RejectionCode.MODEL_BACKEND_ERROR if failed else None,
            answer_spooled=run.spooled,
        )

    def finish(self, key: tuple[str, int], outcome: FinishOutcome) -> None:
        run = self.runs[key]
        run.phase, run.outcome, run.tries = "reporting", outcome, 0
        d = run.dispatch
        if d.conversation_id and self.sim.rng.random() < self.sim.config.answer_spooled_p:
            # Spooled (acknowledged by the broker) before the report; the history writer stores it
            # and commits it after its own delay, independent of this worker's fate.
            run.spooled = True
            self.sim.commits_outstanding[d.generation_id] += 1
            self.sim.at(self.sim.between((5, 3_000)), self.sim.history_writer_commit, d)
        self.report(key)

    def timeout(self, request_id: str, incarnation: int) -> None:
        if incarnation != self.incarnation:
            return
        entry = self.pending.pop(request_id, None)
        if entry is None:
            return
        key, kind, _ = entry
        run = self.runs.get(key)
        if run is None:
            return
        retries = self.sim.config.worker_retries_max
        if kind == "accept" and run.phase == "accepting":
            if run.tries < retries and self.clock() <= run.dispatch.queue_deadline_ms:
                self.accept(key)
            else:
                # Acceptance never confirmed: never start. If it did commit, the lease runs out.
                self.release(key)
        elif kind == "report" and run.phase == "reporting":
            if run.tries < retries + 2:
                self.report(key)
            else:
                self.release(key)  # the lease expiry settles it

    def on_outcome(self, outcome: Outcome) -> None:
        entry = self.pending.pop(outcome.request_id or "", None)
        if entry is None:
            return
        key, kind, sent_at = entry
        run = self.runs.get(key)
        if run is None:
            return
        sim = self.sim
        lease_until = sent_at + sim.policy.lease_ms  # the processor's deadline counts from our command
        if kind == "accept" and run.phase == "accepting":
            mine = outcome.kind is OutcomeKind.APPLIED or (
                outcome.kind is OutcomeKind.EXISTING and outcome.status is RequestStatus.RUNNING and outcome.epoch == key[1]
            )
            if not mine:
                self.release(key)
                return
            for other in sim.workers:
                for (generation_id, epoch), held in other.runs.items():
                    if generation_id == key[0] and held.phase == "running" and other is not self:
                        sim.fail(f"{self.worker_id} starts {key[0]} epoch {key[1]} while {other.worker_id} runs epoch {epoch}")
            run.phase, run.lease_until_ms, run.last_renew_ms = "running", lease_until, self.clock()
            sim.started.append((key[0], key[1], self.worker_id))
            sim.stats.inferences_started += 1
            sim.at(sim.between(sim.config.decode_step_ms), self.decode, key, self.incarnation)
        elif kind == "renew" and run.phase == "running":
            if outcome.kind is OutcomeKind.REJECTED:
                self.release(key)  # fenced or no longer ours: stop, nothing from it counts
                return
            run.lease_until_ms = max(run.lease_until_ms, lease_until)
            run.cancel = run.cancel or outcome.kind is OutcomeKind.CANCEL_REQUESTED
        elif kind == "report" and run.phase == "reporting":
            self.release(key)

    def on_stop(self, message: StopAttempt) -> None:
        key = (message.generation_id, message.epoch)
        run = self.runs.get(key)
        if run is None or message.worker_id != self.worker_id or not self.up:
            return
        if message.fence_reason is not None:
            self.release(key)  # fenced: abort at once, report nothing
        elif run.phase == "running":
            run.cancel = True

    def decode(self, key: tuple[str, int], incarnation: int) -> None:
        sim = self.sim
        run = self.runs.get(key)
        if incarnation != self.incarnation or run is None or run.phase != "running":
            return
        if sim.rng.random() < sim.config.worker_crash_p:
            self.crash()
            return
        if self.clock() >= run.lease_until_ms:
            self.finish(key, FinishOutcome.FAILED)  # could not renew ownership in time: stop computing
            return
        if run.cancel:
            self.finish(key, FinishOutcome.STOPPED)
            return
        run.tokens += sim.rng.randint(1, 6)
        if run.tokens >= run.target_tokens:
            run.tokens = run.target_tokens
            failed = sim.rng.random() < sim.config.fail_p
            self.finish(key, FinishOutcome.FAILED if failed else FinishOutcome.COMPLETED)
            return
        if self.clock() - run.last_renew_ms >= sim.config.renew_every_ms:
            run.last_renew_ms = self.clock()
            self.send(key, "renew", cmd.RenewLease, output_tokens=run.tokens)
        sim.at(sim.between(sim.config.decode_step_ms), self.decode, key, incarnation)

    def release(self, key: tuple[str, int]) -> None:
        """Forget an attempt and use the freed slot for the next dispatch."""
        del self.runs[key]
        self.sim.at(0, self.poll, self.incarnation, False)

    def crash(self) -> None:
        sim = self.sim
        sim.stats.worker_crashes += 1
        self.up = False
        self.incarnation += 1
        self.runs.clear()
        self.pending.clear()
        sim.at(sim.between(sim.config.worker_restart_ms), self.restart)

    def restart(self) -> None:
        self.up = True
        self.sim.at(0, self.poll, self.incarnation)


# --- entry point (the command line is control_plane/simulator/__main__.py) ----------------------


def simulate(seed: int, steps: int, config: SimConfig | None = None) -> Simulation:
    """Run one seeded simulation of ``steps`` steps, then drain and check; raises ``SimulationFailed``."""
    sim = Simulation(seed, config)
    sim.run(steps)
    return sim
