"""End to end over HTTP: quota, concurrency and burst limits stay apart, each with its typed answer.

- 41 sequential submits from a free user: the 41st is 429 ``quota_exhausted`` with ``reset_at`` at
  the window end (the core decides; the edge renders).
- 20 parallel submits: at most 2 running, the rest ``concurrency_limited``; a burst beyond the
  edge's token bucket is ``rate_limited`` with Retry-After.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid

import pytest

from control_plane.policy import WINDOW_MS
from tests.integration.test_edge_harness import FakeSimWorker, edge_settings, serve_edge

pytestmark = pytest.mark.integration


def body(text: str, stream: bool = False) -> dict:
    return {"model": "simulated-text-model", "messages": [{"role": "user", "content": text}], "stream": stream, "max_output_tokens": 16}


async def test_41st_sequential_submit_is_quota_exhausted_with_reset_at(kafka_bootstrap, topology, running_processor):
    user = f"u-{uuid.uuid4().hex[:8]}"
    settings = edge_settings(kafka_bootstrap, topology, bucket_capacity_tokens=100.0)
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=["ok"], token_interval_s=0.0) as worker,
        serve_edge(settings) as e,
        e.http() as http,
    ):
        for i in range(40):
            r = await http.post("/v1/generations", json=body(f"q{i}"), headers=e.headers(user, f"k{i}"))
            assert r.status_code == 200, (i, r.text)
            assert r.json()["status"] == "completed"
            assert r.json()["output"] == [{"type": "text", "text": "ok"}]
        r = await http.post("/v1/generations", json=body("q40"), headers=e.headers(user, "k40"))
        assert worker.accepted == 40
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "quota_exhausted" and err["retryable"] is False and err["action"] == "wait_for_reset"
    assert err["request_id"] and r.headers["x-request-id"] == err["request_id"]
    now_ms = int(time.time() * 1000)
    window_end_ms = now_ms - now_ms % WINDOW_MS + WINDOW_MS
    assert err["details"]["limit"] == 40 and err["details"]["remaining"] == 0
    assert err["details"]["reset_at"] == dt.datetime.fromtimestamp(window_end_ms / 1000, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert int(r.headers["retry-after"]) >= 1


async def test_parallel_submits_concurrency_limited_then_burst_rate_limited(kafka_bootstrap, topology, running_processor):
    user = f"u-{uuid.uuid4().hex[:8]}"
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=[f"w{i} " for i in range(400)], token_interval_s=0.05) as worker,
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
        e.http() as http,
    ):

        async def submit(i: int):
            req = http.build_request("POST", "/v1/generations", json=body(f"p{i}", stream=True), headers=e.headers(user, f"p{i}"))
            resp = await http.send(req, stream=True)
            if resp.status_code != 200:
                await resp.aread()
                return resp, None, None
            first = b""
            it = resp.aiter_bytes()
            async for chunk in it:
                first += chunk
                if b"\n\n" in first:
                    break
            return resp, it, first

        results = await asyncio.gather(*(submit(i) for i in range(20)))
        admitted = [(r, it, first) for r, it, first in results if r.status_code == 200]
        refused = [r for r, _, _ in results if r.status_code != 200]
        assert 1 <= len(admitted) <= 2
        assert len(admitted) + len(refused) == 20
        for r in refused:
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "concurrency_limited" and err["retryable"] is True, err
            assert err["details"]["limit"] == 2
            assert "retry-after" in r.headers
        # The bucket (capacity 20) is now empty: the next submit is rate_limited, decided at the edge.
        burst = await http.post("/v1/generations", json=body("b"), headers=e.headers(user, "burst"))
        assert burst.status_code == 429, burst.text
        err = burst.json()["error"]
        assert err["code"] == "rate_limited" and err["retryable"] is True and err["action"] == "retry_after_delay"
        assert 1 <= int(burst.headers["retry-after"]) <= 3
        assert 0 < err["details"]["retry_after_ms"] <= 3000
        metrics = (await http.get("/metrics")).text
        assert 'chatplane_edge_admissions_total{code="rate_limited"} 1.0' in metrics
        assert f'chatplane_edge_admissions_total{{code="concurrency_limited"}} {float(len(refused))}' in metrics
        assert worker.accepted <= 2
        for r, it, first in admitted:
            gid = first.split(b'"generation_id":"')[1].split(b'"')[0].decode()
            c = await http.post(f"/v1/generations/{gid}/cancel", headers=e.headers(user))
            assert c.status_code in (200, 202)
            rest = b"".join([chunk async for chunk in it])
            assert (first + rest).count(b"event: generation.cancelled") == 1
            await r.aclose()
