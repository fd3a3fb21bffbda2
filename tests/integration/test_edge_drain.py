"""SIGTERM during 20 live streams (``python -m edge`` as a process, the real processor, a fake worker).

Readiness fails first, new submissions are refused, each held stream gets exactly one terminal event:
the short generations finish inside the drain deadline (``generation.completed``), the long ones
are cancelled at it (``generation.cancelled``); the process exits 0, and the ledger shows every
generation settled: none is left running.
"""

from __future__ import annotations

import asyncio
import signal
import uuid

import httpx_sse
import pytest

from infra.runtime.topic_reader import read_topic
from schemas import events as ev
from schemas.wire import decode_ledger_entry
from tests.integration.test_edge_harness import FakeSimWorker, edge_process_factory  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

STREAMS = 20
SHORT = 10  # streams 0..9 need about 5 s (inside the drain deadline), the rest about 30 s
SHORT_TOKENS = 100
LONG_TOKENS = 600
DRAIN_DEADLINE_S = 12
TERMINALS = ("generation.completed", "generation.cancelled", "generation.error")


def body(i: int) -> dict:
    return {"model": "simulated-text-model", "messages": [{"role": "user", "content": f"s{i}"}], "stream": True, "max_output_tokens": 64}


async def test_sigterm_during_20_live_streams_ends_each_with_a_terminal_event(
    kafka_bootstrap, topology, running_processor, edge_process_factory
):
    edge = edge_process_factory(CHATPLANE_EDGE_DRAIN_DEADLINE_S=str(DRAIN_DEADLINE_S), CHATPLANE_EDGE_DRAIN_CANCEL_WAIT_S="10")
    users = [f"d{i}-{uuid.uuid4().hex[:6]}" for i in range(STREAMS)]
    first_delta = asyncio.Event()
    seen = 0

    def tokens_for(payload):
        n = SHORT_TOKENS if int(payload.messages[0].content[1:]) < SHORT else LONG_TOKENS
        return [f"w{i} " for i in range(n)]

    terminal_after_signal: list[str] = []
    signalled = False
    async with FakeSimWorker(kafka_bootstrap, topology, tokens_for=tokens_for, token_interval_s=0.05, renew_every_tokens=20):
        await edge.start()
        async with edge.http() as http:

            async def one(i: int) -> list[tuple[str, dict]]:
                nonlocal seen
                events = []
                async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=body(i), headers=edge.headers(users[i], "k")) as es:
                    assert es.response.status_code == 200
                    got_delta = False
                    async for sse in es.aiter_sse():
                        events.append((sse.event, sse.json()))
                        if sse.event in TERMINALS and signalled:
                            terminal_after_signal.append(sse.event)
                        if sse.event == "generation.text.delta" and not got_delta:
                            got_delta = True
                            seen += 1
                            if seen == STREAMS:
                                first_delta.set()
                return events

            tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
            await asyncio.wait_for(first_delta.wait(), 60)
            signalled = True
            edge.signal(signal.SIGTERM)
            # Readiness fails first, and new streams are refused while the old ones run on.
            for _ in range(50):
                ready = await http.get("/readyz")
                if ready.status_code == 503:
                    break
                await asyncio.sleep(0.05)
            assert ready.status_code == 503
            refused = await http.post("/v1/generations", json=body(99), headers=edge.headers("late-user", "k"))
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "capacity_exhausted"
            assert "retry-after" in refused.headers
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert await edge.wait(60) == 0
    gids = set()
    for i, events in enumerate(results):
        names = [n for n, _ in events]
        assert names[0] == "generation.created"
        assert sum(n in TERMINALS for n in names) == 1 and names[-1] in TERMINALS, names[-3:]
        # Existing streams run on until the deadline; the rest are cancelled at it.
        assert names[-1] == ("generation.completed" if i < SHORT else "generation.cancelled"), (i, names[-3:])
        gids.add(events[0][1]["generation_id"])
    assert len(gids) == STREAMS
    # Completions arrived while the edge was draining, not only before the signal.
    assert "generation.completed" in terminal_after_signal
    # No generation left running: every admitted one has a terminal ledger event.
    settled = set()
    for _p, _o, _k, value in await read_topic(kafka_bootstrap, topology.ledger):
        for e in decode_ledger_entry(value).events:
            if isinstance(e, ev.GenerationCompleted | ev.GenerationCancelled | ev.GenerationFailed):
                settled.add(e.generation_id)
    assert gids <= settled
