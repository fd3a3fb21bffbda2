"""End to end over HTTP: every code of the seed's error table that the core or a worker decides.

The unit tests render each code from canned decisions; here the real processor (and, where a worker
is involved, ``FakeSimWorker``) produces it, and the edge's answer is checked as the client sees it:
status, ``retryable``, ``action``, ``request_id``, ``details``, ``Retry-After`` on 429/503.

- ``generation_in_progress`` and ``idempotency_conflict``: same key while running / with other content.
- ``model_backend_error`` / ``generation_timeout``: a worker reports the failure; non-streaming gets
  502 / 504, a stream gets ``generation.error`` with code, action and ``partial``.
- ``capacity_exhausted``: no live worker heartbeat, so the edge's capacity estimate is over budget.
- ``quota_service_unavailable``: no processor answers within the decision timeout (fail closed).
- ``result_unavailable``: a same-key retry of a completed generation after its result TTL.
- Non-streaming client disconnect: cancelled (reason ``client_disconnect``) after the grace.
- Logs carry opaque ids only: no prompt, output or bearer token in the edge's or processor's logs.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import httpx_sse
import pytest

from infra.runtime.topic_reader import read_topic
from schemas.codes import REJECTIONS, RejectionCode
from schemas.events import CancelRequested, GenerationAdmitted
from schemas.wire import decode_ledger_entry
from infra.harness.processes import wait_until_deciding
from tests.integration.test_edge_harness import FakeSimWorker, edge_settings, serve_edge

pytestmark = pytest.mark.integration

TERMINALS = ("generation.completed", "generation.cancelled", "generation.error")
POLL_S = 0.05
POLLS_MAX = 400


def body(text: str, stream: bool = False, max_output_tokens: int = 64) -> dict:
    return {"model": "simulated-text-model", "messages": [{"role": "user", "content": text}], "stream": stream, "max_output_tokens": max_output_tokens}


def typed(resp, code: RejectionCode) -> dict:
    spec = REJECTIONS[code]
    assert resp.status_code == spec.http_status, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["retryable"], err["action"]) == (code.value, spec.retryable, spec.action.value), err
    assert err["request_id"].startswith("req_") and err["request_id"] == resp.headers["x-request-id"]
    assert isinstance(err["details"], dict)
    if spec.http_status in (429, 503):
        assert int(resp.headers["retry-after"]) >= 1
    return err


async def ledger_events(kafka_bootstrap, topology, cls):
    found = []
    for _p, _o, _k, value in await read_topic(kafka_bootstrap, topology.ledger):
        found += [e for e in decode_ledger_entry(value).events if isinstance(e, cls)]
    return found


async def test_same_key_while_running_is_in_progress_and_other_content_is_a_conflict(kafka_bootstrap, topology, running_processor):
    user = f"u-{uuid.uuid4().hex[:8]}"
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=[f"t{i} " for i in range(400)], token_interval_s=0.05) as worker,
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
        e.http() as http,
    ):
        async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=body("story", True), headers=e.headers(user, "k")) as es:
            events = []
            it = es.aiter_sse()
            async for sse in it:
                events.append((sse.event, sse.json()))
                if sse.event == "generation.text.delta":
                    break
            gid = events[0][1]["generation_id"]
            again = await http.post("/v1/generations", json=body("story", True), headers=e.headers(user, "k"))
            err = typed(again, RejectionCode.GENERATION_IN_PROGRESS)
            assert err["generation_id"] == gid and err["status"] == "running"
            other = await http.post("/v1/generations", json=body("another story", True), headers=e.headers(user, "k"))
            typed(other, RejectionCode.IDEMPOTENCY_CONFLICT)
            # Another principal cannot cancel it, and is told exactly what an unknown id gets.
            foreign = await http.post(f"/v1/generations/{gid}/cancel", headers=e.headers("someone-else"))
            unknown = await http.post(f"/v1/generations/{uuid.uuid4().hex}/cancel", headers=e.headers("someone-else"))
            typed(foreign, RejectionCode.NOT_FOUND)
            assert foreign.json()["error"]["details"] == unknown.json()["error"]["details"] == {}
            assert (await http.get(f"/v1/generations/{gid}", headers=e.headers(user))).json()["status"] == "running"
            assert (await http.post(f"/v1/generations/{gid}/cancel", headers=e.headers(user))).status_code in (200, 202)
            async for sse in it:
                events.append((sse.event, sse.json()))
        assert [n for n, _ in events if n in TERMINALS] == ["generation.cancelled"]
        assert worker.accepted == 1
    assert [a.generation_id for a in await ledger_events(kafka_bootstrap, topology, GenerationAdmitted) if a.user_id == user] == [gid]


@pytest.mark.parametrize("code", [RejectionCode.MODEL_BACKEND_ERROR, RejectionCode.GENERATION_TIMEOUT])
async def test_worker_failure_is_502_or_504_before_headers_and_generation_error_after(kafka_bootstrap, topology, running_processor, code):
    user = f"u-{uuid.uuid4().hex[:8]}"
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=["a", "b", "c", "d"], token_interval_s=0.02, fail_after_tokens=2, fail_code=code),
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
        e.http() as http,
    ):
        whole = await http.post("/v1/generations", json=body("one"), headers=e.headers(user, "k1"))
        err = typed(whole, code)
        assert err["partial"] is True and err["status"] == "failed"
        got = (await http.get(f"/v1/generations/{err['generation_id']}", headers=e.headers(user))).json()
        assert got["status"] == "failed" and got["error"]["code"] == code.value and got["partial"] is True

        events = []
        async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=body("two", True), headers=e.headers(user, "k2")) as es:
            assert es.response.status_code == 200
            async for sse in es.aiter_sse():
                events.append((sse.event, sse.json()))
    names = [n for n, _ in events]
    assert names == ["generation.created", "generation.text.delta", "generation.text.delta", "generation.error"], names
    last = events[-1][1]
    assert (last["code"], last["action"], last["partial"]) == (code.value, "manual_regenerate", True)
    assert last["sequence"] == 3


async def test_no_live_worker_is_capacity_exhausted_and_a_same_key_retry_is_decided_again(kafka_bootstrap, topology, running_processor):
    user = f"u-{uuid.uuid4().hex[:8]}"
    async with serve_edge(edge_settings(kafka_bootstrap, topology, capacity_check=True)) as e, e.http() as http:
        first = await http.post("/v1/generations", json=body("hello", True), headers=e.headers(user, "k"))
        typed(first, RejectionCode.CAPACITY_EXHAUSTED)
        # Retryable with the same key: the request holds nothing, so the retry is a fresh decision.
        retry = await http.post("/v1/generations", json=body("hello", True), headers=e.headers(user, "k"))
        typed(retry, RejectionCode.CAPACITY_EXHAUSTED)
        metrics = (await http.get("/metrics")).text
    assert 'chatplane_edge_admissions_total{code="capacity_exhausted"} 2.0' in metrics
    assert 'chatplane_edge_admissions_total{code="quota_exhausted"} 0.0' in metrics


async def test_no_decision_in_time_is_quota_service_unavailable(kafka_bootstrap, topology):
    # The topics exist but no processor runs: the decision never arrives and admission fails closed.
    async with serve_edge(edge_settings(kafka_bootstrap, topology, decision_timeout_s=0.5)) as e, e.http() as http:
        r = await http.post("/v1/generations", json=body("hello"), headers=e.headers("u1", "k"))
        typed(r, RejectionCode.QUOTA_SERVICE_UNAVAILABLE)
        c = await http.post(f"/v1/generations/{uuid.uuid4().hex}/cancel", headers=e.headers("u1"))
        typed(c, RejectionCode.QUOTA_SERVICE_UNAVAILABLE)
        metrics = (await http.get("/metrics")).text
    assert 'chatplane_edge_admissions_total{code="quota_service_unavailable"} 1.0' in metrics


async def test_completed_result_past_its_ttl_is_410_result_unavailable(kafka_bootstrap, topology, processor_factory, client, monkeypatch):
    ttl_ms = 1500
    monkeypatch.setenv("CHATPLANE_RESULT_TTL_MS", str(ttl_ms))  # the edge's own result memory too
    processor_factory(CHATPLANE_RESULT_TTL_MS=ttl_ms).start()
    await wait_until_deciding(client)
    user = f"u-{uuid.uuid4().hex[:8]}"
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=["fine"], token_interval_s=0.0),
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
        e.http() as http,
    ):
        done = await http.post("/v1/generations", json=body("q"), headers=e.headers(user, "k"))
        assert done.status_code == 200 and done.json()["output"] == [{"type": "text", "text": "fine"}]
        gid = done.json()["id"]
        again = await http.post("/v1/generations", json=body("q"), headers=e.headers(user, "k"))
        assert again.status_code == 200 and again.json()["id"] == gid and again.json()["output"][0]["text"] == "fine"
        await asyncio.sleep(ttl_ms / 1000 + 0.5)
        expired = await http.post("/v1/generations", json=body("q"), headers=e.headers(user, "k"))
        err = typed(expired, RejectionCode.RESULT_UNAVAILABLE)
        assert err["generation_id"] == gid
        # GET is 410 too; the metadata outlives the content: status and usage come with the error.
        got = await http.get(f"/v1/generations/{gid}", headers=e.headers(user))
        meta = typed(got, RejectionCode.RESULT_UNAVAILABLE)
        assert meta["status"] == "completed" and meta["usage"]["output_tokens"] == 1


async def test_non_streaming_client_disconnect_cancels_after_the_grace(kafka_bootstrap, topology, running_processor):
    user = f"u-{uuid.uuid4().hex[:8]}"
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=[f"t{i} " for i in range(400)], token_interval_s=0.05) as worker,
        serve_edge(edge_settings(kafka_bootstrap, topology, disconnect_grace_s=0.3)) as e,
        e.http() as http,
    ):
        task = asyncio.create_task(http.post("/v1/generations", json=body("long"), headers=e.headers(user, "k")))
        for _ in range(POLLS_MAX):
            if worker.accepted:
                break
            await asyncio.sleep(POLL_S)
        assert worker.accepted == 1
        task.cancel()  # the client goes away while the answer is being generated
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(POLLS_MAX):
            if worker.finished:
                break
            await asyncio.sleep(POLL_S)
        assert [o.value for o in worker.finished.values()] == ["stopped"]
        assert e.app.state.edge.metrics.readers_detached._value.get() == 1
    assert [c.reason.value for c in await ledger_events(kafka_bootstrap, topology, CancelRequested)] == ["client_disconnect"]


async def test_logs_carry_opaque_ids_only(kafka_bootstrap, topology, running_processor, tmp_path, caplog):
    prompt = f"PROMPT-MARKER-{uuid.uuid4().hex}"
    output = f"OUTPUT-MARKER-{uuid.uuid4().hex}"
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="chatplane")
    caplog.set_level(logging.DEBUG, logger="uvicorn")
    user = f"u-{uuid.uuid4().hex[:8]}"
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=[output, " and more"], token_interval_s=0.01),
        serve_edge(edge_settings(kafka_bootstrap, topology, stream_buffer_bytes_max=4096)) as e,
        e.http() as http,
    ):
        headers = e.headers(user, "k1")
        token = headers["Authorization"].split()[1]
        async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=body(prompt, True), headers=headers) as es:
            text = "".join([sse.json().get("delta", "") async for sse in es.aiter_sse()])
        assert output in text  # the content did flow through this edge
        assert (await http.post("/v1/generations", json=body(prompt), headers=e.headers(user, "k2"))).status_code == 200
        # Refusals and bad tokens log too; none of them with the content or the credential.
        await http.post("/v1/generations", json={**body(prompt), "messages": [{"role": "system", "content": prompt}]}, headers=e.headers(user, "k3"))
        await http.post("/v1/generations", json=body(prompt), headers={"Authorization": f"Bearer {token}x", "Idempotency-Key": "k4"})
    logged = caplog.text + "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    assert "token rejected: InvalidSignatureError" in caplog.text  # the edge's logs were captured
    for secret in (prompt, output, token):
        assert secret not in logged
