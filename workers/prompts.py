"""The prompts edges publish beside their submits, read by the worker that will take the dispatch.

Before this, a worker that took a dispatch asked the edge for the prompt (``PromptRequest`` to the
edge inbox, ``PromptPayload`` back on worker control) and only then asked the processor for
acceptance: two Kafka hops on every first token. Now each edge also publishes
the prompt (``PromptPublished``) on ``prompts.<pool>`` as it appends the submit, keyed by the
generation id a new key's submit gets (``control_plane.ids.generation_id_for``). That topic has
the dispatch topics' partition count and the same key, so the prompt lands in the partition number
its dispatch will (schemas/topics.py ``prompts_topic``).

``PromptTopicReader`` reads, without a consumer group, the prompt partitions whose numbers match the
dispatch partitions this worker holds (either tier), following its group assignment, and keeps what
it reads in a bounded buffer (``prompt_buffer_max`` entries, ``prompt_buffer_bytes_max`` bytes of
text, ``prompt_buffer_ttl_s``; oldest dropped first). ``take`` answers from the buffer or waits up to
``prompt_topic_wait_ms`` for the record; a miss (the record is late or lost, the edge's
publication failed, a same-key retry whose generation id the edge could not know) falls back to
asking the edge, as before. On a newly held partition it reads from ``PROMPT_LOOKBACK_MS`` back,
so dispatches already waiting there find their prompts.

What the worker gives up with a prompt read here: asking the edge proved it still held the client
before acceptance (no answer: decline, nothing charged). A generation whose edge died between the
submit and the acceptance is now accepted and charged; its reader then detaches (the edge's
presence lapses) and the processor cancels it after the disconnect grace, while a same-key retry
through another edge attaches to it. See docs/worker.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from infra.runtime.kafka_settings import kafka_client_kwargs, reply_fetch_max_wait_ms
from schemas.messages import ChatMessage, PromptPublished
from schemas.wire import WireError, decode_message

log = logging.getLogger("chatplane.worker.prompts")

# A newly held partition is read from this far back: dispatches wait at most the 15 s queue wait.
PROMPT_LOOKBACK_MS = 30_000
# How often the reader checks the dispatch assignment for partitions to follow.
ASSIGNMENT_CHECK_S = 0.5
FETCH_RECORDS_MAX = 500


@dataclass(slots=True)
class _Held:
    messages: tuple[ChatMessage, ...]
    size: int
    at: float  # monotonic: when it was read


class PromptTopicReader:
    def __init__(self, bootstrap: str, topic: str, buffer_max: int, buffer_bytes_max: int, ttl_s: float) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.buffer_max = buffer_max
        self.buffer_bytes_max = buffer_bytes_max
        self.ttl_s = ttl_s
        self._held: collections.OrderedDict[str, _Held] = collections.OrderedDict()
        self._bytes = 0
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._partitions: frozenset[int] = frozenset()
        self.found = 0  # take() answered from what was read
        self.missed = 0  # take() found nothing in time

    async def start(self, held_partitions: Callable[[], set[int]]) -> bool:
        """Start following ``held_partitions()`` (the dispatch partition numbers held); False when the
        prompts topic is not in the cluster (the worker then always asks the edge)."""
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False, group_id=None, auto_offset_reset="latest",
            fetch_max_wait_ms=reply_fetch_max_wait_ms(), **kafka_client_kwargs(),
        )
        await self._consumer.start()
        if self.topic not in await self._consumer.topics():
            log.warning("topic %s is not in the cluster (run infra/create-topics): prompts are asked of the edge", self.topic)
            await self._consumer.stop()
            self._consumer = None
            return False
        self._task = asyncio.create_task(self._run(held_partitions), name="worker-prompts")
        return True

    @property
    def following(self) -> frozenset[int]:
        """The prompt partitions read now (those of the dispatch partitions held), each positioned."""
        return self._partitions

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()

    async def take(self, generation_id: str, wait_s: float) -> tuple[ChatMessage, ...] | None:
        """The prompt of ``generation_id``, waiting up to ``wait_s`` for it to be read; None if not."""
        held = self._take_held(generation_id)
        if held is None and wait_s > 0 and self._task is not None and generation_id not in self._waiters:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters[generation_id] = waiter
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await waiter
            finally:
                self._waiters.pop(generation_id, None)
            held = self._take_held(generation_id)
        if held is None:
            self.missed += 1
            return None
        self.found += 1
        return held

    def _take_held(self, generation_id: str) -> tuple[ChatMessage, ...] | None:
        # Kept (not popped) after a take: a redelivered dispatch or a later epoch of the same key (the
        # same content: the key's fingerprint binds it) may need it again within the buffer's life.
        held = self._held.get(generation_id)
        if held is None or time.monotonic() - held.at > self.ttl_s:
            return None
        return held.messages

    def hold(self, message: PromptPublished) -> None:
        size = sum(len(m.content) for m in message.messages)
        old = self._held.pop(message.generation_id, None)
        if old is not None:
            self._bytes -= old.size
        self._held[message.generation_id] = _Held(message.messages, size, time.monotonic())
        self._bytes += size
        now = time.monotonic()
        while self._held and (
            len(self._held) > self.buffer_max
            or self._bytes > self.buffer_bytes_max
            or now - next(iter(self._held.values())).at > self.ttl_s
        ):
            _, dropped = self._held.popitem(last=False)
            self._bytes -= dropped.size
        waiter = self._waiters.get(message.generation_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _follow(self, wanted: frozenset[int]) -> None:
        assert self._consumer is not None
        added = wanted - self._partitions
        self._consumer.assign([TopicPartition(self.topic, p) for p in sorted(wanted)])
        if added:
            since = int(time.time() * 1000) - PROMPT_LOOKBACK_MS
            tps = [TopicPartition(self.topic, p) for p in sorted(added)]
            found = await self._consumer.offsets_for_times({tp: since for tp in tps})
            for tp in tps:
                at = found.get(tp)
                if at is not None:
                    self._consumer.seek(tp, at.offset)
                else:
                    await self._consumer.seek_to_end(tp)
                # Resolve the position now: aiokafka resolves "the end" lazily, at the next fetch,
                # and a prompt published in between would be skipped.
                await self._consumer.position(tp)
        self._partitions = wanted

    async def _run(self, held_partitions: Callable[[], set[int]]) -> None:
        assert self._consumer is not None
        checked = 0.0
        while True:
            now = time.monotonic()
            if now - checked >= ASSIGNMENT_CHECK_S:
                checked = now
                wanted = frozenset(held_partitions())
                if wanted != self._partitions:
                    try:
                        await self._follow(wanted)
                    except KafkaError as exc:
                        log.warning("following prompt partitions %s failed: %s", sorted(wanted), exc)
                        self._partitions = frozenset()
            if not self._partitions:
                await asyncio.sleep(ASSIGNMENT_CHECK_S)
                continue
            try:
                batches = await self._consumer.getmany(
                    timeout_ms=int(ASSIGNMENT_CHECK_S * 1000), max_records=FETCH_RECORDS_MAX
                )
            except KafkaError as exc:
                log.warning("reading %s failed: %s", self.topic, exc)
                await asyncio.sleep(ASSIGNMENT_CHECK_S)
                continue
            for records in batches.values():
                for record in records:
                    try:
                        message = decode_message(record.value or b"")
                    except WireError as exc:
                        log.warning("undecodable prompt record at %s:%d: %s", record.topic, record.offset, exc.reason)
                        continue
                    if isinstance(message, PromptPublished):
                        self.hold(message)
