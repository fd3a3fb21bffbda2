"""``CommandClient``: append commands and await their decisions on one edge-inbox partition.

Used by the edge (and by tests and benchmarks in its place). The client owns one inbox partition
(manually assigned, read from its end); every command it sends names that partition in ``reply_to``,
and the processor's ``Outcome`` comes back there. Anything else arriving on the partition (stream
deltas, finalizations) is handed to ``on_message``. Waiting is bounded: a decision that does not
arrive in time raises ``DecisionTimeout`` and the caller fails closed (``quota_service_unavailable``).

The client is where a command's record key is chosen: the user id, for every command. The processor's
single-writer guarantee per user rests on it (one user's commands in one partition, in order), so no
caller computes the key itself. A worker uses the client too, on its own control partition
(``inbox_topic``), through the producer it streams with (``producer``) and reading that partition
itself (``read_inbox=False``: it hands each ``Outcome`` to ``resolve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from infra.runtime.kafka_settings import kafka_client_kwargs, reply_fetch_max_wait_ms, producer_kwargs
from schemas.commands import Command, ReplyTo
from schemas.messages import Outcome
from schemas.topics import Topology
from schemas.wire import WireError, decode_message, encode

log = logging.getLogger("chatplane.client")

DECISION_TIMEOUT_S = 2.0  # how long a caller waits for a decision before failing closed
PENDING_DECISIONS_MAX = 10_000  # bound on decisions awaited at once by one client


class DecisionTimeout(TimeoutError):
    """No decision arrived in time. The command may still be decided, except a submit carrying a
    decision deadline (``SubmitGeneration.decide_by_ms``), which is refused holding nothing if read
    after it; either way a same-key retry finds the request."""


class TooManyPending(RuntimeError):
    """The client already waits for ``PENDING_DECISIONS_MAX`` decisions."""


class CommandClient:
    def __init__(
        self,
        bootstrap: str,
        topology: Topology,
        inbox_partition: int,
        on_message: Callable[[Any], None] | None = None,
        decision_timeout_s: float = DECISION_TIMEOUT_S,
        inbox_topic: str | None = None,
        producer: AIOKafkaProducer | None = None,
        read_inbox: bool = True,
    ) -> None:
        """``inbox_topic``: the topic of the reply partition (default: the edge inbox). ``producer``: a
        started producer to append through, owned by the caller (neither started nor stopped here);
        default: the client's own. ``read_inbox=False``: no consumer here; the caller reads the reply
        partition and passes each ``Outcome`` to ``resolve`` (``on_message`` is then unused)."""
        self.bootstrap = bootstrap
        self.topology = topology
        self.inbox = ReplyTo(topic=inbox_topic or topology.edge_inbox.name, partition=inbox_partition, request_id="-")
        self.on_message = on_message
        self.decision_timeout_s = decision_timeout_s
        self._pending: dict[str, asyncio.Future[Outcome]] = {}
        self._pending_since: dict[str, float] = {}  # monotonic send time per pending command, oldest first
        self._producer: AIOKafkaProducer | None = producer
        self._owns_producer = producer is None
        self.read_inbox = read_inbox
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self.undecodable = 0

    async def start(self) -> None:
        if self._owns_producer:
            self._producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True, linger_ms=0, **producer_kwargs()
            )
            await self._producer.start()
        if not self.read_inbox:
            return
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=reply_fetch_max_wait_ms(),
            auto_offset_reset="latest",
            **kafka_client_kwargs(),
        )
        await self._consumer.start()
        tp = TopicPartition(self.inbox.topic, self.inbox.partition)
        self._consumer.assign([tp])
        await self._consumer.seek_to_end(tp)
        # Resolve the end offset now so no reply sent after start() is skipped.
        await self._consumer.position(tp)
        self._reader = asyncio.create_task(self._read(), name="inbox-reader")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        if self._consumer is not None:
            await self._consumer.stop()
        if self._producer is not None and self._owns_producer:
            await self._producer.stop()

    async def __aenter__(self) -> CommandClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @classmethod
    def send_only(cls, bootstrap: str, topology: Topology) -> CommandClient:
        """A client that only appends commands (``send``), keyed as every command is: no reply partition
        is read and no decision awaited (``decide`` is not for it). For a process whose commands are
        consequences of its own work, whose outcomes it does not wait for (the history writer's
        ``CommitAnswer``). Its own producer, started and stopped by ``start`` and ``stop``."""
        return cls(bootstrap, topology, 0, read_inbox=False)

    def reply_to(self, request_id: str | None = None) -> ReplyTo:
        return replace(self.inbox, request_id=request_id or uuid.uuid4().hex)

    async def send(self, command: Command, headers: list[tuple[str, bytes]] | None = None) -> None:
        """Append a command without waiting for its decision (``headers``: its trace context, tracing.py)."""
        assert self._producer is not None
        # Keyed by the user id, always: the one place the commands topic's key is chosen (module docstring).
        await self._producer.send_and_wait(
            self.topology.commands.name, encode(command), key=command.user_id.encode(), headers=headers
        )

    async def decide(
        self, command: Command, timeout_s: float | None = None, headers: list[tuple[str, bytes]] | None = None
    ) -> Outcome:
        """Append ``command`` (whose ``reply_to`` must be ``self.reply_to(...)``) and await its outcome."""
        assert command.reply_to is not None and command.reply_to.partition == self.inbox.partition
        if len(self._pending) >= PENDING_DECISIONS_MAX:
            raise TooManyPending(f"{PENDING_DECISIONS_MAX} decisions already pending")
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._pending[command.command_id] = fut
        self._pending_since[command.command_id] = time.monotonic()
        try:
            await self.send(command, headers)
            # asyncio.timeout, not wait_for: 3.11's wait_for returns the answer and drops a
            # cancellation that arrives in the same loop turn (a cancelled caller would go on).
            async with asyncio.timeout(timeout_s or self.decision_timeout_s):
                return await fut
        except TimeoutError:
            raise DecisionTimeout(f"no decision for {command.type} within {timeout_s or self.decision_timeout_s}s") from None
        finally:
            self._pending.pop(command.command_id, None)
            self._pending_since.pop(command.command_id, None)

    @property
    def pending(self) -> int:
        """Decisions awaited now."""
        return len(self._pending)

    def oldest_pending_age_s(self) -> float:
        """How long the oldest decision still awaited has waited (0 when none is)."""
        for since in self._pending_since.values():  # insertion order: the first is the oldest
            return time.monotonic() - since
        return 0.0

    async def _read(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            for records in batches.values():
                for record in records:
                    self._dispatch(record.value)

    def resolve(self, outcome: Outcome) -> None:
        """A decision read from the reply partition: wakes the ``decide`` awaiting it (if any still does).
        Called by the client's own reader, or by the caller that reads the partition (``read_inbox=False``)."""
        fut = self._pending.get(outcome.command_id)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    def _dispatch(self, value: bytes | None) -> None:
        try:
            message = decode_message(value or b"")
        except WireError as exc:
            self.undecodable += 1
            log.warning("undecodable inbox message: %s", exc.reason)
            return
        if isinstance(message, Outcome):
            self.resolve(message)
            return
        if self.on_message is not None:
            self.on_message(message)
