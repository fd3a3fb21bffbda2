"""Metrics from every process: each process's ``/metrics`` scraped before and
after one completed and one cancelled generation, and the specific series moved.

The real processor, ``python -m workers --engine sim`` (the one fake: no GPU) with the Cassandra
result store, ``python -m projections.readmodel``, ``python -m projections.history`` and ``python -m
edge``, each on its own metrics port, on a fresh topology and keyspace.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from infra.harness.processes import ProjectionProcess, WorkerProcess, wait_until_deciding
from tests.integration.test_edge_harness import edge_process_factory  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

MODEL = "simulated-text-model"
WAIT_S = 60.0
REJECTIONS_APART = ("quota_exhausted", "rate_limited", "concurrency_limited", "capacity_exhausted")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels``; KeyError when the process does not export it."""
    return samples[(name, frozenset(labels.items()))]


async def scrape(http: httpx.AsyncClient, port: int) -> Samples:
    r = await http.get(f"http://127.0.0.1:{port}/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


async def scrape_all(http: httpx.AsyncClient, ports: dict[str, int]) -> dict[str, Samples]:
    return {name: await scrape(http, port) for name, port in ports.items()}


async def wait_serving(http: httpx.AsyncClient, ports: dict[str, int], procs: dict[str, Any]) -> None:
    deadline = time.monotonic() + WAIT_S
    for name, port in ports.items():
        while True:
            try:
                if (await http.get(f"http://127.0.0.1:{port}/metrics")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            proc = procs.get(name)
            assert proc is None or proc.proc is None or proc.proc.poll() is None, f"{name} exited"
            assert time.monotonic() < deadline, f"{name} serves no /metrics on {port}"
            await asyncio.sleep(0.2)


async def until(check: Any, http: httpx.AsyncClient, ports: dict[str, int], what: str) -> dict[str, Samples]:
    """Scrape every process until ``check(scrapes)`` holds (the writes after a generation are asynchronous)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        scrapes = await scrape_all(http, ports)
        if check(scrapes):
            return scrapes
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.3)


def _sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out


@pytest.fixture
async def stack(kafka_bootstrap, topology, processor_factory, client, cassandra_hosts, cassandra_port, fresh_keyspace,
                tmp_path, edge_process_factory):  # noqa: F811
    ports = {name: free_port() for name in ("processor", "worker", "readmodel", "history")}
    cass = {"CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts), "CHATPLANE_CASSANDRA_PORT": str(cassandra_port),
            "CHATPLANE_CASSANDRA_KEYSPACE": fresh_keyspace}
    processor = processor_factory(CHATPLANE_PROCESSOR_METRICS_PORT=ports["processor"])
    processor.start()
    readmodel = ProjectionProcess(kafka_bootstrap, topology.namespace, tmp_path,
                                  CHATPLANE_READMODEL_METRICS_PORT=ports["readmodel"], **cass)
    history = ProjectionProcess(kafka_bootstrap, topology.namespace, tmp_path, module="projections.history",
                                CHATPLANE_HISTORY_METRICS_PORT=ports["history"], **cass)
    worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_WORKER_RESULT_STORE="cassandra",
                           CHATPLANE_WORKER_REPLAY_STORE="none", CHATPLANE_SIM_TTFT_MS=10,
                           CHATPLANE_SIM_INTER_TOKEN_MS=20, CHATPLANE_SIM_OUTPUT_TOKENS=5000,
                           CHATPLANE_WORKER_METRICS_PORT=ports["worker"], **cass)
    procs = {"processor": processor, "readmodel": readmodel, "history": history, "worker": worker}
    for p in (readmodel, history, worker):
        p.start()
    edge = edge_process_factory()
    try:
        await wait_until_deciding(client)
        await edge.start()
        ports["edge"] = edge.port
        async with httpx.AsyncClient(timeout=10) as http:
            await wait_serving(http, ports, procs)
        # The projections serve /metrics before their schema is made; the result sink needs the read model's.
        deadline = time.monotonic() + WAIT_S
        while not all(f"{name}: started" in p.log_text() for name, p in (("readmodel", readmodel), ("history", history))):
            assert time.monotonic() < deadline, readmodel.log_text()[-2000:] + history.log_text()[-2000:]
            await asyncio.sleep(0.2)
        yield edge, ports
    finally:
        for p in (worker, history, readmodel):
            p.stop()


def _body(tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "max_output_tokens": tokens,
            "messages": [{"role": "user", "content": "Name three colors."}]}


async def test_every_process_serves_metrics_that_move_with_a_generation_and_a_cancel(stack, kafka_bootstrap, topology):
    edge, ports = stack
    user = f"u-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(timeout=10) as scraper:
        before = await scrape_all(scraper, ports)
    # The four rejection codes are separate series from the start, at the processor and the edge.
    for code in REJECTIONS_APART:
        assert value(before["processor"], "chatplane_processor_decisions_total", command="SubmitGeneration",
                     result=code) == 0
        assert value(before["edge"], "chatplane_edge_admissions_total", code=code) == 0
    # Quota correctness: over-admission is a check that stays 0, for each limit.
    for limit in ("messages", "concurrency"):
        assert value(before["processor"], "chatplane_processor_over_admissions_total", limit=limit) == 0

    # One undecodable command: dead-lettered, the partition moves on.
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topology.commands.name, b"not a command", key=user.encode())
    finally:
        await producer.stop()
    async with edge.http() as http:
        # One generation to its end.
        r = await http.post("/v1/generations", headers=edge.headers(user, uuid.uuid4().hex), json=_body(8), timeout=WAIT_S)
        assert r.status_code == 200, r.text
        completed = _sse(r.text)
        assert completed[-1][0] == "generation.completed", completed[-1]
        # One cancelled after its first text.
        async with http.stream("POST", "/v1/generations", headers=edge.headers(user, uuid.uuid4().hex),
                               json=_body(4000), timeout=WAIT_S) as stream:
            assert stream.status_code == 200
            seen, gid, cancelled = "", None, False
            async for chunk in stream.aiter_text():
                seen += chunk
                events = _sse(seen)
                gid = gid or next((d["generation_id"] for name, d in events if name == "generation.created"), None)
                if not cancelled and any(name == "generation.text.delta" for name, _ in events):
                    c = await http.post(f"/v1/generations/{gid}/cancel", headers=edge.headers(user))
                    assert c.status_code in (200, 202), c.text
                    cancelled = True
        assert _sse(seen)[-1][0] == "generation.cancelled", _sse(seen)[-1]

    def delta(scrapes: dict[str, Samples], process: str, name: str, **labels: str) -> float:
        # A series a process creates at its first event is not in the earlier scrape: it was 0.
        return value(scrapes[process], name, **labels) - before[process].get((name, frozenset(labels.items())), 0.0)

    def settled(s: dict[str, Samples]) -> bool:
        return (
            delta(s, "processor", "chatplane_processor_generations_ended_total", status="cancelled", reason="user") >= 1
            and delta(s, "worker", "chatplane_worker_attempts_ended_total", outcome="stopped") >= 1
            and delta(s, "worker", "chatplane_result_sink_stored_total") >= 2
            and delta(s, "readmodel", "chatplane_readmodel_writes_total") >= 2
            and delta(s, "history", "chatplane_history_batches_total") >= 1
        )

    async with httpx.AsyncClient(timeout=10) as scraper:
        after = await until(settled, scraper, ports, "the metrics of both generations")

    # Processor: decisions by command and result, latencies, the quota signals.
    assert delta(after, "processor", "chatplane_processor_decisions_total", command="SubmitGeneration", result="admitted") == 2
    assert delta(after, "processor", "chatplane_processor_decisions_total", command="AcceptAttempt", result="applied") == 2
    assert delta(after, "processor", "chatplane_processor_decisions_total", command="ReportAttemptFinished", result="applied") == 2
    assert delta(after, "processor", "chatplane_processor_decisions_total", command="CancelGeneration", result="cancel_requested") == 1
    assert delta(after, "processor", "chatplane_processor_decide_seconds_count") >= 6
    assert delta(after, "processor", "chatplane_processor_dead_letters_total") == 1
    assert delta(after, "processor", "chatplane_processor_durable_seconds_count") >= 6
    assert delta(after, "processor", "chatplane_processor_generations_ended_total", status="completed", reason="") == 1
    assert delta(after, "processor", "chatplane_processor_reservation_age_seconds_count", settled="consumed") == 2
    assert delta(after, "processor", "chatplane_processor_consumed_without_output_total", end="cancelled") == 1
    assert value(after["processor"], "chatplane_processor_reservations_held") == 0
    assert value(after["processor"], "chatplane_processor_unresolved_dispatches") == 0
    for limit in ("messages", "concurrency"):
        assert value(after["processor"], "chatplane_processor_over_admissions_total", limit=limit) == 0
    lag = [k for k in after["processor"] if k[0] == "chatplane_processor_consumer_lag"]
    assert lag and all(value(after["processor"], name, **dict(labels)) >= 0 for name, labels in lag)
    # Worker: tokens, TTFT, the cancel's stop latency and tokens after it, the result sink's writes.
    assert delta(after, "worker", "chatplane_worker_attempts_accepted_total") == 2
    assert delta(after, "worker", "chatplane_worker_attempts_ended_total", outcome="completed") == 1
    assert delta(after, "worker", "chatplane_worker_output_tokens_total") >= 9
    assert delta(after, "worker", "chatplane_worker_time_to_first_token_seconds_count") == 2
    assert delta(after, "worker", "chatplane_worker_queue_age_at_acceptance_seconds_count") == 2
    assert delta(after, "worker", "chatplane_worker_stop_seconds_count", reason="cancel") == 1
    assert delta(after, "worker", "chatplane_worker_tokens_after_stop_count", reason="cancel") == 1
    assert delta(after, "worker", "chatplane_result_sink_stored_total") == 2
    assert value(after["worker"], "chatplane_worker_slots") >= 1
    assert value(after["worker"], "chatplane_worker_active_sequences") == 0
    assert value(after["worker"], "chatplane_worker_sequences", phase="decode", tier="free") == 0
    # Read model and history: writes and their lag.
    assert delta(after, "readmodel", "chatplane_readmodel_entries_total") >= 6
    assert value(after["readmodel"], "chatplane_readmodel_lag_seconds") > 0
    assert [k for k in after["readmodel"] if k[0] == "chatplane_readmodel_lag_records"]
    assert value(after["readmodel"], "chatplane_readmodel_failures_total") == 0
    # Edge: its admissions and first-token time moved too.
    assert delta(after, "edge", "chatplane_edge_admissions_total", code="admitted") == 2
    assert delta(after, "edge", "chatplane_edge_time_to_first_text_token_seconds_count") == 2
