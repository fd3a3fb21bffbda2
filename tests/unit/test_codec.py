"""The processor's table value codec: ``load_aggregate(dump_aggregate(a)) == a`` for every shape of state.

States come from a seeded simulation (every status, attempts with and without owners and cancel
intent, rejections with codes, reply-to addresses, settled and retired windows, usage) and from the
given/when/then harness, so every field of every record is exercised with real values.
"""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from control_plane.aggregate import Aggregate
from control_plane.codec import STATE_CODEC_VERSION, dump_aggregate, load_aggregate
from control_plane.simulator import Simulation
from control_plane.state import Attempt, RequestRecord, UserLedger
from schemas.codes import CancelReason, RequestStatus
from tests.unit.ledger_dsl import Ledger


def _round_trip(aggregate: Aggregate) -> Aggregate:
    data = dump_aggregate(aggregate)
    assert isinstance(data, bytes)
    loaded = load_aggregate(data)
    assert loaded == aggregate
    assert dump_aggregate(loaded) == data  # a fixed point: no drift over repeated recoveries
    return loaded


@pytest.fixture(scope="module")
def simulated() -> list[Aggregate]:
    """Live aggregates sampled every 500 steps of a seeded simulation (before anything drains)."""
    sim = Simulation(3)
    sim.start()
    samples: list[Aggregate] = []
    for step in range(6_000):
        sim.step()
        if step % 500 == 499:
            samples.extend(sim.processor.aggregates.values())
    return samples


def test_every_simulated_aggregate_round_trips(simulated: list[Aggregate]) -> None:
    assert simulated
    for aggregate in simulated:
        _round_trip(aggregate)


def test_types_are_rebuilt_not_left_as_strings_or_dicts(simulated: list[Aggregate]) -> None:
    seen_status: set[RequestStatus] = set()
    for aggregate in simulated:
        loaded = load_aggregate(dump_aggregate(aggregate))
        assert all(isinstance(k, int) for k in loaded.ledger.windows)
        assert all(isinstance(k, int) for k in loaded.ledger.slots)
        for record in loaded.ledger.requests.values():
            assert type(record.status) is RequestStatus
            seen_status.add(record.status)
            assert record.attempt is None or isinstance(record.attempt, Attempt)
        for remembered in loaded.recent:
            assert isinstance(remembered.command_id, str)
            decision = remembered.decision()
            assert all(dataclasses.is_dataclass(e) for e in decision.events)
            assert type(decision.outcome.kind).__name__ == "OutcomeKind"
    assert len(seen_status) >= 3


def test_running_attempt_with_cancel_intent_round_trips() -> None:
    L = Ledger()
    g = L.submit("k1").outcome.generation_id
    L.accept(g)
    L.cancel(g)
    record = L.record(g)
    assert record.attempt.cancel_reason is CancelReason.USER
    loaded = _round_trip(L.aggregate)
    assert loaded.ledger.record_of(g).attempt.cancel_reason is CancelReason.USER


def test_empty_aggregate_round_trips_and_unknown_versions_are_refused() -> None:
    _round_trip(Aggregate.empty("u"))
    doc = orjson.loads(dump_aggregate(Aggregate.empty("u")))
    assert doc["v"] == STATE_CODEC_VERSION
    doc["v"] = STATE_CODEC_VERSION + 1
    with pytest.raises(ValueError, match="unsupported state codec version"):
        load_aggregate(orjson.dumps(doc))


def test_a_value_written_before_open_windows_from_ms_existed_still_loads() -> None:
    doc = orjson.loads(dump_aggregate(Aggregate.empty("u")))
    del doc["ledger"]["open_windows_from_ms"]
    assert load_aggregate(orjson.dumps(doc)).ledger == UserLedger("u")


def test_every_state_field_is_covered_by_the_codec() -> None:
    # A field added to the state without teaching the codec would be silently dropped on recovery.
    ledger = UserLedger("u", open_windows_from_ms=123, last_event_ms=7)
    assert load_aggregate(dump_aggregate(Aggregate(ledger))).ledger == ledger
    assert {f.name for f in dataclasses.fields(RequestRecord)} >= {"attempt", "reply_to", "code"}


def test_an_attempt_written_before_window_start_ms_existed_still_loads() -> None:
    L = Ledger()
    g = L.submit("k1").outcome.generation_id
    doc = orjson.loads(dump_aggregate(L.aggregate))
    record = next(iter(doc["ledger"]["requests"].values()))
    assert record["attempt"]["window_start_ms"] == L.state.record_of(g).attempt.window_start_ms > 0
    del record["attempt"]["window_start_ms"]
    # Its reservation names the window (a usage record takes the window from the attempt).
    assert load_aggregate(orjson.dumps(doc)).ledger == L.state
    del doc["ledger"]["reservations"][f"{g}.1"]
    assert load_aggregate(orjson.dumps(doc)).ledger.record_of(g).attempt.window_start_ms == 0


def test_a_value_holding_settled_reservations_loads_them_as_window_counters() -> None:
    # Before 2026-12-05 the state kept consumed and released reservations until their window retired.
    L = Ledger()
    consumed = L.submit("k1").outcome.generation_id
    L.accept(consumed)
    released = L.submit("k2").outcome.generation_id
    L.decline(released)
    held = L.submit("k3").outcome.generation_id
    doc = orjson.loads(dump_aggregate(L.aggregate))
    ledger = doc["ledger"]
    (window,) = ledger["windows"].values()
    del window["released"]
    old = {"evidence": None, "window_start_ms": window["window_start_ms"], "reconcile_deadline_ms": 1}
    for gid, state in ((consumed, "consumed"), (released, "released")):
        ledger["reservations"][f"{gid}.1"] = {"reservation_id": f"{gid}.1", "generation_id": gid, "epoch": 1, "state": state, **old}
    ledger["reservations"][f"{held}.1"]["evidence"] = None
    loaded = load_aggregate(orjson.dumps(doc)).ledger
    assert loaded == L.state
    assert list(loaded.reservations) == [f"{held}.1"]
    (w,) = loaded.windows.values()
    assert (w.used, w.reserved, w.released) == (1, 1, 1)


def test_with_changes_builds_the_value_dataclasses_replace_builds() -> None:
    from control_plane.state import with_changes

    L = Ledger()
    g = L.submit("k1").outcome.generation_id
    L.accept(g)
    record = L.state.record_of(g)
    for obj, changes in (
        (record, {"status": RequestStatus.COMPLETED, "attempt": None, "terminal_at_ms": 5}),
        (record.attempt, {"cancel_reason": CancelReason.USER, "lease_deadline_ms": 9}),
        (L.state, {"last_event_ms": 1, "slots": {}}),
        (L.state, {}),
    ):
        assert with_changes(obj, **changes) == dataclasses.replace(obj, **changes)
        assert with_changes(obj, **changes) is not obj
    with pytest.raises(TypeError, match="no field 'statu'"):
        with_changes(record, statu=RequestStatus.COMPLETED)
