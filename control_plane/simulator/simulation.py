"""The whole simulation, wired and run: the world, the processor, the edge and the workers, started,
stepped with random pauses, drained and checked.

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

The parts: ``world`` (the clock, the pending deliveries, the lossy network, the logs as they land),
``processor`` (the admission processor and its timer), ``edge`` (the edge and its clients),
``workers``, ``checks`` (the end state), ``config`` (sizes, fault rates, counters). This module is
the one that knows them all: ``Simulation`` is the world with its actors, and the world's last hop
(``to_commands_log``, ``track_output``, ``deliver_dispatch``, ``deliver_message``) lands on them here.

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

from typing import Any

from control_plane.simulator.checks import check_end_state, summarize
from control_plane.simulator.config import SimConfig, Stats
from control_plane.simulator.edge import Edge
from control_plane.simulator.processor import Processor
from control_plane.simulator.workers import Worker
from control_plane.simulator.world import World
from schemas.messages import GenerationFinalized, Outcome, StopAttempt
from schemas.wire import decode_message, encode


class Simulation(World):
    """The world with its actors: one processor (and its timer), one edge, ``config.workers`` workers."""

    def __init__(self, seed: int, config: SimConfig | None = None) -> None:
        super().__init__(seed, config)
        self.processor = Processor(self)
        self.edge = Edge(self)
        self.workers: list[Worker] = []
        self.workers.extend(Worker(self, f"w{i}", self.workers) for i in range(self.config.workers))

    # --- the world's last hop, onto the actors -------------------------------------------------

    def to_commands_log(self, data: bytes) -> None:
        self.processor.append(data)

    def track_output(self, origin: int, seqs: list[int]) -> None:
        self.processor.track(origin, seqs)

    def deliver_dispatch(self, value: bytes) -> None:
        dispatch = decode_message(value)
        if dispatch.event_id not in self.ledger:
            # The previous design's hole: a dispatch (and a reply) sent beside a ledger entry that a
            # crash then lost; the generation never existed on the log.
            self.fail(f"dispatch {dispatch.event_id} of {dispatch.generation_id} delivered before its ledger entry")
        self.dispatch_queue.append(dispatch)
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

    # --- the end -------------------------------------------------------------------------------

    def check_end(self) -> None:
        check_end_state(self, self.processor.aggregates)

    def summary(self) -> dict[str, Any]:
        return summarize(self.ledger)


# --- entry point (the command line is control_plane/simulator/__main__.py) ----------------------


def simulate(seed: int, steps: int, config: SimConfig | None = None) -> Simulation:
    """Run one seeded simulation of ``steps`` steps, then drain and check; raises ``SimulationFailed``."""
    sim = Simulation(seed, config)
    sim.run(steps)
    return sim
