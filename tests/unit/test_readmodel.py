"""The read-model projection's pure fold (ledger entry -> column updates), the batch merge that
writes one statement per generation at the batch's highest revision, the usage report's
aggregation, and the read-model settings. No servers."""

from __future__ import annotations

import asyncio

import pytest

from projections.readmodel.writer import fold_entry, merge_batch, update_cql
from infra.stores.schema import ReadModelSettings
from schemas.tables import GENERATION_COLUMNS
from projections.reports.usage import UsageTotals, aggregate_usage, parse_time_ms
from schemas import events as ev
from schemas.codes import FinishOutcome, RequestStatus
from schemas.wire import decode_ledger_entry, encode
from tests.unit.ledger_dsl import TEST_MODELS, Ledger


def _entry(decision, command_id: str, command_type: str = "X", user_id: str = "user-1") -> ev.LedgerEntry:
    entry = ev.LedgerEntry(command_id=command_id, command_type=command_type, user_id=user_id, events=tuple(decision.events))
    return decode_ledger_entry(encode(entry))  # through the wire, as the projection sees it


def _story():
    """submit -> accept -> report completed, as three ledger entries."""
    led = Ledger()
    sub = led.submit()
    gid = sub.outcome.generation_id
    led.advance(100)
    acc = led.accept(gid)
    led.advance(100)
    fin = led.report(gid, FinishOutcome.COMPLETED, output_tokens=33)
    return gid, [_entry(sub, "c1"), _entry(acc, "c2"), _entry(fin, "c3")]


def test_fold_admitted_sets_owner_status_model_and_window():
    gid, entries = _story()
    cols = fold_entry(entries[0])[gid]
    assert cols["user_id"] == "user-1"
    assert cols["status"] == RequestStatus.QUEUED.value
    assert cols["model_version"] == TEST_MODELS["fast-text-model"].version
    assert cols["input_tokens"] == 12 and cols["output_tokens"] == 0
    assert cols["window_end_ms"] > cols["window_start_ms"]
    assert set(cols) <= set(GENERATION_COLUMNS)


def test_fold_completion_sets_status_usage_and_result_expiry():
    gid, entries = _story()
    cols = fold_entry(entries[2])[gid]
    assert cols["status"] == RequestStatus.COMPLETED.value
    assert cols["output_tokens"] == 33
    assert cols["usage_epoch"] == 1
    assert cols["terminal_reason"]
    assert cols["result_expires_at_ms"] > cols["finished_at_ms"]
    # the completion entry says nothing about the owner: a partial update leaves it alone
    assert "user_id" not in cols


def test_merge_batch_one_row_per_generation_at_highest_offset_with_latest_values():
    gid, entries = _story()
    rows = merge_batch([(3, 10, entries[0]), (3, 11, entries[1]), (3, 14, entries[2])])
    assert len(rows) == 1
    row = rows[0]
    assert (row.generation_id, row.partition, row.revision) == (gid, 3, 14)
    assert row.columns["status"] == RequestStatus.COMPLETED.value  # the last value wins within the batch
    assert row.columns["user_id"] == "user-1"  # columns only earlier entries set are kept
    assert row.columns["accepted_at_ms"] < row.columns["finished_at_ms"]


def test_merge_batch_equals_entry_by_entry_fold():
    """What one merged statement writes equals what one statement per entry would leave."""
    gid, entries = _story()
    one_by_one: dict[str, object] = {}
    for e in entries:
        one_by_one.update(fold_entry(e).get(gid, {}))
    merged = merge_batch([(0, i, e) for i, e in enumerate(entries)])[0].columns
    assert merged == one_by_one


def test_entries_without_shown_events_produce_no_update():
    led = Ledger()
    sub = led.submit()
    gid = sub.outcome.generation_id
    led.advance(3000)
    renew = led.renew(gid)  # LeaseRenewed on a queued (not accepted) attempt or late report: nothing shown
    rows = merge_batch([(0, 5, _entry(renew, "c9"))])
    assert all(set(r.columns) <= set(GENERATION_COLUMNS) for r in rows)
    assert all("status" not in r.columns or r.columns["status"] for r in rows)


def test_a_turn_s_row_keeps_its_conversation_and_revision_and_old_rows_read_without_them():
    """Every edge names a turn's next revision from the row (not only the edge that admitted it); a
    row projected before the columns existed reads as a stateless one."""
    from types import SimpleNamespace

    from infra.stores.queries import _view
    from schemas.tables import ADDED_GENERATION_COLUMNS

    led = Ledger()
    led.create_conversation()
    turn = led.turn("t1", 0)
    gid = turn.outcome.generation_id
    cols = fold_entry(_entry(turn, "c1"))[gid]
    assert (cols["conversation_id"], cols["turn_revision"], cols["status"]) == ("conv_a", 1, RequestStatus.QUEUED.value)
    assert set(cols) <= set(GENERATION_COLUMNS)
    assert {"conversation_id", "turn_revision"} <= set(ADDED_GENERATION_COLUMNS)  # an existing table gains them
    stateless = led.submit("plain")
    assert "conversation_id" not in fold_entry(_entry(stateless, "c2"))[stateless.outcome.generation_id]
    row = {c: None for c in GENERATION_COLUMNS} | {"generation_id": gid, "user_id": "user-1", "status": "completed", "epoch": 1}
    view = _view(SimpleNamespace(**(row | {"conversation_id": "conv_a", "turn_revision": 1})), None, 0)
    assert (view.conversation_id, view.turn_revision) == ("conv_a", 1)
    old = {k: v for k, v in row.items() if k not in ("conversation_id", "turn_revision")}
    view = _view(SimpleNamespace(**old), None, 0)
    assert (view.conversation_id, view.turn_revision) == (None, None)


def test_update_cql_writes_with_ttl_and_revision_timestamp():
    cql = update_cql("ks", ("status", "user_id"))
    assert "USING TTL ? AND TIMESTAMP ?" in cql
    assert cql.endswith("WHERE generation_id = ?")
    assert "revision = ?" in cql


def test_settings_metadata_outlives_content(monkeypatch):
    monkeypatch.setenv("CHATPLANE_RESULT_TTL_S", "7200")
    monkeypatch.setenv("CHATPLANE_GENERATION_METADATA_TTL_S", "3600")
    with pytest.raises(ValueError):
        ReadModelSettings()
    monkeypatch.setenv("CHATPLANE_GENERATION_METADATA_TTL_S", "86400")
    s = ReadModelSettings()
    assert s.result_ttl_s == 7200 and s.metadata_ttl_s == 86400


def test_settings_reject_non_identifier_keyspace(monkeypatch):
    monkeypatch.setenv("CHATPLANE_CASSANDRA_KEYSPACE", "ks; DROP")
    with pytest.raises(ValueError):
        ReadModelSettings()


def _usage(gid: str, user: str, at_ms: int, inp: int, out: int, epoch: int = 1) -> ev.UsageRecorded:
    return ev.UsageRecorded(
        event_id=f"{gid}/u{epoch}",
        command_id=f"c-{gid}-{epoch}",
        user_id=user,
        generation_id=gid,
        occurred_at_ms=at_ms,
        epoch=epoch,
        input_tokens=inp,
        output_tokens=out,
        terminal_reason="completed",
        outcome=FinishOutcome.COMPLETED,
        model_version="m1",
        tier="paid",
        window_start_ms=at_ms - at_ms % 10_800_000,
    )


def test_usage_aggregation_per_user_model_hour_and_dedup():
    h = 3_600_000
    t = 1_762_441_200_000
    recs = [
        _usage("g1", "alice", t + 10, 5, 7),
        _usage("g1", "alice", t + 10, 5, 7),  # a redelivered duplicate: counted once
        _usage("g2", "alice", t + h + 5, 1, 2),
        _usage("g3", "bob", t + 20, 3, 4),
        _usage("g4", "bob", t + 5 * h, 100, 100),  # outside [t, t + 2h)
    ]
    totals = aggregate_usage(recs, t, t + 2 * h)
    assert totals.total == UsageTotals(generations=3, input_tokens=9, output_tokens=13)
    assert totals.by_user["alice"] == UsageTotals(2, 6, 9)
    assert totals.by_user["bob"] == UsageTotals(1, 3, 4)
    assert totals.by_model["m1"] == UsageTotals(3, 9, 13)
    assert totals.by_hour[t] == UsageTotals(2, 8, 11)
    assert totals.by_hour[t + h] == UsageTotals(1, 1, 2)
    assert totals.duplicates_skipped == 1


def test_parse_time_accepts_iso_and_ms():
    assert parse_time_ms("2025-11-06T15:00:00Z") == 1_762_441_200_000
    assert parse_time_ms("1762441200000") == 1_762_441_200_000
    with pytest.raises(ValueError):
        parse_time_ms("yesterday")


class _Polls:
    """Stands in for the projection's consumer: answers getmany from a list of prepared polls."""

    def __init__(self, *polls):
        self.polls = list(polls)
        self.calls = []

    async def getmany(self, *parts, timeout_ms=0, max_records=None):
        self.calls.append((timeout_ms, max_records))
        if self.polls:
            return self.polls.pop(0)
        await asyncio.sleep(timeout_ms / 1000)  # nothing more arrives within the wait
        return {}


async def test_a_poll_that_found_entries_lingers_and_merges_what_came_next_in_order():
    import time

    from aiokafka import TopicPartition

    from projections.readmodel.writer import BATCH_RECORDS_MAX, ReadModelProjection
    from schemas.topics import Topology

    a, b = TopicPartition("ledger", 0), TopicPartition("ledger", 1)
    projection = ReadModelProjection("127.0.0.1:1", Topology(""), ReadModelSettings(batch_linger_ms=50))
    projection.consumer = _Polls({a: ["a1"]}, {a: ["a2"], b: ["b1"]}, {b: ["b2"]})
    started = time.monotonic()
    merged = await projection._linger(await projection.consumer.getmany())
    assert 0.045 <= time.monotonic() - started < 1.0  # polled until the linger's deadline (to the ms), not past it
    assert merged == {a: ["a1", "a2"], b: ["b1", "b2"]}  # each partition's records in the order polled
    # Each poll is bounded by what the batch still takes.
    assert [m for _, m in projection.consumer.calls[1:4]] == [BATCH_RECORDS_MAX - 1, BATCH_RECORDS_MAX - 3, BATCH_RECORDS_MAX - 4]
    # Nothing found, or lingering off: no wait, no second poll.
    for settings, first in ((ReadModelSettings(batch_linger_ms=50), {}), (ReadModelSettings(batch_linger_ms=0), {a: ["x"]})):
        projection = ReadModelProjection("127.0.0.1:1", Topology(""), settings)
        projection.consumer = _Polls({a: ["late"]})
        assert await projection._linger(first) == first and projection.consumer.calls == []
