"""Generations held by this edge: bounded buffers between the inbox reader and the client sockets.

Data flow::

    edge inbox --(CommandClient reader)--> StreamHub.on_message
        TextDelta            -> the stream of (generation_id, epoch): frame, buffer, wake the writer
        GenerationFinalized  -> the terminal frame (the processor committed the transition); a
                                completed result's whole text -> ResultRetention (edge/result_retention.py)
        PromptRequest        -> the stream's messages, or none -> PromptPublisher.answer
                                (edge/prompt_publisher.py: PromptPayload to the worker's control partition)
    StreamHub.frames writer  --(SSE frames, heartbeats)--> the client socket (edge.routes)
    cancels, detaches, re-attaches --> BackgroundSends (edge/background.py) --> the command client

Bounds: each stream buffers at most ``stream_buffer_bytes_max`` of frames not yet written to its
socket, and all streams together at most ``aggregate_buffer_bytes_max``. A delta that would pass
either limit is not buffered: the stream is marked overflowed, further deltas are dropped, and its
generation is cancelled with reason ``slow_consumer`` (counted). The inbox reader never waits for a
socket, so one slow reader cannot slow the others. A reader that disconnects detaches its generation
(``DetachReader``, grace ``disconnect_grace_s``): the processor cancels it with reason
``client_disconnect`` at the end of the grace unless a reader attaches again. The deadline is in the
processor's state, so it holds if this edge dies inside the grace; an edge that dies with readers
attached stops renewing its liveness lease (edge/presence.py) and the processor detaches them.
The terminal frame is always delivered (it is small and bounded) and only after the processor's
``GenerationFinalized``; deltas of an epoch other than the stream's current one are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from edge import sse
from edge.background import BackgroundSends
from edge.metrics import EdgeMetrics
from edge.prompt_publisher import PromptPublisher
from edge.result_retention import ResultRetention
from edge.settings import EdgeSettings
from schemas.codes import CancelReason, RejectionCode, RequestStatus, Tier
from schemas.commands import AttachReader, CancelGeneration, DetachReader
from schemas.messages import ChatMessage, GenerationFinalized, PromptRequest, TextDelta

log = logging.getLogger("chatplane.edge.streams")

# Messages for a generation this edge does not hold yet: the reader can see a worker's prompt request
# or first delta before the submitting handler has registered the stream its decision admitted
# (same inbox partition, next loop iteration). They are parked briefly, then dropped.
EARLY_GENERATIONS_MAX = 10_000
EARLY_MESSAGES_PER_GENERATION_MAX = 64
EARLY_HOLD_S = 5.0


@dataclass(slots=True)
class GenerationStream:
    generation_id: str
    user_id: str
    tier: Tier
    epoch: int
    streaming: bool
    messages: tuple[ChatMessage, ...]
    input_tokens: int
    model_version: str
    received_s: float
    admitted_s: float
    # The result buffer holds at most this many deltas (a worker sends at most one per token).
    max_output_tokens: int = 1_000_000
    # How its events are written (the native generation.* events, or OpenAI's chunks).
    framer: sse.Framer = sse.NATIVE
    # A conversation turn: its conversation and the revision its user message committed at (the
    # created event carries both); None for a stateless request.
    conversation_id: str | None = None
    revision: int | None = None
    # Awaited before the client is told the generation ended (its terminal frame, or its JSON
    # answer): a conversation turn waits for the history store to show its answer's revision
    # (edge.history.answer_visible, itself bounded). Until then the terminal frame is held in
    # ``held_terminal`` rather than buffered; None: nothing to wait for.
    before_terminal: Callable[[], Awaitable[Any]] | None = None
    held_terminal: bytes | None = None
    buffer: deque[bytes] = field(default_factory=deque)
    buffered_bytes: int = 0
    next_sequence: int = 1
    last_worker_sequence: int = -1
    overflowed: bool = False
    reader_gone: bool = False
    # Set once this edge's DetachReader for it has been sent (or failed to send): a keyless retry
    # attached to it here re-attaches after that, so the detach cannot be decided after the attach.
    detach_sent: asyncio.Event | None = None
    finalized: GenerationFinalized | None = None
    terminal_status: RequestStatus | None = None
    first_delta_seen: bool = False
    first_token_s: float | None = None  # monotonic time the first text delta was forwarded (edge/outcomes.py)
    closed: bool = False  # ended without a committed terminal state (drain past its deadline)
    result_parts: list[str] = field(default_factory=list)
    result_bytes: int = 0
    result_truncated: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class GenerationView:
    """What this edge knows of a generation it admitted (for GET when the read model is absent)."""

    generation_id: str
    owner: str
    status: RequestStatus
    model_version: str
    input_tokens: int = 0
    output_tokens: int = 0
    code: RejectionCode | None = None
    partial: bool = False
    conversation_id: str | None = None
    revision: int | None = None
    terminal_sequence: int = 0  # the terminal event's id as the processor fixed it (0: after the last delta)
    result_expires_at_ms: int | None = None
    # Completed, and its text not stored yet (the worker holds it for a later write): the content
    # answers 503 result_pending, not 410 result_unavailable (infra.stores.queries).
    result_pending: bool = False


class StreamHub:
    """The stream registry: the generations this edge holds, their buffers and their readers.

    Its collaborators are passed in (``edge.state.Edge`` wires one of each beside it); left out, the
    hub makes its own from ``settings`` (tests): ``background`` runs its cancels and detaches,
    ``prompts`` answers workers' prompt requests, ``retention`` keeps completed results.
    """

    def __init__(
        self,
        settings: EdgeSettings,
        metrics: EdgeMetrics,
        edge_id: str = "",
        *,
        background: BackgroundSends | None = None,
        prompts: PromptPublisher | None = None,
        retention: ResultRetention | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        # This process as a reader (SubmitGeneration.reader_id, DetachReader.reader_id).
        self.edge_id = edge_id
        self.streams: dict[str, GenerationStream] = {}
        self.aggregate_bytes = 0
        self.draining = False
        self.recent: OrderedDict[str, GenerationView] = OrderedDict()
        self.client: Any = None  # infra.runtime.command_client.CommandClient, set by the app at start-up
        self.background = background if background is not None else BackgroundSends()
        self.prompts = prompts if prompts is not None else PromptPublisher(metrics, self.background)
        self.retention = retention if retention is not None else ResultRetention.from_settings(settings)
        self.early: OrderedDict[str, tuple[float, list[Any]]] = OrderedDict()
        # Generation id -> requests of this edge following it besides the one that admitted it (keyless
        # retries the processor attached to it: ``follow``); at most ``streams_max`` generations.
        self.followers: dict[str, int] = {}

    # --- registration -------------------------------------------------------------------------

    def full(self) -> bool:
        return len(self.streams) >= self.settings.streams_max

    def hold(self, stream: GenerationStream) -> None:
        self.streams[stream.generation_id] = stream
        self.metrics.active_streams.set(len(self.streams))
        view = GenerationView(stream.generation_id, stream.user_id, RequestStatus.QUEUED, stream.model_version, stream.input_tokens)
        view.conversation_id, view.revision = stream.conversation_id, stream.revision
        self.remember(view)
        if stream.conversation_id is not None and stream.framer is sse.NATIVE:
            created = sse.created(stream.generation_id, RequestStatus.QUEUED.value, stream.conversation_id, stream.revision)
        else:
            created = stream.framer.created(stream.generation_id, RequestStatus.QUEUED.value)
        self._push(stream, created, bounded=False)
        parked = self.early.pop(stream.generation_id, None)
        if parked is not None:
            for message in parked[1]:
                self.on_message(message)

    def _park(self, generation_id: str, message: Any) -> bool:
        """Keep a message for a generation not held (yet); False if it is known to be over."""
        if generation_id in self.recent:
            return False
        now = time.monotonic()
        while self.early and next(iter(self.early.values()))[0] < now:
            self.early.popitem(last=False)
        entry = self.early.get(generation_id)
        if entry is None:
            if len(self.early) >= EARLY_GENERATIONS_MAX:
                self.early.popitem(last=False)
            entry = (now + EARLY_HOLD_S, [])
            self.early[generation_id] = entry
        if len(entry[1]) < EARLY_MESSAGES_PER_GENERATION_MAX:
            entry[1].append(message)
        return True

    def remember(self, view: GenerationView) -> None:
        self.recent[view.generation_id] = view
        self.recent.move_to_end(view.generation_id)
        while len(self.recent) > self.settings.recent_generations_max:
            self.recent.popitem(last=False)

    def _drop(self, stream: GenerationStream) -> None:
        if self.streams.get(stream.generation_id) is stream:
            del self.streams[stream.generation_id]
        self.aggregate_bytes -= stream.buffered_bytes
        stream.buffered_bytes = 0
        stream.buffer.clear()
        self.metrics.active_streams.set(len(self.streams))
        self.metrics.buffered_bytes.set(self.aggregate_bytes)

    # --- inbox --------------------------------------------------------------------------------

    def on_message(self, message: Any) -> None:
        if isinstance(message, TextDelta):
            self._on_delta(message)
        elif isinstance(message, GenerationFinalized):
            self._on_finalized(message)
        elif isinstance(message, PromptRequest):
            self._on_prompt_request(message)

    def _on_delta(self, d: TextDelta) -> None:
        stream = self.streams.get(d.generation_id)
        if stream is None:
            if not self._park(d.generation_id, d):
                self.metrics.deltas_dropped.labels("no_stream").inc()
            return
        if d.epoch != stream.epoch:
            self.metrics.deltas_dropped.labels("stale_epoch").inc()
            return
        if d.sequence <= stream.last_worker_sequence:
            self.metrics.deltas_dropped.labels("duplicate").inc()
            return
        stream.last_worker_sequence = d.sequence
        if stream.finalized is not None or stream.overflowed or stream.reader_gone:
            self.metrics.deltas_dropped.labels("not_forwarded").inc()
            if stream.reader_gone and stream.finalized is None and not stream.overflowed:
                # No frame for a reader that left, but the text is still collected (bounded as
                # ever): a retry attached to the generation here answers with all of it, and the
                # retained result is whole.
                view = self.recent.get(stream.generation_id)
                if view is not None and view.status is RequestStatus.QUEUED:
                    view.status = RequestStatus.RUNNING
                self._collect(stream, d.text)
            return
        if not stream.first_delta_seen:
            stream.first_delta_seen = True
            # A worker streams only after its acceptance committed: the generation is running.
            view = self.recent.get(stream.generation_id)
            if view is not None and view.status is RequestStatus.QUEUED:
                view.status = RequestStatus.RUNNING
            now = time.monotonic()
            stream.first_token_s = now
            self.metrics.first_token.observe(now - stream.received_s)
            self.metrics.queue_age.observe(now - stream.admitted_s)
        self._collect(stream, d.text)
        if stream.streaming:
            # The worker's sequence is the event id, so a stream resumed on any edge replays the same ids.
            frame = stream.framer.delta(stream.generation_id, d.sequence, d.index, d.text)
            limit = self._over_limit(stream, len(frame))
            if limit is not None:
                self._slow_consumer(stream, limit)
                return
            stream.next_sequence = d.sequence + 1
            self._push(stream, frame, bounded=True)

    def _collect(self, stream: GenerationStream, text: str) -> None:
        """The bounded result buffer (non-streaming answer, and the retained result of a stream)."""
        if stream.result_truncated:
            return
        size = len(text.encode())
        over = None
        if stream.result_bytes + size > self.settings.result_bytes_max:
            over = "result_bytes"
        elif len(stream.result_parts) >= stream.max_output_tokens:
            over = "result_tokens"
        if over is not None:
            stream.result_truncated = True
            if not stream.streaming:
                self._slow_consumer(stream, over)
            return
        stream.result_parts.append(text)
        stream.result_bytes += size

    def _over_limit(self, stream: GenerationStream, size: int) -> str | None:
        if stream.buffered_bytes + size > self.settings.stream_buffer_bytes_max:
            return "stream_bytes"
        if self.aggregate_bytes + size > self.settings.aggregate_buffer_bytes_max:
            return "aggregate_bytes"
        return None

    def _push(self, stream: GenerationStream, frame: bytes, bounded: bool) -> None:
        stream.buffer.append(frame)
        stream.buffered_bytes += len(frame)
        self.aggregate_bytes += len(frame)
        self.metrics.buffered_bytes.set(self.aggregate_bytes)
        stream.wake.set()

    def _slow_consumer(self, stream: GenerationStream, limit: str) -> None:
        stream.overflowed = True
        self.metrics.slow_consumer_cancels.labels(limit).inc()
        log.info("slow consumer: cancelling generation_id=%s limit=%s", stream.generation_id, limit)
        self.cancel(stream, CancelReason.SLOW_CONSUMER)

    def _on_finalized(self, f: GenerationFinalized) -> None:
        view = self.recent.get(f.generation_id)
        if view is not None:
            view.status, view.code, view.partial = f.status, f.code, f.partial
            view.input_tokens, view.output_tokens = f.input_tokens, f.output_tokens
            view.terminal_sequence = f.sequence
        stream = self.streams.get(f.generation_id)
        if stream is None:
            if view is None:
                self._park(f.generation_id, f)
            return
        if stream.finalized is not None:
            return
        if f.epoch != stream.epoch:
            return
        stream.finalized = f
        status, code = f.status, f.code
        if status is RequestStatus.ADMISSION_RETRYABLE:
            # Declined before it started (no worker took it in time): retryable with the same key.
            status, code = RequestStatus.FAILED, RejectionCode.CAPACITY_EXHAUSTED
        stream.terminal_status = status
        # Deltas after the reader left are collected too, so the text is whole unless truncated (then
        # the result store has it; this edge's memory must not answer with a truncated copy).
        if status is RequestStatus.COMPLETED and not stream.result_truncated:
            self.retention.retain(stream.generation_id, "".join(stream.result_parts))
        self.metrics.terminal_events.labels(status.value).inc()
        if stream.streaming:
            # The processor fixed the terminal event's id with the terminal state (0: after the last delta).
            sequence = f.sequence or max(stream.next_sequence, stream.last_worker_sequence + 1)
            if stream.conversation_id is not None and stream.revision is not None and stream.framer is sse.NATIVE:
                # Every turn's answer commits at the revision after the turn's own (completed or
                # incomplete): the revision the conversation's next turn must send.
                frame = sse.terminal(
                    stream.generation_id, sequence, status, code, f.partial, f.input_tokens, f.output_tokens,
                    stream.conversation_id, stream.revision + 1,
                )
            else:
                frame = stream.framer.terminal(
                    stream.generation_id, sequence, status, code, f.partial, f.input_tokens, f.output_tokens
                )
            stream.next_sequence = sequence + 1
            if stream.before_terminal is not None:
                stream.held_terminal = frame  # written by frames() once before_terminal has returned
            else:
                self._push(stream, frame, bounded=False)
        stream.done.set()
        stream.wake.set()
        if stream.reader_gone:
            self._drop(stream)

    def _on_prompt_request(self, r: PromptRequest) -> None:
        stream = self.streams.get(r.generation_id)
        if stream is None and self._park(r.generation_id, r):
            return
        found = stream is not None and stream.epoch == r.epoch and stream.finalized is None and not stream.overflowed
        self.prompts.answer(r, stream.messages if found and stream is not None else None)

    # --- control ------------------------------------------------------------------------------

    def cancel(self, stream: GenerationStream, reason: CancelReason) -> None:
        self.background.spawn(self.send_cancel(stream.user_id, stream.generation_id, reason))

    async def send_cancel(self, user_id: str, generation_id: str, reason: CancelReason) -> None:
        command = CancelGeneration(
            command_id=uuid.uuid4().hex,
            user_id=user_id,
            issued_at_ms=int(time.time() * 1000),
            generation_id=generation_id,
            reason=reason,
        )
        await self.client.send(command)

    def release(self, stream: GenerationStream) -> None:
        """The reader is gone (disconnect or response written). Detach the generation if still running."""
        if stream.reader_gone:
            return
        stream.reader_gone = True
        self.aggregate_bytes -= stream.buffered_bytes
        stream.buffered_bytes = 0
        stream.buffer.clear()
        self.metrics.buffered_bytes.set(self.aggregate_bytes)
        if stream.finalized is not None:
            self._drop(stream)
            return
        if self.followers.get(stream.generation_id):
            # Another request of this edge reads it (a retry attached to it): the edge is still its
            # reader. The stream stays held, collecting text, until its end or the last follower goes.
            return
        stream.detach_sent = asyncio.Event()  # before the task runs: a follower arriving now waits for it
        self.background.spawn(self._detach(stream))

    # --- followers ----------------------------------------------------------------------------

    def follow(self, generation_id: str, user_id: str) -> bool:
        """A request of this edge follows ``generation_id``, which the processor attached it to (a
        keyless retry of the request that admitted it); False when ``streams_max`` generations are
        followed already. While one follows, this edge does not detach the generation.

        If this edge already sent (or is sending) a detach for it, its first try's client having
        gone, a ``AttachReader`` follows that detach: the attach decided with the retry's admission
        may have been read before it, and the detach must not cancel what the retry reads.
        """
        if generation_id not in self.followers and len(self.followers) >= self.settings.streams_max:
            return False
        self.followers[generation_id] = self.followers.get(generation_id, 0) + 1
        stream = self.streams.get(generation_id)
        if stream is not None and stream.detach_sent is not None and stream.finalized is None:
            self.background.spawn(self._reattach_after(stream.detach_sent, generation_id, user_id))
        return True

    def unfollow(self, generation_id: str, user_id: str, ended: bool) -> None:
        """A follower's response ended; the last one to leave a generation that has not ended detaches
        it, exactly as the reader that admitted it would have."""
        left = self.followers.get(generation_id, 0) - 1
        if left > 0:
            self.followers[generation_id] = left
            return
        self.followers.pop(generation_id, None)
        if ended:
            return
        stream = self.streams.get(generation_id)
        if stream is None:
            self.background.spawn(self._send_detach(user_id, generation_id))
        elif stream.reader_gone and stream.detach_sent is None and stream.finalized is None:
            stream.detach_sent = asyncio.Event()
            self.background.spawn(self._detach(stream))

    async def _reattach_after(self, detach_sent: asyncio.Event, generation_id: str, user_id: str) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.decision_timeout_s):
                await detach_sent.wait()
        command = AttachReader(
            command_id=uuid.uuid4().hex,
            user_id=user_id,
            issued_at_ms=int(time.time() * 1000),
            generation_id=generation_id,
            reader_id=self.edge_id,
        )
        await self.client.send(command)

    async def _send_detach(self, user_id: str, generation_id: str) -> None:
        grace_s = self.settings.disconnect_grace_s
        self.metrics.readers_detached.inc()
        command = DetachReader(
            command_id=uuid.uuid4().hex,
            user_id=user_id,
            issued_at_ms=int(time.time() * 1000),
            generation_id=generation_id,
            reader_id=self.edge_id,
            grace_ms=int(grace_s * 1000),
            reason=CancelReason.CLIENT_DISCONNECT,
        )
        await self.client.send(command)

    async def _detach(self, stream: GenerationStream) -> None:
        """Tell the processor the reader is gone, then hold the stream until its terminal state (the
        processor's timer cancels it at the end of the grace unless a reader attaches again)."""
        grace_s = self.settings.disconnect_grace_s
        self.metrics.readers_detached.inc()
        log.debug("client gone: detaching generation_id=%s", stream.generation_id)
        command = DetachReader(
            command_id=uuid.uuid4().hex,
            user_id=stream.user_id,
            issued_at_ms=int(time.time() * 1000),
            generation_id=stream.generation_id,
            reader_id=self.edge_id,
            grace_ms=int(grace_s * 1000),
            reason=CancelReason.CLIENT_DISCONNECT,
        )
        sent = stream.detach_sent = stream.detach_sent or asyncio.Event()
        try:
            try:
                await self.client.send(command)
            finally:
                sent.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s + self.settings.generation_wait_s_max):
                    await stream.done.wait()
        finally:
            self._drop(stream)

    # --- writer -------------------------------------------------------------------------------

    async def frames(self, stream: GenerationStream) -> AsyncIterator[bytes]:
        """Frames for one SSE response: buffered events as they come, heartbeats while idle."""
        deadline = time.monotonic() + self.settings.generation_wait_s_max
        try:
            while True:
                if stream.buffer:
                    # Everything buffered goes out as one write: one ASGI send, one chunk, one
                    # syscall for a burst of deltas instead of one per delta.
                    batch = b"".join(stream.buffer)
                    stream.buffer.clear()
                    stream.buffered_bytes -= len(batch)
                    self.aggregate_bytes -= len(batch)
                    yield batch
                self.metrics.buffered_bytes.set(self.aggregate_bytes)
                if stream.finalized is not None or stream.closed:
                    if stream.held_terminal is not None and stream.before_terminal is not None:
                        held, stream.held_terminal = stream.held_terminal, None
                        await stream.before_terminal()
                        yield held
                    return
                stream.wake.clear()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # Past every deadline the workers and processor enforce: end with EOF
                    # (interrupted output) rather than hold the socket forever.
                    self.cancel(stream, CancelReason.CLIENT_DISCONNECT)
                    return
                try:
                    # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancellation (the
                    # client went away) that arrives as the wake-up does.
                    async with asyncio.timeout(min(self.settings.heartbeat_interval_s, remaining)):
                        await stream.wake.wait()
                except TimeoutError:
                    yield sse.HEARTBEAT
        finally:
            self.release(stream)

    async def wait_done(self, stream: GenerationStream, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await stream.done.wait()
        except TimeoutError:
            return False
        return True

    # --- drain --------------------------------------------------------------------------------

    async def drain(self, deadline_s: float, cancel_wait_s: float) -> dict[str, int]:
        """Refuse new streams, let held ones finish until the deadline, then cancel the rest."""
        self.draining = True
        self.metrics.draining.set(1)
        end = time.monotonic() + deadline_s
        while self.streams and time.monotonic() < end:
            await asyncio.sleep(0.05)
        remaining = [s for s in self.streams.values() if s.finalized is None]
        for s in remaining:
            self.cancel(s, CancelReason.DRAIN)
        end = time.monotonic() + cancel_wait_s
        while any(s.finalized is None for s in remaining) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        unresolved = [s for s in remaining if s.finalized is None]
        for s in unresolved:
            # No committed terminal state arrived in time: end the stream with EOF (interrupted).
            s.closed = True
            s.done.set()
            s.wake.set()
        # Give writers a moment to flush their terminal frames.
        end = time.monotonic() + 1.0
        while any(not s.reader_gone for s in self.streams.values()) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        await self.flush_background()
        return {"cancelled": len(remaining), "unresolved": len(unresolved)}

    async def flush_background(self, timeout_s: float = 5.0) -> None:
        await self.background.flush(timeout_s)
