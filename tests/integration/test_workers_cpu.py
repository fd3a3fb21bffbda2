"""Must-show 6: ``python -m workers --engine cpu`` (SmolLM2-135M-Instruct on llama.cpp) answers
"Name three colors." with real text through the whole stack: HTTP edge -> processor -> worker -> edge.

Skipped, with the reason, when the cpu runtime is not installed.
"""

from __future__ import annotations

import uuid

import httpx_sse
import pytest

from schemas.codes import RequestStatus
from infra.harness.processes import WorkerProcess
from tests.integration.test_edge_harness import edge_settings, serve_edge
from workers.engines.cpu import cpu_runtime_missing_reason

MISSING = cpu_runtime_missing_reason()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(MISSING is not None, reason=f"cpu runtime not installed: {MISSING}"),
]

COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink")


async def test_cpu_worker_names_three_colors_through_the_whole_stack(kafka_bootstrap, topology, running_processor, tmp_path):
    worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="cpu")
    worker.start()
    try:
        body = {"model": "fast-text-model", "messages": [{"role": "user", "content": "Name three colors."}],
                "stream": True, "max_output_tokens": 64}
        async with serve_edge(edge_settings(kafka_bootstrap, topology)) as e, e.http() as http:
            events = []
            user = f"u-{uuid.uuid4().hex[:8]}"
            async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=body,
                                              headers=e.headers(user, uuid.uuid4().hex)) as es:
                assert es.response.status_code == 200, await es.response.aread()
                async for sse in es.aiter_sse():
                    events.append((sse.event, sse.json()))
            names = [n for n, _ in events]
            assert names[0] == "generation.created" and names[-1] == "generation.completed", (names, worker.log())
            text = "".join(d.get("delta", "") for n, d in events if n == "generation.text.delta").lower()
            assert sum(c in text for c in COLORS) >= 2, text
            done = events[-1][1]
            gid = events[0][1]["generation_id"]
            got = await http.get(f"/v1/generations/{gid}", headers=e.headers(user))
            assert got.status_code == 200 and got.json()["status"] == RequestStatus.COMPLETED.value, got.text
            assert done.get("usage", {}).get("output_tokens", 1) > 0, done
    finally:
        worker.stop()
