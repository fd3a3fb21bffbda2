"""infra/runtime/tracing.py: off costs nothing and adds no header; on, the context goes through
Kafka headers and spans carry ids only. The whole-stack trace is tests/integration/test_tracing.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from infra.runtime import tracing
from infra.runtime.command_client import CommandClient
from infra.runtime.settings import SettingsError
from schemas.codes import Tier
from schemas.commands import ReplyTo, SubmitGeneration
from schemas.topics import Topology

ROOT = Path(__file__).resolve().parents[2]


class RecordingProducer:
    """Stands in for aiokafka's producer: records what each send was given."""

    def __init__(self) -> None:
        self.sends: list[dict] = []

    async def send_and_wait(self, topic, value=None, key=None, partition=None, headers=None):
        self.sends.append({"topic": topic, "key": key, "headers": headers})


def submit() -> SubmitGeneration:
    return SubmitGeneration(
        command_id="c1", user_id="u1", issued_at_ms=1, idempotency_key="k", fingerprint="f", model_alias="m",
        tier=Tier.FREE, stream=True, max_output_tokens=8, input_tokens=3,
        reply_to=ReplyTo(topic="inbox", partition=0, request_id="r"),
    )


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter), "unit")
    try:
        yield exporter
    finally:
        tracing.uninstall()


def test_off_every_hook_is_a_no_op():
    assert tracing.ENABLED is False
    assert tracing.extract([(tracing.TRACEPARENT, b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")]) is None
    assert tracing.start("x", None, root=True, generation_id="g") is None
    assert tracing.headers(None) is None
    assert tracing.begin_generation(time.monotonic(), submit()) is None
    assert tracing.generation_headers(None) is None
    assert tracing.record("x", None, 0) is None
    assert tracing.now_ns() == 0
    assert tracing.parents([[object()]]) == []  # records are not even looked at
    tracing.remember("g", None)
    assert tracing.recall("g") is None
    tracing.end(None)
    tracing.end_generation(None)


async def test_off_no_header_is_added_to_a_command():
    client = CommandClient("127.0.0.1:1", Topology("t"), 0)
    client._producer = RecordingProducer()
    traced = tracing.begin_generation(time.monotonic(), submit())
    await client.send(submit(), tracing.generation_headers(traced))
    assert client._producer.sends == [{"topic": "t.chatplane.commands", "key": b"u1", "headers": None}]


def test_off_by_default_imports_no_sdk():
    """Without CHATPLANE_TRACING the module neither turns on nor imports the SDK."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPLANE_TRACING")}
    code = ("import sys; from infra.runtime import tracing; "
            "on = tracing.configure('x'); "
            "print(on, tracing.ENABLED, any(m.startswith('opentelemetry.sdk') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr


async def test_on_the_context_travels_in_headers_and_spans_chain(spans):
    client = CommandClient("127.0.0.1:1", Topology("t"), 0)
    client._producer = RecordingProducer()
    traced = tracing.begin_generation(time.monotonic() - 0.01, submit())
    await client.send(submit(), tracing.generation_headers(traced))
    tracing.end_generation(traced)
    sent = client._producer.sends[0]["headers"]
    assert [k for k, _ in sent] == [tracing.TRACEPARENT]
    parent = tracing.extract(sent)
    child = tracing.start("processor.decide", parent, command_type="SubmitGeneration")
    tracing.end(child, outcome="admitted")
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert set(finished) == {"edge.generation", "edge.checks", "edge.command_append", "processor.decide"}
    root = finished["edge.generation"]
    assert root.parent is None
    assert {s.context.trace_id for s in finished.values()} == {root.context.trace_id}
    assert finished["processor.decide"].parent.span_id == finished["edge.command_append"].context.span_id
    assert finished["edge.checks"].start_time == root.start_time  # the checks run from the request's arrival
    assert dict(finished["processor.decide"].attributes) == {
        "chatplane.command_type": "SubmitGeneration", "chatplane.outcome": "admitted"}
    # Without a parent nothing but the edge starts a trace.
    assert tracing.start("processor.decide", None) is None
    assert tracing.extract([("other", b"x")]) is None


def test_on_attributes_are_ids_only(spans):
    with pytest.raises(ValueError, match="not an id"):
        tracing.start("x", None, root=True, text="hello")
    s = tracing.start("x", None, root=True, generation_id="g" * 500)
    tracing.end(s)
    assert spans.get_finished_spans()[0].attributes["chatplane.generation_id"] == "g" * tracing.ATTRIBUTE_CHARS_MAX


def test_on_the_edge_remembers_roots_bounded(spans):
    tracing.install(SimpleSpanProcessor(spans), "unit", roots_max=2)
    traced = {}
    for gid in ("g1", "g2", "g3"):
        traced[gid] = tracing.begin_generation(time.monotonic(), submit())
        tracing.end_generation(traced[gid])
        tracing.remember(gid, traced[gid])
    assert tracing.recall("g1") is None
    assert tracing.recall("g3").get_span_context().span_id == traced["g3"][0].get_span_context().span_id
    cancel = tracing.start("edge.cancel", tracing.recall("g3"), root=True)
    tracing.end(cancel)
    assert cancel.parent.span_id == traced["g3"][0].get_span_context().span_id


def test_configure_refuses_bad_settings(monkeypatch):
    monkeypatch.setenv("CHATPLANE_TRACING", "jaeger")
    with pytest.raises(SettingsError, match="CHATPLANE_TRACING"):
        tracing.configure("x")
    monkeypatch.setenv("CHATPLANE_TRACING", "file")
    monkeypatch.delenv("CHATPLANE_TRACING_FILE", raising=False)
    with pytest.raises(SettingsError, match="CHATPLANE_TRACING_FILE"):
        tracing.configure("x")
    assert tracing.ENABLED is False


def test_otlp_mode_needs_an_endpoint_and_then_batches_to_it(monkeypatch):
    monkeypatch.setenv("CHATPLANE_TRACING", "otlp")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    with pytest.raises(SettingsError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        tracing.configure("x")
    assert tracing.ENABLED is False
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")  # nothing listens: never sent here
    try:
        assert tracing.configure("svc") is True
        batch = tracing._provider._active_span_processor._span_processors[0]._batch_processor
        assert type(batch._exporter).__name__ == "OTLPSpanExporter"
    finally:
        tracing.uninstall()  # no span was made: nothing is sent towards the missing collector


def test_file_mode_writes_bounded_json_lines(monkeypatch, tmp_path):
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("CHATPLANE_TRACING", "file")
    monkeypatch.setenv("CHATPLANE_TRACING_FILE", str(path))
    monkeypatch.setenv("CHATPLANE_TRACING_FILE_SPANS_MAX", "2")
    try:
        assert tracing.configure("svc") is True
        root = tracing.start("a", None, root=True, generation_id="g")
        for name in ("b", "c"):
            tracing.end(tracing.start(name, root))
        tracing.end(root)
    finally:
        tracing.uninstall()
    lines = tracing.read_span_file(path)
    assert [s["name"] for s in lines] == ["b", "c"]
    assert lines[0]["service"] == "svc" and lines[0]["parent_id"] == f"{root.get_span_context().span_id:016x}"


def test_drop_mode_encodes_and_drops(monkeypatch):
    monkeypatch.setenv("CHATPLANE_TRACING", "drop")
    try:
        assert tracing.configure("svc") is True
        tracing.end(tracing.start("a", None, root=True))
        tracing.flush()
        exporter = tracing._provider._active_span_processor._span_processors[0]._batch_processor._exporter
        assert exporter.spans == 1 and exporter.bytes > 0
    finally:
        tracing.uninstall()
