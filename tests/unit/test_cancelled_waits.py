"""A bounded wait that is cancelled in the loop turn its answer arrives must still be cancelled.

Python 3.11's ``asyncio.wait_for`` returns the answer and drops such a cancellation, so a caller
that was told to stop (a request handler at shutdown, an SSE writer whose client left) goes on.
Each wait below is cancelled right after its answer is set; each must raise ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from edge.metrics import EdgeMetrics
from edge.settings import EdgeSettings
from edge.streams import GenerationStream, StreamHub
from infra.runtime.command_client import CommandClient
from schemas.codes import CancelReason, Tier
from schemas.commands import CancelGeneration
from schemas.messages import Outcome, OutcomeKind
from schemas.topics import Topology


class _InstantProducer:
    """Stands in for the producer: accepts every send at once (the decision then comes from the test)."""

    async def send_and_wait(self, topic, value, key=None, partition=None, headers=None):
        return None


async def _until(predicate, turns: int = 20) -> None:
    for _ in range(turns):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the waiter never started waiting")


async def test_command_client_decide_cancelled_as_its_decision_arrives_raises_cancelled():
    client = CommandClient("unused:9092", Topology(f"t{uuid.uuid4().hex[:6]}"), inbox_partition=0)
    client._producer = _InstantProducer()  # type: ignore[assignment]
    command = CancelGeneration(command_id=uuid.uuid4().hex, user_id="u", issued_at_ms=0, generation_id="gen_x",
                               reason=CancelReason.USER, reply_to=client.reply_to())
    task = asyncio.create_task(client.decide(command, timeout_s=30))
    await _until(lambda: command.command_id in client._pending)
    client._pending[command.command_id].set_result(Outcome(command_id=command.command_id, kind=OutcomeKind.APPLIED))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):  # a writer that dropped the cancellation would run on: fail, not hang
            await task
    assert command.command_id not in client._pending


def _stream() -> GenerationStream:
    now = time.monotonic()
    return GenerationStream(generation_id="gen_x", user_id="u", tier=Tier.FREE, epoch=1, streaming=True,
                            messages=(), input_tokens=1, model_version="m", received_s=now, admitted_s=now)


async def test_stream_wait_done_cancelled_as_the_stream_ends_raises_cancelled():
    hub = StreamHub(EdgeSettings(capacity_check=False, read_model=False), EdgeMetrics())
    stream = _stream()
    task = asyncio.create_task(hub.wait_done(stream, 30))
    await _until(lambda: bool(stream.done._waiters))
    stream.done.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):  # a writer that dropped the cancellation would run on: fail, not hang
            await task


async def test_sse_writer_cancelled_as_it_is_woken_stops_and_releases_the_stream():
    hub = StreamHub(EdgeSettings(capacity_check=False, read_model=False), EdgeMetrics())
    stream = _stream()
    frames = hub.frames(stream)

    async def pump() -> list[bytes]:
        return [frame async for frame in frames]

    task = asyncio.create_task(pump())
    await _until(lambda: bool(stream.wake._waiters))
    stream.buffer.append(b"data: x\n\n")
    stream.wake.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):  # a writer that dropped the cancellation would run on: fail, not hang
            await task
    assert stream.reader_gone
