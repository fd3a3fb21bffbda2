"""End to end over HTTP on the real broker and processor: the seed's opening story.

Stream a generation, read the first delta, cancel it, retry with the same Idempotency-Key: one
generation, one message spent, and the retry is told the existing state.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx_sse
import pytest

from infra.runtime.topic_reader import read_topic
from schemas.codes import RequestStatus
from schemas.events import CancelRequested, GenerationAdmitted
from schemas.wire import decode_ledger_entry
from tests.integration.test_edge_harness import FakeSimWorker, edge_settings, serve_edge, sse_events

pytestmark = pytest.mark.integration

BODY = {"model": "simulated-text-model", "messages": [{"role": "user", "content": "Tell me a story"}], "stream": True, "max_output_tokens": 64}


async def test_opening_story_stream_cancel_retry(kafka_bootstrap, topology, running_processor):
    user = f"u-{uuid.uuid4().hex[:8]}"
    key = uuid.uuid4().hex
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=[f"t{i} " for i in range(200)], token_interval_s=0.05) as worker,
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
        e.http() as http,
    ):
        events = []
        async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=BODY, headers=e.headers(user, key)) as es:
            assert es.response.status_code == 200
            assert es.response.headers["content-type"].startswith("text/event-stream")
            assert es.response.headers["cache-control"] == "no-store"
            assert es.response.headers["x-accel-buffering"] == "no"
            it = es.aiter_sse()
            async for sse in it:
                events.append((sse.event, sse.json()))
                if sse.event == "generation.text.delta":
                    break
            gid = events[0][1]["generation_id"]
            assert events[0][0] == "generation.created"
            cancel = await http.post(f"/v1/generations/{gid}/cancel", headers=e.headers(user))
            assert cancel.status_code in (200, 202), cancel.text
            async for sse in it:
                events.append((sse.event, sse.json()))
        names = [n for n, _ in events]
        assert names[-1] == "generation.cancelled", names
        assert sum(n in ("generation.completed", "generation.cancelled", "generation.error") for n in names) == 1
        seqs = [d["sequence"] for _, d in events]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert events[-1][1]["partial"] is True

        # A retry with the same key: the same generation, its state, no new message spent; in the form
        # the request asks for (a stream: its events replayed, ending in the same terminal event).
        retry = await http.post("/v1/generations", json=BODY, headers=e.headers(user, key))
        assert retry.status_code == 200, retry.text
        assert retry.headers["content-type"].startswith("text/event-stream"), retry.text
        replayed = sse_events(retry.text)
        assert {d["generation_id"] for _, _, d in replayed} == {gid}
        assert replayed[0][1] == "generation.created" and replayed[-1][1] == "generation.cancelled", replayed
        assert replayed[-1][2]["partial"] is True
        as_json = await http.post("/v1/generations", json={**BODY, "stream": False}, headers=e.headers(user, key))
        doc = as_json.json()
        assert doc["id"] == gid and doc["status"] == RequestStatus.CANCELLED.value, as_json.text
        got = await http.get(f"/v1/generations/{gid}", headers=e.headers(user))
        assert got.status_code == 200 and got.json()["status"] == "cancelled"
        # Others get 404 with no hint that the id exists.
        other = await http.get(f"/v1/generations/{gid}", headers=e.headers("someone-else"))
        unknown = await http.get(f"/v1/generations/{uuid.uuid4().hex}", headers=e.headers("someone-else"))
        assert other.status_code == unknown.status_code == 404
        assert other.json()["error"]["code"] == unknown.json()["error"]["code"] == "not_found"
        assert worker.accepted == 1
    # One generation, one message spent: the ledger holds exactly one admission for this user.
    admitted = []
    for _p, _o, _k, value in await read_topic(kafka_bootstrap, topology.ledger):
        entry = decode_ledger_entry(value)
        admitted += [ev for ev in entry.events if isinstance(ev, GenerationAdmitted) and ev.user_id == user]
    assert [a.generation_id for a in admitted] == [gid]


async def test_heartbeats_while_idle_and_client_disconnect_cancels_after_grace(kafka_bootstrap, topology, running_processor):
    user = f"u-{uuid.uuid4().hex[:8]}"
    settings = edge_settings(kafka_bootstrap, topology, heartbeat_interval_s=0.1, disconnect_grace_s=0.3)
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=[f"t{i} " for i in range(100)], token_interval_s=0.5) as worker,
        serve_edge(settings) as e,
        e.http() as http,
    ):
        req = http.build_request("POST", "/v1/generations", json=BODY, headers=e.headers(user, "k"))
        resp = await http.send(req, stream=True)
        raw = b""
        it = resp.aiter_bytes()
        async for chunk in it:
            raw += chunk
            if b"generation.text.delta" in raw:
                break
        await resp.aclose()  # the client goes away mid-stream
        assert b": keep-alive\n\n" in raw.split(b"generation.text.delta")[0]
        gid = raw.split(b'"generation_id":"')[1].split(b'"')[0].decode()
        for _ in range(200):
            got = (await http.get(f"/v1/generations/{gid}", headers=e.headers(user))).json()
            if got["status"] == "cancelled":
                break
            await asyncio.sleep(0.05)
        assert got["status"] == "cancelled" and got["partial"] is True
        assert worker.finished[gid].value == "stopped"
        assert e.app.state.edge.metrics.readers_detached._value.get() == 1
    reasons = []
    for _p, _o, _k, value in await read_topic(kafka_bootstrap, topology.ledger):
        reasons += [x.reason.value for x in decode_ledger_entry(value).events if isinstance(x, CancelRequested)]
    assert reasons == ["client_disconnect"]
