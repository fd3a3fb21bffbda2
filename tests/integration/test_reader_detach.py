"""Orphan work after an edge dies: kill -9 the edge mid-stream; the processor hears its
liveness lease lapse, detaches the generation it was reading, cancels it at the end of the grace,
and the worker's engine stops. A generation read by an edge that stays alive is left alone.

The real processor (subprocess, short lease and grace so the test is quick), a real
``python -m workers --engine sim`` worker, two real edges (``python -m edge`` subprocesses) on their
own inbox partitions; the ledger topic is the evidence.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest

from schemas import events as ev
from schemas.codes import CancelReason
from infra.harness.processes import WorkerProcess, wait_until_deciding
from tests.integration.test_edge_harness import edge_process_factory  # noqa: F401 (fixture)
from tests.integration.workers_harness import ledger_events

pytestmark = pytest.mark.integration

LEASE_MS = 1_500  # the processor's edge lease (CHATPLANE_EDGE_PRESENCE_LEASE_MS)
GRACE_MS = 2_000  # the detach grace of a lost edge (CHATPLANE_EDGE_LOST_GRACE_MS)
PRESENCE_INTERVAL_S = 0.3  # the edges' beat: the lease is max(LEASE_MS, 3 beats)
# What the mechanism may take beyond lease + grace: the detach is sent on a timer tick (0.5 s) and
# decided, the cancel is decided at the next tick after the deadline, the StopAttempt reaches the
# worker, its engine stops between two tokens and the report is decided.
STOP_BOUND_MS = 3_000
INTER_TOKEN_MS = 20
ORPHAN_TOKENS = 1_500  # 30 s of output: it would outlive the test without the mechanism
SURVIVOR_TOKENS = 400  # 8 s: runs on across the kill, the lease and the grace
WAIT_S = 60.0
POLL_S = 0.1


def body(tokens: int) -> dict:
    return {"model": "simulated-text-model", "messages": [{"role": "user", "content": "Tell a long story."}],
            "stream": True, "max_output_tokens": tokens}


async def first_delta(http, edge, user: str, tokens: int):
    """Open a stream and read it up to its first text delta; returns (the rest of it, generation id)."""
    req = http.build_request("POST", "/v1/generations", json=body(tokens), headers=edge.headers(user, f"k-{user}"))
    resp = await http.send(req, stream=True)
    assert resp.status_code == 200, await resp.aread()
    raw = b""
    chunks = resp.aiter_bytes()
    async for chunk in chunks:
        raw += chunk
        if b"generation.text.delta" in raw:
            break
    gid = raw.split(b'"generation_id":"')[1].split(b'"')[0].decode()
    return chunks, gid


async def terminal_of(kafka_bootstrap, topology, gid: str) -> list:
    deadline = time.monotonic() + WAIT_S
    while True:
        events = await ledger_events(kafka_bootstrap, topology, gid)
        if any(isinstance(e, ev.TERMINAL_EVENT_TYPES) for e in events):
            return events
        assert time.monotonic() < deadline, f"{gid} never ended: {[type(e).__name__ for e in events]}"
        await asyncio.sleep(POLL_S)


def usage_tokens(events: list) -> int:
    return sum(e.output_tokens for e in events if isinstance(e, ev.UsageRecorded))


async def test_an_edge_killed_mid_stream_leaves_no_engine_running_for_it(
    kafka_bootstrap, topology, processor_factory, client, edge_process_factory, tmp_path
):
    processor = processor_factory(CHATPLANE_EDGE_PRESENCE_LEASE_MS=LEASE_MS, CHATPLANE_EDGE_LOST_GRACE_MS=GRACE_MS)
    processor.start()
    await wait_until_deciding(client)
    worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_SIM_TTFT_MS=50,
                           CHATPLANE_SIM_INTER_TOKEN_MS=INTER_TOKEN_MS, CHATPLANE_SIM_JITTER_MS=0,
                           CHATPLANE_SIM_OUTPUT_TOKENS=ORPHAN_TOKENS)
    worker.start()
    doomed = edge_process_factory(CHATPLANE_EDGE_PRESENCE_INTERVAL_S=PRESENCE_INTERVAL_S)
    survivor = edge_process_factory(CHATPLANE_EDGE_PRESENCE_INTERVAL_S=PRESENCE_INTERVAL_S,
                                    CHATPLANE_EDGE_INBOX_PARTITION=2)
    try:
        await doomed.start()
        await survivor.start()
        async with doomed.http() as http_doomed, survivor.http() as http_survivor:
            kept, kept_gid = await first_delta(http_survivor, survivor, f"alive-{uuid.uuid4().hex[:6]}", SURVIVOR_TOKENS)
            _, orphan_gid = await first_delta(http_doomed, doomed, f"orphan-{uuid.uuid4().hex[:6]}", ORPHAN_TOKENS)
            killed_at_ms = int(time.time() * 1000)
            doomed.signal(signal.SIGKILL)
            events = await terminal_of(kafka_bootstrap, topology, orphan_gid)
            # The surviving edge's client keeps reading its stream to the end.
            rest = b"".join([chunk async for chunk in kept])
            assert b"event: generation.completed" in rest, rest[-500:]
        survivor_events = await terminal_of(kafka_bootstrap, topology, kept_gid)
    finally:
        worker.stop()

    detached = [e for e in events if isinstance(e, ev.ReaderDetached)]
    assert len(detached) == 1 and detached[0].reason is CancelReason.EDGE_LOST, events
    assert detached[0].occurred_at_ms - killed_at_ms <= LEASE_MS + STOP_BOUND_MS, "the lapse was noticed late"
    cancel = [e for e in events if isinstance(e, ev.CancelRequested)]
    assert len(cancel) == 1 and cancel[0].reason is CancelReason.EDGE_LOST
    assert cancel[0].occurred_at_ms >= detached[0].detached_until_ms, "cancelled before the grace ended"
    ended = [e for e in events if isinstance(e, ev.TERMINAL_EVENT_TYPES)]
    assert [type(e) for e in ended] == [ev.GenerationCancelled] and ended[0].reason is CancelReason.EDGE_LOST
    stopped_after_ms = ended[0].occurred_at_ms - killed_at_ms
    print(f"edge killed -> detached after {detached[0].occurred_at_ms - killed_at_ms} ms, engine stopped after "
          f"{stopped_after_ms} ms (bound {LEASE_MS + GRACE_MS + STOP_BOUND_MS}), {usage_tokens(events)} of {ORPHAN_TOKENS} tokens")
    assert stopped_after_ms <= LEASE_MS + GRACE_MS + STOP_BOUND_MS, f"the engine ran {stopped_after_ms} ms after the kill"
    usage = [e for e in events if isinstance(e, ev.UsageRecorded)]
    assert len(usage) == 1 and 0 < usage[0].output_tokens < ORPHAN_TOKENS, "the engine stopped early, its tokens counted"
    assert any(isinstance(e, ev.ConcurrencySlotReleased) for e in events), "the user's slot is free again"
    # The edge that stayed alive had its generation left alone: no detach, completed in full.
    assert not any(isinstance(e, ev.ReaderDetached) for e in survivor_events), survivor_events
    assert any(isinstance(e, ev.GenerationCompleted) for e in survivor_events)
