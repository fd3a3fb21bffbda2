"""One attempt: one dispatch's run on this worker, from the dispatch taken off its topic to its report.

An attempt is a state machine (``Attempt``), one method per transition::

    TAKEN --_request_prompt--> PROMPT_REQUESTED --_request_accept--> ACCEPT_REQUESTED --_accepted--> ACCEPTED
      |                          |                                      |
      +--------------------------+--------------------------------------+--_give_up / _decline--> GAVE_UP
    ACCEPTED --_start_engine--> RUNNING --_begin_stop--> STOPPING
    RUNNING, STOPPING --_on_finished / _fail--> ENDED --_report--> REPORTED

TAKEN: check the model version, the queue deadline (past it: decline, which releases the
reservation) and the epoch; fetch the prompt from the edge (no answer in time: decline); append
``AcceptAttempt`` and start the engine only once the processor answered ``running``. RUNNING: stream
deltas (sequence 1, 2, ... per (generation, epoch)), renew the lease, and between decode steps check
for a ``StopReason`` (``StopAttempt``, a ``cancel_requested`` renewal, a lost lease, max tokens, a
worker shutdown). STOPPING: the stop is acknowledged by the engine's ``Finished(ABORTED)``; the slot is
freed only after it. An engine that does not acknowledge, stalls, errs or runs past the duration limit
ends the attempt as an ``AttemptFailure``. REPORTED: the final text went to the ``ResultSink`` before
``ReportAttemptFinished`` with a closed ``FinishReason`` (usage also on cancel), appended with no
``reply_to``: once Kafka has it, the processor decides it from the log, and the worker acts on nothing
the answer would say. No prompt or generated text is ever logged or put in a command.

The attempt touches its worker (``workers.worker.Worker``) only through ``AttemptHost``: the settings,
engine, model, output check, sinks and measured rates, appending a command and awaiting its outcome
(or, for the report, only Kafka's acknowledgement),
the prompt (published or asked of the edge), sending a delta, spooling an answer, watching for a stop
(``StopAttempt`` on the control partition), counting a token, and giving its slot back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any, Protocol, assert_never

from aiokafka.errors import KafkaError

from infra.content.policy_checks import PolicyCheck, output_hold
from infra.runtime import tracing
from schemas import commands as cmd
from schemas.codes import FinishOutcome, FinishReason, RejectionCode, RequestStatus
from schemas.commands import ReplyTo
from schemas.messages import (
    ChatMessage,
    DispatchAuthorized,
    Outcome,
    OutcomeKind,
    PromptPayload,
    PromptRequest,
    TextDelta,
)
from workers.engines.base import (
    Engine,
    EngineError,
    EngineRequest,
    Finished,
    Generation,
    Message,
    TextChunk,
)
from workers.replay_sink import ReplaySink
from workers.settings import WorkerSettings
from workers.work import WorkRates

log = logging.getLogger("chatplane.workers")

ABORT_ACK_TIMEOUT_S = 10.0  # an engine that does not acknowledge an abort in this long is broken
RENEWER_STOP_TIMEOUT_S = 5.0  # an attempt waits this long for its lease renewer to end


def now_ms() -> int:
    return int(time.time() * 1000)


class ResultSink(Protocol):
    """Where the final text of an attempt goes before the worker reports completion (the result store)."""

    async def put(self, generation_id: str, epoch: int, text: str, usage: tuple[int, int]) -> bool | None:
        """True: stored; False: not stored yet (held for a later write); None: never stored here
        (no store, or the text is over its size limit). Reported as ``result_stored``."""
        ...


class ServedModel(Protocol):
    """What the worker needs of the model it serves (its catalog entry)."""

    system_instructions: str  # trusted; the first message of every engine request
    pool: str  # the catalog's pool of this model version: its dispatch topics and consumer group

    def serves(self, model_version: str) -> bool: ...


# --- the attempt's closed vocabularies ------------------------------------------------------------


class AttemptState(Enum):
    """Where one attempt is; ``_NEXT_STATES`` lists the transitions ``Attempt._to`` allows."""

    TAKEN = "taken"  # the dispatch was taken from its topic and a slot is held for it
    PROMPT_REQUESTED = "prompt_requested"  # PromptRequest sent to the edge; waiting for the PromptPayload
    ACCEPT_REQUESTED = "accept_requested"  # AcceptAttempt appended; waiting for the processor's answer
    ACCEPTED = "accepted"  # the processor answered running: the attempt is ours
    RUNNING = "running"  # the engine generates, deltas stream, the lease is renewed
    STOPPING = "stopping"  # Generation.abort() called; waiting for the engine's Finished(ABORTED)
    ENDED = "ended"  # the engine finished, or the attempt failed (``Attempt.failure``)
    REPORTED = "reported"  # the result was written and ReportAttemptFinished appended (or given up on)
    GAVE_UP = "gave_up"  # never ran: declined, not accepted, or stopped before acceptance


_S = AttemptState
_NEXT_STATES: dict[AttemptState, frozenset[AttemptState]] = {
    _S.TAKEN: frozenset({_S.PROMPT_REQUESTED, _S.GAVE_UP}),
    _S.PROMPT_REQUESTED: frozenset({_S.ACCEPT_REQUESTED, _S.GAVE_UP}),
    _S.ACCEPT_REQUESTED: frozenset({_S.ACCEPTED, _S.GAVE_UP}),
    _S.ACCEPTED: frozenset({_S.RUNNING}),
    _S.RUNNING: frozenset({_S.STOPPING, _S.ENDED}),
    _S.STOPPING: frozenset({_S.ENDED}),
    _S.ENDED: frozenset({_S.REPORTED}),
    _S.REPORTED: frozenset(),
    _S.GAVE_UP: frozenset(),
}
assert set(_NEXT_STATES) == set(AttemptState), "every state needs its transitions"
# States in which an attempt still has engine work ahead (its heartbeat's held work).
_WORK_STATES = frozenset({_S.TAKEN, _S.PROMPT_REQUESTED, _S.ACCEPT_REQUESTED, _S.ACCEPTED, _S.RUNNING, _S.STOPPING})


class DeclineReason(StrEnum):
    """Why the worker declines a dispatch it has not started (``DeclineAttempt.reason``)."""

    MODEL_VERSION_MISMATCH = "model_version_mismatch"  # this worker serves another version
    QUEUE_DEADLINE = "queue_deadline"  # the dispatch waited past its queue deadline
    NO_STREAM_TARGET = "no_stream_target"  # the dispatch names no edge inbox to stream to
    PROMPT_UNAVAILABLE = "prompt_unavailable"  # the edge did not answer with the prompt in time


class StopReason(StrEnum):
    """Why a running attempt must stop (the first one wins); the engine acknowledges it with
    ``Finished(ABORTED)``. The values are what ``AttemptTrace.stop_reason`` and the logs show."""

    CANCEL = "cancel"  # StopAttempt without a fence reason, or a renewal answered cancel_requested
    FENCED = "fenced"  # StopAttempt with a fence reason, or a renewal rejected: the epoch is not ours
    LEASE_LOST = "lease_lost"  # no renewal confirmed within the lease: the processor fences it then
    MAX_OUTPUT_TOKENS = "max_output_tokens"  # the request's token budget is spent: a completion
    GENERATION_DURATION_MAX = "generation_duration_max"  # the run passed generation_duration_max_s
    WORKER_SHUTDOWN = "worker_shutdown"  # the drain on shutdown ran out of time
    OUTPUT_REFUSED = "output_refused"  # the output check refused the engine's next text (docs/policy.md)


class AttemptFailure(StrEnum):
    """Why a running attempt ended without the engine's ``Finished`` (reported as failed)."""

    ABORT_NOT_ACKNOWLEDGED = "abort_not_acknowledged"  # no Finished(ABORTED) within ABORT_ACK_TIMEOUT_S
    GENERATION_DURATION_MAX = "generation_duration_max"  # the engine step outlived the duration limit
    ENGINE_STALLED = "engine_stalled"  # no item from the engine within engine_stall_max_s
    ENGINE_ENDED_WITHOUT_FINISH = "engine_ended_without_finish"  # the iteration ended with no Finished
    ENGINE_ERROR = "engine_error"  # the engine raised EngineError (its reason is logged, not reported)


def stop_report(reason: StopReason) -> tuple[FinishOutcome, RejectionCode | None, FinishReason]:
    """How an attempt the engine stopped for ``reason`` is reported: outcome, error code, finish reason."""
    match reason:
        case StopReason.CANCEL:
            return FinishOutcome.STOPPED, None, FinishReason.CANCEL
        case StopReason.MAX_OUTPUT_TOKENS:
            return FinishOutcome.COMPLETED, None, FinishReason.LENGTH
        case StopReason.FENCED:
            return FinishOutcome.FAILED, RejectionCode.MODEL_BACKEND_ERROR, FinishReason.FENCED
        case StopReason.LEASE_LOST:
            return FinishOutcome.FAILED, RejectionCode.MODEL_BACKEND_ERROR, FinishReason.LEASE_LOST
        case StopReason.GENERATION_DURATION_MAX:
            return FinishOutcome.FAILED, RejectionCode.GENERATION_TIMEOUT, FinishReason.GENERATION_DURATION_MAX
        case StopReason.WORKER_SHUTDOWN:
            return FinishOutcome.FAILED, RejectionCode.MODEL_BACKEND_ERROR, FinishReason.WORKER_SHUTDOWN
        case StopReason.OUTPUT_REFUSED:
            # A failure with its own code: the message stays spent (it was accepted), as after any failure.
            return FinishOutcome.FAILED, RejectionCode.OUTPUT_REFUSED, FinishReason.OUTPUT_REFUSED
    assert_never(reason)


def failure_report(failure: AttemptFailure) -> tuple[RejectionCode, FinishReason]:
    """How a failed attempt is reported (outcome ``failed``): error code and finish reason."""
    match failure:
        case AttemptFailure.GENERATION_DURATION_MAX:
            return RejectionCode.GENERATION_TIMEOUT, FinishReason.GENERATION_DURATION_MAX
        case AttemptFailure.ABORT_NOT_ACKNOWLEDGED:
            return RejectionCode.MODEL_BACKEND_ERROR, FinishReason.ABORT_NOT_ACKNOWLEDGED
        case AttemptFailure.ENGINE_STALLED:
            return RejectionCode.MODEL_BACKEND_ERROR, FinishReason.ENGINE_STALLED
        case AttemptFailure.ENGINE_ENDED_WITHOUT_FINISH:
            return RejectionCode.MODEL_BACKEND_ERROR, FinishReason.ENGINE_ENDED_WITHOUT_FINISH
        case AttemptFailure.ENGINE_ERROR:
            return RejectionCode.MODEL_BACKEND_ERROR, FinishReason.ENGINE_ERROR
    assert_never(failure)


def keeps_result(reason: StopReason | None) -> bool:
    """Whether the text of an attempt stopped for ``reason`` goes to the result sink: not when the
    epoch is (or is about to be) fenced, since the processor no longer takes anything from it."""
    match reason:
        case (
            None | StopReason.CANCEL | StopReason.MAX_OUTPUT_TOKENS | StopReason.GENERATION_DURATION_MAX
            | StopReason.WORKER_SHUTDOWN | StopReason.OUTPUT_REFUSED  # (the refused text is not in it)
        ):
            return True
        case StopReason.FENCED | StopReason.LEASE_LOST:
            return False
    assert_never(reason)


@dataclass
class AttemptTrace:
    """What happened to one attempt, for tests and benchmarks (no content)."""

    generation_id: str
    epoch: int
    declined: str | None = None  # a DeclineReason, "stopped_before_accept" or "not_accepted:<code>"
    accepted: bool = False
    taken_at: float = field(default_factory=time.monotonic)  # the dispatch was taken from its topic
    prompt_at: float | None = None  # the prompt was read (published) or the edge's PromptPayload arrived
    prompt_published: bool = False  # the prompt came from prompts.<pool>, not from asking the edge
    accepted_at: float | None = None  # the processor's acceptance arrived
    lease_until_ms: int = 0  # the lease the processor confirmed (acceptance or the last renewal)
    engine_started_at: float | None = None
    engine_first_token_at: float | None = None
    stop_requested_at: float | None = None
    stop_reason: StopReason | None = None
    tokens_at_stop: int | None = None
    stopped_at: float | None = None  # the engine's stop acknowledgement (or its end)
    slot_freed_at: float | None = None
    output_tokens: int = 0
    input_tokens: int = 0  # the engine's own count (reported; the ledger bills the admission's)
    deltas_sent: int = 0
    outcome: FinishOutcome | None = None
    # Kafka acknowledged the attempt's ReportAttemptFinished in ``commands`` (False: not yet, or not
    # after ``decision_attempts_max`` tries). The processor's decision is in the ledger, not here.
    report_appended: bool = False
    authorized_at_ms: int = 0  # the dispatch's authorization (admission) time, processor clock (metrics)

    @property
    def tokens_after_stop(self) -> int | None:
        return None if self.tokens_at_stop is None else self.output_tokens - self.tokens_at_stop


class StopSignal:
    """Why an attempt must stop (first reason wins)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: StopReason | None = None

    def set(self, reason: StopReason) -> None:
        if self.reason is None:
            self.reason = reason
            self.event.set()


# --- what an attempt needs from its worker --------------------------------------------------------


class AttemptHost(Protocol):
    """All an attempt uses of the worker that runs it (``workers.worker.Worker`` is one)."""

    settings: WorkerSettings
    engine: Engine
    model: ServedModel
    policy_check: PolicyCheck | None  # the output check between decode steps; None: none
    result_sink: ResultSink
    replay_sink: ReplaySink  # deltas stored before they are sent, for replay from any edge
    rates: WorkRates  # the engine's measured rates, fed with each attempt's prefill and decode times

    def reply_to(self) -> ReplyTo:
        """A fresh reply address on the worker's control partition (a command's or a PromptRequest's)."""
        ...

    async def decide(self, command: Any, headers: tracing.Headers | None = None) -> Outcome | None:
        """Append ``command`` and await its outcome (bounded, retried); None: no answer."""
        ...

    async def append(self, command: Any, headers: tracing.Headers | None = None) -> bool:
        """Append ``command`` (``reply_to`` None: no answer comes) and await only Kafka's
        acknowledgement (bounded, retried); False: not acknowledged."""
        ...

    async def published_prompt(self, generation_id: str) -> tuple[ChatMessage, ...] | None:
        """The prompt the edge published for ``generation_id``, if read in time; None: ask the edge."""
        ...

    async def request_prompt(self, request: PromptRequest, stream_to: ReplyTo) -> PromptPayload | None:
        """Send ``request`` to the edge and await its PromptPayload; None when none came in time."""
        ...

    async def send_delta(self, stream_to: ReplyTo, delta: TextDelta) -> asyncio.Future[Any]:
        """Hand ``delta`` to the producer; the future is the broker's acknowledgement."""
        ...

    async def spool_answer(self, d: DispatchAuthorized, text: str, completed: bool, output_tokens: int) -> bool:
        """A conversation turn's answer onto the answers topic; True once acknowledged."""
        ...

    def stopped_before(self, key: tuple[str, int]) -> StopReason | None:
        """Why the attempt ``key`` was stopped before it was watched (``StopAttempt`` came first), or None."""
        ...

    def watch_stop(self, key: tuple[str, int], stop: StopSignal) -> None:
        """From now on a ``StopAttempt`` for ``key`` sets ``stop`` (one that came first sets it at once)."""
        ...

    def unwatch_stop(self, key: tuple[str, int]) -> None: ...

    def token_produced(self) -> None:
        """One output token from the engine (the heartbeat's measured tokens per second)."""
        ...

    def free_slot(self, trace: AttemptTrace | None) -> None:
        """Give the attempt's slot back (at most once per trace)."""
        ...


class Attempt:
    """One attempt of one dispatch on this worker, from the dispatch taken off its topic to its report.

    ``state`` moves only through ``_to`` (checked against ``_NEXT_STATES``), one method per transition:
    ``_request_prompt``, ``_request_accept``, ``_accepted``, ``_give_up``/``_decline`` before the engine
    runs; ``_start_engine``, ``_begin_stop``, ``_on_finished``, ``_fail`` while it runs; ``_report`` after.
    ``prepare`` and ``run`` drive them; ``_step_running`` and ``_step_stopping`` are one wait each.
    """

    # Set by _start_engine (the attempt is RUNNING from then on).
    request: EngineRequest
    generation: Generation
    iterator: Any  # the generation's async iterator of TextChunk | Finished
    deadline: float  # monotonic: the run's end at generation_duration_max_s
    renewer: asyncio.Task[None]
    stop_wait: asyncio.Future[Any]  # one waiter for the whole attempt, set when any stop reason arrives

    def __init__(self, host: AttemptHost, d: DispatchAuthorized, trace: AttemptTrace) -> None:
        self.host, self.d, self.trace = host, d, trace
        self.settings = host.settings
        self.key = (d.generation_id, d.epoch)
        self.state = AttemptState.TAKEN
        self.payload: PromptPayload | None = None
        self.stop = StopSignal()
        self.tokens = 0  # output tokens the engine reported so far
        self.tokens_delivered = 0  # of those, the ones whose text went (or goes, unsent) to the client's stream
        self.first_token = asyncio.Event()
        self.released = False  # the engine is let go: the renewer stops even if its cancel is lost
        self.finished: Finished | None = None  # the engine's end (ENDED without a failure)
        self.failure: AttemptFailure | None = None  # or why the attempt ended without it
        self.failure_detail = ""  # for the log only (an EngineError's reason: never content)
        self.next_item: asyncio.Future[Any] | None = None  # the engine's next item, being awaited
        self.item_wait_from = 0.0
        self.text_parts: list[str] = []
        # Engine text not sent yet: the previous delta is still in flight or was sent less than the
        # delta interval ago (WorkerSettings.delta_interval_ms, delta_coalesce_chars_max).
        self.unsent: list[str] = []
        self.unsent_chars = 0
        self.sequence = 0
        self.replay_stored = True  # every delta so far stored before it was sent (workers/replay_sink.py)
        self.send_futures: list[asyncio.Future[Any]] = []
        self.last_sent_at = 0.0
        # Tracing (infra/runtime/tracing.py): the attempt's span and a stop's; None when off.
        self.ids = {"generation_id": d.generation_id, "epoch": d.epoch}
        self.span: Any = None
        self.cancel_span: Any = None
        # The tail of the allowed text the output check needs before the next chunk (its context).
        self.output_context = ""
        # Allowed text held back by the output check's hold-back window (policy_checks.output_hold).
        self.held = ""

    def _to(self, state: AttemptState) -> None:
        assert state in _NEXT_STATES[self.state], f"attempt {self.key}: {self.state.name} -> {state.name}"
        self.state = state

    @property
    def output_budget(self) -> int:
        return max(1, min(self.d.max_output_tokens, self.settings.max_output_tokens_max))

    def holds_work(self) -> bool:
        """Whether this attempt still has engine work ahead (queued here, or running)."""
        return self.state in _WORK_STATES

    def work(self) -> tuple[bool, int, int, int]:
        """(running, input tokens, output budget, output tokens so far), for ``workers.work.held_work``."""
        running = self.state in (AttemptState.RUNNING, AttemptState.STOPPING)
        return running, self.d.input_tokens, self.output_budget, self.tokens

    def _command(self, cls: type, **fields: Any) -> Any:
        """A command of this attempt, answered on the worker's control partition unless ``fields``
        says ``reply_to=None``."""
        d = self.d
        if "reply_to" not in fields:
            fields["reply_to"] = self.host.reply_to()
        return cls(
            command_id=uuid.uuid4().hex, user_id=d.user_id, issued_at_ms=now_ms(), generation_id=d.generation_id,
            epoch=d.epoch, worker_id=self.settings.worker_id, **fields,
        )

    # --- before the engine runs ---------------------------------------------------------------------

    async def prepare(self) -> bool:
        """Validate, fetch the prompt and accept: True once ACCEPTED, False when GAVE_UP."""
        d = self.d
        if not self.host.model.serves(d.model_version):
            await self._decline(DeclineReason.MODEL_VERSION_MISMATCH)
            return False
        if now_ms() > d.queue_deadline_ms:
            await self._decline(DeclineReason.QUEUE_DEADLINE)
            return False
        if self.host.stopped_before(self.key) is not None:
            self._give_up("stopped_before_accept")  # cancelled or fenced already: the processor settled it
            return False
        if d.stream_to is None:
            await self._decline(DeclineReason.NO_STREAM_TARGET)
            return False
        prompt_from_ns = tracing.now_ns()
        payload = await self._published_prompt() or await self._request_prompt(d.stream_to)
        tracing.record("worker.prompt", self.span, prompt_from_ns, found=bool(payload and payload.found), **self.ids)
        if payload is None or not payload.found:
            await self._decline(DeclineReason.PROMPT_UNAVAILABLE)
            return False
        if now_ms() > d.queue_deadline_ms:
            await self._decline(DeclineReason.QUEUE_DEADLINE)
            return False
        return await self._request_accept(payload)

    async def _published_prompt(self) -> PromptPayload | None:
        """TAKEN -> PROMPT_REQUESTED with the prompt its edge published (workers/prompts.py), if it was
        read in time; None: ask the edge."""
        messages = await self.host.published_prompt(self.d.generation_id)
        if messages is None:
            return None
        self._to(AttemptState.PROMPT_REQUESTED)
        self.trace.prompt_at = time.monotonic()
        self.trace.prompt_published = True
        return PromptPayload(
            generation_id=self.d.generation_id, epoch=self.d.epoch, worker_id=self.settings.worker_id, found=True,
            messages=messages,
        )

    async def _request_prompt(self, stream_to: ReplyTo) -> PromptPayload | None:
        """TAKEN -> PROMPT_REQUESTED: ask the edge for the prompt; None when no answer came in time."""
        self._to(AttemptState.PROMPT_REQUESTED)
        request = PromptRequest(
            generation_id=self.d.generation_id, epoch=self.d.epoch, worker_id=self.settings.worker_id,
            reply_to=self.host.reply_to(),
        )
        payload = await self.host.request_prompt(request, stream_to)
        self.trace.prompt_at = time.monotonic()
        return payload

    async def _request_accept(self, payload: PromptPayload) -> bool:
        """PROMPT_REQUESTED -> ACCEPT_REQUESTED: append AcceptAttempt; then ACCEPTED or GAVE_UP."""
        self._to(AttemptState.ACCEPT_REQUESTED)
        accept = self._command(cmd.AcceptAttempt)
        span = tracing.start("worker.accept", self.span, **self.ids)
        outcome = await self.host.decide(accept, tracing.headers(span))
        tracing.end(span, outcome=outcome.kind if outcome else None, code=outcome.code if outcome else None)
        if outcome is None or outcome.kind not in (OutcomeKind.APPLIED, OutcomeKind.EXISTING) or outcome.status is not RequestStatus.RUNNING:
            self._give_up(f"not_accepted:{outcome.code.value if outcome and outcome.code else 'no_decision'}")
            return False
        self._accepted(accept, payload)
        return True

    def _accepted(self, accept: cmd.AcceptAttempt, payload: PromptPayload) -> None:
        """ACCEPT_REQUESTED -> ACCEPTED: the processor answered running; the lease runs from the accept."""
        self._to(AttemptState.ACCEPTED)
        self.payload = payload
        self.trace.accepted = True
        self.trace.accepted_at = time.monotonic()
        self.trace.lease_until_ms = accept.issued_at_ms + self.settings.lease_ms

    def _give_up(self, why: str) -> None:
        """TAKEN, PROMPT_REQUESTED or ACCEPT_REQUESTED -> GAVE_UP: nothing ran and nothing will."""
        self._to(AttemptState.GAVE_UP)
        self.trace.declined = why

    async def _decline(self, reason: DeclineReason) -> None:
        """-> GAVE_UP, telling the processor (which releases the reservation)."""
        self._give_up(reason)
        log.info("declining %s epoch %d: %s", self.d.generation_id, self.d.epoch, reason)
        await self.host.decide(self._command(cmd.DeclineAttempt, reason=reason))

    # --- the engine runs ----------------------------------------------------------------------------

    async def run(self) -> None:
        """ACCEPTED -> RUNNING (-> STOPPING) -> ENDED -> REPORTED."""
        self._start_engine()
        try:
            while True:
                match self.state:
                    case AttemptState.RUNNING:
                        await self._step_running()
                    case AttemptState.STOPPING:
                        await self._step_stopping()
                    case AttemptState.ENDED:
                        break
                    case (
                        AttemptState.TAKEN | AttemptState.PROMPT_REQUESTED | AttemptState.ACCEPT_REQUESTED
                        | AttemptState.ACCEPTED | AttemptState.REPORTED | AttemptState.GAVE_UP
                    ):
                        raise AssertionError(f"attempt {self.key}: engine loop in state {self.state.name}")
                    case _:
                        assert_never(self.state)
        finally:
            await self._release_engine()
        await self._report()

    def _start_engine(self) -> None:
        """ACCEPTED -> RUNNING: register the stop, start the lease renewer and the engine."""
        self._to(AttemptState.RUNNING)
        host, d = self.host, self.d
        assert d.stream_to is not None and self.payload is not None
        host.watch_stop(self.key, self.stop)  # a StopAttempt that came first sets it now
        self.renewer = asyncio.create_task(self._renew_lease())
        self.request = self._engine_request(self.payload)
        self.generation = host.engine.generate(self.request)
        self.trace.engine_started_at = time.monotonic()
        self.deadline = self.trace.engine_started_at + self.settings.generation_duration_max_s
        self.iterator = self.generation.__aiter__()
        self.stop_wait = asyncio.ensure_future(self.stop.event.wait())

    def _engine_request(self, payload: PromptPayload) -> EngineRequest:
        messages = [Message("system", self.host.model.system_instructions)]
        # Clients can only supply user/assistant turns; anything else is dropped here too.
        messages += [Message(m.role, m.content) for m in payload.messages if m.role in ("user", "assistant")]
        return EngineRequest(
            request_id=uuid.uuid4().hex,
            messages=tuple(messages),
            max_output_tokens=self.output_budget,
        )

    def _await_next_item(self) -> asyncio.Future[Any]:
        if self.next_item is None:
            self.next_item = asyncio.ensure_future(self.iterator.__anext__())
            self.item_wait_from = time.monotonic()
        return self.next_item

    def _item_due(self) -> float:
        """Monotonic time by which the engine's next item must arrive (stall limit, duration limit)."""
        return min(self.item_wait_from + self.settings.engine_stall_max_s, self.deadline)

    async def _step_running(self) -> None:
        """One wait while RUNNING: for the engine's next item, a stop, or the moment gathered text may go."""
        if self.stop.event.is_set():
            await self._begin_stop()
            return
        next_item = self._await_next_item()
        now = time.monotonic()
        wait_s = max(0.0, self._item_due() - now)
        waiters = {next_item, self.stop_wait}
        interval_s = self.settings.delta_interval_ms / 1000
        if self.unsent:
            # Gathered text goes out once the previous delta is acknowledged and the interval passed.
            if self.send_futures[-1].done():
                wait_s = min(wait_s, max(0.0, self.last_sent_at + interval_s - now))
            else:
                waiters.add(self.send_futures[-1])
        done, _ = await asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        if next_item in done:
            await self._on_item()
            return
        if self.stop_wait in done:
            # Stop while the engine is between steps: abort, then wait (STOPPING) for this step's item.
            await self._begin_stop()
            return
        if self.unsent:
            now = time.monotonic()
            if self.send_futures[-1].done() and now >= self.last_sent_at + interval_s:
                await self._send_delta()
                return
            if now < self._item_due():
                return  # woke for the gathered text, not because the engine stalled
        next_item.cancel()
        if time.monotonic() >= self.deadline:
            self.stop.set(StopReason.GENERATION_DURATION_MAX)
            # The iterator was cancelled mid-step; abort and rebuild is not possible: end here.
            await self.generation.abort()
            self._fail(AttemptFailure.GENERATION_DURATION_MAX)
        else:
            await self.generation.abort()
            self._fail(AttemptFailure.ENGINE_STALLED)

    async def _step_stopping(self) -> None:
        """One wait while STOPPING: for the engine's acknowledgement (its items until then are usage only)."""
        assert self.trace.stop_requested_at is not None
        next_item = self._await_next_item()
        wait_s = max(0.0, self.trace.stop_requested_at + ABORT_ACK_TIMEOUT_S - time.monotonic())
        done, _ = await asyncio.wait({next_item}, timeout=wait_s)
        if next_item in done:
            await self._on_item()
            return
        next_item.cancel()
        self._fail(AttemptFailure.ABORT_NOT_ACKNOWLEDGED)

    async def _on_item(self) -> None:
        """The engine's next item arrived (RUNNING or STOPPING): text, its end, or its failure."""
        assert self.next_item is not None
        try:
            item = self.next_item.result()
        except StopAsyncIteration:
            self._fail(AttemptFailure.ENGINE_ENDED_WITHOUT_FINISH)
            return
        except EngineError as exc:
            self._fail(AttemptFailure.ENGINE_ERROR, exc.reason)
            return
        self.next_item = None
        if isinstance(item, Finished):
            self._on_finished(item)
            return
        assert isinstance(item, TextChunk)
        await self._on_chunk(item)

    async def _on_chunk(self, chunk: TextChunk) -> None:
        self.tokens = chunk.output_tokens
        self.first_token.set()
        self.host.token_produced()
        if self.trace.engine_first_token_at is None:
            self.trace.engine_first_token_at = time.monotonic()
            if self.span is not None:
                tracing.record("worker.first_token", self.span, tracing.wall_ns(self.trace.engine_started_at), **self.ids)
        if self.state is AttemptState.STOPPING or self.stop.reason is StopReason.OUTPUT_REFUSED or not chunk.text:
            return  # after a stop nothing more reaches the client (still counted as usage)
        text, delivered = chunk.text, chunk.output_tokens
        check = self.host.policy_check
        if check is not None:
            # Between decode steps, before the text goes anywhere: refused text is neither sent nor
            # stored. The log names the ids and the check only.
            verdict = check.check_output(self.output_context, text)
            if verdict.refused:
                log.info("output refused: %s epoch %d check=%s", self.d.generation_id, self.d.epoch, verdict.check)
                self.held = ""  # the start of what was refused: never sent, never stored
                self.stop.set(StopReason.OUTPUT_REFUSED)
                return
            keep = check.output_context_chars
            if keep:
                self.output_context = (self.output_context + text)[-keep:]
                # The hold-back window: an allowed tail that may be the first part of a term the next
                # chunk completes waits for that chunk (at most a term's length; released at the end).
                text = self.held + text
                hold = min(output_hold(check, self.output_context), len(text))
                self.held = text[len(text) - hold :] if hold else ""
                if hold:
                    text, delivered = text[: len(text) - hold], self.tokens_delivered
        if text:
            self._take_text(text, delivered)
        if self.unsent and (
            not self.send_futures  # the first text goes at once
            or self.unsent_chars >= self.settings.delta_coalesce_chars_max
            or (
                self.send_futures[-1].done()
                and time.monotonic() >= self.last_sent_at + self.settings.delta_interval_ms / 1000
            )
        ):
            await self._send_delta()
        if chunk.output_tokens >= self.request.max_output_tokens:
            self.stop.set(StopReason.MAX_OUTPUT_TOKENS)

    def _take_text(self, text: str, delivered_tokens: int) -> None:
        """Allowed text: into the result and the next delta."""
        self.text_parts.append(text)
        self.tokens_delivered = delivered_tokens
        self.unsent.append(text)
        self.unsent_chars += len(text)

    async def _send_delta(self) -> None:
        assert self.d.stream_to is not None
        self.sequence += 1
        text = self.unsent[0] if len(self.unsent) == 1 else "".join(self.unsent)
        self.unsent.clear()
        self.unsent_chars = 0
        delta = TextDelta(generation_id=self.d.generation_id, epoch=self.d.epoch, sequence=self.sequence, index=0, text=text)
        if self.replay_stored:
            # Write-ahead: stored before it is sent, so every delta a client saw can be replayed.
            self.replay_stored = await self.host.replay_sink.put(self.d.generation_id, self.d.epoch, self.sequence, text)
        stream_to = self.d.stream_to
        self.send_futures.append(
            await self.host.send_delta(stream_to, delta)
        )
        self.trace.deltas_sent = self.sequence
        self.last_sent_at = time.monotonic()

    async def _begin_stop(self) -> None:
        """RUNNING -> STOPPING: ask the engine to abort; its Finished(ABORTED) acknowledges the stop."""
        self._to(AttemptState.STOPPING)
        self.trace.stop_requested_at = self.trace.stop_requested_at or time.monotonic()
        self.trace.stop_reason = self.stop.reason
        self.trace.tokens_at_stop = self.tokens
        await self.generation.abort()

    def _on_finished(self, finished: Finished) -> None:
        """RUNNING or STOPPING -> ENDED: the engine ended the sequence (by itself or acknowledging a stop)."""
        self._to(AttemptState.ENDED)
        self.finished = finished

    def _fail(self, failure: AttemptFailure, detail: str = "") -> None:
        """RUNNING or STOPPING -> ENDED without the engine's Finished."""
        self._to(AttemptState.ENDED)
        self.failure, self.failure_detail = failure, detail or failure.value

    async def _release_engine(self) -> None:
        """Let the engine and the renewer go (also when the loop raised)."""
        self.stop_wait.cancel()
        # Close the engine's iterator now (it may hold the engine's lock or a sequence slot).
        with contextlib.suppress(Exception):
            await self.iterator.aclose()
        self.trace.stopped_at = time.monotonic()
        self.released = True
        self._measure()
        self.renewer.cancel()
        # Bounded: a renewal in flight ends within its decision timeout, and ``released`` stops the loop.
        await asyncio.wait({self.renewer}, timeout=RENEWER_STOP_TIMEOUT_S)
        self.host.unwatch_stop(self.key)
        if self.finished is not None:
            # The engine ended the sequence: its slot is free now, before the result write and
            # the report (which wait on Cassandra and the processor, not on the engine). After a
            # failure (an abort never acknowledged, a stall) the slot is freed only at the end.
            self.host.free_slot(self.trace)

    def _measure(self) -> None:
        """Feed this attempt's prefill and decode times into the worker's measured rates."""
        finished, trace = self.finished, self.trace
        ran_to_its_end = finished is not None and finished.reason in (FinishReason.STOP, FinishReason.LENGTH)
        self.host.rates.observe(
            input_tokens=finished.input_tokens if finished is not None and finished.input_tokens else self.d.input_tokens,
            output_budget=self.output_budget,
            output_tokens=finished.output_tokens if finished is not None else self.tokens,
            started_at=trace.engine_started_at,
            first_token_at=trace.engine_first_token_at,
            ended_at=trace.stopped_at,
            ran_to_its_end=ran_to_its_end,
        )

    def _reported(self) -> tuple[FinishOutcome, RejectionCode | None, FinishReason]:
        """Outcome, error code (failed only) and finish reason of the ENDED attempt."""
        if self.failure is not None:
            code, reason = failure_report(self.failure)
            return FinishOutcome.FAILED, code, reason
        assert self.finished is not None
        match self.finished.reason:
            case FinishReason.ABORTED:
                if self.stop.reason is None:
                    return FinishOutcome.STOPPED, None, FinishReason.ABORTED  # an abort nobody here asked for
                return stop_report(self.stop.reason)
            case FinishReason.STOP | FinishReason.LENGTH:
                return FinishOutcome.COMPLETED, None, self.finished.reason
        # An engine ends a sequence with STOP, LENGTH or ABORTED only (workers/engines/base.py).
        raise AssertionError(f"an engine ended a sequence with {self.finished.reason!r}")

    async def _report(self) -> None:
        """ENDED -> REPORTED: the last text, the result, then ReportAttemptFinished with usage."""
        d, trace = self.d, self.trace
        tracing.end(self.cancel_span, stop_reason=self.stop.reason)
        span = tracing.start("worker.finalize", self.span, **self.ids)
        if self.held and self.stop.reason is not StopReason.OUTPUT_REFUSED:
            # The hold-back window's tail: no later text completed a term with it.
            self._take_text(self.held, self.tokens)
            self.held = ""
        if self.unsent:
            await self._send_delta()  # text the engine produced before it ended or was stopped
        if self.send_futures:
            with contextlib.suppress(KafkaError):
                await asyncio.gather(*self.send_futures)
        finished = self.finished
        tokens = finished.output_tokens if finished is not None else self.tokens
        inputs = finished.input_tokens if finished is not None and finished.input_tokens else d.input_tokens
        trace.output_tokens = tokens
        trace.input_tokens = inputs
        if self.failure is not None:
            log.warning("attempt %s epoch %d failed: %s", d.generation_id, d.epoch, self.failure_detail)
        outcome, code, reason = self._reported()
        trace.outcome = outcome
        spooled = False
        stored: bool | None = None
        if keeps_result(self.stop.reason):
            text = "".join(self.text_parts)
            # The stored usage names the admission's input count, as the ledger's usage record does
            # (it is authoritative: docs/core.md, "Token budget"); the report carries the engine's own.
            stored = await self.host.result_sink.put(d.generation_id, d.epoch, text, (d.input_tokens, tokens))
            if d.conversation_id:
                spooled = await self.host.spool_answer(d, text, outcome is FinishOutcome.COMPLETED, tokens)
        # Acceptance -> the engine's first token, recorded with the usage (the SLO report's fallback TTFT).
        ttft_ms = None
        if trace.accepted_at is not None and trace.engine_first_token_at is not None:
            ttft_ms = max(0, round((trace.engine_first_token_at - trace.accepted_at) * 1000))
        # Reported also when fenced: the processor drops it and records LateReportIgnored. No reply_to:
        # nothing here acts on the decision (the slot is freed either way, and the edge hears of the
        # end from the processor), so the worker waits only until Kafka has the command; the
        # processor decides it from the log. Not appended at all: the lease expires and the processor
        # fences the epoch, as after a crash.
        trace.report_appended = await self.host.append(
            self._command(
                cmd.ReportAttemptFinished, reply_to=None, outcome=outcome, input_tokens=inputs, output_tokens=tokens,
                finish_reason=reason, error_code=code if outcome is FinishOutcome.FAILED else None,
                answer_spooled=spooled, last_sequence=self.sequence, ttft_ms=ttft_ms,
                delivered_tokens=min(self.tokens_delivered, tokens),
                result_stored=stored if outcome is FinishOutcome.COMPLETED else None,
            ),
            tracing.headers(span),
        )
        tracing.end(span, outcome=outcome, finish_reason=reason, output_tokens=tokens)
        self._to(AttemptState.REPORTED)

    async def _renew_lease(self) -> None:
        """While RUNNING or STOPPING: renew the lease; a renewal's answer or the lease's end may stop it."""
        d, trace, stop = self.d, self.trace, self.stop
        # The first renewal goes out as soon as the engine produced a token (at the latest after one
        # interval): the processor's ``partial`` after a crash is "output tokens reported > 0", so a
        # worker killed before its first periodic renewal would otherwise end as partial: false although
        # the client already had text.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.renew_interval_s):
                await self.first_token.wait()
        lease_ms = self.settings.lease_ms
        while not stop.event.is_set() and not self.released:
            renewal = self._command(cmd.RenewLease, output_tokens=self.tokens)
            try:
                # Never wait for an answer past the confirmed lease: after it the processor fences us.
                async with asyncio.timeout(max(0.0, (trace.lease_until_ms - now_ms()) / 1000)):
                    outcome = await self.host.decide(renewal)
            except TimeoutError:
                outcome = None
            if outcome is not None and outcome.kind in (OutcomeKind.APPLIED, OutcomeKind.CANCEL_REQUESTED):
                trace.lease_until_ms = max(trace.lease_until_ms, renewal.issued_at_ms + lease_ms)
            if outcome is not None and outcome.kind is OutcomeKind.CANCEL_REQUESTED:
                self.cancel_span = self.cancel_span or tracing.start("worker.cancel", self.span, **self.ids)
                stop.set(StopReason.CANCEL)
            elif outcome is not None and outcome.kind is OutcomeKind.REJECTED:
                stop.set(StopReason.FENCED)
            elif now_ms() >= trace.lease_until_ms:
                # No renewal confirmed within the lease (the processor unreachable, or too slow): it
                # fences this epoch at that deadline, so computing on is GPU time nobody gets. Stop.
                log.warning("lease of %s epoch %d lost (no renewal confirmed): stopping", d.generation_id, d.epoch)
                stop.set(StopReason.LEASE_LOST)
            # No answer (None) within the lease: the next renewal tries again.
            if stop.event.is_set() or self.released:
                return
            await asyncio.sleep(min(self.settings.renew_interval_s, max(0.0, (trace.lease_until_ms - now_ms()) / 1000)))
