"""The workers: each pulls dispatch when it has a free slot, commits its acceptance before computing,
renews its lease while it decodes, and reports how the attempt finished.

Data flow: ``world.deliver_dispatch`` queues a ``DispatchAuthorized`` on ``world.dispatch_queue`` and
wakes an idle worker; ``poll`` takes one into a ``Run`` and sends ``AcceptAttempt`` (or
``DeclineAttempt`` when it is too old) through ``world.append_command``; the processor's answers come
back through ``on_outcome`` (accepted: start decoding; renewed; reported: forget the run) and
``on_stop`` (cancel, or a fence: abort at once). ``decode`` steps the inference, renews, and on the
last token (or a cancel, a failure, a lease it could not renew) ``finish`` reports it, first handing a
conversation's spooled answer to the history writer (``world.history_writer_commit``). A worker may
crash mid-generation (its runs are forgotten; its leases then expire). Checked here: no worker starts
a generation another worker of the fleet is running; every started attempt is recorded in
``world.started`` for the end check against the committed acceptances.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from control_plane.simulator.world import World
from schemas import commands as cmd
from schemas import topics
from schemas.codes import FinishOutcome, RejectionCode, RequestStatus
from schemas.messages import DispatchAuthorized, Outcome, OutcomeKind, StopAttempt


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

    def __init__(self, sim: World, worker_id: str, fleet: list[Worker]) -> None:
        self.sim = sim
        self.worker_id = worker_id
        self.fleet = fleet  # every worker pulling the same dispatch, this one included
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
            for other in self.fleet:
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
