"""The token budget end to end (docs/core.md, "Token budget"): the real processor, the real worker
(``python -m workers --engine sim``) and the real edge over HTTP.

1. 50 concurrent requests whose reservations exceed the budget: the admitted ones never hold more
   than the budget; each client follows its refusal's action (``concurrency_limited``: wait and
   retry the same key) until it completes or gets ``quota_exhausted`` with ``kind: tokens``; after
   they finish the window's ``used`` is the sum of their actual usage.
2. A cancelled generation settles to the tokens it generated; the freed remainder admits a request
   that was refused while the reservation held it.
3. kill -9 of the processor and of a worker mid-generation: the audit is clean and every token
   reservation is settled exactly once (a killed worker's at its last renewal plus the bound).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from control_plane.evolve import evolve
from control_plane.policy import Policy
from control_plane.state import UserLedger
from projections.ledger.audit import audit
from schemas import events as ev
from schemas.codes import FinishOutcome
from infra.harness.processes import WorkerProcess, wait_until_committed, wait_until_deciding
from tests.integration.test_edge_harness import edge_settings, serve_edge
from tests.integration.workers_harness import ledger_events

pytestmark = pytest.mark.integration

WAIT_S = 120.0  # generous: a loaded 2-core machine
RETRY_SLEEP_S = 0.5


def body(text: str, max_output_tokens: int, **extra: object) -> dict:
    return {"model": "simulated-text-model", "messages": [{"role": "user", "content": text}], "stream": False,
            "max_output_tokens": max_output_tokens, **extra}


async def until(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.3)


def processor_env(budget: int, **over: object) -> dict[str, object]:
    return {"CHATPLANE_TOKEN_BUDGET_FREE": budget, "CHATPLANE_QUOTA_FREE_PER_WINDOW": 1_000,
            "CHATPLANE_CONCURRENCY_LIMIT": 64, **over}


def sim_worker(kafka_bootstrap, topology, tmp_path, output_tokens: int, inter_token_ms: int) -> WorkerProcess:
    return WorkerProcess(
        kafka_bootstrap, topology, tmp_path, CHATPLANE_SIM_OUTPUT_TOKENS=output_tokens,
        CHATPLANE_SIM_INTER_TOKEN_MS=inter_token_ms, CHATPLANE_SIM_TTFT_MS=20, CHATPLANE_SIM_JITTER_MS=0,
        CHATPLANE_WORKER_SLOTS=16,
    )


async def post(http, path: str, json: dict, headers: dict):
    """A submit that retries, with the same key, what the loaded machine may answer while it starts
    (503 quota_service_unavailable / capacity_exhausted: nothing was held or charged)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        r = await http.post(path, json=json, headers=headers)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        await asyncio.sleep(1.0 + random.random())


async def warm_up(e, http) -> None:
    """One request by another user until the worker serves it (it may still be starting)."""
    async def served():
        r = await post(http, "/v1/generations", json=body("warm", 4), headers=e.headers("warm-up", "warm"))
        return r.status_code == 200
    await until(served, "the worker to serve a first request")


async def usage_records(kafka_bootstrap, topology) -> list[ev.UsageRecorded]:
    return [e for e in await ledger_events(kafka_bootstrap, topology) if isinstance(e, ev.UsageRecorded)]


async def test_50_concurrent_requests_never_hold_more_than_the_budget_and_used_is_their_actual_usage(
    kafka_bootstrap, topology, processor_factory, client, tmp_path
):
    budget, max_output = 400, 40  # about 8 reservations at once; each uses ~1/4 of what it reserves
    p = processor_factory(**processor_env(budget))
    p.start()
    await wait_until_deciding(client)
    worker = sim_worker(kafka_bootstrap, topology, tmp_path, output_tokens=6, inter_token_ms=20)
    worker.start()
    user = f"u-{uuid.uuid4().hex[:8]}"
    settings = edge_settings(kafka_bootstrap, topology, bucket_capacity_tokens=10_000.0)
    completed: dict[str, tuple[int, int]] = {}
    exhausted: list[dict] = []
    waited = 0
    try:
        async with serve_edge(settings) as e, e.http() as http:

            async def one(i: int) -> None:
                nonlocal waited
                deadline = time.monotonic() + WAIT_S
                while time.monotonic() < deadline:
                    r = await http.post("/v1/generations", json=body(f"q{i}", max_output), headers=e.headers(user, f"k{i}"))
                    if r.status_code == 200:
                        doc = r.json()
                        assert doc["status"] == "completed", doc
                        completed[doc["id"]] = (doc["usage"]["input_tokens"], doc["usage"]["output_tokens"])
                        return
                    err = r.json()["error"]
                    if r.status_code == 503 and err["code"] in ("quota_service_unavailable", "capacity_exhausted"):
                        # The loaded machine answered late or its worker did not take the request in
                        # time (nothing held or charged): retry the same key with backoff.
                        await asyncio.sleep(1.0 + random.random())
                        continue
                    assert r.status_code == 429, r.text
                    if err["code"] == "quota_exhausted":
                        exhausted.append(err)
                        return
                    # Running generations hold the room (or a slot): wait for one to finish, same key.
                    assert err["code"] == "concurrency_limited", err
                    waited += 1
                    await asyncio.sleep(RETRY_SLEEP_S * (1 + random.random()))
                raise AssertionError(f"request {i} neither completed nor was refused for the window")

            await warm_up(e, http)
            await asyncio.gather(*(one(i) for i in range(50)))
            usage = (await http.get("/v1/usage", headers=e.headers(user))).json()
    finally:
        worker.stop()
    assert len(completed) + len(exhausted) == 50 and completed and exhausted and waited > 0, (len(completed), len(exhausted))
    for err in exhausted:
        assert err["details"]["kind"] == "tokens" and err["details"]["limit"] == budget and err["retryable"] is False, err
        assert err["details"]["reset_at"]
    actual = sum(i + o for i, o in completed.values())
    assert usage["tokens"] == {"limit": budget, "used": actual, "reserved": 0, "remaining": budget - actual}, usage
    # The window never held more than the budget, after any event (folded from the ledger).
    state, peak = UserLedger(user), 0
    events = [x for x in await ledger_events(kafka_bootstrap, topology) if x.user_id == user]
    for event in events:
        state = evolve(state, event)
        peak = max([peak] + [w.tokens_used + w.tokens_reserved for w in state.windows.values()])
    assert 0 < peak <= budget
    assert {x.generation_id for x in events if isinstance(x, ev.GenerationCompleted)} == set(completed)
    await wait_until_committed(kafka_bootstrap, topology)
    p.stop()
    report = await audit(kafka_bootstrap, topology, concurrency_limit=64)
    assert report.ok, report.render()
    assert report.token_reservations == report.token_settlements and report.tokens_unsettled == 0
    assert sum(x.billable_tokens for x in events if isinstance(x, ev.UsageRecorded)) == actual
    assert report.states[user] == state and sum(w.tokens_used for w in state.windows.values()) == actual


async def test_a_cancelled_generation_settles_to_what_it_generated_and_the_rest_admits_another(
    kafka_bootstrap, topology, processor_factory, client, tmp_path
):
    budget = 600
    p = processor_factory(**processor_env(budget))
    p.start()
    await wait_until_deciding(client)
    worker = sim_worker(kafka_bootstrap, topology, tmp_path, output_tokens=5_000, inter_token_ms=40)
    worker.start()
    user = f"u-{uuid.uuid4().hex[:8]}"
    try:
        async with serve_edge(edge_settings(kafka_bootstrap, topology)) as e, e.http() as http:
            # A long generation reserving most of the budget (input + 500), run without a reader.
            await warm_up(e, http)
            r = await post(http, "/v1/generations", json=body("long", 500, background=True), headers=e.headers(user, "long"))
            assert r.status_code == 202 or r.status_code == 200, r.text
            long_id = r.json()["id"]

            async def renewed_with_tokens():
                return [x for x in await ledger_events(kafka_bootstrap, topology, long_id)
                        if isinstance(x, ev.LeaseRenewed) and x.output_tokens > 0]

            await until(renewed_with_tokens, "the long generation to report tokens")
            # Its reservation leaves no room for another 200: wait for one to finish (retryable).
            refused = await post(http, "/v1/generations", json=body("short", 200), headers=e.headers(user, "short"))
            assert refused.status_code == 429, refused.text
            err = refused.json()["error"]
            assert err["code"] == "concurrency_limited" and err["details"]["kind"] == "tokens", err
            cancel = await http.post(f"/v1/generations/{long_id}/cancel", headers=e.headers(user))
            assert cancel.status_code in (200, 202), cancel.text

            async def settled():
                return [u for u in await usage_records(kafka_bootstrap, topology) if u.generation_id == long_id]

            (u,) = await until(settled, "the cancelled generation's usage record")
            assert u.outcome is FinishOutcome.STOPPED, u  # the worker's stop acknowledgement
            assert any(isinstance(x, ev.GenerationCancelled) for x in await ledger_events(kafka_bootstrap, topology, long_id))
            assert 0 < u.output_tokens < 500 and u.requested_output_tokens == 500
            assert u.billable_tokens == u.input_tokens + u.output_tokens and u.overshoot_tokens == 0
            assert u.tokens_reserved == u.input_tokens + 500 and u.delivered_tokens <= u.output_tokens
            doc = (await http.get("/v1/usage", headers=e.headers(user))).json()["tokens"]
            assert (doc["used"], doc["reserved"]) == (u.billable_tokens, 0), doc
            # The freed remainder admits the request refused above (same key, decided again).
            again = await post(http, "/v1/generations", json=body("short", 200), headers=e.headers(user, "short"))
            assert again.status_code == 200 and again.json()["status"] == "completed", again.text
            short = again.json()["usage"]
            final = (await http.get("/v1/usage", headers=e.headers(user))).json()["tokens"]
            assert final["used"] == u.billable_tokens + short["input_tokens"] + short["output_tokens"], final
    finally:
        worker.stop()


async def test_kill9_of_the_processor_and_a_worker_mid_generation_settles_every_token_reservation_once(
    kafka_bootstrap, topology, processor_factory, client, tmp_path
):
    bound = 17
    env = processor_env(100_000, CHATPLANE_LEASE_MS=4_000, CHATPLANE_TOKEN_LOST_REPORT_BOUND=bound)
    p = processor_factory(**env)
    p.start()
    await wait_until_deciding(client)
    worker = sim_worker(kafka_bootstrap, topology, tmp_path, output_tokens=5_000, inter_token_ms=50)
    worker.start()
    user = f"u-{uuid.uuid4().hex[:8]}"
    try:
        async with serve_edge(edge_settings(kafka_bootstrap, topology)) as e, e.http() as http:
            await warm_up(e, http)
            ids = []
            for i in range(3):
                r = await post(http, "/v1/generations", json=body(f"g{i}", 2_000, background=True), headers=e.headers(user, f"g{i}"))
                assert r.status_code in (200, 202), r.text
                ids.append(r.json()["id"])

            async def all_renewed():
                renewed = {x.generation_id for x in await ledger_events(kafka_bootstrap, topology)
                           if isinstance(x, ev.LeaseRenewed) and x.output_tokens > 0}
                return set(ids) <= renewed

            await until(all_renewed, "three generations running and renewing")
            # Both mid-generation: the worker's reports are lost, and the processor dies before their
            # leases expire (its timer, restarted from the changelog, settles them).
            worker.kill9()
            p.kill9()
            p.start("p2")
            await wait_until_deciding(client)

            async def all_settled():
                records = [u for u in await usage_records(kafka_bootstrap, topology) if u.generation_id in ids]
                return records if len(records) == len(ids) else None

            records = await until(all_settled, "every generation settled after the kills")
            # A fresh worker serves the next request normally.
            worker = sim_worker(kafka_bootstrap, topology, tmp_path, output_tokens=5, inter_token_ms=10)
            worker.start()
            r = await post(http, "/v1/generations", json=body("after", 20), headers=e.headers(user, "after"))
            assert r.status_code == 200 and r.json()["status"] == "completed", r.text
    finally:
        worker.stop()
    renewals: dict[str, int] = {}
    for x in await ledger_events(kafka_bootstrap, topology):
        if isinstance(x, ev.LeaseRenewed):
            renewals[x.generation_id] = max(renewals.get(x.generation_id, 0), x.output_tokens)
    for u in records:  # settled by the timer at the last renewal + the bound (below the reservation here)
        assert u.outcome is None and u.terminal_reason == "lease_expired", u
        assert u.output_tokens == renewals[u.generation_id]
        assert u.billable_tokens == u.input_tokens + u.output_tokens + bound, u
    await wait_until_committed(kafka_bootstrap, topology)
    p.stop()
    report = await audit(kafka_bootstrap, topology, concurrency_limit=64, dedup_retention_ms=Policy().dedup_retention_ms)
    assert report.ok, report.render()
    assert report.token_reservations == report.token_settlements >= 4 and report.tokens_unsettled == 0, report.render()
    state = report.states[user]
    (window,) = state.windows.values()
    assert window.tokens_reserved == 0
    assert window.tokens_used == sum(u.billable_tokens for u in await usage_records(kafka_bootstrap, topology) if u.user_id == user)
