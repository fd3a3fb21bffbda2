"""Capacity admission against a real worker with one slot: a request sent right after the previous
one completed is admitted (the worker announces its freed slot before the generation's end reaches
the client), and a request sent while the only slot is busy with work that outlasts the queue budget
is ``capacity_exhausted``. The worker's heartbeats report the rates it measured.

``python -m workers --engine sim`` with ``CHATPLANE_WORKER_SLOTS=1``, heartbeats every 1 s (longer
than nothing, shorter than a generation here, so the edge has seen "0 free" while each one ran), the
real processor, an in-process edge with its capacity view on.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from edge.capacity import NO_CAPACITY_WAIT_MS
from schemas.codes import REJECTIONS, RejectionCode
from infra.harness.models import SIM_POOL
from infra.harness.processes import WorkerProcess
from tests.integration.test_edge_harness import edge_settings, serve_edge

pytestmark = pytest.mark.integration

INTER_TOKEN_MS = 100
OUTPUT_TOKENS = 15  # ~1.5 s per generation: more than one heartbeat interval
SEQUENTIAL = 4
HEARTBEAT_WAIT_S = 60.0
POLL_S = 0.05


def body(stream: bool = False, max_output_tokens: int = OUTPUT_TOKENS) -> dict:
    return {"model": "simulated-text-model", "messages": [{"role": "user", "content": "Name three colors."}],
            "stream": stream, "max_output_tokens": max_output_tokens}


async def test_one_slot_worker_admits_back_to_back_requests_and_refuses_while_busy(
    kafka_bootstrap, topology, running_processor, tmp_path
):
    worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_WORKER_SLOTS=1,
                           CHATPLANE_WORKER_HEARTBEAT_INTERVAL_S=1.0, CHATPLANE_SIM_TTFT_MS=10,
                           CHATPLANE_SIM_INTER_TOKEN_MS=INTER_TOKEN_MS, CHATPLANE_SIM_JITTER_MS=0,
                           CHATPLANE_SIM_OUTPUT_TOKENS=OUTPUT_TOKENS)
    worker.start()
    user = f"u-{uuid.uuid4().hex[:8]}"
    try:
        async with serve_edge(edge_settings(kafka_bootstrap, topology, capacity_check=True)) as e, e.http() as http:
            view = e.app.state.edge.capacity
            deadline = time.monotonic() + HEARTBEAT_WAIT_S
            while view.estimate_wait_ms(SIM_POOL) == NO_CAPACITY_WAIT_MS:
                assert time.monotonic() < deadline, f"no heartbeat from the worker\n{worker.log()}"
                await asyncio.sleep(POLL_S)

            for i in range(SEQUENTIAL):
                r = await http.post("/v1/generations", json=body(), headers=e.headers(user, f"seq-{i}"))
                assert r.status_code == 200, (i, r.text)
                assert r.json()["status"] == "completed"

            # The worker measured its engine: ~10 tokens/s of decode (100 ms a token), the whole budget used.
            (seen,) = [s.heartbeat for s in view._workers.values() if s.heartbeat.pool == SIM_POOL]
            assert seen.reports_work and 5 < seen.decode_tokens_per_s < 20, seen
            assert seen.prefill_tokens_per_s > 0 and seen.output_fill > 0.9, seen

            # While the only slot is busy with a budget of 200 tokens (~20 s at the measured rate, far
            # past the 2 s queue budget; it uses 15 of them, as the last ones did), the next request
            # is refused before any reservation.
            busy = body(stream=True, max_output_tokens=200)
            async with http.stream("POST", "/v1/generations", json=busy, headers=e.headers(user, "busy-0")) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                async for line in lines:
                    if line.startswith("event: generation.text.delta"):
                        break
                deadline = time.monotonic() + HEARTBEAT_WAIT_S
                while view.estimate_wait_ms(SIM_POOL) == 0:  # the "0 free" heartbeat is on its way
                    assert time.monotonic() < deadline, "the busy slot was never announced"
                    await asyncio.sleep(POLL_S)
                refused = await http.post("/v1/generations", json=body(), headers=e.headers(user, "busy-1"))
                assert refused.status_code == REJECTIONS[RejectionCode.CAPACITY_EXHAUSTED].http_status, refused.text
                assert refused.json()["error"]["code"] == "capacity_exhausted"
                async for line in lines:
                    if line.startswith("event: generation.completed"):
                        break
                else:
                    raise AssertionError("the running stream did not complete")
            after = await http.post("/v1/generations", json=body(), headers=e.headers(user, "after"))
            assert after.status_code == 200, after.text
    finally:
        worker.stop()
