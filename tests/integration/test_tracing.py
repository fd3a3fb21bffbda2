"""One connected trace per generation across the log, ids only.

The edge (uvicorn, in this process), the real worker with the sim engine (in this process) and the
read-model projection (in this process) export to one ``InMemorySpanExporter``; the admission
processor runs as its real subprocess (``python -m projections``), which cannot share it, and writes
its spans with ``CHATPLANE_TRACING=file`` (one JSON line per span) that the test reads back. Both come
down to the same records (``tracing.span_record``). One generation runs to completion and one is
cancelled while it streams; each must be a single trace whose every span's parent is in the trace,
with the named spans of each hop, no attribute holding the prompt or the output, and the trace
context in the Kafka records' headers, not in their values.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import httpx_sse
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from infra.stores.schema import ReadModelSettings
from projections.readmodel.writer import ReadModelProjection
from infra.runtime import tracing
from infra.harness.processes import wait_until_deciding
from infra.harness.worker_edge import served, worker_settings
from tests.integration.test_edge_harness import edge_settings, serve_edge
from workers.engines.sim import SimConfig, SimulatedEngine
from workers.worker import Worker

pytestmark = pytest.mark.integration

SPANS_WAIT_S = 60.0
STREAM_GUARD_S = 60.0
PROMPT = "Tracing canary prompt: name three colors."
MODEL = "simulated-text-model"
COMMON = {"edge.generation", "edge.checks", "edge.command_append", "processor.decide", "worker.dispatch",
          "worker.prompt", "worker.accept", "worker.first_token", "worker.finalize", "readmodel.write"}
CANCELLED = COMMON | {"edge.cancel", "worker.cancel"}


@pytest.fixture
def memory_spans():
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter), "chatplane-test")
    try:
        yield exporter
    finally:
        tracing.uninstall()


def all_spans(exporter: InMemorySpanExporter, processor_file) -> list[dict]:
    return [tracing.span_record(s) for s in exporter.get_finished_spans()] + tracing.read_span_file(processor_file)


def trace_of(spans: list[dict], generation_id: str) -> list[dict]:
    roots = [s for s in spans if s["name"] == "edge.generation"
             and s["attributes"].get("chatplane.generation_id") == generation_id]
    if len(roots) != 1:
        return []
    return [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]


async def wait_for_trace(exporter, processor_file, generation_id: str, wanted: set[str], terminal_decisions: int) -> list[dict]:
    """Until the trace holds every wanted span name and as many read-model writes as decisions (the last
    ones, the finalization's, arrive after the stream ended)."""
    deadline = time.monotonic() + SPANS_WAIT_S
    while True:
        spans = trace_of(all_spans(exporter, processor_file), generation_id)
        names = {s["name"] for s in spans}
        decides = sum(s["name"] == "processor.decide" for s in spans)
        writes = sum(s["name"] == "readmodel.write" for s in spans)
        if wanted <= names and decides >= terminal_decisions and writes >= decides:
            return spans
        assert time.monotonic() < deadline, f"trace of {generation_id}: have {sorted(names)}, want {sorted(wanted)}"
        await asyncio.sleep(0.2)


def assert_connected(spans: list[dict]) -> None:
    assert len({s["trace_id"] for s in spans}) == 1
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent_id"] is None]
    assert [r["name"] for r in roots] == ["edge.generation"], roots
    orphans = [(s["name"], s["service"]) for s in spans if s["parent_id"] is not None and s["parent_id"] not in ids]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"


def assert_ids_only(spans: list[dict], texts: list[str]) -> None:
    for s in spans:
        for key, value in s["attributes"].items():
            assert key.startswith("chatplane."), (s["name"], key)
            if isinstance(value, str):
                for text in texts:
                    assert text not in value, (s["name"], key)


async def ledger_records(bootstrap: str, topic: str, partitions: int) -> list[tuple[bytes, dict[str, bytes]]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out = []
        deadline = time.monotonic() + 30
        while any([await consumer.position(tp) < ends[tp] for tp in tps]):
            assert time.monotonic() < deadline, "could not read the ledger to its end"
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out += [(r.value or b"", dict(r.headers or ())) for r in records]
        return out
    finally:
        await consumer.stop()


async def stream(http, edge, user: str, max_output_tokens: int, on_first_delta=None) -> tuple[str, list[str], str]:
    """POST a streaming generation; (generation id, text deltas, terminal event)."""
    body = {"model": MODEL, "stream": True, "max_output_tokens": max_output_tokens,
            "messages": [{"role": "user", "content": PROMPT}]}
    gid, texts = "", []
    async with asyncio.timeout(STREAM_GUARD_S):
        async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=body,
                                          headers=edge.headers(user, uuid.uuid4().hex)) as es:
            assert es.response.status_code == 200, await es.response.aread()
            async for sse in es.aiter_sse():
                data = sse.json()
                if sse.event == "generation.created":
                    gid = data["generation_id"]
                elif sse.event == "generation.text.delta":
                    texts.append(data["delta"])
                    if on_first_delta is not None and len(texts) == 1:
                        await on_first_delta(gid)
                elif sse.event in ("generation.completed", "generation.cancelled", "generation.error"):
                    return gid, texts, sse.event
    raise AssertionError("the stream ended without a terminal event")


async def test_one_generation_and_one_cancelled_are_each_one_connected_trace(
    kafka_bootstrap, topology, processor_factory, client, cassandra_hosts, cassandra_port, fresh_keyspace,
    tmp_path, memory_spans,
):
    processor_file = tmp_path / "processor-spans.jsonl"
    processor = processor_factory(CHATPLANE_TRACING="file", CHATPLANE_TRACING_FILE=processor_file)
    processor.start()
    await wait_until_deciding(client)
    projection = ReadModelProjection(
        kafka_bootstrap, topology, ReadModelSettings(hosts=tuple(cassandra_hosts), port=cassandra_port, keyspace=fresh_keyspace)
    )
    await projection.start()
    projecting = asyncio.create_task(projection.run())
    sim = SimConfig(ttft_ms=20, inter_token_ms=20, jitter_ms=0, output_tokens=1_000)
    try:
        async with (
            Worker(worker_settings(kafka_bootstrap, topology), SimulatedEngine(sim), served()),
            serve_edge(edge_settings(kafka_bootstrap, topology)) as edge,
            edge.http() as http,
        ):
            done_gid, done_texts, end = await stream(http, edge, f"u-{uuid.uuid4().hex[:8]}", 6)
            assert end == "generation.completed" and "".join(done_texts)

            async def cancel(gid: str) -> None:
                r = await http.post(f"/v1/generations/{gid}/cancel", headers=edge.headers(user))
                assert r.status_code in (200, 202), r.text

            user = f"u-{uuid.uuid4().hex[:8]}"
            cancelled_gid, cancelled_texts, end = await stream(http, edge, user, 900, on_first_delta=cancel)
            assert end == "generation.cancelled"

            # Submit, accept, finalize: three decisions at least (the cancel adds its own).
            done = await wait_for_trace(memory_spans, processor_file, done_gid, COMMON, 3)
            cancelled = await wait_for_trace(memory_spans, processor_file, cancelled_gid, CANCELLED, 4)
    finally:
        projection.stop()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(projecting, 10)
        await projection.close()

    for spans, texts, gid in ((done, done_texts, done_gid), (cancelled, cancelled_texts, cancelled_gid)):
        assert_connected(spans)
        services = {s["service"] for s in spans}
        assert services == {"chatplane-test", "chatplane-processor"}, services
        # Every decision of the generation is in its trace: submit, accept, (cancel,) finalize.
        kinds = {s["attributes"].get("chatplane.command_type") for s in spans if s["name"] == "processor.decide"}
        assert {"SubmitGeneration", "AcceptAttempt", "ReportAttemptFinished"} <= kinds, kinds
        assert all(s["attributes"].get("chatplane.generation_id") == gid
                   for s in spans if s["name"] in ("processor.decide", "worker.dispatch", "worker.finalize"))
        assert_ids_only(spans, [PROMPT, "".join(texts), *(t for t in texts if len(t) >= 4)])
    assert "CancelGeneration" in {s["attributes"].get("chatplane.command_type") for s in cancelled}
    assert done[0]["trace_id"] != cancelled[0]["trace_id"]

    # The context travels in the ledger records' headers, never in their values.
    records = await ledger_records(kafka_bootstrap, topology.ledger.name, topology.ledger.partitions)
    traced = [(value, h) for value, h in records if tracing.TRACEPARENT in h]
    assert traced, "no ledger record carries a traceparent header"
    for value, headers in traced:
        trace_id = headers[tracing.TRACEPARENT].decode().split("-")[1]
        assert trace_id.encode() not in value and b"traceparent" not in value
