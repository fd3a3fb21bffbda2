"""Resumable streams: ``GET /v1/generations/{id}/events`` replays a generation from durable state, on any
edge replica, then follows it live to its terminal event (docs/edge.md, "Resumable streams").

Data flow::

    worker --delta, stored BEFORE it is sent--> generation_events (infra/stores/replay.py)
    processor --terminal state + its sequence--> ledger --> generations_by_id.terminal_sequence
    client --GET .../events, Last-Event-ID: N--> any edge:
        reader task: generation_events after N (pages of REPLAY_PAGE), then polled every
                     REPLAY_POLL_S with the read model's status, until the terminal state
        -> bounded buffer (the stream buffer's byte ceiling) -> the SSE response (id: <sequence>)

Ids and the seam: a delta's id is the worker's sequence (also the live stream's id), and the
terminal event's id is the one the processor fixed with the terminal state, so every replica
replays the same ids. Deltas are stored before they are sent, so the store holds every delta a
client was sent: a client that reconnects with the last id it saw gets every later event once, in
order. A reader that does not keep up (its buffer passes ``stream_buffer_bytes_max``) is cut off
(EOF, counted); the generation goes on, and the client can resume from its last id.

Readers: opening the stream attaches this edge as the generation's reader (withdrawing a pending
cancel of a detached generation, within the disconnect grace), and closing it detaches it, exactly
like a live stream; a ``background`` generation has no reader and is never cancelled by either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from edge import sse
from edge.errors import ApiError
from edge.history import answer_visible
from infra.stores.replay import ReplayStore
from infra.stores.session import CassandraSession
from schemas.codes import CancelReason, RejectionCode, RequestStatus
from schemas.commands import AttachReader, DetachReader

log = logging.getLogger("chatplane.edge.replay")

REPLAY_PAGE = 256  # deltas read per store call
REPLAY_POLL_S = 0.1  # how often a follower reads the store and the read model for what is new
REPLAY_LOOKUP_WAIT_S = 2.0  # a generation with stored deltas the read model does not show yet is waited for
REPLAY_DRAIN_WAIT_S = 2.0  # a full buffer not taken by the socket within this: the reader is cut off
_TERMINAL = (RequestStatus.COMPLETED, RequestStatus.CANCELLED, RequestStatus.FAILED, RequestStatus.REJECTED)


class ReplayAccess:
    """The edge's ``ReplayStore``, built on the process's shared session on first use; failures are the
    read model's 503."""

    def __init__(self, cassandra: CassandraSession) -> None:
        self._cassandra = cassandra
        self._store: ReplayStore | None = None

    async def store(self) -> ReplayStore:
        if self._store is None:
            try:
                self._store = await self._cassandra.store(ReplayStore)
            except Exception:  # noqa: BLE001 - unavailable (logged by the session), retried later
                raise ApiError(RejectionCode.STORE_UNAVAILABLE, retry_after_s=2) from None
        return self._store

    async def has_deltas(self, generation_id: str) -> bool:
        store = await self.store()
        return bool(await store.read_after(generation_id, 0, 1))

    async def text_so_far(self, generation_id: str, before_seq: int | None = None) -> str:
        """The stored text of a running generation, or of one that ended partway (cancelled, failed),
        which GET shows with ``partial: true``: the deltas below ``before_seq`` (its terminal event's
        sequence, as a replay ends there), all of them when None."""
        store = await self.store()
        parts: list[str] = []
        after = 0
        while True:
            rows = await store.read_after(generation_id, after, REPLAY_PAGE)
            for r in rows:
                if before_seq is not None and r.seq >= before_seq:
                    return "".join(parts)
                parts.append(r.text)
            if len(rows) < REPLAY_PAGE:
                return "".join(parts)
            after = rows[-1].seq


def resume_point(last_event_id: str | None, after: int | None) -> int:
    """The sequence to replay after: ``Last-Event-ID``, else ``?after=``; -1 (from the start, the
    created event included) when neither is given.

    The header wins: a browser's EventSource reconnects to the same URL (``?after=`` included, as
    first opened) and adds ``Last-Event-ID`` with the last id it received, so the header is always
    the newer position of the two."""
    if last_event_id is not None and last_event_id != "":
        if not last_event_id.isdigit() or len(last_event_id) > 9:
            raise ApiError(RejectionCode.INVALID_REQUEST, field="Last-Event-ID")
        return int(last_event_id)
    if after is not None:
        return after
    return -1


class Replay:
    """One events response: a reader task fills a bounded buffer, ``frames`` writes it out."""

    def __init__(self, edge: Any, user_id: str, view: Any, after: int) -> None:
        self.edge, self.user_id, self.view, self.after = edge, user_id, view, after
        self.settings = edge.settings
        self.buffer: deque[bytes] = deque()
        self.buffered = 0
        self.cut_off = False
        self.finished = False
        self.wake = asyncio.Event()
        self.drained = asyncio.Event()

    async def _push(self, frame: bytes) -> bool:
        """Buffer one frame; at the ceiling wait (``REPLAY_DRAIN_WAIT_S``) for the socket to take the
        buffer, and cut the reader off if it does not: a replay reads the store far faster than any
        socket, so the ceiling alone would cut off fast readers too."""
        if self.buffered + len(frame) > self.settings.stream_buffer_bytes_max:
            self.drained.clear()
            try:
                async with asyncio.timeout(REPLAY_DRAIN_WAIT_S):
                    while self.buffered + len(frame) > self.settings.stream_buffer_bytes_max:
                        await self.drained.wait()
                        self.drained.clear()
            except TimeoutError:
                self.cut_off = True
                self.edge.metrics.slow_consumer_cancels.labels("replay_bytes").inc()
                self.wake.set()
                return False
        self.buffer.append(frame)
        self.buffered += len(frame)
        self.wake.set()
        return True

    async def _read(self) -> None:
        """Store, then read model, polled until the terminal state is committed and written out."""
        edge, gid = self.edge, self.view.generation_id
        store = await edge.replay.store()
        last = self.after
        view = self.view
        if last < 0:
            # As the first stream's created event: a turn's names its conversation and revision.
            if not await self._push(sse.created(gid, RequestStatus.QUEUED.value, view.conversation_id, view.revision)):
                return
            last = 0
        while True:
            terminal = view.status in _TERMINAL
            final = (view.terminal_sequence or 0) if terminal else 0
            while True:
                rows = await store.read_after(gid, last, REPLAY_PAGE)
                for r in rows:
                    if final and r.seq >= final:
                        break
                    if not await self._push(sse.delta(gid, r.seq, 0, r.text)):
                        return
                    last = r.seq
                if len(rows) < REPLAY_PAGE:
                    break
            if terminal:
                status, code = view.status, view.code
                if status is RequestStatus.REJECTED:
                    status = RequestStatus.FAILED
                # A conversation turn's end names the next turn's revision: this edge's memory of a
                # turn it admitted, else the read model's row (or the processor's answer to a retry).
                turn_known = view.conversation_id is not None and view.revision is not None
                if turn_known:
                    # Read-your-writes, as on the stream that admitted it: its end is told once the
                    # history store shows the answer's revision (bounded; counted when not).
                    await answer_visible(edge.history, edge.metrics, view.conversation_id, view.revision + 1)
                frame = sse.terminal(
                    gid, final or last + 1, status, code, view.partial, view.input_tokens, view.output_tokens,
                    view.conversation_id if turn_known else None, view.revision + 1 if turn_known else None,
                )
                if not await self._push(frame):
                    return
                self.finished = True
                self.wake.set()
                return
            await asyncio.sleep(REPLAY_POLL_S)
            fresh = await edge.lookup(gid, self.user_id)
            if fresh is not None:
                if fresh.conversation_id is None:
                    # A row projected before it recorded turns: keep the turn the first view named.
                    fresh.conversation_id, fresh.revision = view.conversation_id, view.revision
                view = fresh

    async def frames(self) -> AsyncIterator[bytes]:
        edge = self.edge
        reader = asyncio.create_task(self._read())
        attached = self.view.status.active
        if attached:
            edge.background.spawn(edge.client.send(self._reader_command(AttachReader)))
        deadline = time.monotonic() + self.settings.generation_wait_s_max
        try:
            while True:
                if self.buffer:
                    batch = b"".join(self.buffer)
                    self.buffer.clear()
                    yield batch  # blocks while the socket does not take it (a slow reader)
                    self.buffered -= len(batch)
                    self.drained.set()
                if self.cut_off or (self.finished and not self.buffer):
                    return
                if self.buffer:
                    continue  # pushed while the last batch was being written
                if reader.done():
                    exc = reader.exception()
                    if exc is not None:
                        log.warning("replay of %s ended: %s", self.view.generation_id, type(exc).__name__)
                    return  # EOF: interrupted; the client resumes from its last id
                self.wake.clear()
                if time.monotonic() >= deadline:
                    return
                try:
                    async with asyncio.timeout(self.settings.heartbeat_interval_s):
                        await self.wake.wait()
                except TimeoutError:
                    yield sse.HEARTBEAT
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            if attached and not self.finished:
                edge.background.spawn(edge.client.send(self._reader_command(DetachReader)))

    def _reader_command(self, cls: type) -> Any:
        fields: dict[str, Any] = dict(
            command_id=uuid.uuid4().hex,
            user_id=self.user_id,
            issued_at_ms=int(time.time() * 1000),
            generation_id=self.view.generation_id,
            reader_id=self.edge.edge_id,
        )
        if cls is DetachReader:
            fields.update(grace_ms=int(self.settings.disconnect_grace_s * 1000), reason=CancelReason.CLIENT_DISCONNECT)
        return cls(**fields)
