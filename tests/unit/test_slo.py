"""The SLO report (projections/reports/slo, docs/slo.md) on a recorded ledger with known answers.

tests/fixtures/slo_ledger.jsonl holds 28 edge outcomes and 30 ledger entries around the window
[2026-01-01T00:00:00Z, 00:10:00Z), in two 5-minute buckets A [00:00, 00:05) and B [00:05, 00:10).
The outcomes (request number: what it is):

  A:  1 admitted 120 ms, ttft 800, g1 completed       2 admitted 150 ms, ttft 1200, g2 user-cancelled
      3 admitted 90 ms, ttft 600, g3 failed (502)      4 admitted 200 ms, ttft 2500, g4 completed
      5 admitted 610 ms (late), ttft 1900, g5 completed
      6 invalid_request   7 unauthorized   8 rate_limited 3 ms   9 quota_exhausted 140 ms
     10 capacity_exhausted 4 ms (shed)    11 quota_service_unavailable 2003 ms (decision timeout)
     12 existing 110 ms   13 admitted 130 ms, no text, g6 failed generation_timeout
     14 no typed answer (500, a bug)
  B: 15 admitted, ttft 700, g7 client_disconnect       16 admitted, ttft 900, g8 completed
     17 admitted, ttft 1000, g9 completed              18 admitted (background, no edge ttft), g10 completed
     19 concurrency_limited  20 model_not_allowed  21 generation_in_progress  23 invalid_request
     22 admitted, ttft 1500, g11 (no terminal: open)    26 admitted, g13 user-cancelled in the queue (never accepted)
     27 admitted, ttft 650, g14 cancelled by drain       28 admitted, ttft 1100, g15 accepted 00:09:59, completed 00:10:30
  outside: 24 (received 1 s before the window, g0), 25 (received at the window's end: half-open)
Ledger only: g12 accepted in B, cancelled slow_consumer, worker ttft 300 (its edge record was lost).
Every admitted decision above not marked otherwise took <= 150 ms.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import orjson
import pytest

from edge.metrics import EdgeMetrics
from edge.outcomes import OutcomeDraft, OutcomeLog, build_record
from projections.reports.slo import report as cli
from projections.reports.slo.compute import (
    DEMAND_ENVELOPE_CODES,
    ENTITLEMENT_CODES,
    GENERATION_CODES,
    INVALID_CODES,
    REQUEST_STATE_CODES,
    SERVICE_CODES,
    compute,
    nearest_rank,
)
from projections.reports.slo.read import decode_records, outcomes_in, read_file
from schemas.codes import RejectionCode
from schemas.outcomes import (
    OUTCOME_BATCH_BYTES_MAX,
    AdmissionResult,
    EdgeOutcome,
    OutcomeRoute,
    decode_outcome,
    decode_outcomes,
    encode_outcomes,
)
from schemas.wire import encode

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "slo_ledger.jsonl"
T0 = 1767225600000  # 2026-01-01T00:00:00Z
MIN = 60_000


@pytest.fixture(scope="module")
def report():
    records = read_file(FIXTURE)
    assert len(records.outcomes) == 28 and len(records.entries) == 30
    return compute(records.outcomes, records.entries, T0, T0 + 10 * MIN, 5 * MIN)


def test_admission_response_contract(report):
    c = report.overall.contract
    # In the window: requests 1-23, 26, 27, 28 = 26. Invalid (out): 6, 7, 23 -> 23 valid.
    # Misses: 5 (admitted after 610 ms), 11 (503 after the 2003 ms decision timeout), 14 (no typed
    # answer) -> 20 good. 20 / 23 = 0.869565...
    assert (c.good, c.total) == (20, 23)
    assert c.value == pytest.approx(20 / 23)
    assert c.met is False
    assert dict(c.misses) == {"late:admitted": 1, "late:quota_service_unavailable": 1, "no_typed_decision": 1}
    assert dict(c.excluded) == {"invalid:invalid_request": 2, "invalid:unauthorized": 1}


def test_eligible_admission_availability(report):
    a = report.overall.availability
    # Admitted: 1, 2, 3, 4, 5, 13, 15, 16, 17, 18, 22, 26, 27, 28 = 14 good.
    # Service failures: 10 (capacity_exhausted, shed), 11 (quota_service_unavailable), 14 (no answer) = 3.
    # 14 / 17 = 0.823529...
    assert (a.good, a.total) == (14, 17)
    assert a.value == pytest.approx(14 / 17)
    # Excluded: invalid 6, 7, 23; entitlement 9 (quota_exhausted), 20 (model_not_allowed); demand
    # envelope 8 (rate_limited), 19 (concurrency_limited); existing 12; request state 21.
    assert dict(a.excluded) == {
        "invalid:invalid_request": 2, "invalid:unauthorized": 1,
        "entitlement:quota_exhausted": 1, "entitlement:model_not_allowed": 1,
        "demand_envelope:rate_limited": 1, "demand_envelope:concurrency_limited": 1,
        "existing": 1, "request_state:generation_in_progress": 1,
    }
    assert dict(a.misses) == {"refused:capacity_exhausted": 1, "refused:quota_service_unavailable": 1, "no_typed_decision": 1}


def test_time_to_first_text_token_p95(report):
    t = report.overall.ttft
    # Edge-side: 1 800, 2 1200, 3 600, 4 2500, 5 1900, 15 700, 16 900, 17 1000, 22 1500, 27 650,
    # 28 1100 (11). Worker-side only where the edge has none: g10 450, g12 300 (2). Not 13 or 26 (no
    # text), not g0 / 24 (outside). Sorted: 300 450 600 650 700 800 900 1000 1100 1200 1500 1900 2500;
    # nearest rank ceil(0.95 * 13) = 13 -> 2500 ms, not below 2000: missed.
    assert sorted(t.samples_ms) == [300, 450, 600, 650, 700, 800, 900, 1000, 1100, 1200, 1500, 1900, 2500]
    assert dict(t.sources) == {"edge": 11, "worker": 2}
    assert t.value == 2500
    assert t.met is False


def test_accepted_generation_completion(report):
    g = report.overall.completion
    # Accepted in the window: g1-g12, g14, g15 (14; g0 before it, g13 never accepted).
    # Out: g2 (user cancel), g11 (open). Of 12: completed g1 g4 g5 g8 g9 g10 g15 (g15 ends after the
    # window but was accepted in it) = 7. 7 / 12 = 0.583333...
    assert (g.good, g.total) == (7, 12)
    assert g.value == pytest.approx(7 / 12)
    assert dict(g.excluded) == {"user_cancelled": 1, "open": 1}
    assert dict(g.misses) == {
        "failed:model_backend_error": 1, "failed:generation_timeout": 1,
        "cancelled:client_disconnect": 1, "cancelled:slow_consumer": 1, "cancelled:drain": 1,
    }


def test_per_bucket_figures(report):
    (a_start, a), (b_start, b) = report.buckets
    assert (a_start, b_start) == (T0, T0 + 5 * MIN)
    # Contract A: 1-14 minus 6, 7 = 12; misses 5, 11, 14 -> 9/12. B: 15-23, 26-28 minus 23 = 11, all in time.
    assert (a.contract.good, a.contract.total, b.contract.good, b.contract.total) == (9, 12, 11, 11)
    # Availability A: admitted 1-5, 13 (6) of 6 + failures 10, 11, 14 -> 6/9. B: 8 admitted of 8.
    assert (a.availability.good, a.availability.total, b.availability.good, b.availability.total) == (6, 9, 8, 8)
    # TTFT A: 600 800 1200 1900 2500 -> rank ceil(4.75) = 5 -> 2500. B: 300 450 650 700 900 1000 1100 1500
    # -> rank ceil(7.6) = 8 -> 1500 (met).
    assert (a.ttft.value, b.ttft.value, b.ttft.met) == (2500, 1500, True)
    # Completion A: g1 g4 g5 of g1 g3 g4 g5 g6 (g2 user) -> 3/5. B: g8 g9 g10 g15 of g7 g8 g9 g10 g12 g14 g15 -> 4/7.
    assert (a.completion.good, a.completion.total, b.completion.good, b.completion.total) == (3, 5, 4, 7)


def test_nearest_rank():
    values = list(range(1, 21))  # 1..20: rank ceil(0.95 * 20) = 19
    assert nearest_rank(values, 95) == 19
    assert nearest_rank([*values, 21], 95) == 20  # 21 values: rank ceil(19.95) = 20
    assert nearest_rank([], 95) is None
    assert nearest_rank([7.5], 95) == 7.5


def test_every_rejection_code_has_one_class():
    sets = (INVALID_CODES, ENTITLEMENT_CODES, DEMAND_ENVELOPE_CODES, REQUEST_STATE_CODES, SERVICE_CODES, GENERATION_CODES)
    for code in RejectionCode:
        assert sum(code.value in s for s in sets) == 1, f"{code.value} needs exactly one class in projections/reports/slo/compute.py"


def test_the_command_line_prints_the_same_figures_as_json(capsys, tmp_path):
    chart = tmp_path / "slo.png"
    status = cli.main(["--file", str(FIXTURE), "--from", "2026-01-01T00:00:00Z", "--to", "2026-01-01T00:10:00Z",
                       "--json", "--bucket", "5m", "--chart", str(chart)])
    assert status == 0
    doc = json.loads(capsys.readouterr().out)
    o = doc["objectives"]
    assert (o["admission_response_contract"]["good"], o["admission_response_contract"]["total"]) == (20, 23)
    assert (o["eligible_admission_availability"]["good"], o["eligible_admission_availability"]["total"]) == (14, 17)
    assert o["time_to_first_text_token_p95"]["value_ms"] == 2500
    assert o["time_to_first_text_token_p95"]["sources"] == {"edge": 11, "worker": 2}
    assert (o["accepted_generation_completion"]["good"], o["accepted_generation_completion"]["total"]) == (7, 12)
    assert [b["start"] for b in doc["buckets"]] == ["2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_line_refuses_a_missing_window(capsys):
    assert cli.main([]) == 2
    assert "--from and --to are required" in capsys.readouterr().err


class _Held:
    """The fields of edge.streams.GenerationStream that build_record reads."""

    first_token_s = 10.25
    terminal_status = None
    finalized = None
    overflowed = False
    reader_gone = True


def test_an_outcome_record_is_content_free_and_round_trips():
    draft = OutcomeDraft(route=OutcomeRoute.GENERATIONS, received_s=10.0, received_at_ms=T0, user_id="alice@example.com")
    draft.result, draft.stream, draft.generation_id, draft.decided_s, draft.held = AdmissionResult.ADMITTED, True, "g1", 10.1, _Held()
    record = build_record(draft, "req_1", "edge-1", 200, 12.0, user_key="k")
    assert record.decision_ms == pytest.approx(100.0) and record.ttft_ms == pytest.approx(250.0)
    assert record.total_ms == pytest.approx(2000.0)
    assert record.cancel_reason is not None and record.cancel_reason.value == "client_disconnect"
    data = encode(record)
    assert b"alice" not in data and record.user_ref and len(record.user_ref) == 16
    assert record.user_ref != build_record(draft, "req_1", "edge-1", 200, 12.0, user_key="other").user_ref
    assert decode_outcome(data) == record


def test_a_full_outcome_buffer_drops_and_counts_without_blocking():
    metrics = EdgeMetrics()
    log = OutcomeLog("t", buffer_max=2, batch_max=10, flush_interval_s=1.0, flush_timeout_s=1.0, metrics=metrics)
    record = EdgeOutcome(
        request_id="r", edge_id="e", route=OutcomeRoute.GENERATIONS, user_ref="", generation_id="", stream=None,
        result=AdmissionResult.REFUSED, code=RejectionCode.INVALID_REQUEST, http_status=400, received_at_ms=T0,
        decision_ms=1.0, ttft_ms=None, total_ms=1.0, final_status=None, cancel_reason=None,
    )
    assert [log.append(record) for _ in range(3)] == [True, True, False]
    assert len(log.buffer) == 2
    assert metrics.registry.get_sample_value("chatplane_edge_outcomes_dropped_total", {"reason": "buffer_full"}) == 1.0


def _outcome(i: int = 0, edge_id: str = "e") -> EdgeOutcome:
    return EdgeOutcome(
        request_id=f"req_{i}", edge_id=edge_id, route=OutcomeRoute.GENERATIONS, user_ref="", generation_id="",
        stream=None, result=AdmissionResult.REFUSED, code=RejectionCode.INVALID_REQUEST, http_status=400,
        received_at_ms=T0 + i, decision_ms=1.0, ttft_ms=None, total_ms=1.0, final_status=None, cancel_reason=None,
    )


def test_a_batch_record_round_trips_and_the_old_one_record_form_still_reads():
    outcomes = [_outcome(i) for i in range(3)]
    data = encode_outcomes(outcomes)
    assert orjson.loads(data)["type"] == "EdgeOutcomeBatch"
    assert decode_outcomes(data) == outcomes
    assert outcomes_in(data) == 3
    # A record written before batches: one bare EdgeOutcome.
    old = encode(outcomes[0])
    assert decode_outcomes(old) == [outcomes[0]] == [decode_outcome(old)]
    assert outcomes_in(old) == 1
    assert decode_outcomes(encode_outcomes([])) == []


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        ({"type": "Nope"}, "not an EdgeOutcomeBatch or EdgeOutcome"),
        ({"type": "EdgeOutcomeBatch", "schema_version": 2, "outcomes": []}, "unsupported EdgeOutcomeBatch schema_version"),
        ({"type": "EdgeOutcomeBatch", "schema_version": 1, "outcomes": {}}, "field outcomes is not a list"),
        ({"type": "EdgeOutcomeBatch", "schema_version": 1, "outcomes": [], "extra": 1}, "unexpected field"),
        ({"type": "EdgeOutcomeBatch", "schema_version": 1, "outcomes": [1]}, "outcomes.0 is not a JSON object"),
        ({"type": "EdgeOutcomeBatch", "schema_version": 1, "outcomes": [{"type": "EdgeOutcome", "schema_version": 1}]},
         "outcomes.0: invalid field"),
    ],
)
def test_an_invalid_batch_record_is_refused_with_its_reason(doc, reason):
    with pytest.raises(ValueError, match=reason):
        decode_outcomes(orjson.dumps(doc))


def test_an_oversized_batch_record_is_refused_unparsed():
    with pytest.raises(ValueError, match="exceeds"):
        decode_outcomes(b" " * (OUTCOME_BATCH_BYTES_MAX + 1))


def test_the_report_is_the_same_from_batch_records_and_from_old_ones(report):
    """The fixture's outcomes (old form) regrouped into batch records, mixed with one old-form line and
    the ledger entries, give the same figures."""
    lines = FIXTURE.read_bytes().splitlines()
    outcome_lines = [line for line in lines if orjson.loads(line)["type"] == "EdgeOutcome"]
    others = [line for line in lines if orjson.loads(line)["type"] != "EdgeOutcome"]
    outcomes = [decode_outcome(line) for line in outcome_lines[1:]]
    batches = [encode_outcomes(outcomes[i : i + 10]) for i in range(0, len(outcomes), 10)]
    records = decode_records([outcome_lines[0], *batches, *others], source="mixed")
    assert len(records.outcomes) == 28 and len(records.entries) == 30 and records.undecodable == 0
    again = compute(records.outcomes, records.entries, T0, T0 + 10 * MIN, 5 * MIN)
    assert again.as_dict() == report.as_dict()


class _RecordingProducer:
    """aiokafka's ``send`` as OutcomeLog uses it: each call is one Kafka record, delivered at once
    (or, with ``fail``, failed on delivery)."""

    def __init__(self, fail: bool = False) -> None:
        self.records: list[tuple[str, bytes, bytes | None]] = []
        self.fail = fail

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> asyncio.Future[None]:
        self.records.append((topic, value, key))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.fail:
            done.set_exception(RuntimeError("broker gone"))
        else:
            done.set_result(None)
        return done


async def test_n_requests_through_the_outcome_log_cost_fewer_than_n_records():
    n = 50
    metrics = EdgeMetrics()
    log = OutcomeLog("t", buffer_max=1000, batch_max=500, flush_interval_s=0.05, flush_timeout_s=1.0, metrics=metrics)
    producer = _RecordingProducer()
    log.start(producer)  # type: ignore[arg-type]
    outcomes = [_outcome(i) for i in range(n)]
    for o in outcomes:
        assert log.append(o)
    async with asyncio.timeout(5):
        while log.sent < n:
            await asyncio.sleep(0.01)
    await log.stop()
    assert len(producer.records) < n
    assert len(producer.records) == 1 and log.records_sent == 1
    topic, value, key = producer.records[0]
    assert (topic, key) == ("t", b"e")
    assert decode_outcomes(value) == outcomes  # every outcome, in order
    assert metrics.registry.get_sample_value("chatplane_edge_outcomes_dropped_total", {"reason": "send_failed"}) in (None, 0.0)


async def test_the_outcome_log_splits_a_flush_at_the_per_record_maximum_and_at_the_byte_bound(monkeypatch):
    log = OutcomeLog("t", buffer_max=1000, batch_max=500, flush_interval_s=60, flush_timeout_s=1.0, metrics=EdgeMetrics(),
                     per_record_max=20)
    producer = _RecordingProducer()
    log.start(producer)  # type: ignore[arg-type]
    outcomes = [_outcome(i) for i in range(45)]
    for o in outcomes:
        log.append(o)
    await log.stop()  # the flush on shutdown
    assert [len(decode_outcomes(v)) for _, v, _ in producer.records] == [20, 20, 5]
    assert [o for _, v, _ in producer.records for o in decode_outcomes(v)] == outcomes
    assert (log.sent, log.records_sent) == (45, 3)

    # A record over the byte bound is split in halves until each fits.
    import edge.outcomes as module

    one = len(encode_outcomes([outcomes[0]]))
    monkeypatch.setattr(module, "OUTCOME_BATCH_BYTES_MAX", 4 * one)
    records = log._records(outcomes[:20])
    assert all(len(v) <= 4 * one for _, v in records) and len(records) > 1
    assert [o for chunk, _ in records for o in chunk] == outcomes[:20]


async def test_a_failed_batch_send_counts_each_of_its_outcomes():
    metrics = EdgeMetrics()
    log = OutcomeLog("t", buffer_max=1000, batch_max=500, flush_interval_s=60, flush_timeout_s=1.0, metrics=metrics,
                     per_record_max=4)
    log.start(_RecordingProducer(fail=True))  # type: ignore[arg-type]
    for i in range(10):
        log.append(_outcome(i))
    await log.stop()
    assert metrics.registry.get_sample_value("chatplane_edge_outcomes_dropped_total", {"reason": "send_failed"}) == 10.0
    assert (log.sent, log.records_sent) == (0, 0)
