"""The worker's buffer of published prompts (workers/prompts.py): bounded by count, bytes and age."""

from __future__ import annotations

import asyncio
import time

from schemas.messages import ChatMessage, PromptPublished
from workers.prompts import PromptTopicReader


def published(gid: str, text: str = "hello") -> PromptPublished:
    return PromptPublished(generation_id=gid, user_id="u", published_at_ms=0, messages=(ChatMessage("user", text),))


def reader(**over) -> PromptTopicReader:
    kw = dict(bootstrap="unused", topic="t", buffer_max=3, buffer_bytes_max=100, ttl_s=60.0) | over
    return PromptTopicReader(**kw)


def test_a_held_prompt_is_taken_and_kept_for_a_later_epoch():
    r = reader()
    r.hold(published("g1", "Name three colors."))
    for _ in range(2):
        (message,) = asyncio.run(r.take("g1", wait_s=0))
        assert message.content == "Name three colors."
    assert asyncio.run(r.take("g2", wait_s=0)) is None
    assert (r.found, r.missed) == (2, 1)


def test_the_buffer_drops_its_oldest_past_its_count_bytes_and_age():
    r = reader()
    for i in range(4):
        r.hold(published(f"g{i}"))
    assert list(r._held) == ["g1", "g2", "g3"]  # count: 3
    r.hold(published("big", "x" * 96))
    assert list(r._held) == ["big"] and r._bytes == 96  # bytes: 100
    aged = reader(ttl_s=0.01)
    aged.hold(published("old"))
    time.sleep(0.02)
    assert asyncio.run(aged.take("old", wait_s=0)) is None
    aged.hold(published("new"))
    assert list(aged._held) == ["new"]


def test_a_take_waits_for_a_prompt_read_meanwhile():
    async def scenario() -> tuple[object, float]:
        r = reader()
        r._task = asyncio.create_task(asyncio.sleep(10))  # as if the reading loop ran
        asyncio.get_running_loop().call_later(0.05, r.hold, published("g"))
        t = time.monotonic()
        got = await r.take("g", wait_s=2.0)
        r._task.cancel()
        return got, time.monotonic() - t

    got, waited = asyncio.run(scenario())
    assert got is not None and waited < 1.0


def test_the_prompts_topic_is_co_partitioned_with_the_dispatch_topics():
    # The edge keys a prompt by the generation id its dispatch is keyed by; the same default
    # partitioner puts both in the same partition number only if the counts are equal.
    from schemas.topics import TIERS, Topology

    topo = Topology("ns")
    for tier in TIERS:
        assert topo.prompts("pool").partitions == topo.dispatch("pool", tier).partitions
