"""The inference worker: takes dispatches of one model pool, owns attempts, runs an engine, reports usage.

Where it sits in the data flow::

    dispatch.<pool>.paid / .free --(consumer group <ns>.chatplane-workers.<pool>, pull-based)--> Worker
    Worker --PromptRequest--> edge inbox (dispatch.stream_to)   edge --PromptPayload--> worker-control
    Worker --AcceptAttempt / DeclineAttempt / RenewLease / ReportAttemptFinished--> commands
    processor --Outcome (not of a report), StopAttempt--> worker-control partition worker_control_partition(worker_id)
    Worker --TextDelta--> edge inbox (dispatch.stream_to)      Worker --WorkerHeartbeat--> capacity

The worker owns the Kafka clients, the slots and the control partition; each dispatch it takes runs
as one ``workers.attempt.Attempt`` (a state machine, drawn there), which uses the worker only through
``workers.attempt.AttemptHost`` (implemented here: ``decide``, ``request_prompt``, ``send_delta``,
``watch_stop``, ``free_slot`` and the rest, most under "what an attempt may use"). Commands are appended
and their outcomes awaited through ``infra.runtime.command_client.CommandClient`` (which keys every
command by its user id), on the worker's producer and its control partition; the report
(``ReportAttemptFinished``) is appended with no ``reply_to`` (``append``): the worker acts on nothing the
processor would answer, so it waits only for Kafka's acknowledgement. No prompt or generated text is
ever logged or put in a command.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from infra.runtime.command_client import CommandClient
from infra.runtime.kafka_settings import kafka_client_kwargs, reply_fetch_max_wait_ms, producer_kwargs
from infra.runtime import tracing
from schemas.commands import ReplyTo
from schemas.messages import (
    AnswerSpooled,
    ChatMessage,
    DispatchAuthorized,
    Outcome,
    PromptPayload,
    PromptRequest,
    StopAttempt,
    TextDelta,
    WorkerHeartbeat,
)
from schemas.topics import worker_control_partition
from schemas.wire import WireError, decode_message, encode
from workers.attempt import (
    ABORT_ACK_TIMEOUT_S,
    Attempt,
    AttemptTrace,
    ResultSink,
    ServedModel,
    StopReason,
    StopSignal,
    now_ms,
)
from workers.engines.base import Engine
from infra.content.policy_checks import PolicyCheck
from workers.settings import WorkerSettings
from workers.prompts import PromptTopicReader
from workers.replay_sink import NullReplaySink, ReplaySink
from workers.work import WorkRates, held_work

log = logging.getLogger("chatplane.workers")

# One poll of the dispatch topics while a slot is free. Kept short although the broker answers a long
# poll at the first record: aiokafka 0.14 sends no second fetch to a broker while one is in flight,
# so a partition drained by max_records=1 would wait for the long poll on the others to return.
DISPATCH_FETCH_TIMEOUT_MS = 100
CONTROL_FETCH_TIMEOUT_MS = 500
FENCED_REMEMBERED_MAX = 10_000  # (generation, epoch) pairs stopped before their dispatch was handled
DRAIN_TIMEOUT_S = 30.0  # on shutdown, running attempts get this long before they are aborted
TOKENS_PER_S_WINDOW_S = 10.0  # the heartbeat's measured rate is over this trailing window
TOKEN_RATE_SAMPLES_MAX = 10_000
PRODUCER_LINGER_MS = 0
SPOOL_RETRY_BACKOFF_S = 0.2  # between failed sends of a conversation answer to the answers topic
APPEND_RETRY_BACKOFF_S = 0.2  # between failed appends of a command no answer is awaited for (the report)
COMMIT_ON_STOP_TIMEOUT_S = 5.0  # the last dispatch offsets are committed on shutdown within this long


class MissingTopics(RuntimeError):
    """The worker's dispatch or control topics do not exist (nothing to consume: fail at start)."""


class NullResultSink:
    """Keeps nothing (the default when no result store is wired)."""

    async def put(self, generation_id: str, epoch: int, text: str, usage: tuple[int, int]) -> bool | None:
        return None


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
        model: ServedModel,
        result_sink: ResultSink | None = None,
        on_trace: Callable[[AttemptTrace], None] | None = None,
        replay_sink: ReplaySink | None = None,
        policy_check: PolicyCheck | None = None,
    ) -> None:
        self.settings = settings
        # The output check between decode steps (infra/content/policy_checks.py); None: none.
        self.policy_check = policy_check
        self.engine = engine
        self.model = model
        self.result_sink: ResultSink = result_sink or NullResultSink()
        # Deltas stored before they are sent, for replay from any edge (workers/replay_sink.py).
        self.replay_sink: ReplaySink = replay_sink or NullReplaySink()
        self.on_trace = on_trace
        topo = settings.topology
        self.control = ReplyTo(topo.worker_control.name, worker_control_partition(settings.worker_id), "-")
        self.dispatch_topics = {"paid": topo.dispatch(model.pool, "paid").name, "free": topo.dispatch(model.pool, "free").name}
        limit = engine.max_concurrent if settings.slots <= 0 else min(settings.slots, engine.max_concurrent)
        self.slots = max(1, limit)
        self.free_slots = self.slots
        self._slot_freed = asyncio.Event()
        # Set whenever free_slots changes: the heartbeat goes out then, not at the next interval, so
        # the edge's capacity view sees a freed slot before the client sees the generation end.
        self._capacity_changed = asyncio.Event()
        self.active: dict[tuple[str, int], StopSignal] = {}
        self.preparing = 0  # dispatches taken, not yet accepted or declined
        # The attempts this worker holds (at most one per slot) and its engine's measured rates: the
        # work its heartbeats report (workers/work.py).
        self.held: dict[tuple[str, int], Attempt] = {}
        self.rates = WorkRates()
        # Dispatches waiting in each assigned partition when one was last taken from it (0 once a
        # bounded wait found nothing), and how long the last taken dispatch had waited on the log.
        self._backlog: dict[TopicPartition, int] = {}
        self._queue_age_ms = 0
        # What happened to the newest attempts, for tests and benchmarks: at most
        # settings.attempt_traces_max of them, oldest dropped first (0, the default of python -m
        # workers: none kept, since a worker runs millions of attempts a day; on_trace sees each).
        self.traces: collections.OrderedDict[tuple[str, int], AttemptTrace] = collections.OrderedDict()
        # Attempts stopped before their dispatch was handled here, and why (bounded by FENCED_REMEMBERED_MAX).
        self._fenced: collections.OrderedDict[tuple[str, int], StopReason] = collections.OrderedDict()
        self._prompts: dict[tuple[str, int], asyncio.Future[PromptPayload]] = {}
        self.prompt_reader = PromptTopicReader(
            settings.kafka_bootstrap, topo.prompts(model.pool).name, settings.prompt_buffer_max,
            settings.prompt_buffer_bytes_max, settings.prompt_buffer_ttl_s,
        )
        self.prompt_reader_on = False
        self._token_samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=TOKEN_RATE_SAMPLES_MAX)
        self._offsets = _OffsetTracker()
        self._to_commit: dict[TopicPartition, int] = {}  # the newest offset per partition not yet committed
        self._commit_wanted = asyncio.Event()
        self._taken = {"paid": 0, "free": 0}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._stopping = False
        self.producer: AIOKafkaProducer | None = None
        # Appends commands and awaits their outcomes (on self.producer; _control_loop hands it the outcomes).
        self.commands: CommandClient | None = None
        self.dispatch_consumer: AIOKafkaConsumer | None = None
        self.control_consumer: AIOKafkaConsumer | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        await self.engine.start()
        self.producer = AIOKafkaProducer(
            bootstrap_servers=s.kafka_bootstrap, acks="all", enable_idempotence=True, linger_ms=PRODUCER_LINGER_MS,
            **producer_kwargs(),
        )
        await self.producer.start()
        self.commands = CommandClient(
            s.kafka_bootstrap, s.topology, self.control.partition, decision_timeout_s=s.decision_timeout_s,
            inbox_topic=self.control.topic, producer=self.producer, read_inbox=False,
        )
        await self.commands.start()  # starts nothing: it uses this producer, and the control loop reads
        self.control_consumer = AIOKafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap, enable_auto_commit=False, auto_offset_reset="latest",
            fetch_max_wait_ms=reply_fetch_max_wait_ms(), **kafka_client_kwargs(),
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
            group_id=s.group_id(self.model.pool),
            client_id=s.worker_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=max(100, s.session_timeout_ms // 3),
            max_partition_fetch_bytes=64 * 1024,
            fetch_max_wait_ms=DISPATCH_FETCH_TIMEOUT_MS,
            **kafka_client_kwargs(),
        )
        await self.dispatch_consumer.start()
        if s.prompt_topic:
            consumer = self.dispatch_consumer
            self.prompt_reader_on = await self.prompt_reader.start(lambda: {tp.partition for tp in consumer.assignment()})
        self._loops = [
            asyncio.create_task(self._control_loop(), name="worker-control"),
            asyncio.create_task(self._dispatch_loop(), name="worker-dispatch"),
            asyncio.create_task(self._heartbeat_loop(), name="worker-heartbeat"),
            asyncio.create_task(self._commit_loop(), name="worker-commit"),
        ]
        log.info("worker %s ready: pool=%s engine=%s slots=%d control=%d", s.worker_id, self.model.pool, self.engine.name,
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
            stop.set(StopReason.WORKER_SHUTDOWN)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=ABORT_ACK_TIMEOUT_S + 5)
        for task in self._loops:
            task.cancel()
        for task in [*self._loops, *self._tasks]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._commit_pending(), COMMIT_ON_STOP_TIMEOUT_S)
        await self.prompt_reader.stop()
        if self.commands is not None:
            await self.commands.stop()  # cancels any decision still awaited (the producer is stopped below)
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
                    self._on_control(record.value, record.headers)

    def _on_control(self, value: bytes | None, headers: Any = None) -> None:
        try:
            message = decode_message(value or b"")
        except WireError as exc:
            log.warning("undecodable control message: %s", exc.reason)
            return
        if isinstance(message, Outcome):
            if self.commands is not None:
                self.commands.resolve(message)
        elif isinstance(message, PromptPayload):
            if message.worker_id == self.settings.worker_id:
                fut = self._prompts.get((message.generation_id, message.epoch))
                if fut is not None and not fut.done():
                    fut.set_result(message)
        elif isinstance(message, StopAttempt):
            if message.worker_id != self.settings.worker_id:
                return
            key = (message.generation_id, message.epoch)
            reason = StopReason.FENCED if message.fence_reason is not None else StopReason.CANCEL
            stop = self.active.get(key)
            if stop is not None:
                if (held := self.held.get(key)) is not None and held.cancel_span is None:
                    held.cancel_span = tracing.start("worker.cancel", held.span, links=[tracing.extract(headers)], **held.ids)
                stop.set(reason)
            else:
                self._fenced[key] = reason
                while len(self._fenced) > FENCED_REMEMBERED_MAX:
                    self._fenced.popitem(last=False)

    # --- what an attempt may use (workers.attempt.AttemptHost) ---------------------------------------

    async def decide(self, command: Any, headers: tracing.Headers | None = None) -> Outcome | None:
        """Append a command and await its outcome on the control partition, through the command client
        (each wait bounded by ``decision_timeout_s``; retried with the same command id, which the
        processor answers from its decision memory). None: no answer."""
        assert self.commands is not None
        for _ in range(self.settings.decision_attempts_max):
            try:
                return await self.commands.decide(command, headers=headers)
            except (TimeoutError, KafkaError):  # DecisionTimeout is a TimeoutError
                log.warning("no decision for %s %s yet; retrying", command.type, command.command_id)
        log.error("no decision for %s %s after %d attempts", command.type, command.command_id,
                  self.settings.decision_attempts_max)
        return None

    async def append(self, command: Any, headers: tracing.Headers | None = None) -> bool:
        """Append a command whose decision nobody here waits for (its ``reply_to`` is None, so the
        processor sends no answer): True once Kafka acknowledged it in ``commands`` (acks=all), from
        where the processor decides it, at least once. Each try is bounded by ``decision_timeout_s``;
        at most ``decision_attempts_max`` tries, ``APPEND_RETRY_BACKOFF_S`` apart, with the same
        command id (a try that timed out may still land: the processor decides a second copy as a
        repeat, which changes nothing).
        False: not acknowledged after them all."""
        assert self.commands is not None and command.reply_to is None
        tries = self.settings.decision_attempts_max
        for attempt in range(1, tries + 1):
            try:
                async with asyncio.timeout(self.settings.decision_timeout_s):
                    await self.commands.send(command, headers)
                return True
            except (TimeoutError, KafkaError) as exc:
                log.warning("%s %s not appended (%s), try %d of %d", command.type, command.command_id,
                            type(exc).__name__, attempt, tries)
            if attempt < tries:
                await asyncio.sleep(APPEND_RETRY_BACKOFF_S)
        log.error("%s of %s epoch %d (command %s) not appended after %d tries", command.type, command.generation_id,
                  command.epoch, command.command_id, tries)
        return False

    def reply_to(self) -> ReplyTo:
        """A fresh reply address on this worker's control partition."""
        return replace(self.control, request_id=uuid.uuid4().hex)

    async def published_prompt(self, generation_id: str) -> tuple[ChatMessage, ...] | None:
        """The prompt read from prompts.<pool> (workers/prompts.py) within ``prompt_topic_wait_ms``; None:
        not read (or that topic not followed), ask the edge."""
        if not self.prompt_reader_on:
            return None
        return await self.prompt_reader.take(generation_id, self.settings.prompt_topic_wait_ms / 1000)

    async def request_prompt(self, request: PromptRequest, stream_to: ReplyTo) -> PromptPayload | None:
        """Send ``request`` to the edge's inbox partition; its PromptPayload arrives on the control
        partition (``_on_control``). None when none came within ``prompt_timeout_s``."""
        assert self.producer is not None
        key = (request.generation_id, request.epoch)
        fut: asyncio.Future[PromptPayload] = asyncio.get_running_loop().create_future()
        self._prompts[key] = fut
        try:
            await self.producer.send_and_wait(stream_to.topic, encode(request), partition=stream_to.partition)
            async with asyncio.timeout(self.settings.prompt_timeout_s):
                return await fut
        except TimeoutError:
            return None
        finally:
            self._prompts.pop(key, None)

    async def send_delta(self, stream_to: ReplyTo, delta: TextDelta) -> asyncio.Future[Any]:
        """Hand ``delta`` to the producer for the edge's inbox partition; the future is its acknowledgement."""
        assert self.producer is not None
        return await self.producer.send(stream_to.topic, encode(delta), partition=stream_to.partition)

    def stopped_before(self, key: tuple[str, int]) -> StopReason | None:
        return self._fenced.get(key)

    def watch_stop(self, key: tuple[str, int], stop: StopSignal) -> None:
        self.active[key] = stop
        if key in self._fenced:
            stop.set(self._fenced.pop(key))

    def unwatch_stop(self, key: tuple[str, int]) -> None:
        self.active.pop(key, None)

    def token_produced(self) -> None:
        self._token_samples.append((time.monotonic(), 1))


    async def spool_answer(self, d: DispatchAuthorized, text: str, completed: bool, output_tokens: int) -> bool:
        """A conversation turn's answer onto the answers topic (the history writer's recoverable copy),
        before the report: True once the broker acknowledged it (acks=all), False after
        ``settings.spool_attempts_max`` failed sends. Then the report says nothing was spooled, and
        the processor commits the answer incomplete and empty rather than wait for a copy that
        does not exist (docs/conversations.md, "Durable completion")."""
        assert self.producer is not None
        record = AnswerSpooled(
            user_id=d.user_id, conversation_id=d.conversation_id, generation_id=d.generation_id, epoch=d.epoch,
            worker_id=self.settings.worker_id, turn_revision=d.turn_revision, regenerate=d.regenerate, text=text, completed=completed, output_tokens=output_tokens,
            spooled_at_ms=now_ms(),
        )
        for attempt in range(self.settings.spool_attempts_max):
            try:
                await self.producer.send_and_wait(
                    self.settings.topology.answers.name, encode(record), key=d.user_id.encode()
                )
                return True
            except KafkaError as exc:
                log.warning("spooling the answer of %s failed (%s), attempt %d", d.generation_id, type(exc).__name__, attempt + 1)
                await asyncio.sleep(SPOOL_RETRY_BACKOFF_S)
        return False

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
                self._backlog.clear()  # a bounded wait on every partition found nothing waiting
                if not consumer.assignment():
                    await asyncio.sleep(DISPATCH_FETCH_TIMEOUT_MS / 1000)
                continue
            tier, tp, record = taken
            highwater = consumer.highwater(tp)
            if highwater is not None:
                self._backlog[tp] = max(0, highwater - record.offset - 1)
            self._queue_age_ms = max(0, now_ms() - record.timestamp) if record.timestamp > 0 else 0  # -1: no timestamp
            self._taken[tier] += 1
            self._offsets.begin(tp, record.offset)
            self.free_slots -= 1
            self.preparing += 1
            self._capacity_changed.set()
            task = asyncio.create_task(self._handle(tp, record.offset, record.value, record.headers))
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

    def free_slot(self, trace: AttemptTrace | None) -> None:
        """Give the attempt's slot back (once: ``Attempt`` frees it when the engine stopped, ``_handle``
        in any case)."""
        if trace is not None:
            if trace.slot_freed_at is not None:
                return
            trace.slot_freed_at = time.monotonic()
        self.free_slots += 1
        self._slot_freed.set()
        self._capacity_changed.set()

    # --- one attempt --------------------------------------------------------------------------------

    def _keep_trace(self, trace: AttemptTrace) -> None:
        """Keep ``trace`` in ``self.traces`` (bounded by ``attempt_traces_max``, oldest dropped first)."""
        kept_max = self.settings.attempt_traces_max
        if kept_max <= 0:
            return
        key = (trace.generation_id, trace.epoch)
        self.traces[key] = trace
        self.traces.move_to_end(key)
        while len(self.traces) > kept_max:
            self.traces.popitem(last=False)

    async def _handle(self, tp: TopicPartition, offset: int, value: bytes | None, headers: Any = None) -> None:
        trace: AttemptTrace | None = None
        attempt: Attempt | None = None
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
            trace = AttemptTrace(d.generation_id, d.epoch, authorized_at_ms=d.authorized_at_ms)
            self._keep_trace(trace)
            attempt = Attempt(self, d, trace)
            attempt.span = tracing.start("worker.dispatch", tracing.extract(headers), worker_id=self.settings.worker_id, **attempt.ids)
            self.held[attempt.key] = attempt
            accepted = await attempt.prepare()
            self.preparing -= 1
            self._commit(tp, offset)
            committed = True
            if accepted:
                await attempt.run()
        except Exception:
            log.exception("attempt failed unexpectedly")
        finally:
            if attempt is not None and self.held.get(attempt.key) is attempt:
                del self.held[attempt.key]
            if not committed:
                self.preparing -= 1
                self._commit(tp, offset)
            if attempt is not None:
                tracing.end(attempt.span, status=attempt.state.name.lower())
            self.free_slot(trace)
            if trace is not None and self.on_trace is not None:
                self.on_trace(trace)

    # --- capacity heartbeats ------------------------------------------------------------------------

    def tokens_per_s(self) -> float:
        horizon = time.monotonic() - TOKENS_PER_S_WINDOW_S
        while self._token_samples and self._token_samples[0][0] < horizon:
            self._token_samples.popleft()
        return sum(n for _, n in self._token_samples) / TOKENS_PER_S_WINDOW_S

    def heartbeat(self) -> WorkerHeartbeat:
        work = held_work(self.rates, [a.work() for a in self.held.values() if a.holds_work()])
        kv_max = self.settings.kv_tokens_max
        assignment = self.dispatch_consumer.assignment() if self.dispatch_consumer is not None else set()
        backlog = sum(n for tp, n in self._backlog.items() if tp in assignment)
        return WorkerHeartbeat(
            worker_id=self.settings.worker_id,
            pool=self.model.pool,
            sent_at_ms=now_ms(),
            free_slots=max(0, self.free_slots),
            active_sequences=len(self.active),
            queued=self.preparing,
            kv_pressure=float(max(0.0, min(1.0, self.engine.kv_pressure()))),
            tokens_per_s=round(self.tokens_per_s(), 3),
            prefill_tokens_per_s=round(self.rates.prefill_tokens_per_s, 3),
            decode_tokens_per_s=round(self.rates.decode_tokens_per_s, 3),
            output_fill=round(self.rates.output_fill, 4),
            queued_input_tokens=work.queued_input_tokens,
            queued_output_tokens=work.queued_output_tokens,
            output_tokens_left=work.output_tokens_left,
            kv_tokens_free=-1 if kv_max <= 0 else max(0, kv_max - work.tokens_held),
            dispatch_backlog=backlog,
            queue_age_ms=self._queue_age_ms if backlog > 0 else 0,
            reports_work=True,
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
