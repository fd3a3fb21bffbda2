"""The admission processor and its deadline timer, as the simulation runs them: one partition's single
writer driving the real ``handle`` and the real ``route``.

Data flow: command records arrive through ``append`` (from the world's producers) into ``log``;
``process_next`` consumes them in order (stamping a submit's read time, or the stamp recalled from the
ledger after a restart), folds each into ``aggregates`` with ``handle``, checks the new state with
``check_state`` and routes the outputs: ledger entries are held in ``pending_ledger`` until they land
(``flush_one``) or a commit flushes them (``world.commit_ledger``); every other output waits in
``outbox``, in command order, until the ledger entry of its command has landed (as the real
processor's drain waits for the entry's acknowledgement), then usage records go to
``world.deliver_usage``, dispatch and messages over the lossy network (``world.send``). Every few
commands ``commit`` snapshots the table and the offset; ``crash`` loses what was not committed (some
of the pending entries got out first, and of those some outputs: the crash may fall between an
entry's acknowledgement and its outputs; in-flight outputs may be lost) and ``restart`` re-consumes from the
committed offset. ``timer_tick`` appends ``ReconcileDue`` for every user past its next deadline.
"""

from __future__ import annotations

import dataclasses

from control_plane.aggregate import Aggregate, handle
from control_plane.decide import next_deadline_ms, read_past_deadline
from control_plane.invariants import check_state
from control_plane.routing import route
from control_plane.simulator.world import World
from schemas import commands as cmd
from schemas.wire import decode_command


@dataclasses.dataclass(slots=True)
class _Held:
    """One command's outputs other than its ledger entry, waiting for that entry to land."""

    entry: bytes | None  # its ledger entry (None: it has none, it waits only for the commands before it)
    sends: list  # callables, each sending one output
    landed: bool = False


class Processor:
    """One partition's single writer: a commands log, a table of aggregates, committed snapshots."""

    def __init__(self, sim: World) -> None:
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
        self.pending_ledger: list[tuple[_Held, bytes]] = []  # (its command's outputs, entry) not yet on the ledger log
        self.outbox: list[_Held] = []  # outputs waiting for their command's ledger entry, in command order
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
        held = _Held(None, [])
        for out in route(sim.topology, before.ledger, after.ledger, command, decision, 0):
            if out.topic == sim.topology.ledger.name:
                held.entry = out.value
                self.pending_ledger.append((held, out.value))
                sim.at(sim.between(sim.config.net_delay_ms), self.flush_one, out.value)
            elif out.topic == sim.topology.usage.name:
                held.sends.append(lambda v=out.value: self.track(
                    origin, [sim.at(sim.between(sim.config.net_delay_ms), sim.deliver_usage, v)]
                ))
            elif out.topic in sim.dispatch_topics:
                held.sends.append(lambda v=out.value: sim.send(sim.deliver_dispatch, v, origin))
            else:
                held.sends.append(lambda v=out.value: sim.send(sim.deliver_message, v, origin))
        self.outbox.append(held)
        if not sim.config.outputs_after_ledger:  # the previous design, kept to show the check catches it
            held.landed = True
        self.release()

    def land(self, held: _Held, value: bytes) -> None:
        self.sim.commit_ledger(value)
        held.landed = True

    def release(self, most: int | None = None) -> None:
        """Send the outputs at the head of the outbox whose ledger entry has landed (or that have none)."""
        sent = 0
        while self.outbox and (self.outbox[0].entry is None or self.outbox[0].landed) and (most is None or sent < most):
            for send in self.outbox.pop(0).sends:
                send()
            sent += 1

    def flush_one(self, value: bytes) -> None:
        """The producer keeps a partition's order: this entry lands with every entry sent before it."""
        if not any(pending is value for _, pending in self.pending_ledger):
            return  # already flushed by a commit, or lost in a crash
        while self.pending_ledger:
            held, pending = self.pending_ledger.pop(0)
            self.land(held, pending)
            if pending is value:
                break
        self.release()

    def commit(self) -> None:
        """Flush the producer (every pending ledger entry lands), then snapshot the table and the offset."""
        for held, value in self.pending_ledger:
            self.land(held, value)
        self.pending_ledger.clear()
        self.release()
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
        for held, value in pending[:sent]:
            self.land(held, value)
        # The crash may fall after entries were acknowledged and before all of their outputs were
        # sent: some of the releasable outputs got out, the rest are lost with the outbox.
        releasable = 0
        for held in self.outbox:
            if not (held.entry is None or held.landed):
                break
            releasable += 1
        self.release(most=sim.rng.randint(0, releasable) if releasable else 0)
        self.outbox.clear()
        for _, seqs in self.in_flight:
            for seq in seqs:
                if sim.rng.random() < sim.config.crash_drop_p:
                    sim.lose(seq)
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
