"""The inference worker: takes dispatches of one model pool, owns attempts, runs an engine, reports usage.

Where it sits in the data flow (DESIGN sections 3 and 6)::

    dispatch.<pool>.paid / .free --(consumer group <ns>.chatplane-workers.<pool>, pull-based)--> Worker
    Worker --PromptRequest--> edge inbox (dispatch.stream_to)   edge --PromptPayload--> worker-control
    Worker --AcceptAttempt / DeclineAttempt / RenewLease / ReportAttemptFinished--> commands
    processor --Outcome, StopAttempt--> worker-control partition worker_control_partition(worker_id)
    Worker --TextDelta--> edge inbox (dispatch.stream_to)      Worker --WorkerHeartbeat--> capacity

One attempt: check the model version, the queue deadline (past it: decline, which releases the
reservation) and the epoch; fetch the prompt from the edge (no answer in time: decline); append
``AcceptAttempt`` and start the engine only once the processor answered ``running``. Stream deltas
(sequence 1, 2, ... per (generation, epoch)), renew the lease, and between decode steps check for a
stop (``StopAttempt``, a ``cancel_requested`` renewal, a lost lease, max tokens, max duration, a
stalled engine). A stop is acknowledged by the engine's ``Finished(ABORTED)``; the slot is freed only
after it. The final text goes to the ``ResultSink`` before ``ReportAttemptFinished`` (usage also on
cancel). No prompt or generated text is ever logged or put in a command.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from schemas import commands as cmd
from schemas.codes import FinishOutcome, RejectionCode, RequestStatus
from schemas.commands import ReplyTo
from schemas.messages import (
    DispatchAuthorized,
    Outcome,
    OutcomeKind,
    PromptPayload,
    PromptRequest,
    StopAttempt,
    TextDelta,
    WorkerHeartbeat,
)
from schemas.topics import worker_control_partition
from schemas.wire import WireError, decode_message, encode
from workers.engines.base import Engine, EngineError, EngineRequest, Finished, FinishReason, Message, TextChunk
from workers.registry import RegisteredModel
from workers.settings import WorkerSettings

log = logging.getLogger("chatplane.workers")

DISPATCH_FETCH_TIMEOUT_MS = 100  # one poll of the dispatch topics while a slot is free
CONTROL_FETCH_TIMEOUT_MS = 50
CONTROL_FETCH_MAX_WAIT_MS = 5
FENCED_REMEMBERED_MAX = 10_000  # (generation, epoch) pairs stopped before their dispatch was handled
ABORT_ACK_TIMEOUT_S = 10.0  # an engine that does not acknowledge an abort in this long is broken
DRAIN_TIMEOUT_S = 30.0  # on shutdown, running attempts get this long before they are aborted
TOKENS_PER_S_WINDOW_S = 10.0  # the heartbeat's measured rate is over this trailing window
TOKEN_RATE_SAMPLES_MAX = 10_000
PRODUCER_LINGER_MS = 0
RENEWER_STOP_TIMEOUT_S = 5.0  # an attempt waits this long for its lease renewer to end
COMMIT_ON_STOP_TIMEOUT_S = 5.0  # the last dispatch offsets are committed on shutdown within this long


def now_ms() -> int:
    return int(time.time() * 1000)


class MissingTopics(RuntimeError):
    """The worker's dispatch or control topics do not exist (nothing to consume: fail at start)."""


class ResultSink(Protocol):
    """Where the final text of an attempt goes before the worker reports completion (issue 7: Cassandra)."""

    async def put(self, generation_id: str, epoch: int, text: str, usage: tuple[int, int]) -> None: ...


class NullResultSink:
    """Keeps nothing (the default when no result store is wired)."""

    async def put(self, generation_id: str, epoch: int, text: str, usage: tuple[int, int]) -> None:
        return None


@dataclass
class MemoryResultSink:
    """Keeps results in memory (tests); bounded by ``max_items``."""

    max_items: int = 1_000
    items: collections.OrderedDict[tuple[str, int], tuple[str, tuple[int, int]]] = field(
        default_factory=collections.OrderedDict
    )

    async def put(self, generation_id: str, epoch: int, text: str, usage: tuple[int, int]) -> None:
        self.items[(generation_id, epoch)] = (text, usage)
        while len(self.items) > self.max_items:
            self.items.popitem(last=False)


@dataclass
class AttemptTrace:
    """What happened to one attempt, for tests and benchmarks (no content)."""

    generation_id: str
    epoch: int
    declined: str | None = None
    accepted: bool = False
    taken_at: float = field(default_factory=time.monotonic)  # the dispatch was taken from its topic
    prompt_at: float | None = None  # the edge's PromptPayload arrived
    accepted_at: float | None = None  # the processor's acceptance arrived
    lease_until_ms: int = 0  # the lease the processor confirmed (acceptance or the last renewal)
    engine_started_at: float | None = None
    engine_first_token_at: float | None = None
    stop_requested_at: float | None = None
    stop_reason: str | None = None
    tokens_at_stop: int | None = None
    stopped_at: float | None = None  # the engine's stop acknowledgement (or its end)
    slot_freed_at: float | None = None
    output_tokens: int = 0
    deltas_sent: int = 0
    outcome: FinishOutcome | None = None
    report: Outcome | None = None

    @property
    def tokens_after_stop(self) -> int | None:
        return None if self.tokens_at_stop is None else self.output_tokens - self.tokens_at_stop


class _Stop:
    """Why an attempt must stop (first reason wins)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: str | None = None
        self.outcome = FinishOutcome.STOPPED
        self.code: RejectionCode | None = None

    def set(self, reason: str, outcome: FinishOutcome = FinishOutcome.STOPPED, code: RejectionCode | None = None) -> None:
        if self.reason is None:
            self.reason, self.outcome, self.code = reason, outcome, code
            self.event.set()


class _OffsetTracker:
    """Commits, per partition, the offset below which every dispatch was accepted or declined."""

    def __init__(self) -> None:
        self.pending: dict[TopicPartition, set[int]] = collections.defaultdict(set)
        self.highest: dict[TopicPartition, int] = {}

    def begin(self, tp: TopicPartition, offset: int) -> None:
        self.pending[tp].add(offset)
        self.highest[tp] = max(self.highest.get(tp, -1), offset)

    def done(self, tp: TopicPartition, offset: int) -> int | None:
        """The offset to commit for ``tp`` now (the next one to read), or None."""
        self.pending[tp].discard(offset)
        if self.pending[tp]:
            return min(self.pending[tp])
        return self.highest[tp] + 1


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        model: RegisteredModel,
        result_sink: ResultSink | None = None,
        on_trace: Callable[[AttemptTrace], None] | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.model = model
        self.result_sink: ResultSink = result_sink or NullResultSink()
        self.on_trace = on_trace
        topo = settings.topology
        self.control = ReplyTo(topo.worker_control.name, worker_control_partition(settings.worker_id), "-")
        self.dispatch_topics = {"paid": topo.dispatch(settings.pool, "paid").name, "free": topo.dispatch(settings.pool, "free").name}
        limit = engine.max_concurrent if settings.slots <= 0 else min(settings.slots, engine.max_concurrent)
        self.slots = max(1, limit)
        self.free_slots = self.slots
        self._slot_freed = asyncio.Event()
        # Set whenever free_slots changes: the heartbeat goes out then, not at the next interval, so
        # the edge's capacity view sees a freed slot before the client sees the generation end.
        self._capacity_changed = asyncio.Event()
        self.active: dict[tuple[str, int], _Stop] = {}
        self.preparing = 0  # dispatches taken, not yet accepted or declined
        self.traces: dict[tuple[str, int], AttemptTrace] = {}
        self._fenced: collections.OrderedDict[tuple[str, int], str] = collections.OrderedDict()
        self._decisions: dict[str, asyncio.Future[Outcome]] = {}
        self._prompts: dict[tuple[str, int], asyncio.Future[PromptPayload]] = {}
        self._token_samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=TOKEN_RATE_SAMPLES_MAX)
        self._offsets = _OffsetTracker()
        self._to_commit: dict[TopicPartition, int] = {}  # the newest offset per partition not yet committed
        self._commit_wanted = asyncio.Event()
        self._taken = {"paid": 0, "free": 0}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._stopping = False
        self.producer: AIOKafkaProducer | None = None
        self.dispatch_consumer: AIOKafkaConsumer | None = None
        self.control_consumer: AIOKafkaConsumer | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        await self.engine.start()
        self.producer = AIOKafkaProducer(
            bootstrap_servers=s.kafka_bootstrap, acks="all", enable_idempotence=True, linger_ms=PRODUCER_LINGER_MS
        )
        await self.producer.start()
        self.control_consumer = AIOKafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap, enable_auto_commit=False, auto_offset_reset="latest",
            fetch_max_wait_ms=CONTROL_FETCH_MAX_WAIT_MS,
        )
        await self.control_consumer.start()
        missing = {self.control.topic, *self.dispatch_topics.values()} - await self.control_consumer.topics()
        if missing:
            # aiokafka would wait for them forever (logging each metadata miss); say what is wrong instead.
            await self.control_consumer.stop()
            await self.producer.stop()
            raise MissingTopics(f"topics not in the cluster: {sorted(missing)} (run infra/create-topics)")
        tp = TopicPartition(self.control.topic, self.control.partition)
        self.control_consumer.assign([tp])
        await self.control_consumer.seek_to_end(tp)
        await self.control_consumer.position(tp)
        self.dispatch_consumer = AIOKafkaConsumer(
            *self.dispatch_topics.values(),
            bootstrap_servers=s.kafka_bootstrap,
            group_id=s.group_id,
            client_id=s.worker_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=max(100, s.session_timeout_ms // 3),
            max_partition_fetch_bytes=64 * 1024,
            fetch_max_wait_ms=DISPATCH_FETCH_TIMEOUT_MS,
        )
        await self.dispatch_consumer.start()
        self._loops = [
            asyncio.create_task(self._control_loop(), name="worker-control"),
            asyncio.create_task(self._dispatch_loop(), name="worker-dispatch"),
            asyncio.create_task(self._heartbeat_loop(), name="worker-heartbeat"),
            asyncio.create_task(self._commit_loop(), name="worker-commit"),
        ]
        log.info("worker %s ready: pool=%s engine=%s slots=%d control=%d", s.worker_id, s.pool, self.engine.name,
                 self.slots, self.control.partition)

    async def stop(self, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Stop taking dispatches, let running attempts finish (bounded), then close everything."""
        self._stopping = True
        if self._loops:
            self._loops[1].cancel()
        deadline = time.monotonic() + drain_timeout_s
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for stop in list(self.active.values()):
            stop.set("worker_shutdown", FinishOutcome.FAILED, RejectionCode.MODEL_BACKEND_ERROR)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=ABORT_ACK_TIMEOUT_S + 5)
        for task in self._loops:
            task.cancel()
        for task in [*self._loops, *self._tasks]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._commit_pending(), COMMIT_ON_STOP_TIMEOUT_S)
        for closeable in (self.dispatch_consumer, self.control_consumer, self.producer):
            if closeable is not None:
                with contextlib.suppress(Exception):
                    await closeable.stop()
        await self.engine.close()

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- the control partition --------------------------------------------------------------------

    async def _control_loop(self) -> None:
        assert self.control_consumer is not None
        while True:
            batches = await self.control_consumer.getmany(timeout_ms=CONTROL_FETCH_TIMEOUT_MS)
            for records in batches.values():
                for record in records:
                    self._on_control(record.value)

    def _on_control(self, value: bytes | None) -> None:
        try:
            message = decode_message(value or b"")
        except WireError as exc:
            log.warning("undecodable control message: %s", exc.reason)
            return
        if isinstance(message, Outcome):
            fut = self._decisions.get(message.command_id)
            if fut is not None and not fut.done():
                fut.set_result(message)
        elif isinstance(message, PromptPayload):
            if message.worker_id == self.settings.worker_id:
                fut = self._prompts.get((message.generation_id, message.epoch))
                if fut is not None and not fut.done():
                    fut.set_result(message)
        elif isinstance(message, StopAttempt):
            if message.worker_id != self.settings.worker_id:
                return
            key = (message.generation_id, message.epoch)
            reason = "fenced" if message.fence_reason is not None else "cancel"
            stop = self.active.get(key)
            if stop is not None:
                if reason == "fenced":
                    stop.set("fenced", FinishOutcome.FAILED, RejectionCode.MODEL_BACKEND_ERROR)
                else:
                    stop.set("cancel")
            else:
                self._fenced[key] = reason
                while len(self._fenced) > FENCED_REMEMBERED_MAX:
                    self._fenced.popitem(last=False)

    async def decide(self, command: Any) -> Outcome | None:
        """Append a command and await its outcome on the control partition (bounded, retried with the
        same command id, which the processor answers from its decision memory). None: no answer."""
        assert self.producer is not None
        for _ in range(self.settings.decision_attempts_max):
            fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
            self._decisions[command.command_id] = fut
            try:
                await self.producer.send_and_wait(
                    self.settings.topology.commands.name, encode(command), key=command.user_id.encode()
                )
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
                # arrives as the answer does, and a renewer cancelled at the end of its attempt then
                # kept running (and the attempt waited for it forever).
                async with asyncio.timeout(self.settings.decision_timeout_s):
                    return await fut
            except (TimeoutError, KafkaError):
                log.warning("no decision for %s %s yet; retrying", command.type, command.command_id)
            finally:
                self._decisions.pop(command.command_id, None)
        log.error("no decision for %s %s after %d attempts", command.type, command.command_id,
                  self.settings.decision_attempts_max)
        return None

    def _command(self, cls: type, d: DispatchAuthorized, **fields: Any) -> Any:
        return cls(
            command_id=uuid.uuid4().hex, user_id=d.user_id, issued_at_ms=now_ms(), generation_id=d.generation_id,
            epoch=d.epoch, worker_id=self.settings.worker_id, reply_to=replace(self.control, request_id=uuid.uuid4().hex),
            **fields,
        )

    # --- dispatch consumption (pull-based, weighted paid/free) ------------------------------------

    def _preferred_tier(self) -> str:
        """Weighted share: ``paid_weight`` paid for each free, but free never below ``free_min_share``."""
        paid, free = self._taken["paid"], self._taken["free"]
        total = paid + free
        if total and free / total < self.settings.free_min_share:
            return "free"
        return "paid" if paid < self.settings.paid_weight * (free + 1) else "free"

    def _partitions(self, tier: str) -> list[TopicPartition]:
        assert self.dispatch_consumer is not None
        return [tp for tp in self.dispatch_consumer.assignment() if tp.topic == self.dispatch_topics[tier]]

    async def _dispatch_loop(self) -> None:
        consumer = self.dispatch_consumer
        assert consumer is not None
        while not self._stopping:
            if self.free_slots <= 0:
                # Pull-based: nothing is fetched while no slot is free.
                consumer.pause(*consumer.assignment())
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            consumer.resume(*consumer.assignment())
            first = self._preferred_tier()
            second = "free" if first == "paid" else "paid"
            taken = None
            # What is already fetched, preferred tier first; then one bounded wait on every assigned
            # partition (waiting on the preferred tier alone delayed the other tier's next dispatch by up
            # to the whole wait while the worker was idle).
            for tier, timeout in ((first, 0), (second, 0), (None, DISPATCH_FETCH_TIMEOUT_MS)):
                parts = self._partitions(tier) if tier is not None else list(consumer.assignment())
                if not parts:
                    continue
                batches = await consumer.getmany(*parts, timeout_ms=timeout, max_records=1)
                for tp, records in batches.items():
                    if records:
                        taken = ("paid" if tp.topic == self.dispatch_topics["paid"] else "free", tp, records[0])
                        break
                if taken:
                    break
            if taken is None:
                if not consumer.assignment():
                    await asyncio.sleep(DISPATCH_FETCH_TIMEOUT_MS / 1000)
                continue
            tier, tp, record = taken
            self._taken[tier] += 1
            self._offsets.begin(tp, record.offset)
            self.free_slots -= 1
            self.preparing += 1
            self._capacity_changed.set()
            task = asyncio.create_task(self._handle(tp, record.offset, record.value))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _commit(self, tp: TopicPartition, offset: int) -> None:
        """Mark a dispatch settled (accepted or declined); ``_commit_loop`` commits it off the attempt's
        path, so the engine starts without waiting for the group coordinator."""
        commit = self._offsets.done(tp, offset)
        if commit is None:
            return
        self._to_commit[tp] = max(commit, self._to_commit.get(tp, -1))
        self._commit_wanted.set()

    async def _commit_pending(self) -> None:
        if not self._to_commit or self.dispatch_consumer is None:
            return
        assigned = self.dispatch_consumer.assignment()
        offsets = {tp: o for tp, o in self._to_commit.items() if tp in assigned}  # revoked: not ours to commit
        self._to_commit = {tp: o for tp, o in self._to_commit.items() if tp in offsets}
        if not offsets:
            return
        try:
            await self.dispatch_consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance moved the partition: the dispatch may be redelivered; the processor's
            # acceptance check makes a second accept of the same epoch a no-op or a rejection.
            log.warning("dispatch offset commit failed: %s", type(exc).__name__)
        # Done with these (committed or given up as above); a newer offset that arrived meanwhile stays.
        # Cancelled mid-commit (shutdown), they stay for the last commit in stop().
        for tp, offset in offsets.items():
            if self._to_commit.get(tp) == offset:
                del self._to_commit[tp]

    async def _commit_loop(self) -> None:
        """One commit at a time, in order, of the newest settled offset per partition."""
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            await self._commit_pending()

    def _free_slot(self, trace: AttemptTrace | None) -> None:
        """Give the attempt's slot back (once: ``_run`` frees it when the engine stopped, ``_handle``
        in any case)."""
        if trace is not None:
            if trace.slot_freed_at is not None:
                return
            trace.slot_freed_at = time.monotonic()
        self.free_slots += 1
        self._slot_freed.set()
        self._capacity_changed.set()

    # --- one attempt --------------------------------------------------------------------------------

    async def _handle(self, tp: TopicPartition, offset: int, value: bytes | None) -> None:
        trace: AttemptTrace | None = None
        committed = False
        try:
            try:
                d = decode_message(value or b"")
            except WireError as exc:
                log.warning("undecodable dispatch at %s:%d: %s", tp.topic, offset, exc.reason)
                d = None
            if not isinstance(d, DispatchAuthorized):
                return
            if (d.generation_id, d.epoch) in self.active:
                # Redelivered (a commit lost to a rebalance) while it runs here: it is already ours.
                log.info("dispatch %s epoch %d redelivered while running here: skipped", d.generation_id, d.epoch)
                return
            trace = AttemptTrace(d.generation_id, d.epoch)
            self.traces[(d.generation_id, d.epoch)] = trace
            payload = await self._prepare(d, trace)
            self.preparing -= 1
            self._commit(tp, offset)
            committed = True
            if payload is not None:
                await self._run(d, payload, trace)
        except Exception:
            log.exception("attempt failed unexpectedly")
        finally:
            if not committed:
                self.preparing -= 1
                self._commit(tp, offset)
            self._free_slot(trace)
            if trace is not None and self.on_trace is not None:
                self.on_trace(trace)

    async def _decline(self, d: DispatchAuthorized, trace: AttemptTrace, reason: str) -> None:
        trace.declined = reason
        log.info("declining %s epoch %d: %s", d.generation_id, d.epoch, reason)
        await self.decide(self._command(cmd.DeclineAttempt, d, reason=reason))

    async def _prepare(self, d: DispatchAuthorized, trace: AttemptTrace) -> PromptPayload | None:
        """Validate, fetch the prompt and accept. Returns the prompt once the processor accepted."""
        assert self.producer is not None
        key = (d.generation_id, d.epoch)
        if not self.model.serves(d.model_version):
            await self._decline(d, trace, "model_version_mismatch")
            return None
        if now_ms() > d.queue_deadline_ms:
            await self._decline(d, trace, "queue_deadline")
            return None
        if key in self._fenced:
            trace.declined = "stopped_before_accept"
            return None  # cancelled or fenced already: the processor settled it; never accept
        if d.stream_to is None:
            await self._decline(d, trace, "no_stream_target")
            return None
        fut: asyncio.Future[PromptPayload] = asyncio.get_running_loop().create_future()
        self._prompts[key] = fut
        try:
            request = PromptRequest(
                generation_id=d.generation_id, epoch=d.epoch, worker_id=self.settings.worker_id,
                reply_to=replace(self.control, request_id=uuid.uuid4().hex),
            )
            await self.producer.send_and_wait(d.stream_to.topic, encode(request), partition=d.stream_to.partition)
            async with asyncio.timeout(self.settings.prompt_timeout_s):
                payload = await fut
        except TimeoutError:
            payload = None
        finally:
            self._prompts.pop(key, None)
        trace.prompt_at = time.monotonic()
        if payload is None or not payload.found:
            await self._decline(d, trace, "prompt_unavailable")
            return None
        if now_ms() > d.queue_deadline_ms:
            await self._decline(d, trace, "queue_deadline")
            return None
        accept = self._command(cmd.AcceptAttempt, d)
        outcome = await self.decide(accept)
        if outcome is None or outcome.kind not in (OutcomeKind.APPLIED, OutcomeKind.EXISTING) or outcome.status is not RequestStatus.RUNNING:
            trace.declined = f"not_accepted:{outcome.code.value if outcome and outcome.code else 'no_decision'}"
            return None
        trace.accepted = True
        trace.accepted_at = time.monotonic()
        trace.lease_until_ms = accept.issued_at_ms + self.settings.lease_ms
        return payload

    def _engine_request(self, d: DispatchAuthorized, payload: PromptPayload) -> EngineRequest:
        messages = [Message("system", self.model.system_instructions)]
        # Clients can only supply user/assistant turns; anything else is dropped here too.
        messages += [Message(m.role, m.content) for m in payload.messages if m.role in ("user", "assistant")]
        return EngineRequest(
            request_id=uuid.uuid4().hex,
            messages=tuple(messages),
            max_output_tokens=max(1, min(d.max_output_tokens, self.settings.max_output_tokens_max)),
        )

    async def _run(self, d: DispatchAuthorized, payload: PromptPayload, trace: AttemptTrace) -> None:
        assert self.producer is not None and d.stream_to is not None
        key = (d.generation_id, d.epoch)
        stop = _Stop()
        self.active[key] = stop
        if key in self._fenced:
            reason = self._fenced.pop(key)
            stop.set(*(("cancel",) if reason == "cancel" else ("fenced", FinishOutcome.FAILED, RejectionCode.MODEL_BACKEND_ERROR)))
        progress = {"tokens": 0}
        first_token = asyncio.Event()
        ended = asyncio.Event()  # the attempt is over: the renewer stops even if its cancel is lost
        renewer = asyncio.create_task(self._renew_loop(d, trace, stop, progress, ended, first_token))
        request = self._engine_request(d, payload)
        generation = self.engine.generate(request)
        trace.engine_started_at = time.monotonic()
        deadline = trace.engine_started_at + self.settings.generation_duration_max_s
        text_parts: list[str] = []
        sequence = 0
        send_futures: list[asyncio.Future[Any]] = []
        # Engine text not sent yet: the previous delta is still in flight or was sent less than the
        # delta interval ago (WorkerSettings.delta_interval_ms, delta_coalesce_chars_max).
        unsent: list[str] = []
        unsent_chars = 0
        coalesce_max = self.settings.delta_coalesce_chars_max
        interval_s = self.settings.delta_interval_ms / 1000
        stall_max_s = self.settings.engine_stall_max_s
        last_sent_at = 0.0
        item_wait_from = 0.0

        async def send_delta() -> None:
            nonlocal sequence, unsent_chars, last_sent_at
            sequence += 1
            text = unsent[0] if len(unsent) == 1 else "".join(unsent)
            unsent.clear()
            unsent_chars = 0
            delta = TextDelta(generation_id=d.generation_id, epoch=d.epoch, sequence=sequence, index=0, text=text)
            send_futures.append(await self.producer.send(d.stream_to.topic, encode(delta), partition=d.stream_to.partition))
            trace.deltas_sent = sequence
            last_sent_at = time.monotonic()

        next_item: asyncio.Future[Any] | None = None
        finished: Finished | None = None
        failure: str | None = None
        aborting = False
        iterator = generation.__aiter__()
        # One waiter for the whole attempt (not one per decode step): set when any stop reason arrives.
        stop_wait = asyncio.ensure_future(stop.event.wait())
        try:
            while True:
                if stop.event.is_set() and not aborting:
                    aborting = True
                    trace.stop_requested_at = trace.stop_requested_at or time.monotonic()
                    trace.stop_reason = stop.reason
                    trace.tokens_at_stop = progress["tokens"]
                    await generation.abort()
                now = time.monotonic()
                if next_item is None:
                    next_item = asyncio.ensure_future(iterator.__anext__())
                    item_wait_from = now
                if aborting:
                    wait_s = max(0.0, trace.stop_requested_at + ABORT_ACK_TIMEOUT_S - now)
                else:
                    wait_s = max(0.0, min(item_wait_from + stall_max_s, deadline) - now)
                waiters = {next_item} if aborting else {next_item, stop_wait}
                if unsent and not aborting:
                    # Gathered text goes out once the previous delta is acknowledged and the interval passed.
                    if send_futures[-1].done():
                        wait_s = min(wait_s, max(0.0, last_sent_at + interval_s - now))
                    else:
                        waiters.add(send_futures[-1])
                done, _ = await asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                if unsent and not aborting and next_item not in done and stop_wait not in done:
                    now = time.monotonic()
                    if send_futures[-1].done() and now >= last_sent_at + interval_s:
                        await send_delta()
                        continue
                    if now < min(item_wait_from + stall_max_s, deadline):
                        continue  # woke for the gathered text, not because the engine stalled
                if next_item not in done:
                    if not aborting and stop_wait in done:
                        # Stop while the engine is between steps: abort, then wait for this step's item.
                        aborting = True
                        trace.stop_requested_at = time.monotonic()
                        trace.stop_reason = stop.reason
                        trace.tokens_at_stop = progress["tokens"]
                        await generation.abort()
                        done, _ = await asyncio.wait({next_item}, timeout=ABORT_ACK_TIMEOUT_S)
                        if next_item not in done:
                            next_item.cancel()
                            failure = "abort_not_acknowledged"
                            break
                    elif aborting:
                        next_item.cancel()
                        failure = "abort_not_acknowledged"
                        break
                    elif time.monotonic() >= deadline:
                        next_item.cancel()
                        stop.set("generation_duration_max", FinishOutcome.FAILED, RejectionCode.GENERATION_TIMEOUT)
                        # The iterator was cancelled mid-step; abort and rebuild is not possible: end here.
                        await generation.abort()
                        failure = "generation_duration_max"
                        break
                    else:
                        next_item.cancel()
                        await generation.abort()
                        failure = "engine_stalled"
                        break
                try:
                    item = next_item.result()
                    next_item = None
                except StopAsyncIteration:
                    failure = "engine_ended_without_finish"
                    break
                except EngineError as exc:
                    failure = exc.reason
                    break
                if isinstance(item, Finished):
                    finished = item
                    break
                assert isinstance(item, TextChunk)
                progress["tokens"] = item.output_tokens
                first_token.set()
                self._token_samples.append((time.monotonic(), 1))
                if trace.engine_first_token_at is None:
                    trace.engine_first_token_at = time.monotonic()
                if aborting or not item.text:
                    continue  # after a stop nothing more reaches the client (still counted as usage)
                text_parts.append(item.text)
                unsent.append(item.text)
                unsent_chars += len(item.text)
                if (
                    not send_futures  # the first text goes at once
                    or unsent_chars >= coalesce_max
                    or (send_futures[-1].done() and time.monotonic() >= last_sent_at + interval_s)
                ):
                    await send_delta()
                if item.output_tokens >= request.max_output_tokens and not aborting:
                    stop.set("max_output_tokens", FinishOutcome.COMPLETED)
        finally:
            stop_wait.cancel()
            # Close the engine's iterator now (it may hold the engine's lock or a sequence slot).
            with contextlib.suppress(Exception):
                await iterator.aclose()
            trace.stopped_at = time.monotonic()
            ended.set()
            renewer.cancel()
            # Bounded: a renewal in flight ends within its decision timeout, and ``ended`` stops the loop.
            await asyncio.wait({renewer}, timeout=RENEWER_STOP_TIMEOUT_S)
            self.active.pop(key, None)
            if finished is not None:
                # The engine ended the sequence: its slot is free now, before the result write and
                # the report (which wait on Cassandra and the processor, not on the engine). After a
                # failure (an abort never acknowledged, a stall) the slot is freed only at the end.
                self._free_slot(trace)
        if unsent:
            await send_delta()  # text the engine produced before it ended or was stopped
        if send_futures:
            with contextlib.suppress(KafkaError):
                await asyncio.gather(*send_futures)
        tokens = finished.output_tokens if finished is not None else progress["tokens"]
        inputs = finished.input_tokens if finished is not None and finished.input_tokens else d.input_tokens
        trace.output_tokens = tokens
        if failure is not None:
            outcome, code, reason = FinishOutcome.FAILED, stop.code or RejectionCode.MODEL_BACKEND_ERROR, failure
            if failure == "generation_duration_max":
                code = RejectionCode.GENERATION_TIMEOUT
            log.warning("attempt %s epoch %d failed: %s", d.generation_id, d.epoch, failure)
        elif finished is not None and finished.reason is FinishReason.ABORTED:
            outcome, code, reason = stop.outcome, stop.code, stop.reason or "aborted"
            if stop.reason == "max_output_tokens":
                outcome, reason = FinishOutcome.COMPLETED, "length"
        else:
            assert finished is not None
            outcome, code, reason = FinishOutcome.COMPLETED, None, finished.reason.value
        trace.outcome = outcome
        text = "".join(text_parts)
        if stop.reason not in ("fenced", "lease_lost"):
            await self.result_sink.put(d.generation_id, d.epoch, text, (inputs, tokens))
        # Reported also when fenced: the processor drops it and records LateReportIgnored.
        trace.report = await self.decide(
            self._command(
                cmd.ReportAttemptFinished, d, outcome=outcome, input_tokens=inputs, output_tokens=tokens,
                finish_reason=reason[:64], error_code=code if outcome is FinishOutcome.FAILED else None,
            )
        )

    async def _renew_loop(
        self, d: DispatchAuthorized, trace: AttemptTrace, stop: _Stop, progress: dict[str, int], ended: asyncio.Event,
        first_token: asyncio.Event,
    ) -> None:
        # The first renewal goes out as soon as the engine produced a token (at the latest after one
        # interval): the processor's ``partial`` after a crash is "output tokens reported > 0", so a
        # worker killed before its first periodic renewal would otherwise end as partial: false although
        # the client already had text.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.renew_interval_s):
                await first_token.wait()
        lease_ms = self.settings.lease_ms
        while not stop.event.is_set() and not ended.is_set():
            renewal = self._command(cmd.RenewLease, d, output_tokens=progress["tokens"])
            try:
                # Never wait for an answer past the confirmed lease: after it the processor fences us.
                async with asyncio.timeout(max(0.0, (trace.lease_until_ms - now_ms()) / 1000)):
                    outcome = await self.decide(renewal)
            except TimeoutError:
                outcome = None
            if outcome is not None and outcome.kind in (OutcomeKind.APPLIED, OutcomeKind.CANCEL_REQUESTED):
                trace.lease_until_ms = max(trace.lease_until_ms, renewal.issued_at_ms + lease_ms)
            if outcome is not None and outcome.kind is OutcomeKind.CANCEL_REQUESTED:
                stop.set("cancel")
            elif outcome is not None and outcome.kind is OutcomeKind.REJECTED:
                stop.set("fenced", FinishOutcome.FAILED, RejectionCode.MODEL_BACKEND_ERROR)
            elif now_ms() >= trace.lease_until_ms:
                # No renewal confirmed within the lease (the processor unreachable, or too slow): it
                # fences this epoch at that deadline, so computing on is GPU time nobody gets. Stop.
                log.warning("lease of %s epoch %d lost (no renewal confirmed): stopping", d.generation_id, d.epoch)
                stop.set("lease_lost", FinishOutcome.FAILED, RejectionCode.MODEL_BACKEND_ERROR)
            # No answer (None) within the lease: the next renewal tries again.
            if stop.event.is_set() or ended.is_set():
                return
            await asyncio.sleep(min(self.settings.renew_interval_s, max(0.0, (trace.lease_until_ms - now_ms()) / 1000)))

    # --- capacity heartbeats ------------------------------------------------------------------------

    def tokens_per_s(self) -> float:
        horizon = time.monotonic() - TOKENS_PER_S_WINDOW_S
        while self._token_samples and self._token_samples[0][0] < horizon:
            self._token_samples.popleft()
        return sum(n for _, n in self._token_samples) / TOKENS_PER_S_WINDOW_S

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.settings.worker_id,
            pool=self.settings.pool,
            sent_at_ms=now_ms(),
            free_slots=max(0, self.free_slots),
            active_sequences=len(self.active),
            queued=self.preparing,
            kv_pressure=float(max(0.0, min(1.0, self.engine.kv_pressure()))),
            tokens_per_s=round(self.tokens_per_s(), 3),
        )

    async def _heartbeat_loop(self) -> None:
        """A heartbeat every ``heartbeat_interval_s``, and one as soon as free capacity changed (at
        most one per ``heartbeat_min_interval_s``)."""
        assert self.producer is not None
        while True:
            self._capacity_changed.clear()
            sent_at = time.monotonic()
            try:
                await self.producer.send_and_wait(
                    self.settings.topology.capacity.name, encode(self.heartbeat()), key=self.settings.worker_id.encode()
                )
            except KafkaError as exc:
                log.warning("heartbeat not sent: %s", type(exc).__name__)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, sent_at + self.settings.heartbeat_interval_s - time.monotonic())):
                    await self._capacity_changed.wait()
            await asyncio.sleep(max(0.0, sent_at + self.settings.heartbeat_min_interval_s - time.monotonic()))
