"""Admission beyond message counts, the edge/worker half: the per-address bucket before
authentication (must-show 4) and the policy checks at their two boundaries.

Real parts only: ``python -m edge`` subprocesses, the real processor, a ``python -m workers --engine sim``
worker (the one fake: no GPU). Two client addresses are simulated through the forwarding header from a
trusted loopback peer (127.0.0.1); an untrusted peer is the same machine's 127.0.0.2 (Linux routes all
of 127/8 to loopback), whose forwarding header must be ignored.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from projections.ledger.audit import audit
from infra.runtime.topic_reader import read_topic
from schemas import commands as cmd
from schemas import events as ev
from schemas.codes import RejectionCode
from schemas.wire import decode_command
from infra.harness.processes import HTTP_TIMEOUT_S, WorkerProcess, wait_until_committed, wait_until_deciding
from tests.integration.test_edge_errors import body, typed
from tests.integration.test_edge_harness import edge_process_factory  # noqa: F401 (fixture)
from tests.integration.workers_harness import ledger_events

pytestmark = pytest.mark.integration

IP_BURST = 20
IP_RATE_PER_S = 1.0
FLOOD = 1_000
WAIT_S = 60.0
BLOCKED = "sim-token-5"  # the simulator's fifth token (workers/engines/sim.py): "sim-token-1 sim-token-2 ..."


def _from(url: str, local_address: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url, timeout=HTTP_TIMEOUT_S, transport=httpx.AsyncHTTPTransport(local_address=local_address)
    )


def _ip_refusal(resp: httpx.Response) -> None:
    err = typed(resp, RejectionCode.RATE_LIMITED)
    assert err["details"]["scope"] == "ip" and err["details"]["retry_after_ms"] > 0, err


async def test_must_show_4_a_bad_token_flood_from_one_address_is_refused_by_its_bucket(edge_process_factory):  # noqa: F811
    edge = edge_process_factory(
        CHATPLANE_EDGE_IP_BURST=str(IP_BURST), CHATPLANE_EDGE_IP_RATE_PER_S=str(IP_RATE_PER_S),
        CHATPLANE_EDGE_TRUSTED_PROXIES="127.0.0.1/32",
    )
    await edge.start()
    bad = {"Authorization": "Bearer not-a-token", "Idempotency-Key": "k"}
    async with _from(edge.url, "127.0.0.1") as proxy, _from(edge.url, "127.0.0.2") as stranger:
        # 1,000 requests with invalid tokens from 198.51.100.1 (through the trusted proxy, 127.0.0.1).
        started = time.monotonic()
        codes = []
        for _ in range(FLOOD):
            resp = await proxy.post("/v1/generations", json=body("hi"), headers={**bad, "X-Forwarded-For": "198.51.100.1"})
            codes.append(resp.status_code)
            if resp.status_code == 429:
                _ip_refusal(resp)
            else:
                typed(resp, RejectionCode.UNAUTHORIZED)
        elapsed_s = time.monotonic() - started
        # The burst was spent on authentication failures, then the bucket refused before any token work;
        # only its refill (rate x elapsed) let more through.
        assert codes[:IP_BURST] == [401] * IP_BURST
        assert codes[IP_BURST] == 429
        unauthorized = codes.count(401)
        assert unauthorized <= IP_BURST + IP_RATE_PER_S * elapsed_s + 1, (unauthorized, elapsed_s)
        assert codes.count(429) == FLOOD - unauthorized >= FLOOD // 2
        print(f"flood: {FLOOD} requests in {elapsed_s:.1f} s: {unauthorized} x 401, {FLOOD - unauthorized} x 429 scope=ip")

        # A different address behind the same proxy is unaffected: its bad token is a 401, its good
        # token passes authentication (a 404 for an unknown generation).
        other = {"X-Forwarded-For": "198.51.100.2"}
        typed(await proxy.post("/v1/generations", json=body("hi"), headers={**bad, **other}), RejectionCode.UNAUTHORIZED)
        resp = await proxy.get("/v1/generations/gen_unknown", headers={**edge.headers("u-other"), **other})
        typed(resp, RejectionCode.NOT_FOUND)

        # From an untrusted peer the header is ignored: every request counts against 127.0.0.2 itself,
        # whatever address it claims, so a fresh spoofed address each time does not escape the bucket.
        spoofed = []
        for i in range(IP_BURST + 10):
            resp = await stranger.post(
                "/v1/generations", json=body("hi"), headers={**bad, "X-Forwarded-For": f"203.0.113.{i % 250}"}
            )
            spoofed.append(resp.status_code)
        assert spoofed.count(401) <= IP_BURST + 2 and spoofed[-1] == 429, spoofed
        _ip_refusal(resp)
        # ... and claiming the other client's address from there did not spend that client's bucket.
        resp = await proxy.get("/v1/generations/gen_unknown", headers={**edge.headers("u-other"), **other})
        typed(resp, RejectionCode.NOT_FOUND)


async def _count_stream(http: httpx.AsyncClient, headers: dict[str, str]) -> list[tuple[str, dict]]:
    """One streamed generation of up to 30 simulator tokens: its SSE events, to the end."""
    async with http.stream("POST", "/v1/generations", json=body("Count for me.", stream=True, max_output_tokens=30),
                           headers=headers) as stream:
        assert stream.status_code == 200
        return _sse((await stream.aread()).decode())


def _sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out


async def test_the_prompt_and_output_checks_refuse_at_their_boundaries(
    kafka_bootstrap, topology, processor_factory, client, edge_process_factory, tmp_path  # noqa: F811
):
    processor = processor_factory()
    processor.start()
    await wait_until_deciding(client)
    worker = WorkerProcess(
        kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_SIM_TTFT_MS=10, CHATPLANE_SIM_INTER_TOKEN_MS=20,
        CHATPLANE_SIM_OUTPUT_TOKENS=40, CHATPLANE_POLICY_BLOCKLIST=BLOCKED,
    )
    worker.start()
    try:
        edge = edge_process_factory(CHATPLANE_POLICY_BLOCKLIST=f"unrelated,{BLOCKED}")
        await edge.start()
        user = f"u-{uuid.uuid4().hex[:8]}"
        async with edge.http() as http:
            # The prompt boundary: refused at the edge with the typed code, the text never echoed.
            resp = await http.post("/v1/generations", json=body(f"Please say {BLOCKED.upper()} twice."),
                                   headers=edge.headers(user, "refused-key"))
            err = typed(resp, RejectionCode.PROMPT_REFUSED)
            assert BLOCKED not in resp.text.lower() and err["details"] == {}

            # The output boundary: the simulator's fifth token is refused between decode steps.
            events = await _count_stream(http, edge.headers(user, "output-key"))
            # Without a stream, the refusal is the HTTP answer itself (no header had gone out).
            resp = await http.post("/v1/generations", json=body("Count again.", max_output_tokens=30),
                                   headers=edge.headers(user, "plain-key"))
            err = typed(resp, RejectionCode.OUTPUT_REFUSED)
            assert err["generation_id"] and err["partial"] is True and BLOCKED not in resp.text
        names = [name for name, _ in events]
        assert names[0] == "generation.created" and names[-1] == "generation.error", names
        error = events[-1][1]
        assert (error["code"], error["action"], error["partial"]) == ("output_refused", "change_request", True)
        text = "".join(data["delta"] for name, data in events if name == "generation.text.delta")
        assert text.endswith("sim-token-4") and BLOCKED not in text, text
        gid = events[0][1]["generation_id"]

        # The ledger: finalized failed with that code after acceptance (the message is spent); the usage
        # record names the reason. Nothing was appended for the refused prompt.
        deadline = time.monotonic() + WAIT_S
        while not any(isinstance(e, ev.GenerationFailed) for e in await ledger_events(kafka_bootstrap, topology, gid)):
            assert time.monotonic() < deadline, "no GenerationFailed"
            await asyncio.sleep(0.2)
        events_of = await ledger_events(kafka_bootstrap, topology, gid)
        (failed,) = [e for e in events_of if isinstance(e, ev.GenerationFailed)]
        assert failed.code is RejectionCode.OUTPUT_REFUSED and failed.partial
        assert any(isinstance(e, ev.AttemptAccepted) for e in events_of)
        (usage,) = [e for e in events_of if isinstance(e, ev.UsageRecorded)]
        assert usage.terminal_reason == "output_refused"
        submits = [decode_command(r[3]) for r in await read_topic(kafka_bootstrap, topology.commands)]
        keys = [c.idempotency_key for c in submits if isinstance(c, cmd.SubmitGeneration) and c.user_id == user]
        assert keys == ["output-key", "plain-key"], keys

        await wait_until_committed(kafka_bootstrap, topology)
        processor.stop()
        report = await audit(kafka_bootstrap, topology, concurrency_limit=2)
        assert report.ok, report.render()
        assert report.consumed == 2 and report.released == 0  # both refused answers spent their message
    finally:
        worker.stop()


async def test_the_output_check_holds_back_the_first_part_of_a_term_split_across_chunks(
    kafka_bootstrap, topology, processor_factory, client, edge_process_factory, tmp_path  # noqa: F811
):
    """The hold-back window (docs/policy.md): the simulator sends one token per chunk, so a two-token
    term arrives split. Its first token is held until the second refuses it (never sent); a held
    token that no term completes goes out with the next chunk, or at the end of the answer."""
    processor = processor_factory()
    processor.start()
    await wait_until_deciding(client)
    worker = WorkerProcess(
        kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_SIM_TTFT_MS=10, CHATPLANE_SIM_INTER_TOKEN_MS=20,
        CHATPLANE_SIM_OUTPUT_TOKENS=40, CHATPLANE_POLICY_BLOCKLIST="sim-token-2 never,sim-token-3 sim-token-4",
    )
    worker.start()
    try:
        edge = edge_process_factory()
        await edge.start()
        user = f"u-{uuid.uuid4().hex[:8]}"
        async with edge.http() as http:
            events = await _count_stream(http, edge.headers(user, "split-key"))
            # Three tokens: "sim-token-3" ends the answer held (the term's first part) and is released
            # at the end, since no fourth token completes it.
            resp = await http.post("/v1/generations", json=body("Count to three.", max_output_tokens=3),
                                   headers=edge.headers(user, "short-key"))
            assert resp.status_code == 200, resp.text
            doc = resp.json()
        names = [name for name, _ in events]
        assert names[0] == "generation.created" and names[-1] == "generation.error", names
        assert events[-1][1]["code"] == "output_refused"
        deltas = [data["delta"] for name, data in events if name == "generation.text.delta"]
        # "sim-token-2" was held (it may begin "sim-token-2 never") and released with the third token's
        # space; "sim-token-3" was held (it may begin the refused term) and never sent.
        assert "".join(deltas) == "sim-token-1 sim-token-2 ", deltas
        assert doc["status"] == "completed" and doc["output"] == [{"type": "text", "text": "sim-token-1 sim-token-2 sim-token-3"}], doc
    finally:
        worker.stop()
        processor.stop()
