"""``GET /v1/usage`` over HTTP, answered from the real processor's state (edge/routes/usage.py)."""

from __future__ import annotations

import uuid

import pytest

from tests.integration.test_edge_harness import FakeSimWorker, edge_settings, serve_edge

pytestmark = pytest.mark.integration


def body(text: str) -> dict:
    return {"model": "simulated-text-model", "messages": [{"role": "user", "content": text}], "stream": False,
            "max_output_tokens": 8}


async def test_usage_counts_what_was_spent_and_a_fresh_user_has_the_whole_allowance(kafka_bootstrap, topology, running_processor):
    user = f"u-{uuid.uuid4().hex[:8]}"
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=["ok"], token_interval_s=0.0),
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
        e.http() as http,
    ):
        first = await http.get("/v1/usage", headers=e.headers(user))
        assert first.status_code == 200, first.text
        doc = first.json()
        assert doc["quota"]["limit"] == 40 and doc["quota"]["used"] == 0 and doc["quota"]["remaining"] == 40
        assert doc["concurrency"]["active"] == 0 and doc["concurrency"]["limit"] >= 1
        assert doc["burst"]["available"] == doc["burst"]["capacity"] == 20
        for i in range(2):
            r = await http.post("/v1/generations", json=body(f"q{i}"), headers=e.headers(user, f"k{i}"))
            assert r.status_code == 200 and r.json()["status"] == "completed", r.text
        # Read after the user's commands on the same partition: both messages are counted at once.
        after = (await http.get("/v1/usage", headers=e.headers(user))).json()
        assert (after["quota"]["used"], after["quota"]["reserved"], after["quota"]["remaining"]) == (2, 0, 38)
        assert after["quota"]["reset_at"] == doc["quota"]["reset_at"] and after["concurrency"]["active"] == 0
        assert after["burst"]["available"] == 18
        assert (await http.get("/v1/usage")).status_code == 401
