"""The edge's side of a keyless retry attached to its first try's generation (edge/streams.py,
edge/followers.py, edge/routes/openai.py): the reader commands this edge sends, in the order the
processor must read them, and the text a follower answers with.

The processor's side (which generation a retry attaches to) is tests/unit/test_retry_attach.py; the
whole path with the official client is tests/integration/test_openai_retries.py.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from edge.followers import Follower
from edge.metrics import EdgeMetrics
from edge.routes.openai import retry_attach_of
from edge.settings import EdgeSettings
from edge.streams import GenerationStream, StreamHub
from schemas.codes import RequestStatus, RetryAttach, Tier
from schemas.commands import AttachReader, DetachReader
from schemas.messages import GenerationFinalized, TextDelta

GID, USER, EDGE = "gen_followed000000000", "u-1", "edge-1"


class RecordingClient:
    """Stands in for the command client: records what the hub sends (the processor is not ours here)."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, command: object) -> None:
        await asyncio.sleep(0)  # a send yields, as a real one does
        self.sent.append(command)


def hub_and_stream(streaming: bool = False) -> tuple[StreamHub, RecordingClient, GenerationStream]:
    hub = StreamHub(EdgeSettings(capacity_check=False, read_model=False, disconnect_grace_s=5.0), EdgeMetrics(), EDGE)
    client = RecordingClient()
    hub.client = client
    now = time.monotonic()
    stream = GenerationStream(generation_id=GID, user_id=USER, tier=Tier.FREE, epoch=1, streaming=streaming,
                              messages=(), input_tokens=3, model_version="m", received_s=now, admitted_s=now)
    hub.hold(stream)
    return hub, client, stream


def delta(sequence: int, text: str) -> TextDelta:
    return TextDelta(generation_id=GID, epoch=1, sequence=sequence, index=0, text=text)


def completed() -> GenerationFinalized:
    return GenerationFinalized(event_id="c1/0", generation_id=GID, user_id=USER, epoch=1, status=RequestStatus.COMPLETED,
                               code=None, partial=False, input_tokens=3, output_tokens=2)


def kinds(client: RecordingClient) -> list[str]:
    return [type(c).__name__ for c in client.sent]


async def test_a_follower_arriving_after_the_first_tries_detach_reattaches_after_it():
    hub, client, stream = hub_and_stream()
    hub.release(stream)  # the first try's client gave up: a detach is on its way
    assert hub.follow(GID, USER)
    for _ in range(20):
        await asyncio.sleep(0)
    assert kinds(client) == ["DetachReader", "AttachReader"], "the attach must be read after the detach"
    assert client.sent[1].reader_id == EDGE and client.sent[1].generation_id == GID
    assert isinstance(client.sent[1], AttachReader)


async def test_no_detach_while_a_follower_reads_and_the_last_one_out_detaches():
    hub, client, stream = hub_and_stream()
    assert hub.follow(GID, USER)
    hub.release(stream)  # the first try's client left after the retry attached
    await hub.flush_background()
    assert kinds(client) == [], "the edge is still the generation's reader"
    hub.unfollow(GID, USER, ended=False)
    await asyncio.sleep(0.05)
    assert kinds(client) == ["DetachReader"] and isinstance(client.sent[0], DetachReader)
    hub.on_message(completed())  # lets the held stream go
    await hub.flush_background()
    assert hub.followers == {} and GID not in hub.streams


async def test_text_after_the_first_tries_reader_left_is_collected_for_the_follower():
    hub, _client, stream = hub_and_stream(streaming=True)
    hub.on_message(delta(1, "Red, "))
    assert hub.follow(GID, USER)
    hub.release(stream)
    hub.on_message(delta(2, "green."))
    hub.on_message(completed())
    follower = Follower(SimpleNamespace(hub=hub, settings=hub.settings), USER, GID)
    follower.stream = stream
    await follower.step()
    assert follower.ended
    view, text = await follower.settled()
    assert view.status is RequestStatus.COMPLETED and text == "Red, green."
    assert hub.retention.result_of(GID) == "Red, green.", "the whole text is retained for a later retry or GET"
    hub.unfollow(GID, USER, ended=True)
    await hub.flush_background()


async def test_a_stream_follower_sends_the_text_so_far_then_the_rest_then_the_end():
    hub, _client, stream = hub_and_stream()
    hub.on_message(delta(1, "Red, "))
    follower = Follower(SimpleNamespace(hub=hub, settings=hub.settings), USER, GID)
    assert hub.follow(GID, USER)
    frames = follower.frames(_Framer(), RequestStatus.RUNNING)
    assert await anext(frames) == b"created"
    assert await anext(frames) == b"delta 1 Red, "
    hub.on_message(delta(2, "green."))
    assert await anext(frames) == b"delta 2 green."
    hub.on_message(completed())
    assert [f async for f in frames] == [b"terminal 3 completed"]


class _Framer:
    def created(self, generation_id: str, status: str) -> bytes:
        return b"created"

    def delta(self, generation_id: str, sequence: int, index: int, text: str) -> bytes:
        return f"delta {sequence} {text}".encode()

    def terminal(self, generation_id, sequence, status, code, partial, input_tokens, output_tokens) -> bytes:
        return f"terminal {sequence} {status.value}".encode()


def test_only_a_keyless_try_marked_as_a_retry_may_attach():
    assert retry_attach_of("my-key", {"x-stainless-retry-count": "1"}) is RetryAttach.OFF
    assert retry_attach_of(None, {}) is RetryAttach.ORIGINAL
    assert retry_attach_of(None, {"x-stainless-retry-count": "0"}) is RetryAttach.ORIGINAL
    assert retry_attach_of(None, {"x-stainless-retry-count": "2"}) is RetryAttach.RETRY
    # Untrusted text: anything but a short run of ASCII digits is a first try, never a retry.
    for odd in ("-1", "1.0", "²", "99999", " 1", "one"):
        assert retry_attach_of(None, {"x-stainless-retry-count": odd}) is RetryAttach.ORIGINAL, odd
