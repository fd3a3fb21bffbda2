"""The processor's timer on its own (projections/ledger/timer.py): what it appends for the users of
the partitions assigned here, given only what the processor passes it (no Kafka, no faust).

The whole path (a lost edge's generations detached and cancelled) is tests/integration/test_reader_detach.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from control_plane.aggregate import Aggregate
from projections.ledger.presence import PRESENCE_RESTART_PAUSE_S, PresenceWatch
from projections.ledger.timer import ReconcileTimer, TimerLimits, user_partition
from schemas.codes import CancelReason
from schemas.topics import Topology
from schemas.wire import decode_command
from tests.unit.ledger_dsl import Ledger

PARTITIONS = 4
EDGE = "edge-a"


class Presence:
    """Stands in for the PresenceView: the edges named lost are lost."""

    def __init__(self) -> None:
        self.gone: set[str] = set()

    def lost(self, edge_id: str, now_ms: int) -> bool:
        return edge_id in self.gone


def stats() -> SimpleNamespace:
    return SimpleNamespace(reconciles_appended=0, readers_detached=0, readers_reattached=0, readers_unwatched=0)


def limits(**over: object) -> TimerLimits:
    base = dict(instance_id="p-1", reconcile_commands_per_tick_max=10, reconcile_resend_ms=5_000,
                readers_tracked_max=100, edge_lost_grace_ms=7_000)
    return TimerLimits(**{**base, **over})  # type: ignore[arg-type]


def timer(**kw: object) -> tuple[ReconcileTimer, list[tuple[bytes, object]], Presence]:
    sent: list[tuple[bytes, object]] = []
    presence = Presence()

    async def send(key: bytes, value: bytes) -> None:
        sent.append((key, decode_command(value)))

    aggregates: dict[bytes, Aggregate] = kw.pop("aggregates", {})  # type: ignore[assignment]
    t = ReconcileTimer(
        kw.pop("limits", limits()),  # type: ignore[arg-type]
        Ledger().policy,
        PARTITIONS,
        presence,  # type: ignore[arg-type]
        kw.pop("stats", stats()),  # type: ignore[arg-type]
        assigned=kw.pop("assigned", lambda: set(range(PARTITIONS))),  # type: ignore[arg-type]
        table_entries=kw.pop("table_entries", lambda: []),  # type: ignore[arg-type]
        unwritten=kw.pop("unwritten", lambda: list(aggregates.items())),  # type: ignore[arg-type]
        aggregate_of=lambda key, user_id: aggregates.get(key) or Aggregate.empty(user_id),
        send=send,
    )
    return t, sent, presence


def now_ms() -> int:
    return int(time.time() * 1000)


async def test_a_passed_deadline_appends_one_reconcile_keyed_by_the_user_then_waits_the_resend():
    t, sent, _ = timer()
    t.decided(b"u-1", now_ms() - 1, frozenset())
    t.decided(b"u-2", now_ms() + 60_000, frozenset())
    t._scan_needed = False  # the assignment is not rescanned here: only what was decided counts
    await t.tick()
    assert [(k, type(c).__name__, c.user_id) for k, c in sent] == [(b"u-1", "ReconcileDue", "u-1")]
    assert sent[0][1].command_id.endswith(":p-1") and t.stats.reconciles_appended == 1
    await t.tick()
    assert len(sent) == 1, "the next one waits reconcile_resend_ms"
    t.decided(b"u-1", None, frozenset())
    assert b"u-1" not in t.deadlines


async def test_due_users_beyond_the_tick_budget_wait_for_the_next_tick_oldest_first():
    t, sent, _ = timer(limits=limits(reconcile_commands_per_tick_max=2))
    t._scan_needed = False
    base = now_ms() - 1_000
    for i in range(5):
        t.decided(f"u-{i}".encode(), base - i, frozenset())
    await t.tick()
    assert [k for k, _ in sent] == [b"u-4", b"u-3"]


async def test_a_rescan_reads_the_table_and_the_aggregates_ahead_of_it_for_the_assigned_partitions_only():
    L = Ledger(user_id="u-ahead")
    g = L.submit("k1", reader_id=EDGE).outcome.generation_id
    assert g
    mine = {user_partition(b"u-ahead", PARTITIONS)}
    t, _, _ = timer(aggregates={b"u-ahead": L.aggregate}, assigned=lambda: mine)
    await t.tick()
    assert t.readers == {b"u-ahead": frozenset({EDGE})}
    assert b"u-ahead" in t.deadlines
    t.forget(mine)
    assert t.readers == {} and t.deadlines == {}


async def test_a_lost_edge_detaches_its_generations_and_reattaches_them_when_heard_again_in_time():
    L = Ledger(user_id="u-r")
    g = L.submit("k1", reader_id=EDGE).outcome.generation_id
    t, sent, presence = timer(aggregates={b"u-r": L.aggregate})
    t._scan_needed = False
    t.decided(b"u-r", None, frozenset({EDGE}))
    await t.tick()
    assert sent == [], "a reader heard from is left alone"
    presence.gone.add(EDGE)
    await t.tick()
    [(key, detach)] = sent
    assert key == b"u-r" and type(detach).__name__ == "DetachReader"
    assert (detach.generation_id, detach.reader_id, detach.grace_ms, detach.reason) == (g, EDGE, 7_000, CancelReason.EDGE_LOST)
    await t.tick()
    assert len(sent) == 1, "one round per reconcile_resend_ms"
    presence.gone.clear()
    await t.tick()
    assert [type(c).__name__ for _, c in sent] == ["DetachReader", "AttachReader"]
    assert (sent[1][1].generation_id, sent[1][1].reader_id) == (g, EDGE)
    assert (t.stats.readers_detached, t.stats.readers_reattached) == (1, 1)


def test_readers_of_users_past_the_bound_go_unwatched():
    t, _, _ = timer(limits=limits(readers_tracked_max=1))
    t.decided(b"u-1", None, frozenset({EDGE}))
    t.decided(b"u-2", None, frozenset({EDGE}))
    assert list(t.readers) == [b"u-1"] and t.stats.readers_unwatched == 1
    t.decided(b"u-1", None, frozenset())
    assert t.readers == {}


def test_the_presence_watch_owns_its_view():
    watch = PresenceWatch("127.0.0.1:1", Topology(""), lease_ms=3_000, edges_max=10)
    assert watch.view.lease_ms == 3_000 and watch.view.edges_max == 10
    assert watch.restart_pause_s == PRESENCE_RESTART_PAUSE_S
