"""Readers in the core: a generation whose reader is gone is detached with a deadline in the ledger
state; a reader attaching (on any edge) withdraws it; at the deadline the timer cancels it.

The processor's shell issues ``DetachReader(reason=edge_lost)`` when a reader's edge stops renewing
its liveness lease (tests/integration/test_reader_detach.py), the edge when a client's socket closes.
"""

from __future__ import annotations

from control_plane.codec import dump_aggregate, load_aggregate
from control_plane.decide import next_deadline_ms
from control_plane.evolve import evolve_all
from control_plane.state import UserLedger
from schemas.codes import CancelReason, FenceReason, FinishOutcome, RequestStatus
from schemas.messages import OutcomeKind
from tests.unit.ledger_dsl import Ledger, types

EDGE_A = "edge-a"
EDGE_B = "edge-b"


def admitted(L: Ledger, key: str = "k1", reader: str = EDGE_A) -> str:
    d = L.submit(key, reader_id=reader)
    assert d.outcome.kind is OutcomeKind.ADMITTED, d.outcome
    assert d.events[0].reader_id == reader, "the admission records who reads it"
    return d.outcome.generation_id


def running(L: Ledger, key: str = "k1", reader: str = EDGE_A) -> str:
    g = admitted(L, key, reader)
    assert L.accept(g).outcome.kind is OutcomeKind.APPLIED
    return g


def test_a_detached_running_generation_is_cancelled_at_its_deadline_and_not_before():
    L = Ledger()
    g = running(L)
    d = L.detach(g, EDGE_A, grace_ms=5_000, reason=CancelReason.EDGE_LOST)
    assert types(d) == ["ReaderDetached"] and d.events[0].detached_until_ms == L.now_ms + 5_000
    assert next_deadline_ms(L.state, L.policy) == L.now_ms + 5_000, "the timer wakes at the detach deadline"
    L.advance(4_999)
    assert types(L.reconcile()) == [], "nothing happens inside the grace"
    L.advance(1)
    due = L.reconcile()
    assert types(due) == ["CancelRequested"] and due.events[0].reason is CancelReason.EDGE_LOST
    assert due.events[0].owner_worker_id == "w1", "the stop goes to the owning worker"
    assert L.state.slots, "the slot is held until the worker acknowledges the stop"
    stopped = L.report(g, FinishOutcome.STOPPED, output_tokens=3)
    assert types(stopped) == ["ConcurrencySlotReleased", "UsageRecorded", "GenerationCancelled"]
    assert stopped.events[2].reason is CancelReason.EDGE_LOST
    assert L.state.slots == {} and L.record(g).status is RequestStatus.CANCELLED
    assert L.record(g).detached_until_ms == 0, "a settled request waits for no reader"
    assert L.window().used == 1, "the accepted message stays consumed"


def test_a_detached_queued_generation_is_cancelled_in_queue_and_its_reservation_released():
    L = Ledger()
    g = admitted(L)
    L.detach(g, EDGE_A, grace_ms=1_000)
    L.advance(1_000)
    d = L.reconcile()
    assert types(d) == ["AttemptFenced", "ReservationReleased", "ConcurrencySlotReleased", "GenerationCancelled"]
    assert d.events[0].reason is FenceReason.CANCELLED_IN_QUEUE
    assert d.events[3].reason is CancelReason.CLIENT_DISCONNECT
    assert (L.window().used, L.window().reserved) == (0, 0), "nothing charged for work that never started"


def test_a_reader_attaching_on_another_edge_withdraws_the_detach():
    L = Ledger()
    g = running(L)
    L.detach(g, EDGE_A, grace_ms=5_000)
    attached = L.attach(g, EDGE_B)
    assert types(attached) == ["ReaderAttached"]
    assert L.record(g).reader_id == EDGE_B and L.record(g).detached_until_ms == 0
    L.advance(60_000 - 1)  # past the grace, inside the lease (renewed below) and the run deadline
    L.renew(g)
    assert "CancelRequested" not in types(L.reconcile())
    # The old reader's late detach no longer applies: EDGE_B reads it now.
    assert L.detach(g, EDGE_A).events == ()
    assert types(L.detach(g, EDGE_B, grace_ms=0)) == ["ReaderDetached"]


def test_detach_is_idempotent_and_the_first_deadline_stands():
    L = Ledger()
    g = running(L)
    first = L.detach(g, EDGE_A, grace_ms=5_000)
    L.advance(3_000)
    again = L.detach(g, EDGE_A, grace_ms=5_000)
    assert again.events == () and again.outcome.kind is OutcomeKind.EXISTING
    assert L.record(g).detached_until_ms == first.events[0].detached_until_ms


def test_detach_and_attach_change_nothing_once_settled_or_being_cancelled():
    L = Ledger()
    g = running(L)
    L.cancel(g)
    assert L.detach(g, EDGE_A).events == (), "a user's cancel is already stopping it"
    assert L.attach(g, EDGE_B).events == (), "a reader cannot bring back a cancelled generation"
    L.report(g, FinishOutcome.STOPPED)
    assert L.detach(g, EDGE_A).events == () and L.attach(g, EDGE_B).events == ()
    assert L.detach("gen_nope", EDGE_A).outcome.code is not None


def test_a_lease_expiry_before_the_detach_deadline_fences_as_before():
    L = Ledger()
    g = running(L)
    L.detach(g, EDGE_A, grace_ms=L.policy.lease_ms + 10_000)
    L.advance(L.policy.lease_ms)
    d = L.reconcile()
    assert types(d)[0] == "AttemptFenced" and d.events[0].reason is FenceReason.LEASE_EXPIRED


def test_replaying_the_ledger_and_reloading_the_table_value_keep_the_detach():
    L = Ledger()
    g = running(L)
    L.detach(g, EDGE_A, grace_ms=5_000, reason=CancelReason.EDGE_LOST)
    replayed = evolve_all(UserLedger(L.user_id), L.all_events)
    assert replayed == L.state
    reloaded = load_aggregate(dump_aggregate(L.aggregate)).ledger
    record = reloaded.record_of(g)
    assert record is not None and record.detach_reason is CancelReason.EDGE_LOST
    assert record.detached_until_ms == L.record(g).detached_until_ms and record.reader_id == EDGE_A
