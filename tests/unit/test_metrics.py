"""Metrics from every process (docs/metrics.md): the /metrics server, the processor's quota signals on
the pure core's decisions, the worker's per-attempt observations, and the drift checks that keep
the Grafana dashboard, the Prometheus config and the docs in step with what the processes export."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.policy import Policy
from edge.metrics import EdgeMetrics
from projections.ledger.metrics import ProcessorMetrics
from projections.ledger.processor import ProcessorStats
from projections.history.metrics import history_metrics
from projections.readmodel.metrics import readmodel_metrics
from projections.readmodel.writer import ProjectionStats
from projections.history.writer import HistoryStats
from infra.runtime.metrics_http import LoopHistogram, MetricsPortUnavailable, MetricsServer, start_metrics_server
from schemas.codes import FinishOutcome, Tier
from schemas.topics import Topology
from infra.harness.worker_edge import served, worker_settings
from tests.unit.ledger_dsl import Ledger, types
from workers.attempt import AttemptTrace, StopReason
from workers.engines.sim import SimulatedEngine
from workers.metrics import WorkerMetrics
from workers.result_sink import CassandraResultSink
from workers.worker import Worker

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "chatplane-dashboard.json"
PROMETHEUS = ROOT / "infra" / "prometheus" / "prometheus.yml"
DOCS = ROOT / "docs" / "metrics.md"


# --- the /metrics server --------------------------------------------------------------------------


async def _request(port: int, raw: bytes) -> bytes:
    """Send ``raw`` and read to EOF; b"" when the server closed without answering."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    except ConnectionError:  # closed unanswered with our bytes unread: a reset
        return b""
    finally:
        writer.close()


async def test_the_server_answers_get_metrics_with_the_registry_and_nothing_else():
    registry = CollectorRegistry()
    Counter("chatplane_test_things", "things", registry=registry).inc(3)
    server = MetricsServer(registry, "127.0.0.1", 0, name="test")
    port = await server.start()
    try:
        ok = await _request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body = ok.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 OK") and b"text/plain" in head
        assert b"chatplane_test_things_total 3.0" in body
        assert (await _request(port, b"GET /other HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404")
        assert (await _request(port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405")
        assert (await _request(port, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400")
        assert (await _request(port, b"GET /healthz HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200")
        # A request head over the bound is closed unanswered.
        assert await _request(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n") == b""
        assert server.scrapes == 1 and server.connections == 0
    finally:
        await server.close()


async def test_connections_over_the_bound_are_closed_unanswered():
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, connections_max=1)
    port = await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # holds the one connection (no request yet)
        deadline = time.monotonic() + 5
        while server.connections < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert await _request(port, b"GET /metrics HTTP/1.1\r\n\r\n") == b""
        writer.write(b"GET /metrics HTTP/1.1\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        await server.close()


async def test_port_zero_serves_nothing_and_a_taken_port_is_a_typed_error():
    assert await start_metrics_server(CollectorRegistry(), 0, name="off") is None
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    port = await server.start()
    try:
        with pytest.raises(MetricsPortUnavailable, match=f"127.0.0.1:{port}"):
            await start_metrics_server(CollectorRegistry(), port, name="second", host="127.0.0.1")
    finally:
        await server.close()


def test_the_loop_histogram_counts_as_prometheus_does_bounds_inclusive_and_cumulative():
    h = LoopHistogram((0.5, 1.0))
    for v in (0.1, 0.5, 0.7, 3.0):
        h.observe(v)
    assert h.buckets() == [("0.5", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and h.total == pytest.approx(4.3)


# --- the processor's signals, on the pure core's decisions ------------------------------------------


class Observed(Ledger):
    """The DSL's ledger, every decision also fed to ``ProcessorMetrics.decided`` as the processor does."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.metrics = ProcessorMetrics(self.policy.concurrency_limit, clock_ms=lambda: self.now_ms)

    def run(self, command: Any) -> Any:
        before = self.state
        decision = super().run(command)
        self.metrics.decided(0, command, before, self.state, decision, False, 0.001)
        return decision

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        assert value is not None, (name, labels)
        return value


def test_decisions_count_by_command_and_result_with_the_four_refusals_apart():
    ledger = Observed(policy=Policy(quota_limit_by_tier={Tier.FREE: 1, Tier.PAID: 1}))
    for code in ("quota_exhausted", "rate_limited", "concurrency_limited", "capacity_exhausted"):
        assert ledger.sample("chatplane_processor_decisions_total", command="SubmitGeneration", result=code) == 0
    ledger.submit("k1")
    ledger.submit("k2")  # over the quota of 1
    again = ledger.submit("k1").outcome  # the same key while it runs: its own result
    assert ledger.sample("chatplane_processor_decisions_total", command="SubmitGeneration", result="admitted") == 1
    assert ledger.sample("chatplane_processor_decisions_total", command="SubmitGeneration", result="quota_exhausted") == 1
    assert again.code is not None and again.code.value == "generation_in_progress"
    assert ledger.sample("chatplane_processor_decisions_total", command="SubmitGeneration", result="generation_in_progress") == 1
    assert ledger.sample("chatplane_processor_decide_seconds_count") == 3
    assert ledger.sample("chatplane_processor_over_admissions_total", limit="messages") == 0


def test_reservation_age_and_unresolved_dispatches_follow_the_reservation():
    ledger = Observed()
    ledger.submit()
    ledger.advance(3_000)
    held, oldest_s, unresolved = ledger.metrics.reservations_now(None)
    assert (held, oldest_s, unresolved) == (1, 3.0, 0)
    # Past its reconcile deadline (queue deadline + grace) without acceptance: unresolved.
    ledger.advance(ledger.policy.queue_wait_max_ms + ledger.policy.reconcile_grace_ms)
    assert ledger.metrics.reservations_now(None)[2] == 1
    assert ledger.metrics.reservations_now({5}) == (0, 0.0, 0)  # its partition (0) is no longer assigned here


def test_consumed_reservations_repeated_and_stale_accepts_and_cancels_after_consumption():
    ledger = Observed()
    gid = ledger.submit().events[0].generation_id
    ledger.advance(250)
    assert "ReservationConsumed" in types(ledger.accept(gid))
    assert ledger.sample("chatplane_processor_reservation_age_seconds_count", settled="consumed") == 1
    assert ledger.sample("chatplane_processor_reservation_age_seconds_sum", settled="consumed") == pytest.approx(0.25)
    assert ledger.metrics.reservations_now(None)[0] == 0
    ledger.accept(gid)  # the owner repeats it (its answer was lost)
    ledger.accept(gid, worker="w2")  # another worker: stale
    assert ledger.sample("chatplane_processor_duplicate_consumes_refused_total", reason="repeat") == 1
    assert ledger.sample("chatplane_processor_duplicate_consumes_refused_total", reason="stale") == 1
    ledger.cancel(gid)
    ledger.report(gid, outcome=FinishOutcome.STOPPED, finish_reason="cancel")
    assert ledger.sample("chatplane_processor_generations_ended_total", status="cancelled", reason="user") == 1
    assert ledger.sample("chatplane_processor_consumed_without_output_total", end="cancelled") == 1
    # A cancel before acceptance consumed nothing.
    other = ledger.submit("k2").events[0].generation_id
    ledger.cancel(other)
    assert ledger.sample("chatplane_processor_consumed_without_output_total", end="cancelled") == 1
    assert ledger.sample("chatplane_processor_reservation_age_seconds_count", settled="released") == 1


def test_a_redelivered_accept_counts_as_a_refused_duplicate_not_as_a_decision():
    ledger = Observed()
    gid = ledger.submit().events[0].generation_id
    before = ledger.state
    decision = ledger.accept(gid)
    ledger.metrics.decided(0, _last_accept(ledger, gid), before, ledger.state, decision, True, 0.001)
    assert ledger.sample("chatplane_processor_duplicate_consumes_refused_total", reason="redelivered") == 1
    assert ledger.sample("chatplane_processor_decisions_total", command="AcceptAttempt", result="applied") == 1


def _last_accept(ledger: Ledger, gid: str) -> Any:
    from schemas.commands import AcceptAttempt

    return AcceptAttempt(command_id="again", user_id=ledger.user_id, issued_at_ms=ledger.now_ms, generation_id=gid,
                         epoch=1, worker_id="w1")


def test_the_over_admission_check_fires_on_a_state_over_its_limits():
    """Not a constant: an admission that left the window or the slots over their limits is counted."""
    ledger = Observed(policy=Policy(quota_limit_by_tier={Tier.FREE: 2, Tier.PAID: 2}, concurrency_limit=1))
    submit = ledger.submit_cmd("k1")
    before = ledger.state
    decision = ledger.run(submit)
    assert ledger.sample("chatplane_processor_over_admissions_total", limit="messages") == 0
    after = ledger.state
    window_start = next(iter(after.windows))
    over_quota = replace(after, windows={window_start: replace(after.windows[window_start], used=2)})
    ledger.metrics.decided(0, submit, before, over_quota, decision, False, 0.001)
    assert ledger.sample("chatplane_processor_over_admissions_total", limit="messages") == 1
    over_slots = replace(after, slots={**after.slots, 7: "gen_other"})
    ledger.metrics.decided(0, submit, before, over_slots, decision, False, 0.001)
    assert ledger.sample("chatplane_processor_over_admissions_total", limit="concurrency") == 1


# --- the worker's per-attempt observations --------------------------------------------------------


def test_attempt_traces_feed_the_worker_histograms_and_declines_by_closed_reason():
    metrics = WorkerMetrics()
    metrics.observe_attempt(AttemptTrace("gen_a", 1, declined="not_accepted:stale_attempt"))
    metrics.observe_attempt(AttemptTrace("gen_b", 1, declined="queue_deadline"))
    now = time.monotonic()
    cancelled = AttemptTrace(
        "gen_c", 1, accepted=True, taken_at=now - 1.0, accepted_at=now - 0.9, engine_started_at=now - 0.9,
        engine_first_token_at=now - 0.8, stop_requested_at=now - 0.3, stop_reason=StopReason.CANCEL,
        tokens_at_stop=10, stopped_at=now - 0.25, output_tokens=12, outcome=FinishOutcome.STOPPED,
        authorized_at_ms=int((time.time() - 1.2) * 1000),
    )
    completed = AttemptTrace(
        "gen_d", 1, accepted=True, accepted_at=now - 0.5, engine_started_at=now - 0.5, engine_first_token_at=now - 0.4,
        stopped_at=now - 0.1, output_tokens=4, outcome=FinishOutcome.COMPLETED, authorized_at_ms=int(time.time() * 1000) - 600,
    )
    metrics.observe_attempt(cancelled)
    metrics.observe_attempt(completed)

    def sample(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, labels)
        assert value is not None, (name, labels)
        return value

    assert sample("chatplane_worker_declines_total", reason="not_accepted") == 1
    assert sample("chatplane_worker_declines_total", reason="queue_deadline") == 1
    assert sample("chatplane_worker_attempts_accepted_total") == 2
    assert sample("chatplane_worker_output_tokens_total") == 16
    assert sample("chatplane_worker_stop_seconds_count", reason="cancel") == 1
    assert sample("chatplane_worker_stop_seconds_sum", reason="cancel") == pytest.approx(0.05, abs=1e-6)
    assert sample("chatplane_worker_tokens_after_stop_sum", reason="cancel") == 2
    assert sample("chatplane_worker_inter_token_seconds_count") == 1  # the completed one only
    assert sample("chatplane_worker_inter_token_seconds_sum") == pytest.approx(0.1, abs=1e-6)  # 0.3 s / 3 gaps
    assert sample("chatplane_worker_queue_age_at_acceptance_seconds_sum") == pytest.approx(0.3 + 0.1, abs=0.05)
    assert sample("chatplane_worker_prefill_seconds_count") == 2


# --- drift: the dashboard, the Prometheus config and the docs against what is exported -------------


def _exported_names() -> dict[str, set[str]]:
    """Every sample name each process exports, from its real metrics classes (the scraped series read
    from stand-ins with the attributes the collectors read)."""
    processor = ProcessorMetrics(2)
    processor.bind(_FakeProcessor())
    worker = WorkerMetrics()
    worker.bind(Worker(worker_settings("127.0.0.1:1", Topology("t"), kv_tokens_max=1000), SimulatedEngine(), served()),
                CassandraResultSink(opener=_never))
    topology = Topology("t")
    readmodel, history = readmodel_metrics(topology), history_metrics(topology)
    readmodel.bind(_FakeConsumerOwner(ProjectionStats(), topology.ledger.name))
    history.bind(_FakeConsumerOwner(HistoryStats(), topology.answers.name))
    out = {}
    for name, registry in (("edge", EdgeMetrics().registry), ("processor", processor.registry), ("worker", worker.registry),
                           ("readmodel", readmodel.registry), ("history", history.registry)):
        out[name] = {s.name for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    return out


async def _never() -> Any:
    raise AssertionError("not opened in this test")


class _FakeProcessor:
    stats = ProcessorStats()
    _pending: deque[Any] = deque([object()])

    def assigned_command_partitions(self) -> set[int]:
        return {0, 1}

    def partition_lag(self, assigned: set[int]) -> dict[int, int]:
        return {p: 3 for p in assigned}


class _FakeConsumer:
    def __init__(self, topic: str) -> None:
        from aiokafka import TopicPartition

        self.tp = TopicPartition(topic, 0)

    def assignment(self) -> set[Any]:
        return {self.tp}

    def highwater(self, tp: Any) -> int:
        return 10


class _FakeConsumerOwner:
    def __init__(self, stats: Any, topic: str) -> None:
        self.stats, self.consumer = stats, _FakeConsumer(topic)
        stats.positions[self.consumer.tp] = 7


def _base(name: str) -> str:
    return re.sub(r"_(bucket|count|sum|total|created)$", "", name)


def test_the_scraped_series_report_what_their_sources_hold():
    names = _exported_names()
    topology = Topology("t")
    readmodel = readmodel_metrics(topology)
    readmodel.bind(_FakeConsumerOwner(ProjectionStats(rows_written=5, last_lag_ms=1500), topology.ledger.name))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(readmodel.registry).decode()) for s in f.samples}
    assert samples[("chatplane_readmodel_writes_total", ())] == 5
    assert samples[("chatplane_readmodel_lag_seconds", ())] == 1.5
    assert samples[("chatplane_readmodel_lag_records", (("partition", "0"), ("source", "ledger")))] == 3
    assert "chatplane_processor_consumer_lag" in names["processor"]
    assert "chatplane_worker_kv_tokens_free" in names["worker"] and "chatplane_result_sink_lag_seconds" in names["worker"]


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    return exprs


def test_every_metric_the_dashboard_queries_is_exported_by_a_process():
    exported = {_base(n) for names in _exported_names().values() for n in names}
    used = {_base(m) for e in _dashboard_exprs() for m in re.findall(r"\bchatplane_[a-z0-9_]+", e)}
    assert used, "the dashboard queries no chatplane metric"
    assert used <= exported, f"the dashboard queries series nobody exports: {sorted(used - exported)}"


def test_the_dashboard_shows_the_four_objectives_and_the_four_refusals_apart():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for objective in ("500 ms", "availability", "first text token p95", "completion"):
        assert objective in titles, objective
    exprs = _dashboard_exprs()
    for code in ("quota_exhausted", "rate_limited", "concurrency_limited", "capacity_exhausted"):
        # Its own query: never a regex that sums it with another refusal.
        assert any(f'code="{code}"' in e for e in exprs), code
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_dashboards_availability_counts_the_service_refusals_the_slo_report_counts():
    """The availability panel's denominator and the SLO report (projections/reports/slo/compute.py) name the
    same failures: a code added to one (store_unavailable, internal_error) is added to the other."""
    from projections.reports.slo.compute import SERVICE_CODES

    (expr,) = [e for e in _dashboard_exprs() if "admitted / " in e or 'code="admitted"}[5m])) / ' in e]
    (eligible,) = re.findall(r'code=~"([a-z_|]+)"', expr)
    assert set(eligible.split("|")) == {"admitted", *SERVICE_CODES}


def test_every_series_a_process_other_than_the_edge_exports_is_named_in_the_docs():
    docs = DOCS.read_text()
    for process, names in _exported_names().items():
        if process == "edge":
            continue
        missing = sorted({_base(n) for n in names if _base(n) not in docs})
        assert not missing, f"{process} series missing from docs/metrics.md: {missing}"


def test_the_prometheus_config_scrapes_every_process_at_the_make_up_ports():
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {job["job_name"]: t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    makefile = (ROOT / "Makefile").read_text()

    def make_port(var: str) -> str:
        found = re.search(rf"^{var} := \$\(or \$\(CHATPLANE_{var}\),(\d+)\)$", makefile, re.M)
        assert found, var
        return found.group(1)

    assert targets == {
        "chatplane-edge": f"127.0.0.1:{make_port('EDGE_PORT')}",
        "chatplane-processor": f"127.0.0.1:{make_port('PROCESSOR_METRICS_PORT')}",
        "chatplane-readmodel": f"127.0.0.1:{make_port('READMODEL_METRICS_PORT')}",
        "chatplane-history": f"127.0.0.1:{make_port('HISTORY_METRICS_PORT')}",
        "chatplane-worker": f"127.0.0.1:{make_port('WORKER_METRICS_PORT')}",
    }
    for var in ("PROCESSOR", "READMODEL", "HISTORY", "WORKER"):
        assert f"CHATPLANE_{var}_METRICS_PORT=$({var}_METRICS_PORT) infra/component-start" in makefile
