"""A keyless retry the processor attached to an earlier try's generation follows it to its end.

Where this sits: ``POST /v1/chat/completions`` without an ``Idempotency-Key`` sends its submit with
``RetryAttach`` (``retry`` when the official client marks the try as its retry). When the processor
answers ``attached`` with a generation still queued or running, no new stream is held: this module
follows that generation instead and answers the try in the form it asked for (docs/edge.md,
"Retries without a key")::

    the stream this edge holds for it (the first try's, its text collected even after that client
    left: edge/streams.py)  --polled every FOLLOW_POLL_S-->  deltas (stream) / the settled answer
    or, when another edge admitted it: edge.lookup + edge.result (the read side), every
    FOLLOW_LOOKUP_POLL_S, the text at the end

While a follower reads it, this edge does not detach the generation; the last follower to leave
before its end detaches it, as any reader does (``StreamHub.follow`` / ``unfollow``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from edge import sse
from edge.errors import ApiError
from edge.streams import GenerationStream, GenerationView, StreamHub
from schemas.codes import RejectionCode, RequestStatus

# How often a follower looks at the stream this edge holds (in-process: cheap), and at the read side
# for a generation another edge admitted (a read-model query each time).
FOLLOW_POLL_S = 0.05
FOLLOW_LOOKUP_POLL_S = 0.25
# A generation neither this edge nor the read side shows within this is not followable from here
# (the read model is off or behind): 503 store_unavailable, retryable.
FOLLOW_LOOKUP_WAIT_S = 2.0
# How often a non-streaming follower checks that its client is still there.
FOLLOW_DISCONNECT_POLL_S = 1.0
_ACTIVE = (RequestStatus.QUEUED, RequestStatus.RUNNING)


class FollowerGone(Exception):
    """The client of a non-streaming follower disconnected while it waited."""


class Follower:
    """One request following ``generation_id`` (registered with the hub by ``open``)."""

    def __init__(self, edge: Any, user_id: str, generation_id: str) -> None:
        self.edge, self.user_id, self.generation_id = edge, user_id, generation_id
        self.hub: StreamHub = edge.hub
        self.stream: GenerationStream | None = None
        self.view: GenerationView | None = None
        self.ended = False
        self.opened = False
        self._started_s = time.monotonic()
        self.deadline_s = self._started_s + edge.settings.generation_wait_s_max

    def open(self) -> None:
        if not self.hub.follow(self.generation_id, self.user_id):
            raise ApiError(RejectionCode.CAPACITY_EXHAUSTED, retry_after_s=1)
        self.opened = True

    def close(self) -> None:
        if self.opened:
            self.opened = False
            self.hub.unfollow(self.generation_id, self.user_id, ended=self.ended)

    async def step(self) -> None:
        """Wait a little for progress; ``ended`` once the generation's end is known here."""
        if self.stream is None:
            self.stream = self.hub.streams.get(self.generation_id)
        stream = self.stream
        if stream is not None:
            await self.hub.wait_done(stream, FOLLOW_POLL_S)
            self.ended = stream.done.is_set() or stream.closed
            return
        view = await self.edge.lookup(self.generation_id, self.user_id)
        if view is not None and view.status not in _ACTIVE:
            self.view, self.ended = view, True
            return
        if view is None and time.monotonic() - self._started_s > FOLLOW_LOOKUP_WAIT_S:
            raise ApiError(RejectionCode.STORE_UNAVAILABLE, retry_after_s=1, extra={"generation_id": self.generation_id})
        await asyncio.sleep(FOLLOW_LOOKUP_POLL_S)

    def text_so_far(self) -> str:
        stream = self.stream
        return "" if stream is None or stream.result_truncated else "".join(stream.result_parts)

    async def settled(self) -> tuple[GenerationView, str | None]:
        """The ended generation's state and, when it completed, its whole text (None past retention)."""
        gid, stream = self.generation_id, self.stream
        if stream is not None:
            f = stream.finalized
            if f is None:  # drained past its deadline without a committed terminal state
                raise ApiError(RejectionCode.GENERATION_TIMEOUT, extra={"generation_id": gid})
            status = stream.terminal_status or f.status
            code = f.code
            if f.status is RequestStatus.ADMISSION_RETRYABLE:
                status, code = RequestStatus.FAILED, RejectionCode.CAPACITY_EXHAUSTED
            view = GenerationView(gid, self.user_id, status, stream.model_version, f.input_tokens, f.output_tokens, code, f.partial)
            text = None if stream.result_truncated else "".join(stream.result_parts)
        else:
            assert self.view is not None
            view, text = self.view, None
            if view.status is RequestStatus.ADMISSION_RETRYABLE:
                view.status, view.code = RequestStatus.FAILED, RejectionCode.CAPACITY_EXHAUSTED
        if view.status is not RequestStatus.COMPLETED:
            return view, None
        if text is None:
            text = await self.edge.result(gid, self.user_id)
        return view, text

    async def wait(self, request: Any) -> None:
        """Non-streaming: until the end (``GENERATION_TIMEOUT`` past the edge's wait bound)."""
        next_check_s = time.monotonic() + FOLLOW_DISCONNECT_POLL_S
        while not self.ended:
            if time.monotonic() >= self.deadline_s:
                raise ApiError(RejectionCode.GENERATION_TIMEOUT, extra={"generation_id": self.generation_id})
            await self.step()
            if not self.ended and time.monotonic() >= next_check_s:
                next_check_s = time.monotonic() + FOLLOW_DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise FollowerGone()

    async def frames(self, framer: sse.Framer, status: RequestStatus) -> AsyncIterator[bytes]:
        """Streaming: the created event, the text as it comes, the terminal event; EOF (interrupted)
        past the edge's wait bound. Ids count this response's own events."""
        gid = self.generation_id
        heartbeat_s = self.edge.settings.heartbeat_interval_s
        yield framer.created(gid, status.value)
        sequence, sent_chars, quiet_since_s = 0, 0, time.monotonic()
        while not self.ended:
            if time.monotonic() >= self.deadline_s:
                return
            await self.step()
            text = self.text_so_far()
            if len(text) > sent_chars:
                sequence += 1
                yield framer.delta(gid, sequence, 0, text[sent_chars:])
                sent_chars, quiet_since_s = len(text), time.monotonic()
            elif time.monotonic() - quiet_since_s >= heartbeat_s:
                yield sse.HEARTBEAT
                quiet_since_s = time.monotonic()
        try:
            view, text = await self.settled()
        except ApiError as err:
            yield framer.terminal(gid, sequence + 1, RequestStatus.FAILED, err.code, sent_chars > 0, 0, 0)
            return
        if view.status is RequestStatus.COMPLETED and text is None:
            yield framer.terminal(gid, sequence + 1, RequestStatus.FAILED, RejectionCode.RESULT_UNAVAILABLE, sent_chars > 0, 0, 0)
            return
        if text is not None and len(text) > sent_chars:
            sequence += 1
            yield framer.delta(gid, sequence, 0, text[sent_chars:])
        yield framer.terminal(
            gid, sequence + 1, view.status, view.code, view.partial, view.input_tokens, view.output_tokens
        )
