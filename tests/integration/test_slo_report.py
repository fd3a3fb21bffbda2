"""The SLO report over a real stack's window (docs/slo.md): a ``python -m edge`` process, the real
processor and a ``python -m workers --engine sim`` worker (the one fake: no GPU) serve a few
requests, refusals among them; then ``python -m projections.reports.slo --json`` over that window counts
exactly what was sent, from the outcomes and ledger topics.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from infra.harness.processes import WorkerProcess
from tests.integration.test_edge_harness import edge_process_factory  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODEL = "simulated-text-model"
WAIT_S = 45.0
BUCKET_CAPACITY = 3  # the fourth admission of one user in the test is rate limited


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _body(tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "stream": stream, "max_output_tokens": tokens, "messages": [{"role": "user", "content": "Hello there."}]}


async def _slo(namespace: str, bootstrap: str, start: str, end: str, *extra: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "projections.reports.slo", "--from", start, "--to", end, "--json", *extra, cwd=ROOT,
        env={**os.environ, "CHATPLANE_KAFKA_BOOTSTRAP": bootstrap, "CHATPLANE_NAMESPACE": namespace},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert proc.returncode == 0, err.decode()[-2000:]
    return json.loads(out)


async def test_the_report_counts_what_the_edge_served(kafka_bootstrap, topology, running_processor, tmp_path, edge_process_factory):  # noqa: F811
    worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_SIM_TTFT_MS=10,
                           CHATPLANE_SIM_INTER_TOKEN_MS=20, CHATPLANE_SIM_OUTPUT_TOKENS=5000)
    worker.start()
    edge = edge_process_factory(CHATPLANE_EDGE_BUCKET_CAPACITY=str(BUCKET_CAPACITY), CHATPLANE_EDGE_BUCKET_REFILL_INTERVAL_S="600",
                                # Nothing is flushed on the interval during the test: the records reach
                                # the topic through the flush on shutdown (SIGTERM below).
                                CHATPLANE_EDGE_OUTCOMES_FLUSH_INTERVAL_S="600")
    try:
        await edge.start()
        user = f"u-{uuid.uuid4().hex[:8]}"
        start = time.time()
        async with edge.http() as http:
            # 1. streamed, completed (the worker may still be joining: wait for the first admission).
            deadline = time.monotonic() + WAIT_S
            r1 = await http.post("/v1/generations", json=_body(5, True), headers=edge.headers(user, uuid.uuid4().hex))
            assert r1.status_code == 200 and "generation.completed" in r1.text, r1.text[-500:]
            # 2. not streamed, completed.
            r2 = await http.post("/v1/generations", json=_body(5, False), headers=edge.headers(user, uuid.uuid4().hex))
            assert r2.status_code == 200 and r2.json()["status"] == "completed", r2.text
            # 3. streamed, cancelled by its user after the first text.
            async with http.stream("POST", "/v1/generations", json=_body(2000, True), headers=edge.headers(user, uuid.uuid4().hex)) as r3:
                assert r3.status_code == 200
                seen, cancelled = "", False
                async for chunk in r3.aiter_text():
                    seen += chunk
                    if not cancelled and "generation.text.delta" in seen:
                        gid = json.loads(seen.split("data: ", 1)[1].split("\n", 1)[0])["generation_id"]
                        c = await http.post(f"/v1/generations/{gid}/cancel", headers=edge.headers(user))
                        assert c.status_code in (200, 202), c.text
                        cancelled = True
                    assert time.monotonic() < deadline, "the cancelled stream did not end"
                assert "generation.cancelled" in seen, seen[-500:]
            # 4. the user's burst bucket is spent: rate limited (the edge's own refusal).
            r4 = await http.post("/v1/generations", json=_body(5, True), headers=edge.headers(user, uuid.uuid4().hex))
            assert r4.status_code == 429 and r4.json()["error"]["code"] == "rate_limited", r4.text
            # 5. invalid (no messages) and 6. unauthenticated: out of every objective.
            r5 = await http.post("/v1/generations", json={**_body(5, True), "messages": []}, headers=edge.headers(user, uuid.uuid4().hex))
            assert r5.status_code == 400, r5.text
            r6 = await http.post("/v1/generations", json=_body(5, True), headers={"Idempotency-Key": uuid.uuid4().hex})
            assert r6.status_code == 401, r6.text
        end = time.time() + 1
        edge.signal(signal.SIGTERM)  # drain, then flush the buffered outcome records
        assert await edge.wait(WAIT_S) == 0
        # The cancel's terminal is on the ledger once the worker acknowledged the stop: poll the
        # report until it is there (the outcomes are all there at once, flushed before the exit).
        while True:
            doc = await _slo(topology.namespace, kafka_bootstrap, _iso(start), _iso(end), "--dump", str(tmp_path / "dump.jsonl"))
            o = doc["objectives"]
            complete = o["accepted_generation_completion"]
            if doc["records"]["outcomes"] >= 6 and complete["total"] + complete["excluded"].get("user_cancelled", 0) >= 3:
                break
            assert time.monotonic() < deadline, f"the report never saw every request: {doc['records']}, {complete}"
            await asyncio.sleep(0.5)
    finally:
        worker.stop()

    assert doc["records"]["outcomes"] == 6
    contract = o["admission_response_contract"]
    # Valid: the three admissions and the rate-limited refusal; the invalid and unauthenticated are out.
    assert contract["total"] == 4
    assert contract["excluded"] == {"invalid:invalid_request": 1, "invalid:unauthorized": 1}
    # Each valid one got a typed decision; how many within 500 ms depends on this machine's load.
    assert contract["good"] + sum(v for k, v in contract["misses"].items() if k.startswith("late:")) == 4
    availability = o["eligible_admission_availability"]
    assert (availability["good"], availability["total"]) == (3, 3)
    assert availability["excluded"] == {"demand_envelope:rate_limited": 1, "invalid:invalid_request": 1, "invalid:unauthorized": 1}
    ttft = o["time_to_first_text_token_p95"]
    assert ttft["count"] == 3 and ttft["sources"] == {"edge": 3}  # all three admitted produced text
    assert ttft["value_ms"] is not None and ttft["value_ms"] > 0
    assert (complete["good"], complete["total"]) == (2, 2)
    assert complete["excluded"] == {"user_cancelled": 1}

    # The dump holds what the report read: the worker's TTFT is recorded with each usage (acceptance ->
    # first token), and the outcome records carry no text.
    lines = [json.loads(line) for line in (tmp_path / "dump.jsonl").read_text().splitlines()]
    usage = [e for line in lines if line["type"] == "LedgerEntry" for e in line["events"] if e["type"] == "UsageRecorded"]
    assert len(usage) == 3 and all(isinstance(u["ttft_ms"], int) and u["ttft_ms"] >= 0 for u in usage), usage
    # The edge sent its six outcomes together: one batch record (the flush on shutdown), not six.
    batches = [line for line in lines if line["type"] == "EdgeOutcomeBatch"]
    assert len(batches) == 1 and not any(line["type"] == "EdgeOutcome" for line in lines), [line["type"] for line in lines]
    outcomes = [x for batch in batches for x in batch["outcomes"]]
    assert sorted(x["http_status"] for x in outcomes) == [200, 200, 200, 400, 401, 429]
    assert not any("Hello" in json.dumps(x) for x in outcomes)
