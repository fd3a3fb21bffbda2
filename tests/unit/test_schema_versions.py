"""A ledger written by an older schema version still reads, replays and audits cleanly."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from projections.ledger.audit import Auditor
from schemas.codes import RequestStatus
from schemas.events import GenerationAdmitted
from schemas.wire import WireError, decode_ledger_entry

RECORDED_V1 = Path(__file__).resolve().parents[1] / "fixtures" / "ledger_v1.jsonl"


def test_recorded_v1_ledger_replays_through_the_auditor_with_no_violation():
    lines = RECORDED_V1.read_bytes().splitlines()
    assert any(b'"schema_version":1' in line and b"GenerationAdmitted" in line for line in lines)
    auditor = Auditor(concurrency_limit=2)
    for n, line in enumerate(lines):
        auditor.feed_raw(f"line {n}", line)
    report = auditor.finish()
    assert report.ok, report.render()
    assert report.entries_read == len(lines) == 9
    assert dict(report.terminal) == {"completed": 1, "cancelled": 2}
    assert report.consumed == 2 and report.released == 1
    state = report.states["legacy-user"]
    assert sorted(r.status for r in state.requests.values()) == [
        RequestStatus.CANCELLED,
        RequestStatus.CANCELLED,
        RequestStatus.COMPLETED,
    ]


def test_v1_generation_admitted_is_upcast_with_its_window_end_and_no_reader():
    first = decode_ledger_entry(RECORDED_V1.read_bytes().splitlines()[0])
    admitted = first.events[0]
    assert isinstance(admitted, GenerationAdmitted) and admitted.schema_version == 3
    assert admitted.window_end_ms == admitted.window_start_ms + 3 * 3600 * 1000
    # v3 names the reader's edge; nothing recorded before it named one (never detached by an edge's death).
    assert admitted.reader_id == ""


def test_a_version_from_the_future_is_refused_with_a_reason():
    doc = orjson.loads(RECORDED_V1.read_bytes().splitlines()[0])
    doc["events"][0]["schema_version"] = 99
    with pytest.raises(WireError, match="unsupported schema_version 99"):
        decode_ledger_entry(orjson.dumps(doc))


def test_a_v2_admission_rejected_is_upcast_with_no_read_stamp_or_deadline():
    # v3 records when a submit refused for lateness was read and the deadline it carried; no refusal
    # written before decision deadlines existed was one of those.
    from schemas.events import AdmissionRejected, LedgerEntry
    from schemas.wire import encode

    v2 = {
        "type": "AdmissionRejected", "schema_version": 2, "event_id": "c1/0", "command_id": "c1", "user_id": "u",
        "generation_id": "gen_x", "occurred_at_ms": 1, "idempotency_key": "k", "fingerprint": "fp-aaaaaaaa",
        "model_alias": "m", "model_version": "m-v1", "pool": "p", "tier": "free", "code": "concurrency_limited",
        "status": "admission_retryable", "window_start_ms": 0, "window_limit": 40, "reset_at_ms": 10,
    }
    entry = {"type": "LedgerEntry", "schema_version": 1, "command_id": "c1", "command_type": "SubmitGeneration", "user_id": "u", "events": [v2]}
    decoded = decode_ledger_entry(orjson.dumps(entry))
    (refused,) = decoded.events
    assert isinstance(refused, AdmissionRejected) and refused.schema_version == 3
    assert (refused.read_at_ms, refused.decide_by_ms) == (0, 0)
    assert decoded.read_at_ms == 0, "an entry written before read stamps has none"
    assert decode_ledger_entry(encode(decoded)) == decoded
    assert isinstance(decoded, LedgerEntry)
