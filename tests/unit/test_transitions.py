"""Given-events / when-command / then-events tests for every transition of the per-user ledger.

Each test drives the pure core through ``tests.unit.ledger_dsl.Ledger``, which checks every
invariant after every command (``InvariantMonitor.observe_batch``), so each story here is also an
invariant test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from control_plane.aggregate import Aggregate, handle
from control_plane.decide import next_deadline_ms
from control_plane.evolve import evolve_all
from control_plane.policy import ModelEntry, Policy
from control_plane.state import UserLedger
from schemas import commands as cmd
from schemas import events as ev
from schemas.codes import (
    REJECTIONS,
    CancelReason,
    ClientAction,
    FenceReason,
    FinishOutcome,
    RejectionCode,
    RequestStatus,
    ReservationState,
    SlotReleaseReason,
    Tier,
)
from schemas.messages import OutcomeKind
from tests.unit.ledger_dsl import T0, TEST_MODELS, Ledger, types

HOUR = 3600 * 1000


def admitted(L: Ledger, key: str = "k1", **over) -> str:
    d = L.submit(key, **over)
    assert d.outcome.kind is OutcomeKind.ADMITTED, d.outcome
    return d.outcome.generation_id


def running(L: Ledger, key: str = "k1", worker: str = "w1") -> str:
    g = admitted(L, key)
    assert L.accept(g, worker=worker).outcome.kind is OutcomeKind.APPLIED
    return g


# --- admission ------------------------------------------------------------------------------


def test_new_key_reserves_a_message_takes_a_slot_and_resolves_the_model():
    L = Ledger()
    d = L.submit("k1")
    assert types(d) == ["GenerationAdmitted"]
    admitted_event = d.events[0]
    assert admitted_event.model_version == TEST_MODELS["fast-text-model"].version
    assert admitted_event.epoch == 1 and admitted_event.window_start_ms == T0
    assert admitted_event.window_end_ms == T0 + 3 * HOUR
    assert d.outcome.details.remaining == 39 and d.outcome.details.reset_at_ms == T0 + 3 * HOUR
    w = L.window()
    assert (w.used, w.reserved, w.limit) == (0, 1, 40)
    assert list(L.state.slots.values()) == [d.outcome.generation_id]
    reservation = L.state.reservations[admitted_event.reservation_id]
    assert reservation.state is ReservationState.RESERVED
    assert reservation.reconcile_deadline_ms == T0 + 15_000 + 5_000


def test_same_key_same_fingerprint_in_progress_returns_the_existing_generation():
    L = Ledger()
    g = admitted(L)
    d = L.submit("k1")
    assert d.events == () and d.outcome.code is RejectionCode.GENERATION_IN_PROGRESS
    assert d.outcome.generation_id == g and d.outcome.status is RequestStatus.QUEUED
    L.accept(g)
    d = L.submit("k1")
    assert d.outcome.code is RejectionCode.GENERATION_IN_PROGRESS and d.outcome.status is RequestStatus.RUNNING
    assert L.window().reserved + L.window().used == 1


def test_same_key_different_fingerprint_is_an_idempotency_conflict_and_changes_nothing():
    L = Ledger()
    admitted(L)
    before = L.state
    d = L.submit("k1", fingerprint="fp-bbbbbbbb")
    assert d.outcome.code is RejectionCode.IDEMPOTENCY_CONFLICT and d.events == ()
    assert L.state == before


def test_completed_returns_existing_result_while_retained_then_result_unavailable():
    L = Ledger()
    g = running(L)
    L.advance(2_000)
    done = L.report(g)
    assert types(done) == ["ConcurrencySlotReleased", "UsageRecorded", "GenerationCompleted"]
    expires = done.events[-1].result_expires_at_ms
    assert expires == L.now_ms + L.policy.result_ttl_ms
    d = L.submit("k1")
    assert d.outcome.kind is OutcomeKind.EXISTING and d.outcome.status is RequestStatus.COMPLETED
    assert d.outcome.result_expires_at_ms == expires and d.events == ()
    L.now_ms = expires
    d = L.submit("k1")
    assert d.outcome.code is RejectionCode.RESULT_UNAVAILABLE and d.events == ()
    assert L.window().used == 1, "inference is never rerun and nothing more is spent"


def test_the_41st_request_is_quota_exhausted_with_limit_remaining_and_reset_at():
    L = Ledger()
    for i in range(40):
        g = admitted(L, f"k{i}")
        L.accept(g)
        L.report(g)
    d = L.submit("k40")
    assert d.outcome.code is RejectionCode.QUOTA_EXHAUSTED
    assert (d.outcome.details.limit, d.outcome.details.remaining) == (40, 0)
    assert d.outcome.details.reset_at_ms == T0 + 3 * HOUR
    assert types(d) == ["AdmissionRejected"] and d.events[0].status is RequestStatus.REJECTED
    # The retained key keeps identifying that refusal, even after the reset.
    L.now_ms = T0 + 3 * HOUR + 1
    again = L.submit("k40")
    assert again.outcome.code is RejectionCode.QUOTA_EXHAUSTED and again.events == ()
    assert again.outcome.details.reset_at_ms == T0 + 3 * HOUR
    # A new key after the reset is admitted in the new window.
    assert L.submit("k41").outcome.kind is OutcomeKind.ADMITTED


def test_reserved_messages_count_against_the_quota_before_they_are_consumed():
    L = Ledger(policy=Policy(quota_limit_by_tier={Tier.FREE: 2, Tier.PAID: 2}, concurrency_limit=5))
    admitted(L, "a")
    admitted(L, "b")
    d = L.submit("c")
    assert d.outcome.code is RejectionCode.QUOTA_EXHAUSTED and d.outcome.details.remaining == 0


def test_concurrency_limited_is_a_retryable_admission_state_that_holds_nothing():
    L = Ledger()
    g1 = running(L, "a")
    admitted(L, "b")
    d = L.submit("c")
    assert d.outcome.code is RejectionCode.CONCURRENCY_LIMITED
    assert d.outcome.details.retry_after_ms and d.outcome.status is RequestStatus.ADMISSION_RETRYABLE
    assert L.window().reserved + L.window().used == 2
    L.report(g1)
    retry = L.submit("c")
    assert retry.outcome.kind is OutcomeKind.ADMITTED
    assert retry.outcome.generation_id == d.outcome.generation_id, "the key keeps its generation id"


def test_capacity_exhausted_before_any_reservation_then_same_key_retry_reserves():
    L = Ledger()
    d = L.submit("k1", estimated_queue_wait_ms=L.policy.queue_budget_ms + 1)
    assert d.outcome.code is RejectionCode.CAPACITY_EXHAUSTED
    assert L.state.windows == {} and L.state.slots == {}
    assert L.submit("k1").outcome.kind is OutcomeKind.ADMITTED


def test_a_retryable_refusal_is_readmitted_into_its_models_pool():
    # The refusal records the pool of the version it resolved (AdmissionRejected v2), so the same-key
    # retry is dispatched to the workers of that version; it used to fall back to a pool "default".
    models = {"m": ModelEntry("m", "m-v1@sha256:0123456789ab", "m-pool", frozenset(Tier))}
    L = Ledger(policy=Policy(models=models))
    refused = L.submit("k1", model_alias="m", estimated_queue_wait_ms=L.policy.queue_budget_ms + 1)
    assert refused.outcome.code is RejectionCode.CAPACITY_EXHAUSTED and refused.events[0].pool == "m-pool"
    retry = L.submit("k1", model_alias="m")
    assert types(retry) == ["GenerationAdmitted"] and retry.events[0].pool == "m-pool"
    assert retry.events[0].model_version == "m-v1@sha256:0123456789ab"


def test_a_v1_refusal_without_a_pool_is_readmitted_into_the_pool_serving_its_version():
    models = {"m": ModelEntry("m", "m-v1", "m-pool", frozenset(Tier))}
    L = Ledger(policy=Policy(models=models))
    L.submit("k1", model_alias="m", estimated_queue_wait_ms=L.policy.queue_budget_ms + 1)
    record = L.state.requests["k1"]
    L.aggregate = replace(L.aggregate, ledger=replace(L.state, requests={**L.state.requests, "k1": replace(record, pool="")}))
    retry = L.submit("k1", model_alias="m")
    assert types(retry) == ["GenerationAdmitted"] and retry.events[0].pool == "m-pool"


def test_unknown_model_is_invalid_request_and_tier_policy_gives_model_not_allowed():
    catalog = {"big": ModelEntry("big", "big-v1", "big", frozenset({Tier.PAID}))}
    L = Ledger(policy=Policy(models=catalog))
    d = L.submit("k1", model_alias="nope")
    assert d.outcome.code is RejectionCode.INVALID_REQUEST and d.outcome.details.field == "model"
    d = L.submit("k2", model_alias="big")
    assert d.outcome.code is RejectionCode.MODEL_NOT_ALLOWED and d.events == ()
    d = L.submit("k3", model_alias="big", max_output_tokens=10_000, tier=Tier.PAID)
    assert d.outcome.code is RejectionCode.INVALID_REQUEST and d.outcome.details.field == "max_output_tokens"


# --- acceptance -----------------------------------------------------------------------------


def test_acceptance_consumes_the_reservation_exactly_once():
    L = Ledger()
    g = admitted(L)
    d = L.accept(g)
    assert types(d) == ["AttemptAccepted", "ReservationConsumed"]
    assert d.events[0].lease_deadline_ms == L.now_ms + L.policy.lease_ms
    assert (L.window().used, L.window().reserved) == (1, 0)
    repeat = L.accept(g)
    assert repeat.outcome.kind is OutcomeKind.EXISTING and repeat.events == ()
    assert (L.window().used, L.window().reserved) == (1, 0)


def test_acceptance_by_another_worker_or_for_another_epoch_is_rejected_and_recorded():
    L = Ledger()
    g = admitted(L)
    stale = L.accept(g, epoch=2)
    assert stale.outcome.code is RejectionCode.STALE_ATTEMPT and types(stale) == ["LateReportIgnored"]
    L.accept(g, worker="w1")
    other = L.accept(g, worker="w2")
    assert other.outcome.code is RejectionCode.STALE_ATTEMPT and other.events[0].reason == "owned_elsewhere"
    assert L.window().used == 1


def test_acceptance_after_the_queue_deadline_is_refused_and_releases():
    L = Ledger()
    g = admitted(L)
    L.advance(L.policy.queue_wait_max_ms + 1)
    d = L.accept(g)
    assert d.outcome.code is RejectionCode.STALE_ATTEMPT
    assert "ReservationReleased" in types(d) and "AttemptAccepted" not in types(d)
    assert L.record(g).status is RequestStatus.ADMISSION_RETRYABLE


def test_a_proven_decline_releases_once_and_the_key_can_be_retried_as_a_new_epoch():
    L = Ledger()
    g = admitted(L)
    d = L.decline(g)
    assert types(d) == [
        "AttemptDeclined",
        "AttemptFenced",
        "ReservationReleased",
        "ConcurrencySlotReleased",
        "GenerationReturnedToAdmission",
    ]
    assert (L.window().used, L.window().reserved) == (0, 0) and L.state.slots == {}
    assert L.decline(g).events == (), "a repeated decline is a no-op"
    assert L.accept(g).outcome.code is RejectionCode.STALE_ATTEMPT, "a fenced epoch never accepts"
    retry = L.submit("k1")
    assert retry.outcome.kind is OutcomeKind.ADMITTED and retry.outcome.epoch == 2
    assert retry.outcome.generation_id == g
    assert L.accept(g, epoch=2).outcome.kind is OutcomeKind.APPLIED
    assert L.window().used == 1


def test_a_decline_after_acceptance_is_not_a_proof_and_is_ignored():
    L = Ledger()
    g = running(L)
    d = L.decline(g)
    assert d.outcome.code is RejectionCode.STALE_ATTEMPT and L.window().used == 1


# --- cancellation ---------------------------------------------------------------------------


def test_cancel_of_queued_work_fences_releases_and_is_cancelled_at_once():
    L = Ledger()
    g = admitted(L)
    d = L.cancel(g)
    assert types(d) == ["AttemptFenced", "ReservationReleased", "ConcurrencySlotReleased", "GenerationCancelled"]
    assert d.events[0].reason is FenceReason.CANCELLED_IN_QUEUE
    assert d.outcome.status is RequestStatus.CANCELLED
    assert (L.window().used, L.window().reserved) == (0, 0)
    late = L.accept(g)
    assert late.outcome.code is RejectionCode.STALE_ATTEMPT and late.events[0].reason == "fenced_epoch"


def test_cancel_of_running_work_records_intent_and_waits_for_the_stop_acknowledgement():
    L = Ledger()
    g = running(L)
    d = L.cancel(g)
    assert types(d) == ["CancelRequested"] and d.events[0].owner_worker_id == "w1"
    assert d.outcome.kind is OutcomeKind.CANCEL_REQUESTED and d.outcome.status is RequestStatus.RUNNING
    assert L.state.slots, "the slot is held until the stop is acknowledged"
    again = L.cancel(g)
    assert again.outcome.kind is OutcomeKind.CANCEL_REQUESTED and again.events == ()
    stopped = L.report(g, FinishOutcome.STOPPED, output_tokens=7)
    assert types(stopped) == ["ConcurrencySlotReleased", "UsageRecorded", "GenerationCancelled"]
    assert stopped.events[0].reason is SlotReleaseReason.STOP_ACKNOWLEDGED
    assert stopped.events[1].output_tokens == 7, "generated tokens are recorded on cancel"
    assert stopped.events[2].partial is True
    assert L.state.slots == {} and L.window().used == 1, "the message stays consumed"


def test_cancel_of_terminal_work_returns_the_existing_state():
    L = Ledger()
    g = running(L)
    L.report(g)
    d = L.cancel(g)
    assert d.events == () and d.outcome.kind is OutcomeKind.EXISTING
    assert d.outcome.status is RequestStatus.COMPLETED


def test_cancel_of_unknown_generation_is_not_found():
    L = Ledger()
    assert L.cancel("gen_nope").outcome.code is RejectionCode.NOT_FOUND


def test_cancel_of_a_retryable_admission_state_ends_the_key():
    L = Ledger()
    g = admitted(L)
    L.decline(g)
    assert types(L.cancel(g)) == ["GenerationCancelled"]
    assert L.submit("k1").outcome.kind is OutcomeKind.EXISTING


def test_lease_expiry_with_cancel_intent_is_a_confirmed_cancel():
    L = Ledger()
    g = running(L)
    L.cancel(g)
    L.advance(L.policy.lease_ms)
    d = L.reconcile()
    assert types(d) == ["AttemptFenced", "ConcurrencySlotReleased", "UsageRecorded", "GenerationCancelled"]
    assert d.events[1].reason is SlotReleaseReason.LEASE_FENCED


def test_a_stop_nobody_asked_for_is_a_failure():
    L = Ledger()
    g = running(L)
    d = L.report(g, FinishOutcome.STOPPED, output_tokens=0)
    assert d.events[-1].code is RejectionCode.MODEL_BACKEND_ERROR and d.events[-1].partial is False


# --- finalization, usage, late events -------------------------------------------------------


def test_terminal_is_conditional_and_late_reports_never_reopen():
    L = Ledger()
    g = running(L)
    L.advance(L.policy.lease_ms)
    expired = L.reconcile()
    assert expired.events[-1].code is RejectionCode.MODEL_BACKEND_ERROR
    late = L.report(g, FinishOutcome.COMPLETED)
    assert types(late) == ["LateReportIgnored"] and late.outcome.code is RejectionCode.STALE_ATTEMPT
    assert L.record(g).status is RequestStatus.FAILED
    renew = L.renew(g)
    assert renew.outcome.code is RejectionCode.STALE_ATTEMPT


def test_usage_is_recorded_at_most_once_per_generation_and_epoch():
    L = Ledger()
    g = running(L)
    L.report(g, output_tokens=20)
    repeat = L.report(g, output_tokens=20)
    assert repeat.events == () and repeat.outcome.kind is OutcomeKind.EXISTING
    usage = [e for e in L.all_events if isinstance(e, ev.UsageRecorded)]
    assert len(usage) == 1 and len(L.state.usage) == 1


def test_renewal_extends_the_lease_but_never_past_the_run_deadline():
    L = Ledger()
    g = running(L)
    run_deadline = L.record(g).attempt.run_deadline_ms
    for _ in range(20):
        L.advance(8_000)
        d = L.renew(g, output_tokens=5)
        assert d.outcome.kind is OutcomeKind.APPLIED, d.outcome
    assert L.record(g).attempt.lease_deadline_ms <= run_deadline
    L.now_ms = run_deadline
    d = L.reconcile()
    assert d.events[-1].code is RejectionCode.GENERATION_TIMEOUT, "the run deadline fails with generation_timeout"
    assert d.events[0].reason is FenceReason.RUN_DEADLINE
    assert L.state.slots == {}


def test_a_renewal_reports_cancel_intent_back_to_the_worker():
    L = Ledger()
    g = running(L)
    L.cancel(g)
    assert L.renew(g).outcome.kind is OutcomeKind.CANCEL_REQUESTED


# --- deadlines and windows ------------------------------------------------------------------


def test_reconcile_deadline_fences_and_releases_only_without_acceptance():
    L = Ledger()
    queued = admitted(L, "a")
    accepted = running(L, "b")
    L.advance(L.policy.queue_wait_max_ms + L.policy.reconcile_grace_ms)
    L.renew(accepted)  # the running one keeps its lease
    d = L.reconcile()
    assert {e.generation_id for e in d.events} == {queued}
    assert "ReservationReleased" in types(d)
    assert L.record(queued).status is RequestStatus.ADMISSION_RETRYABLE
    assert L.record(accepted).status is RequestStatus.RUNNING
    assert (L.window().used, L.window().reserved) == (1, 0)


def test_nothing_due_means_no_events_and_the_timer_knows_when_to_come_back():
    L = Ledger()
    g = admitted(L)
    assert L.reconcile().events == ()
    assert next_deadline_ms(L.state, L.policy) == L.record(g).attempt.reconcile_deadline_ms


def test_reservations_stay_with_their_original_window_across_the_boundary():
    L = Ledger()
    L.now_ms = T0 + 3 * HOUR - 1_000  # 17:59:59
    g = admitted(L, "late")
    L.advance(2_000)  # 18:00:01, the next window
    L.accept(g)
    old, new = T0, T0 + 3 * HOUR
    assert (L.state.windows[old].used, L.state.windows[old].reserved) == (1, 0)
    assert new not in L.state.windows
    d = L.submit("next")
    assert d.events[0].window_start_ms == new
    assert L.state.windows[new].reserved == 1


def test_a_past_window_is_retained_while_a_reservation_references_it_then_retired():
    policy = Policy(queue_wait_max_ms=60_000, reconcile_grace_ms=5_000)
    L = Ledger(policy=policy)
    L.now_ms = T0 + 3 * HOUR - 1_000
    g = admitted(L)
    L.advance(10_000)
    assert L.reconcile().events == (), "the old window still has a RESERVED reservation"
    assert T0 in L.state.windows
    L.advance(60_000)
    d = L.reconcile()
    assert types(d)[:4] == ["AttemptFenced", "ReservationReleased", "ConcurrencySlotReleased", "GenerationReturnedToAdmission"]
    L.advance(1)
    retired = L.reconcile()
    assert [e.window_start_ms for e in retired.events if isinstance(e, ev.QuotaWindowRetired)] == [T0]
    assert T0 not in L.state.windows and not any(r.window_start_ms == T0 for r in L.state.reservations.values())
    assert L.record(g).status is RequestStatus.ADMISSION_RETRYABLE


def test_settled_reservations_leave_the_state_and_are_counted_in_their_window():
    # The hot value is rewritten on every command: before this, each consumed or released
    # reservation stayed in it until its window retired (the processor's soak growth).
    L = Ledger()
    for i in range(30):
        g = running(L, key=f"c{i}")
        L.report(g)
        assert L.state.reservations == {}, "a consumed reservation is not held"
    for i in range(3):
        g = admitted(L, key=f"r{i}")
        L.decline(g)
    assert L.state.reservations == {}, "a released reservation is not held"
    w = L.window()
    assert (w.used, w.reserved, w.released) == (30, 0, 3)
    nxt = L.submit("next")
    assert nxt.outcome.details.remaining == 40 - 30 - 1, "released reservations give their message back"
    L.decline(nxt.outcome.generation_id)
    L.now_ms = T0 + 3 * HOUR
    (retired,) = [e for e in L.reconcile().events if isinstance(e, ev.QuotaWindowRetired)]
    assert (retired.window_start_ms, retired.used, retired.released) == (T0, 30, 4)


def test_a_retry_after_the_window_boundary_reserves_in_the_current_window():
    L = Ledger()
    L.now_ms = T0 + 3 * HOUR - 30_000
    g = admitted(L)
    L.decline(g)
    L.advance(60_000)
    retry = L.submit("k1")
    assert retry.outcome.kind is OutcomeKind.ADMITTED and retry.events[0].window_start_ms == T0 + 3 * HOUR
    assert L.state.windows[T0].reserved == 0 and L.state.windows[T0 + 3 * HOUR].reserved == 1


def test_dedup_records_are_kept_24h_after_terminal_then_purged():
    L = Ledger()
    g = running(L)
    L.report(g)
    L.advance(L.policy.dedup_retention_ms - 1)
    assert not [e for e in L.reconcile().events if isinstance(e, ev.DedupRecordPurged)]
    assert L.submit("k1").outcome.status is RequestStatus.COMPLETED
    L.advance(1)
    purged = [e for e in L.reconcile().events if isinstance(e, ev.DedupRecordPurged)]
    assert [e.idempotency_key for e in purged] == ["k1"]
    assert L.state.requests == {} and L.state.usage == {}


def test_an_active_record_is_never_purged_however_old():
    policy = Policy(generation_duration_max_ms=48 * HOUR, lease_ms=48 * HOUR)
    L = Ledger(policy=policy)
    g = running(L)
    L.advance(30 * HOUR)
    d = L.reconcile()
    assert not any(isinstance(e, ev.DedupRecordPurged) for e in d.events)
    assert L.record(g).status is RequestStatus.RUNNING


def completed(L: Ledger, key: str) -> str:
    g = running(L, key)
    L.report(g)
    return g


def test_a_full_record_table_never_forgets_a_key_within_its_retention():
    # At the bound the oldest settled record used to be purged to make room, so a same-key
    # retry of a completed request (well within its 24 h) was admitted and charged again.
    L = Ledger(policy=Policy(dedup_records_per_user_max=3))
    oldest = completed(L, "a")
    for key in ("b", "c"):
        L.advance(60_000)
        completed(L, key)
    L.advance(60_000)
    used = L.window().used
    refused = L.submit("d")
    L.advance(1_000)
    retry = L.submit("a")
    assert retry.outcome.kind is OutcomeKind.EXISTING and retry.outcome.generation_id == oldest, retry.outcome
    assert retry.outcome.status is RequestStatus.COMPLETED and not retry.events
    assert (L.window().used, L.window().reserved) == (used, 0), "nothing charged or held again"
    assert set(L.state.requests) == {"a", "b", "c"}
    assert refused.outcome.code is RejectionCode.IDEMPOTENCY_KEYS_EXHAUSTED


def test_a_new_key_at_the_bound_is_refused_holding_and_storing_nothing_until_the_oldest_leaves_retention():
    L = Ledger(policy=Policy(dedup_records_per_user_max=3, concurrency_limit=1))
    completed(L, "a")
    terminal_a = L.now_ms
    L.advance(60_000)
    completed(L, "b")
    L.advance(60_000)
    h = admitted(L, "c")  # active: never forgotten, never the one to wait for
    L.advance(5_000)
    state = L.state
    d = L.submit("d")
    assert d.outcome.kind is OutcomeKind.REJECTED and d.outcome.code is RejectionCode.IDEMPOTENCY_KEYS_EXHAUSTED
    assert not d.events and L.state == state, "the refusal reserves nothing and records nothing"
    assert d.outcome.generation_id is None
    assert d.outcome.details.limit == 3
    # Retry-After: when the oldest record ("a", terminal at terminal_a) leaves its retention.
    assert d.outcome.details.retry_after_ms == terminal_a + L.policy.dedup_retention_ms - L.now_ms
    spec = REJECTIONS[RejectionCode.IDEMPOTENCY_KEYS_EXHAUSTED]
    assert (spec.http_status, spec.retryable, spec.action) == (429, True, ClientAction.RETRY_AFTER_DELAY)
    # Keys already held still answer as ever; the retryable refusal of "d" left no trace to answer.
    assert L.submit("c").outcome.code is RejectionCode.GENERATION_IN_PROGRESS
    assert L.submit("d").outcome.code is RejectionCode.IDEMPOTENCY_KEYS_EXHAUSTED
    L.cancel(h)
    # One millisecond before "a" leaves retention: still refused; at that moment "a" makes room.
    L.now_ms = terminal_a + L.policy.dedup_retention_ms - 1
    assert L.submit("d").outcome.details.retry_after_ms == 1
    L.advance(1)
    d = L.submit("d")
    assert types(d)[:2] == ["DedupRecordPurged", "GenerationAdmitted"] and d.events[0].idempotency_key == "a"
    assert set(L.state.requests) == {"b", "c", "d"}


def test_every_record_past_retention_is_forgotten_when_a_new_key_needs_room():
    L = Ledger(policy=Policy(dedup_records_per_user_max=3, concurrency_limit=1))
    for key in ("a", "b", "c"):
        completed(L, key)
        L.advance(1_000)
    L.advance(L.policy.dedup_retention_ms)  # no timer ran: all three are due
    d = L.submit("d")
    purged = [e.idempotency_key for e in d.events if isinstance(e, ev.DedupRecordPurged)]
    assert purged == ["a", "b", "c"] and types(d)[-1] == "GenerationAdmitted"
    assert set(L.state.requests) == {"d"}


def test_the_monitor_reports_a_key_forgotten_within_its_retention():
    # The one definition of invariant 7 that the property tests, the simulator and the audit share.
    L = Ledger()
    g = completed(L, "a")
    retained_until = L.now_ms + L.policy.dedup_retention_ms

    def purge(at_ms: int, n: int) -> ev.DedupRecordPurged:
        return ev.DedupRecordPurged(
            event_id=f"x{n}/0", command_id=f"x{n}", user_id=L.user_id, generation_id=g, occurred_at_ms=at_ms, idempotency_key="a"
        )

    (violation,) = L.monitor.observe_batch([purge(retained_until - 1, 1)])
    assert violation.invariant == 7 and "forgotten 1 ms within its retention" in violation.message
    early = Ledger()
    early.monitor.dedup_retention_ms = None  # without the policy (an audit of a bare ledger): not checked
    g = completed(early, "a")
    assert not early.monitor.observe_batch([purge(early.now_ms, 2)])


def test_the_model_version_resolved_at_admission_is_kept_for_retries():
    L = Ledger()
    g = admitted(L)
    L.decline(g)
    L.policy = replace(L.policy, models={"fast-text-model": ModelEntry("fast-text-model", "v2", "v2", frozenset(Tier))})
    retry = L.submit("k1")
    assert retry.outcome.kind is OutcomeKind.ADMITTED and retry.events[0].model_version == TEST_MODELS["fast-text-model"].version
    assert L.submit("k2").events[0].model_version == "v2"


# --- redelivery -----------------------------------------------------------------------------


def test_a_redelivered_command_re_emits_the_same_events_and_changes_nothing():
    L = Ledger()
    command = L.submit_cmd("k1")
    first = L.run(command)
    state = L.state
    aggregate, again, redelivered = handle(L.aggregate, command, L.policy)
    assert redelivered and again == first and aggregate.ledger == state


def test_state_is_a_projection_of_the_events():
    L = Ledger()
    g = running(L, "a")
    L.cancel(g)
    L.report(g, FinishOutcome.STOPPED)
    h = admitted(L, "b")
    L.decline(h)
    L.submit("b")
    assert evolve_all(UserLedger(L.user_id), L.all_events) == L.state


# --- decision deadline: a 503 never charges -------------------------------------------------
#
# The edge gives every submit a deadline (decide_by_ms) a clock-skew margin before it stops waiting
# and answers 503 quota_service_unavailable; the processor stamps when it read the command
# (read_at_ms). A submit read after its deadline is refused, holding nothing.

EDGE_WAIT_MS = 2_000


def late(L: Ledger) -> dict:
    """Deadline and read stamp of a submit the processor read after its edge gave up."""
    return dict(decide_by_ms=L.now_ms + EDGE_WAIT_MS - 300, read_at_ms=L.now_ms + 30_000)


def in_time(L: Ledger) -> dict:
    return dict(decide_by_ms=L.now_ms + EDGE_WAIT_MS - 300, read_at_ms=L.now_ms + 5)


def holds_nothing(L: Ledger) -> bool:
    return not L.state.slots and all(r.state is not ReservationState.RESERVED for r in L.state.reservations.values())


def test_a_submit_read_after_its_decision_deadline_is_refused_holding_nothing_and_says_why():
    L = Ledger()
    stamps = late(L)
    d = L.submit("k1", **stamps)
    assert types(d) == ["AdmissionRejected"]
    refused = d.events[0]
    assert (refused.code, refused.status) == (RejectionCode.QUOTA_SERVICE_UNAVAILABLE, RequestStatus.ADMISSION_RETRYABLE)
    assert (refused.read_at_ms, refused.decide_by_ms) == (stamps["read_at_ms"], stamps["decide_by_ms"])
    assert d.outcome.code is RejectionCode.QUOTA_SERVICE_UNAVAILABLE and d.outcome.status is RequestStatus.ADMISSION_RETRYABLE
    assert L.state.windows == {} and L.state.reservations == {} and L.state.slots == {}
    # The client was told 503 (retry later); its same-key retry gets a fresh decision, admitted once.
    retry = L.submit("k1", **in_time(L))
    assert types(retry) == ["GenerationAdmitted"] and retry.events[0].epoch == 1
    assert retry.outcome.generation_id == d.outcome.generation_id, "the key keeps its generation id"
    assert (L.window().reserved, L.window().used) == (1, 0)
    again = L.submit("k1", **in_time(L))
    assert again.outcome.code is RejectionCode.GENERATION_IN_PROGRESS and L.window().reserved == 1
    L.accept(retry.outcome.generation_id)
    assert (L.window().reserved, L.window().used) == (0, 1), "one message, for the retry that ran"


def test_a_submit_read_by_its_deadline_or_without_one_is_decided_as_ever():
    L = Ledger()
    at_deadline = L.submit("a", decide_by_ms=T0 + 1_000, read_at_ms=T0 + 1_000)
    assert at_deadline.outcome.kind is OutcomeKind.ADMITTED
    unstamped = L.submit("b", decide_by_ms=T0 + 1_000)  # a core not behind a stamping processor
    assert unstamped.outcome.kind is OutcomeKind.ADMITTED
    # Both slots are held now; a submit without a deadline, read however late, is decided as ever.
    no_deadline = L.submit("c", read_at_ms=T0 + 10 * HOUR)
    assert no_deadline.outcome.code is RejectionCode.CONCURRENCY_LIMITED
    assert no_deadline.events[0].read_at_ms == 0 and no_deadline.events[0].decide_by_ms == 0


def test_lateness_is_judged_before_quota_and_slots_so_a_late_submit_is_never_a_final_refusal():
    # The client heard "retry later" (503), not "your allowance is used": the key stays retryable
    # and the retry gets the real answer.
    L = Ledger(policy=Policy(quota_limit_by_tier={Tier.FREE: 1, Tier.PAID: 1}))
    admitted(L, "a")
    d = L.submit("b", **late(L))
    assert d.outcome.code is RejectionCode.QUOTA_SERVICE_UNAVAILABLE
    assert L.state.requests["b"].status is RequestStatus.ADMISSION_RETRYABLE
    assert L.submit("b", **in_time(L)).outcome.code is RejectionCode.QUOTA_EXHAUSTED


def test_a_retryable_key_read_late_again_is_refused_again_and_keeps_its_generation_and_epoch():
    L = Ledger()
    g = admitted(L, "k1")
    L.decline(g)  # proven never started: back to admission, epoch 1 fenced
    before = L.state.requests["k1"]
    d = L.submit("k1", **late(L))
    assert types(d) == ["AdmissionRejected"] and d.events[0].code is RejectionCode.QUOTA_SERVICE_UNAVAILABLE
    after = L.state.requests["k1"]
    assert after.status is RequestStatus.ADMISSION_RETRYABLE and (after.epoch, after.fenced_epoch) == (before.epoch, 1)
    assert holds_nothing(L)
    retry = L.submit("k1", **in_time(L))
    assert retry.outcome.kind is OutcomeKind.ADMITTED and (retry.outcome.generation_id, retry.outcome.epoch) == (g, 2)


@pytest.mark.parametrize("settled", ["queued", "running", "completed", "cancelled", "quota_rejected"])
def test_a_late_same_key_submit_of_admitted_or_settled_work_answers_as_before(settled):
    L = Ledger(policy=Policy(quota_limit_by_tier={Tier.FREE: 1, Tier.PAID: 1}))
    if settled == "quota_rejected":
        admitted(L, "other")
        L.submit("k1")
    else:
        g = admitted(L, "k1")
        if settled == "running":
            L.accept(g)
        elif settled == "completed":
            L.accept(g)
            L.report(g)
        elif settled == "cancelled":
            L.cancel(g)
    on_time = L.submit("k1", **in_time(L))
    events_before = len(L.all_events)
    late_answer = L.submit("k1", **late(L))
    assert late_answer.events == () and len(L.all_events) == events_before
    assert (late_answer.outcome.kind, late_answer.outcome.code, late_answer.outcome.status) == (
        on_time.outcome.kind,
        on_time.outcome.code,
        on_time.outcome.status,
    )


def test_a_redelivered_submit_read_later_is_answered_with_its_remembered_decision():
    # A redelivery is read later than the first delivery: past the deadline, but the decision was made.
    L = Ledger()
    command = L.submit_cmd("k1", **in_time(L))
    first = L.run(command)
    assert first.outcome.kind is OutcomeKind.ADMITTED
    reread = replace(command, read_at_ms=command.decide_by_ms + 60_000)
    aggregate, again, redelivered = handle(L.aggregate, reread, L.policy, 0)
    assert redelivered and again == first and aggregate == L.aggregate


def test_the_read_stamp_travels_on_the_ledger_entry_and_only_for_submits():
    from control_plane.routing import route
    from schemas.topics import Topology
    from schemas.wire import decode_ledger_entry

    L = Ledger()
    before = L.state
    command = L.submit_cmd("k1", **in_time(L))
    decision = L.run(command)
    (entry, *_) = route(Topology(), before, L.state, command, decision, 0)
    assert decode_ledger_entry(entry.value).read_at_ms == command.read_at_ms
    g = decision.outcome.generation_id
    before = L.state
    accept = cmd_accept(L, g)
    (entry, *_) = route(Topology(), before, L.state, accept, L.run(accept), 0)
    assert decode_ledger_entry(entry.value).read_at_ms == 0


# --- the seed's stories ---------------------------------------------------------------------


def test_opening_story_first_words_stop_and_the_phone_retries_the_same_key():
    """Submit, first words, Stop; the phone retries the same key: one generation, one message spent."""
    L = Ledger()
    g = running(L, "msg-1")
    L.renew(g, output_tokens=3)  # first words streamed
    cancel = L.cancel(g, reason=CancelReason.USER)
    assert cancel.outcome.kind is OutcomeKind.CANCEL_REQUESTED
    phone = L.submit("msg-1")
    assert phone.outcome.code is RejectionCode.GENERATION_IN_PROGRESS and phone.outcome.generation_id == g
    L.report(g, FinishOutcome.STOPPED, output_tokens=4)
    phone_again = L.submit("msg-1")
    assert phone_again.outcome.kind is OutcomeKind.EXISTING
    assert phone_again.outcome.status is RequestStatus.CANCELLED and phone_again.outcome.generation_id == g
    assert L.cancel(g).outcome.status is RequestStatus.CANCELLED
    assert (L.window().used, L.window().reserved) == (1, 0)
    assert len([e for e in L.all_events if isinstance(e, ev.GenerationAdmitted)]) == 1


def test_lost_acceptance_acknowledgement_retains_the_reservation_and_starts_nothing_new():
    L = Ledger()
    g = admitted(L)
    L.accept(g)  # committed; the worker never heard back
    L.advance(3_000)
    phone = L.submit("k1")
    assert phone.outcome.code is RejectionCode.GENERATION_IN_PROGRESS
    retry = L.accept(g)  # the worker asks again with a new command id
    assert retry.outcome.kind is OutcomeKind.EXISTING and retry.outcome.status is RequestStatus.RUNNING
    assert L.window().used == 1 and L.reconcile().events == ()


def test_worker_crash_mid_generation_fails_partial_and_never_retries_by_itself():
    L = Ledger()
    g = running(L)
    L.renew(g, output_tokens=12)
    L.advance(L.policy.lease_ms)  # the worker died: no more renewals
    d = L.reconcile()
    failed = d.events[-1]
    assert isinstance(failed, ev.GenerationFailed)
    assert failed.code is RejectionCode.MODEL_BACKEND_ERROR and failed.partial is True
    usage = [e for e in d.events if isinstance(e, ev.UsageRecorded)]
    assert usage[0].output_tokens == 12 and usage[0].terminal_reason == "lease_expired"
    assert not any(isinstance(e, ev.GenerationAdmitted) for e in d.events)
    retry = L.submit("k1")
    assert retry.outcome.kind is OutcomeKind.EXISTING and retry.outcome.status is RequestStatus.FAILED
    assert L.state.slots == {} and L.window().used == 1


def test_lost_finalization_acknowledgement_is_repeated_without_double_accounting():
    L = Ledger()
    g = running(L)
    L.report(g, output_tokens=30)
    for _ in range(3):
        repeat = L.report(g, output_tokens=30)
        assert repeat.outcome.kind is OutcomeKind.EXISTING and repeat.events == ()
    assert L.window().used == 1 and len(L.state.usage) == 1


@pytest.mark.parametrize("first", ["cancel", "complete"])
def test_cancel_racing_completion(first: str):
    L = Ledger()
    g = running(L)
    if first == "complete":
        L.report(g)
        d = L.cancel(g)
        assert d.outcome.status is RequestStatus.COMPLETED and d.events == ()
    else:
        L.cancel(g)
        d = L.report(g, FinishOutcome.COMPLETED)  # the worker finished before it saw the stop
        assert d.events[-1].type == "GenerationCompleted"
        assert L.cancel(g).outcome.status is RequestStatus.COMPLETED
    assert L.state.slots == {} and L.window().used == 1


def test_a_redelivery_beyond_the_decision_memory_is_never_decided_again():
    """After a crash, a catch-up can replay more commands of one user than are remembered."""
    from control_plane.aggregate import RECENT_DECISIONS_MAX

    L = Ledger()
    aggregate = L.aggregate
    accept = None
    g = None
    for offset in range(RECENT_DECISIONS_MAX + 5):
        if offset == 0:
            command = L.submit_cmd("k1")
        elif offset == 1:
            command = accept = cmd_accept(L, g)
        else:
            command = L.submit_cmd("k1")  # same-key retries: in progress
        aggregate, decision, redelivered = handle(aggregate, command, L.policy, offset)
        assert not redelivered and decision is not None
        if offset == 0:
            g = decision.outcome.generation_id
    assert aggregate.remembered(accept.command_id) is None, "the acceptance fell out of memory"
    again, decision, redelivered = handle(aggregate, accept, L.policy, 1)
    assert redelivered and decision is None and again == aggregate
    # Without the offset it would be decided again against the newer state.
    assert handle(aggregate, accept, L.policy)[1] is not None


def cmd_accept(L: Ledger, generation_id: str):
    from schemas.commands import AcceptAttempt

    return AcceptAttempt(**L._base(generation_id=generation_id, epoch=1, worker_id="w1"))


def test_a_usage_query_reports_the_window_and_slots_and_changes_nothing():
    L = Ledger()
    running(L, key="k1")
    admitted(L, key="k2")
    before = L.aggregate
    query = cmd.QueryUsage(command_id="q1", user_id=L.user_id, issued_at_ms=L.now_ms, tier=Tier.FREE)
    after, decision, redelivered = handle(before, query, L.policy)
    assert after is before and decision.events == () and not redelivered
    u = decision.outcome.usage
    assert (u.limit, u.used, u.reserved, u.remaining) == (40, 1, 1, 38)
    assert (u.window_start_ms, u.window_end_ms) == (T0, T0 + 3 * HOUR)
    assert (u.active, u.concurrency_limit) == (2, L.policy.concurrency_limit)
    # A user never seen: the whole allowance of the tier's window.
    fresh = handle(Aggregate.empty("nobody"), replace(query, user_id="nobody", tier=Tier.PAID), L.policy)[1].outcome.usage
    assert (fresh.used, fresh.remaining, fresh.active) == (0, L.policy.quota_limit(Tier.PAID), 0)
