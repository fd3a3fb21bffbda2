"""``evolve(state, event) -> state``: the only way the per-user ledger changes.

One mutator per event type, dispatched through ``_APPLY`` (exhaustive: an unknown type raises).
Mutators apply the fact they are given; they do not judge it. Judging is ``decide``'s job, and
checking a recorded history (for example a corrupted ledger) is ``control_plane.invariants``'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from control_plane.state import (
    RETRY_FINGERPRINTS_PER_USER_MAX,
    Attempt,
    Conversation,
    QuotaWindow,
    RequestRecord,
    Reservation,
    RetryFingerprint,
    UsageEntry,
    UserLedger,
    usage_key,
    with_changes,
)
from schemas.codes import RequestStatus, ReservationState, RetryAttach
from schemas import events as ev


def evolve(state: UserLedger, event: ev.Event) -> UserLedger:
    apply = _APPLY.get(type(event))
    if apply is None:
        raise RuntimeError(f"Unrecognized event {type(event).__name__}")
    return apply(state, event)


def evolve_all(state: UserLedger, events: Iterable[ev.Event]) -> UserLedger:
    for event in events:
        state = evolve(state, event)
    return state


def _put_request(state: UserLedger, record: RequestRecord, at_ms: int) -> UserLedger:
    requests = dict(state.requests)
    requests[record.idempotency_key] = record
    by_generation = state.by_generation
    if by_generation.get(record.generation_id) != record.idempotency_key:
        by_generation = dict(by_generation)
        by_generation[record.generation_id] = record.idempotency_key
    return with_changes(state, requests=requests, by_generation=by_generation, last_event_ms=max(state.last_event_ms, at_ms))


def _update(state: UserLedger, event: Any, **changes: Any) -> UserLedger:
    record = state.record_of(event.generation_id)
    if record is None:
        # A fact about a generation this state never saw (only possible in a damaged ledger).
        return state
    changes.setdefault("updated_at_ms", event.occurred_at_ms)
    return _put_request(state, with_changes(record, **changes), event.occurred_at_ms)


def _window(state: UserLedger, start_ms: int) -> QuotaWindow | None:
    return state.windows.get(start_ms)


def _put_window(state: UserLedger, window: QuotaWindow) -> dict[int, QuotaWindow]:
    windows = dict(state.windows)
    windows[window.window_start_ms] = window
    return windows


def _admitted(state: UserLedger, e: ev.GenerationAdmitted) -> UserLedger:
    window = _window(state, e.window_start_ms) or QuotaWindow(
        e.window_start_ms, e.window_end_ms, e.window_limit, token_limit=e.window_token_limit
    )
    window = with_changes(window, reserved=window.reserved + 1, tokens_reserved=window.tokens_reserved + e.tokens_reserved)
    reservations = dict(state.reservations)
    reservations[e.reservation_id] = Reservation(
        e.reservation_id, e.generation_id, e.epoch, e.window_start_ms, ReservationState.RESERVED, e.reconcile_deadline_ms
    )
    slots = dict(state.slots)
    slots[e.slot_index] = e.generation_id
    previous = state.requests.get(e.idempotency_key)
    record = RequestRecord(
        idempotency_key=e.idempotency_key,
        fingerprint=e.fingerprint,
        generation_id=e.generation_id,
        model_alias=e.model_alias,
        model_version=e.model_version,
        pool=e.pool,
        tier=e.tier,
        stream=e.stream,
        max_output_tokens=e.max_output_tokens,
        input_tokens=e.input_tokens,
        status=RequestStatus.QUEUED,
        epoch=e.epoch,
        fenced_epoch=previous.fenced_epoch if previous else 0,
        created_at_ms=previous.created_at_ms if previous else e.occurred_at_ms,
        updated_at_ms=e.occurred_at_ms,
        attempt=Attempt(
            e.epoch,
            None,
            e.queue_deadline_ms,
            e.reconcile_deadline_ms,
            window_start_ms=e.window_start_ms,
            tokens_reserved=e.tokens_reserved,
        ),
        reply_to=e.reply_to,
        reader_id=e.reader_id,
    )
    state = with_changes(state, windows=_put_window(state, window), reservations=reservations, slots=slots)
    if e.retry_attach_until_ms:
        state = _remember_fingerprint(state, e)
    return _put_request(state, record, e.occurred_at_ms)


def _remember_fingerprint(state: UserLedger, e: ev.GenerationAdmitted) -> UserLedger:
    """The admitted keyless request becomes its fingerprint's newest generation; entries whose window
    has ended leave, and past ``RETRY_FINGERPRINTS_PER_USER_MAX`` the one whose window ends first."""
    remembered = {
        fp: entry for fp, entry in state.retry_fingerprints.items() if entry.attach_until_ms > e.occurred_at_ms and fp != e.fingerprint
    }
    while len(remembered) >= RETRY_FINGERPRINTS_PER_USER_MAX:
        del remembered[min(remembered, key=lambda fp: (remembered[fp].attach_until_ms, fp))]
    remembered[e.fingerprint] = RetryFingerprint(
        e.generation_id, e.retry_attach_until_ms, awaiting_original=e.retry_attach is RetryAttach.RETRY
    )
    return with_changes(state, retry_fingerprints=remembered)


def _request_attached(state: UserLedger, e: ev.RequestAttached) -> UserLedger:
    entry = state.retry_fingerprints.get(e.fingerprint)
    if e.retry_attach is RetryAttach.ORIGINAL and entry is not None and entry.generation_id == e.generation_id:
        # The first try arrived: the generation no longer waits for it (another first try of the
        # same fingerprint is another request).
        remembered = dict(state.retry_fingerprints)
        remembered[e.fingerprint] = with_changes(entry, awaiting_original=False)
        state = with_changes(state, retry_fingerprints=remembered)
    return with_changes(state, last_event_ms=max(state.last_event_ms, e.occurred_at_ms))


def _rejected(state: UserLedger, e: ev.AdmissionRejected) -> UserLedger:
    previous = state.requests.get(e.idempotency_key)
    record = RequestRecord(
        idempotency_key=e.idempotency_key,
        fingerprint=e.fingerprint,
        generation_id=e.generation_id,
        model_alias=e.model_alias,
        model_version=e.model_version,
        pool=e.pool or (previous.pool if previous else ""),
        tier=e.tier,
        stream=previous.stream if previous else False,
        max_output_tokens=previous.max_output_tokens if previous else 0,
        input_tokens=previous.input_tokens if previous else 0,
        status=e.status,
        epoch=previous.epoch if previous else 0,
        fenced_epoch=previous.fenced_epoch if previous else 0,
        created_at_ms=previous.created_at_ms if previous else e.occurred_at_ms,
        updated_at_ms=e.occurred_at_ms,
        code=e.code,
        terminal_at_ms=e.occurred_at_ms if e.status.terminal else 0,
        reset_at_ms=e.reset_at_ms,
        refusal_kind=e.kind,
        token_limit=e.token_limit,
    )
    return _put_request(state, record, e.occurred_at_ms)


def _accepted(state: UserLedger, e: ev.AttemptAccepted) -> UserLedger:
    record = state.record_of(e.generation_id)
    if record is None or record.attempt is None:
        return state
    attempt = with_changes(
        record.attempt, owner_worker_id=e.worker_id, lease_deadline_ms=e.lease_deadline_ms, run_deadline_ms=e.run_deadline_ms
    )
    return _update(state, e, status=RequestStatus.RUNNING, attempt=attempt)


def _settle_reservation(state: UserLedger, reservation_id: str, to: ReservationState) -> UserLedger:
    """Drop a RESERVED reservation and count it in its window as consumed or released.

    A settled reservation is never read again by ``decide`` (a usage record names the window from
    the attempt), so it is not kept: the state holds only what is still RESERVED.
    """
    reservation = state.reservations.get(reservation_id)
    if reservation is None:
        return state
    reservations = dict(state.reservations)
    del reservations[reservation_id]
    window = state.windows.get(reservation.window_start_ms)
    windows = state.windows
    if window is not None:
        consumed = to is ReservationState.CONSUMED
        window = with_changes(
            window,
            reserved=window.reserved - 1,
            used=window.used + (1 if consumed else 0),
            released=window.released + (0 if consumed else 1),
        )
        windows = _put_window(state, window)
    return with_changes(state, reservations=reservations, windows=windows)


def _consumed(state: UserLedger, e: ev.ReservationConsumed) -> UserLedger:
    return _settle_reservation(state, e.reservation_id, ReservationState.CONSUMED)


def _released(state: UserLedger, e: ev.ReservationReleased) -> UserLedger:
    state = _settle_reservation(state, e.reservation_id, ReservationState.RELEASED)
    if e.tokens_released:
        state = _settle_tokens(state, e, e.window_start_ms, e.tokens_released, 0, 0)
    return state


def _settle_tokens(state: UserLedger, e: Any, window_start_ms: int, reserved: int, billable: int, overshoot: int) -> UserLedger:
    """Settle an attempt's token reservation once: ``reserved`` leaves the window's ``tokens_reserved``
    and ``billable`` joins its ``tokens_used`` (a retired window keeps no counters). The attempt that
    held it is dropped by the same command (every settlement is followed by the terminal event or the
    return to admission), so its ``tokens_reserved`` is left as it is rather than copying the records."""
    window = state.windows.get(window_start_ms)
    if window is not None:
        window = with_changes(
            window,
            tokens_reserved=window.tokens_reserved - reserved,
            tokens_used=window.tokens_used + billable,
            tokens_overshoot=window.tokens_overshoot + overshoot,
        )
        state = with_changes(state, windows=_put_window(state, window))
    return state


def _declined(state: UserLedger, e: ev.AttemptDeclined) -> UserLedger:
    return with_changes(state, last_event_ms=max(state.last_event_ms, e.occurred_at_ms))


def _fenced(state: UserLedger, e: ev.AttemptFenced) -> UserLedger:
    record = state.record_of(e.generation_id)
    if record is None:
        return state
    return _update(state, e, fenced_epoch=max(record.fenced_epoch, e.epoch))


def _renewed(state: UserLedger, e: ev.LeaseRenewed) -> UserLedger:
    record = state.record_of(e.generation_id)
    if record is None or record.attempt is None:
        return state
    attempt = with_changes(record.attempt, lease_deadline_ms=e.lease_deadline_ms, output_tokens_reported=e.output_tokens)
    return _update(state, e, attempt=attempt)


def _cancel_requested(state: UserLedger, e: ev.CancelRequested) -> UserLedger:
    record = state.record_of(e.generation_id)
    if record is None or record.attempt is None:
        return state
    return _update(state, e, attempt=with_changes(record.attempt, cancel_reason=e.reason))


def _slot_released(state: UserLedger, e: ev.ConcurrencySlotReleased) -> UserLedger:
    if state.slots.get(e.slot_index) != e.generation_id:
        return state
    slots = dict(state.slots)
    del slots[e.slot_index]
    return with_changes(state, slots=slots)


def _returned(state: UserLedger, e: ev.GenerationReturnedToAdmission) -> UserLedger:
    return _update(state, e, status=RequestStatus.ADMISSION_RETRYABLE, attempt=None, code=e.code, **_NO_DETACH)


def _terminal(state: UserLedger, e: Any, status: RequestStatus, **changes: Any) -> UserLedger:
    return _update(
        state, e, status=status, attempt=None, terminal_at_ms=e.occurred_at_ms, terminal_sequence=e.sequence, **_NO_DETACH, **changes
    )


# A settled request has no reader to wait for.
_NO_DETACH: dict[str, Any] = {"detached_until_ms": 0, "detach_reason": None}


def _reader_detached(state: UserLedger, e: ev.ReaderDetached) -> UserLedger:
    return _update(state, e, detached_until_ms=e.detached_until_ms, detach_reason=e.reason)


def _reader_attached(state: UserLedger, e: ev.ReaderAttached) -> UserLedger:
    return _update(state, e, reader_id=e.reader_id, **_NO_DETACH)


def _completed(state: UserLedger, e: ev.GenerationCompleted) -> UserLedger:
    return _terminal(state, e, RequestStatus.COMPLETED, code=None, result_expires_at_ms=e.result_expires_at_ms)


def _cancelled(state: UserLedger, e: ev.GenerationCancelled) -> UserLedger:
    return _terminal(state, e, RequestStatus.CANCELLED, code=None)


def _failed(state: UserLedger, e: ev.GenerationFailed) -> UserLedger:
    return _terminal(state, e, RequestStatus.FAILED, code=e.code)


def _usage(state: UserLedger, e: ev.UsageRecorded) -> UserLedger:
    usage = dict(state.usage)
    billable = billable_of(e)
    usage[usage_key(e.generation_id, e.epoch)] = UsageEntry(
        e.input_tokens, e.output_tokens, e.terminal_reason, e.requested_output_tokens, e.delivered_tokens, billable
    )
    state = with_changes(state, usage=usage)
    return _settle_tokens(state, e, e.window_start_ms, e.tokens_reserved, billable, e.overshoot_tokens)


def billable_of(e: ev.UsageRecorded) -> int:
    """The tokens a usage record charged; a record from before token budgets names none: its actual usage."""
    return e.billable_tokens or e.input_tokens + e.output_tokens


def _ignored(state: UserLedger, e: ev.LateReportIgnored) -> UserLedger:
    return state


def _purged(state: UserLedger, e: ev.DedupRecordPurged) -> UserLedger:
    record = state.requests.get(e.idempotency_key)
    if record is None:
        return state
    requests = dict(state.requests)
    del requests[e.idempotency_key]
    by_generation = dict(state.by_generation)
    by_generation.pop(record.generation_id, None)
    # Usage is recorded per (generation, epoch) for the epochs this record dispatched, 1..epoch.
    usage = state.usage
    keys = [k for e in range(1, record.epoch + 1) if (k := usage_key(record.generation_id, e)) in usage]
    if keys:
        usage = dict(usage)
        for k in keys:
            del usage[k]
    return with_changes(state, requests=requests, by_generation=by_generation, usage=usage)


def _window_retired(state: UserLedger, e: ev.QuotaWindowRetired) -> UserLedger:
    windows = dict(state.windows)
    retired = windows.pop(e.window_start_ms, None)
    reservations = {k: r for k, r in state.reservations.items() if r.window_start_ms != e.window_start_ms}
    open_from = max(state.open_windows_from_ms, retired.window_end_ms) if retired else state.open_windows_from_ms
    return with_changes(state, windows=windows, reservations=reservations, open_windows_from_ms=open_from)


# --- conversations ---------------------------------------------------------------------------


def _put_conversation(state: UserLedger, conversation_id: str, conversation: Conversation | None, at_ms: int) -> UserLedger:
    conversations = dict(state.conversations)
    if conversation is None:
        conversations.pop(conversation_id, None)
    else:
        conversations[conversation_id] = conversation
    return with_changes(state, conversations=conversations, last_event_ms=max(state.last_event_ms, at_ms))


def _change_conversation(state: UserLedger, e: Any, **changes: Any) -> UserLedger:
    conversation = state.conversations.get(e.conversation_id)
    if conversation is None:
        return state  # a fact about a conversation this state does not hold (a damaged ledger)
    changes.setdefault("updated_at_ms", e.occurred_at_ms)
    return _put_conversation(state, e.conversation_id, with_changes(conversation, **changes), e.occurred_at_ms)


def _conversation_created(state: UserLedger, e: ev.ConversationCreated) -> UserLedger:
    return _put_conversation(state, e.conversation_id, Conversation(revision=0, updated_at_ms=e.occurred_at_ms), e.occurred_at_ms)


def _turn_committed(state: UserLedger, e: ev.ConversationTurnCommitted) -> UserLedger:
    state = _change_conversation(
        state,
        e,
        revision=e.revision,
        in_flight=e.generation_id,
        turn_revision=e.revision,
        regenerate=e.regenerate,
        answer_pending=False,
        answer_stored=False,
    )
    record = state.record_of(e.generation_id)
    if record is not None and (record.conversation_id, record.turn_revision) != (e.conversation_id, e.revision):
        changed = with_changes(record, conversation_id=e.conversation_id, turn_revision=e.revision)
        state = _put_request(state, changed, e.occurred_at_ms)
    return state


def _answer_pending(state: UserLedger, e: ev.ConversationAnswerPending) -> UserLedger:
    return _change_conversation(state, e, answer_pending=True, pending_epoch=e.epoch, pending_status=e.status)


def _answer_stored(state: UserLedger, e: ev.ConversationAnswerStored) -> UserLedger:
    return _change_conversation(state, e, answer_stored=True)


def _answer_committed(state: UserLedger, e: ev.ConversationAnswerCommitted) -> UserLedger:
    return _change_conversation(
        state,
        e,
        revision=e.revision,
        in_flight="",
        turn_revision=0,
        regenerate=False,
        answer_pending=False,
        answer_stored=False,
        pending_epoch=0,
        pending_status="",
    )


def _conversation_deleted(state: UserLedger, e: ev.ConversationDeleted) -> UserLedger:
    state = _put_conversation(state, e.conversation_id, None, e.occurred_at_ms)
    tombstones = dict(state.conversation_tombstones)
    # When it was deleted: decide forgets it ``Policy.conversation_tombstone_ms`` later.
    tombstones[e.conversation_id] = e.occurred_at_ms
    return with_changes(state, conversation_tombstones=tombstones)


def _conversation_parked(state: UserLedger, e: ev.ConversationParked) -> UserLedger:
    return _put_conversation(state, e.conversation_id, None, e.occurred_at_ms)


def _conversation_restored(state: UserLedger, e: ev.ConversationRestored) -> UserLedger:
    return _put_conversation(state, e.conversation_id, Conversation(revision=e.revision, updated_at_ms=e.occurred_at_ms), e.occurred_at_ms)


def _conversation_forgotten(state: UserLedger, e: ev.ConversationForgotten) -> UserLedger:
    if e.conversation_id not in state.conversation_tombstones:
        return state
    tombstones = dict(state.conversation_tombstones)
    del tombstones[e.conversation_id]
    return with_changes(state, conversation_tombstones=tombstones)


_APPLY: dict[type, Callable[[UserLedger, Any], UserLedger]] = {
    ev.GenerationAdmitted: _admitted,
    ev.AdmissionRejected: _rejected,
    ev.AttemptAccepted: _accepted,
    ev.ReservationConsumed: _consumed,
    ev.ReservationReleased: _released,
    ev.AttemptDeclined: _declined,
    ev.AttemptFenced: _fenced,
    ev.LeaseRenewed: _renewed,
    ev.CancelRequested: _cancel_requested,
    ev.ReaderDetached: _reader_detached,
    ev.ReaderAttached: _reader_attached,
    ev.RequestAttached: _request_attached,
    ev.ConcurrencySlotReleased: _slot_released,
    ev.GenerationReturnedToAdmission: _returned,
    ev.GenerationCompleted: _completed,
    ev.GenerationCancelled: _cancelled,
    ev.GenerationFailed: _failed,
    ev.UsageRecorded: _usage,
    ev.LateReportIgnored: _ignored,
    ev.DedupRecordPurged: _purged,
    ev.QuotaWindowRetired: _window_retired,
    ev.ConversationCreated: _conversation_created,
    ev.ConversationTurnCommitted: _turn_committed,
    ev.ConversationAnswerPending: _answer_pending,
    ev.ConversationAnswerStored: _answer_stored,
    ev.ConversationAnswerCommitted: _answer_committed,
    ev.ConversationDeleted: _conversation_deleted,
    ev.ConversationParked: _conversation_parked,
    ev.ConversationRestored: _conversation_restored,
    ev.ConversationForgotten: _conversation_forgotten,
}
assert set(_APPLY) == set(ev.EVENT_TYPES), "every event type needs a mutator"
