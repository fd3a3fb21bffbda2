"""``decide(state, command, policy) -> Decision``: the per-user admission state machine.

Pure: no I/O, no clock, no randomness. Time is the command's ``issued_at_ms``; generation ids and
event ids are derived from the command, so a redelivered command decides the same way against the
same state. A refusal is data (an ``Outcome`` with a ``RejectionCode``), never an exception.

Where this sits: the admission processor (``projections/``) calls ``control_plane.aggregate.handle``,
which de-duplicates command ids, calls this, folds the events with ``evolve`` and routes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, assert_never

from control_plane.ids import generation_id_for
from control_plane.policy import Policy, RiskLimits
from control_plane.state import (
    Conversation,
    QuotaWindow,
    RequestRecord,
    UserLedger,
    reservation_id,
    retained_until_ms,
    usage_key,
)
from schemas import events as ev
from schemas.codes import (
    AnswerStatus,
    CancelReason,
    FenceReason,
    FinishOutcome,
    LateReportReason,
    RejectionCode,
    RequestStatus,
    RetryAttach,
    SlotReleaseReason,
    TerminalReason,
    Tier,
)
from schemas.commands import (
    AcceptAttempt,
    AttachReader,
    CancelGeneration,
    Command,
    CommitAnswer,
    CreateConversation,
    DeleteConversation,
    DeclineAttempt,
    DetachReader,
    QueryUsage,
    ReconcileDue,
    RenewLease,
    ReportAttemptFinished,
    SubmitGeneration,
)
from schemas.messages import Outcome, OutcomeKind, RejectionDetails, UsageSnapshot

# Retry hints for the two retryable admission refusals the ledger decides.
CONCURRENCY_RETRY_AFTER_MS = 2_000
CAPACITY_RETRY_AFTER_MS = 1_000

# The failure codes a worker's report may carry; output_refused is the output check's stop
# (docs/policy.md): the message stays spent, as after any failure once acceptance committed.
_FAILURE_CODES = frozenset({RejectionCode.MODEL_BACKEND_ERROR, RejectionCode.GENERATION_TIMEOUT, RejectionCode.OUTPUT_REFUSED})


@dataclass(frozen=True, slots=True)
class Decision:
    events: tuple[ev.Event, ...]
    outcome: Outcome


class _Emitter:
    """Builds the events of one command with ids ``<command_id>/<n>`` and the command's time."""

    __slots__ = ("command", "events")

    def __init__(self, command: Command) -> None:
        self.command = command
        self.events: list[ev.Event] = []

    def emit(self, cls: Callable[..., ev.Event], generation_id: str, **fields: Any) -> None:
        c = self.command
        self.events.append(
            cls(
                event_id=f"{c.command_id}/{len(self.events)}",
                command_id=c.command_id,
                user_id=c.user_id,
                generation_id=generation_id,
                occurred_at_ms=c.issued_at_ms,
                **fields,
            )
        )

    def decision(self, kind: OutcomeKind, record: RequestRecord | None = None, **fields: Any) -> Decision:
        c = self.command
        if record is not None:
            fields.setdefault("generation_id", record.generation_id)
            fields.setdefault("epoch", record.epoch)
            fields.setdefault("model_version", record.model_version)
        return Decision(
            tuple(self.events),
            Outcome(
                command_id=c.command_id,
                request_id=c.reply_to.request_id if c.reply_to is not None else None,
                kind=kind,
                **fields,
            ),
        )

    def reject(self, code: RejectionCode, record: RequestRecord | None = None, **fields: Any) -> Decision:
        if record is not None:
            fields.setdefault("status", record.status)
        return self.decision(OutcomeKind.REJECTED, record, code=code, **fields)


def decide(state: UserLedger, command: Command, policy: Policy) -> Decision:
    out = _Emitter(command)
    match command:
        case SubmitGeneration():
            return _submit(state, command, policy, out)
        case AcceptAttempt():
            return _accept(state, command, policy, out)
        case DeclineAttempt():
            return _decline(state, command, out)
        case RenewLease():
            return _renew(state, command, policy, out)
        case CancelGeneration():
            return _cancel(state, command, out)
        case DetachReader():
            return _detach(state, command, out)
        case AttachReader():
            return _attach(state, command, out)
        case ReportAttemptFinished():
            return _report(state, command, policy, out)
        case QueryUsage():
            return _query_usage(state, command, policy, out)
        case ReconcileDue():
            return _reconcile(state, command, policy, out)
        case CreateConversation():
            return _create_conversation(state, command, policy, out)
        case DeleteConversation():
            return _delete_conversation(state, command, policy, out)
        case CommitAnswer():
            return _commit_answer(state, command, out)
        case _:
            assert_never(command)


# --- submit ---------------------------------------------------------------------------------


def _submit(state: UserLedger, c: SubmitGeneration, policy: Policy, out: _Emitter) -> Decision:
    record = state.requests.get(c.idempotency_key)
    if record is not None:
        return _resubmit(state, record, c, policy, out)
    # A submit read past its decision deadline is not attached: its issuer has stopped waiting, and
    # naming it the generation's reader would withdraw a pending cancel nobody is there to replace.
    if c.retry_attach is not RetryAttach.OFF and not read_past_deadline(c):
        attached = _attach_to_earlier_try(state, c, out)
        if attached is not None:
            return attached
    model = policy.models.get(c.model_alias)
    if model is None:
        return out.reject(RejectionCode.INVALID_REQUEST, details=RejectionDetails(field="model"))
    if c.tier not in model.tiers:
        return out.reject(RejectionCode.MODEL_NOT_ALLOWED, details=RejectionDetails(field="model"))
    if c.max_output_tokens > policy.max_output_tokens_max:
        return out.reject(RejectionCode.INVALID_REQUEST, details=RejectionDetails(field="max_output_tokens"))
    if len(state.requests) >= policy.dedup_records_per_user_max:
        refused = _make_room(state, c, policy, out)
        if refused is not None:
            return refused
    generation_id = generation_id_for(c.user_id, c.command_id)
    return _admit(state, c, policy, out, generation_id, model.version, model.pool, epoch=1, created=True)


def _pool_serving(policy: Policy, model_version: str) -> str | None:
    """The pool of the catalog's model with this exact version (records written before events named it)."""
    return next((m.pool for m in policy.models.values() if m.version == model_version), None)


def _resubmit(state: UserLedger, record: RequestRecord, c: SubmitGeneration, policy: Policy, out: _Emitter) -> Decision:
    if record.fingerprint != c.fingerprint:
        return out.reject(RejectionCode.IDEMPOTENCY_CONFLICT)
    status = record.status
    turn = _turn_of(record)
    if status.active:
        return out.reject(RejectionCode.GENERATION_IN_PROGRESS, record, same_request=True, **turn)
    if status is RequestStatus.COMPLETED:
        if c.issued_at_ms < record.result_expires_at_ms:
            return out.decision(
                OutcomeKind.EXISTING, record, status=status, result_expires_at_ms=record.result_expires_at_ms, **turn
            )
        return out.reject(RejectionCode.RESULT_UNAVAILABLE, record, **turn)
    if status is RequestStatus.REJECTED:
        assert record.code is not None
        return out.reject(record.code, record, details=_quota_details(state, record, policy))
    if status is RequestStatus.ADMISSION_RETRYABLE:
        # Proven never started (or never dispatched): a fresh reservation under the current window,
        # the same generation id, the model version resolved at first admission, the next epoch.
        pool = record.pool or _pool_serving(policy, record.model_version)
        if pool is None:  # a v1 record whose version no model of the catalog serves any more
            return out.reject(RejectionCode.INVALID_REQUEST, record, details=RejectionDetails(field="model"))
        return _admit(state, c, policy, out, record.generation_id, record.model_version, pool, record.epoch + 1, created=False)
    # CANCELLED or FAILED: the terminal generation is never restarted by its key.
    return out.decision(OutcomeKind.EXISTING, record, status=status, code=record.code, **turn)


def _turn_of(record: RequestRecord) -> dict[str, Any]:
    """The conversation fields of a decision about an existing generation: a same-key retry of a
    conversation turn is answered with the turn's conversation and revision, as its first answer
    was, so that its issuer can name the revision the next turn sends. Empty for a stateless
    request, and for a record stored before turns kept their revision."""
    if not record.conversation_id or record.turn_revision <= 0:
        return {}
    return {"conversation_id": record.conversation_id, "revision": record.turn_revision}


def _attach_to_earlier_try(state: UserLedger, c: SubmitGeneration, out: _Emitter) -> Decision | None:
    """A keyless try answered by the generation an earlier try of the same request was admitted as,
    or None: it is a new request (``_admit`` decides it, and remembers its fingerprint).

    The match is the fingerprint's newest generation remembered within its window, still queued or
    running (and not being cancelled) or completed with its result retained; a cancelled or failed one
    does not match, so a retry after either starts afresh. A first try matches only a generation one
    of its retries was admitted as before it (the edge appended them out of order): two identical
    first tries are two requests. Deciding this here, in the same decision as admission, is what
    makes a retry that races its first try's admission find it: both ride the user's partition.
    """
    entry = state.retry_fingerprints.get(c.fingerprint)
    if entry is None or c.issued_at_ms >= entry.attach_until_ms:
        return None
    match c.retry_attach:
        case RetryAttach.RETRY:
            pass
        case RetryAttach.ORIGINAL:
            if not entry.awaiting_original:
                return None
        case RetryAttach.OFF:
            return None
        case _:
            assert_never(c.retry_attach)
    record = state.record_of(entry.generation_id)
    if record is None or record.fingerprint != c.fingerprint:
        return None
    status = record.status
    if status.active:
        if _being_cancelled(record):
            return None
    elif status is not RequestStatus.COMPLETED or c.issued_at_ms >= record.result_expires_at_ms:
        return None
    out.emit(
        ev.RequestAttached,
        record.generation_id,
        idempotency_key=c.idempotency_key,
        fingerprint=c.fingerprint,
        reader_id=c.reader_id,
        retry_attach=c.retry_attach,
    )
    moves_reader = record.reader_id != c.reader_id or record.detached_until_ms
    if c.retry_attach is RetryAttach.RETRY and status.active and record.reader_id and c.reader_id and moves_reader:
        # The retry's edge reads the generation now: a pending disconnect cancel (the earlier try's
        # client gave up) is withdrawn, as when a reader reattaches (``_attach``). A first try read
        # late does not take the reader from its retry, the try its client is still waiting on.
        out.emit(ev.ReaderAttached, record.generation_id, reader_id=c.reader_id)
    return out.decision(
        OutcomeKind.APPLIED,
        record,
        status=status,
        attached=True,
        result_expires_at_ms=record.result_expires_at_ms if status is RequestStatus.COMPLETED else None,
        **_turn_of(record),
    )


def _quota_details(state: UserLedger, record: RequestRecord, policy: Policy) -> RejectionDetails:
    window = state.windows.get(record.reset_at_ms - policy.window_ms)
    if record.refusal_kind == TOKENS:
        limit = record.token_limit
        held = (window.tokens_used + window.tokens_reserved) if window else 0
        return RejectionDetails(limit=limit, remaining=max(0, limit - held), reset_at_ms=record.reset_at_ms, kind=TOKENS)
    limit = window.limit if window else policy.quota_limit(record.tier)
    remaining = max(0, limit - window.used - window.reserved) if window else limit
    return RejectionDetails(limit=limit, remaining=remaining, reset_at_ms=record.reset_at_ms)


def _query_usage(state: UserLedger, c: QueryUsage, policy: Policy, out: _Emitter) -> Decision:
    """The quota window a submit issued now would be charged to (``_admit``'s choice), and the slots."""
    window_start = max(policy.window_start_ms(c.issued_at_ms), state.open_windows_from_ms)
    window = state.windows.get(window_start)
    used, reserved = (window.used, window.reserved) if window else (0, 0)
    risk_name, risk = policy.risk_limits(c.user_id, c.risk_class)
    limits = _limits(policy, c.tier, window, risk)
    limit = limits.quota
    tokens_used, tokens_reserved = (window.tokens_used, window.tokens_reserved) if window else (0, 0)
    token_limit = limits.tokens if limits.tokens is not None else 0
    snapshot = UsageSnapshot(
        window_start_ms=window_start,
        window_end_ms=window_start + policy.window_ms,
        limit=limit,
        used=used,
        reserved=reserved,
        remaining=max(0, limit - used - reserved),
        active=len(state.slots),
        concurrency_limit=limits.concurrency,
        token_limit=token_limit,
        tokens_used=tokens_used,
        tokens_reserved=tokens_reserved,
        tokens_remaining=max(0, token_limit - tokens_used - tokens_reserved) if limits.tokens is not None else 0,
        risk_class=risk_name,
    )
    return out.decision(OutcomeKind.EXISTING, usage=snapshot)


TOKENS = "tokens"  # RejectionDetails.kind of a refusal by the token budget


@dataclass(frozen=True, slots=True)
class _Limits:
    """The limits one decision applies: the tier's (as its window recorded them), each lowered by the
    account's risk class. ``tokens`` None: no token budget applies."""

    quota: int
    tokens: int | None
    concurrency: int


def _limits(policy: Policy, tier: Tier, window: QuotaWindow | None, risk: RiskLimits | None) -> _Limits:
    quota = window.limit if window else policy.quota_limit(tier)
    tier_tokens = window.token_limit if window else policy.token_budget(tier)
    tokens: int | None = tier_tokens if tier_tokens > 0 else None
    concurrency = policy.concurrency_limit
    if risk is not None:
        if risk.quota_limit is not None:
            quota = min(quota, risk.quota_limit)
        if risk.token_budget is not None:
            tokens = risk.token_budget if tokens is None else min(tokens, risk.token_budget)
        if risk.concurrency_limit is not None:
            concurrency = min(concurrency, risk.concurrency_limit)
    return _Limits(quota, tokens, concurrency)


def read_past_deadline(c: SubmitGeneration) -> bool:
    """Whether the processor read this submit after its decision deadline (the issuer stopped waiting).

    Both times are data in the command: ``decide_by_ms`` from the issuer, ``read_at_ms`` stamped by
    the processor's consuming shell; a command without either is never late.
    """
    return c.decide_by_ms > 0 and c.read_at_ms > c.decide_by_ms


def _admit(
    state: UserLedger,
    c: SubmitGeneration,
    policy: Policy,
    out: _Emitter,
    generation_id: str,
    model_version: str,
    pool: str,
    epoch: int,
    created: bool,
) -> Decision:
    # A command delivered late may be stamped inside a window already retired; re-opening it with
    # fresh counters would admit past its limit, so it is charged to the earliest open window.
    window_start = max(policy.window_start_ms(c.issued_at_ms), state.open_windows_from_ms)
    window_end = window_start + policy.window_ms
    window = state.windows.get(window_start)
    tier_limit = window.limit if window else policy.quota_limit(c.tier)  # what the window records
    tier_tokens = window.token_limit if window else policy.token_budget(c.tier)
    risk_name, risk = policy.risk_limits(c.user_id, c.risk_class)
    limits = _limits(policy, c.tier, window, risk)
    limit = limits.quota
    held = (window.used + window.reserved) if window else 0
    tokens_used, tokens_reserved = (window.tokens_used, window.tokens_reserved) if window else (0, 0)
    tokens_needed = c.input_tokens + c.max_output_tokens

    def refuse(
        code: RejectionCode, status: RequestStatus, details: RejectionDetails, late: bool = False, token_limit: int = 0
    ) -> Decision:
        out.emit(
            ev.AdmissionRejected,
            generation_id,
            idempotency_key=c.idempotency_key,
            fingerprint=c.fingerprint,
            model_alias=c.model_alias,
            model_version=model_version,
            pool=pool,
            tier=c.tier,
            code=code,
            status=status,
            window_start_ms=window_start,
            window_limit=limit,
            reset_at_ms=window_end,
            read_at_ms=c.read_at_ms if late else 0,
            decide_by_ms=c.decide_by_ms if late else 0,
            kind=details.kind or "",
            token_limit=token_limit,
        )
        return out.reject(
            code, generation_id=generation_id, status=status, epoch=epoch - 1, model_version=model_version, details=details
        )

    if read_past_deadline(c):
        # The issuer gave up on this decision and told its client admission failed (503): charging
        # that client now would spend a message nobody waits for. Nothing is held; the key stays
        # retryable, so a same-key retry with a fresh deadline gets a fresh decision.
        return refuse(
            RejectionCode.QUOTA_SERVICE_UNAVAILABLE, RequestStatus.ADMISSION_RETRYABLE, RejectionDetails(), late=True
        )
    turn: tuple[Conversation, int] | None = None
    if c.conversation_id:
        checked = _turn_conversation(state, c, out, generation_id, epoch)
        if isinstance(checked, Decision):
            return checked
        turn = checked
    if held >= limit:
        return refuse(
            RejectionCode.QUOTA_EXHAUSTED,
            RequestStatus.REJECTED,
            RejectionDetails(limit=limit, remaining=0, reset_at_ms=window_end),
        )
    if limits.tokens is not None:
        # The token budget, in the same decision: settled usage that leaves no room for this request's
        # reservation refuses it for the window; room held only by unsettled reservations (running or
        # queued generations) frees as they settle, so the client waits for one to finish.
        budget = limits.tokens
        remaining = max(0, budget - tokens_used - tokens_reserved)
        if tokens_used + tokens_needed > budget:
            return refuse(
                RejectionCode.QUOTA_EXHAUSTED,
                RequestStatus.REJECTED,
                RejectionDetails(limit=budget, remaining=remaining, reset_at_ms=window_end, kind=TOKENS),
                token_limit=budget,
            )
        if tokens_used + tokens_reserved + tokens_needed > budget:
            return refuse(
                RejectionCode.CONCURRENCY_LIMITED,
                RequestStatus.ADMISSION_RETRYABLE,
                RejectionDetails(
                    limit=budget, remaining=remaining, retry_after_ms=CONCURRENCY_RETRY_AFTER_MS, kind=TOKENS
                ),
                token_limit=budget,
            )
    slot = _free_slot(state, limits.concurrency)
    if slot is None:
        return refuse(
            RejectionCode.CONCURRENCY_LIMITED,
            RequestStatus.ADMISSION_RETRYABLE,
            RejectionDetails(retry_after_ms=CONCURRENCY_RETRY_AFTER_MS),
        )
    if c.estimated_queue_wait_ms > policy.queue_budget_ms:
        return refuse(
            RejectionCode.CAPACITY_EXHAUSTED,
            RequestStatus.ADMISSION_RETRYABLE,
            RejectionDetails(retry_after_ms=CAPACITY_RETRY_AFTER_MS),
        )
    queue_deadline = c.issued_at_ms + policy.queue_wait_max_ms
    out.emit(
        ev.GenerationAdmitted,
        generation_id,
        idempotency_key=c.idempotency_key,
        fingerprint=c.fingerprint,
        model_alias=c.model_alias,
        model_version=model_version,
        pool=pool,
        tier=c.tier,
        stream=c.stream,
        max_output_tokens=c.max_output_tokens,
        input_tokens=c.input_tokens,
        epoch=epoch,
        reservation_id=reservation_id(generation_id, epoch),
        window_start_ms=window_start,
        window_end_ms=window_end,
        window_limit=tier_limit,
        slot_index=slot,
        queue_deadline_ms=queue_deadline,
        reconcile_deadline_ms=queue_deadline + policy.reconcile_grace_ms,
        reader_id=c.reader_id,
        reply_to=c.reply_to,
        tokens_reserved=tokens_needed,
        window_token_limit=tier_tokens,
        token_limit=limits.tokens or 0,
        risk_class=risk_name,
        retry_attach=c.retry_attach,
        retry_attach_until_ms=_retry_attach_until_ms(c, policy),
    )
    revision = None
    if turn is not None:
        conversation, restored_from = turn
        if restored_from >= 0:
            out.emit(ev.ConversationRestored, "", conversation_id=c.conversation_id, revision=restored_from)
        revision = conversation.revision if c.regenerate else conversation.revision + 1
        out.emit(
            ev.ConversationTurnCommitted,
            generation_id,
            conversation_id=c.conversation_id,
            revision=revision,
            regenerate=c.regenerate,
        )
    return out.decision(
        OutcomeKind.ADMITTED,
        generation_id=generation_id,
        status=RequestStatus.QUEUED,
        epoch=epoch,
        model_version=model_version,
        details=RejectionDetails(limit=limit, remaining=limit - held - 1, reset_at_ms=window_end),
        conversation_id=c.conversation_id or None,
        revision=revision,
    )


def _retry_attach_until_ms(c: SubmitGeneration, policy: Policy) -> int:
    """Until when a keyless request's later tries attach to the generation admitted now (0: never)."""
    if c.retry_attach is RetryAttach.OFF or policy.openai_retry_attach_ms <= 0:
        return 0
    return c.issued_at_ms + policy.openai_retry_attach_ms


# --- conversations (docs/conversations.md) ----------------------------------------------------


def _held_conversation(
    state: UserLedger, conversation_id: str, restore_revision: int, restorable: bool
) -> tuple[Conversation, int] | None:
    """The conversation as decisions see it, and the revision it is restored from (-1: it was held).

    One the hot state holds is authoritative. One it does not hold is known only through the
    issuer's read of its stored row: parked at ``restore_revision``. That read is trusted only when
    ``restorable`` (the command is within its decision deadline, which is far shorter than the
    minimum idle time before a park, so no park can have followed the read) and no tombstone says
    it was deleted. Anything else is unknown: ``None``.
    """
    conversation = state.conversations.get(conversation_id)
    if conversation is not None:
        return conversation, -1
    if conversation_id in state.conversation_tombstones or restore_revision < 0 or not restorable:
        return None
    return Conversation(revision=restore_revision, updated_at_ms=0), restore_revision


def _restorable(c: SubmitGeneration | DeleteConversation) -> bool:
    if isinstance(c, SubmitGeneration):
        return c.decide_by_ms > 0 and not read_past_deadline(c)
    return True  # a delete of a parked conversation restores nothing: it only records the delete


def _turn_conversation(
    state: UserLedger, c: SubmitGeneration, out: _Emitter, generation_id: str, epoch: int
) -> tuple[Conversation, int] | Decision:
    """The checks a conversation turn passes before quota: the conversation is the caller's and
    live, ``expected_revision`` is its committed revision, and no generation of it runs (a turn
    sent at the revision its running answer will follow, or a regeneration racing one). A refusal
    holds and stores nothing (a same-key retry is decided afresh)."""
    held = _held_conversation(state, c.conversation_id, c.restore_revision, _restorable(c))
    if held is None:
        return out.reject(RejectionCode.NOT_FOUND, conversation_id=c.conversation_id)
    conversation, _restored_from = held
    # A stale revision first: a turn racing one that was admitted is a conflict (the winner's user
    # message moved the revision), whatever that winner is doing now.
    if c.expected_revision != conversation.revision:
        return out.reject(
            RejectionCode.CONVERSATION_CONFLICT,
            details=RejectionDetails(revision=conversation.revision),
            conversation_id=c.conversation_id,
            revision=conversation.revision,
        )
    if conversation.in_flight:
        running = state.record_of(conversation.in_flight)
        return out.reject(
            RejectionCode.GENERATION_IN_PROGRESS,
            generation_id=conversation.in_flight,
            status=running.status if running is not None else None,
            epoch=running.epoch if running is not None else 0,
            conversation_id=c.conversation_id,
            revision=conversation.revision,
        )
    if c.regenerate and conversation.revision < 2:
        # Nothing to regenerate: no answer has committed yet.
        return out.reject(RejectionCode.INVALID_REQUEST, details=RejectionDetails(field="regenerate"))
    return held


def _create_conversation(state: UserLedger, c: CreateConversation, policy: Policy, out: _Emitter) -> Decision:
    cid = c.conversation_id
    conversation = state.conversations.get(cid)
    if conversation is not None:
        return out.decision(OutcomeKind.EXISTING, conversation_id=cid, revision=conversation.revision)
    if cid in state.conversation_tombstones:
        return out.reject(RejectionCode.NOT_FOUND, conversation_id=cid)
    if len(state.conversations) >= policy.conversations_hot_max:
        refused = _park_for_room(state, c.issued_at_ms, policy, out)
        if refused is not None:
            return refused
    out.emit(ev.ConversationCreated, "", conversation_id=cid)
    return out.decision(OutcomeKind.APPLIED, conversation_id=cid, revision=0)


def _parkable_since(conversation: Conversation) -> int | None:
    """When this conversation became idle (no generation of it in flight), or None while one is."""
    return None if conversation.in_flight else conversation.updated_at_ms


def _park_for_room(state: UserLedger, now_ms: int, policy: Policy, out: _Emitter) -> Decision | None:
    """The hot state is full: park the least recently changed idle conversation, or refuse."""
    candidates = sorted(
        (since, cid) for cid, conv in state.conversations.items() if (since := _parkable_since(conv)) is not None
    )
    if candidates and candidates[0][0] + policy.conversation_park_min_idle_ms <= now_ms:
        _, cid = candidates[0]
        out.emit(ev.ConversationParked, "", conversation_id=cid, revision=state.conversations[cid].revision)
        return None
    retry_after_ms = (
        candidates[0][0] + policy.conversation_park_min_idle_ms - now_ms if candidates else CONCURRENCY_RETRY_AFTER_MS
    )
    return out.reject(
        RejectionCode.RATE_LIMITED,
        details=RejectionDetails(limit=policy.conversations_hot_max, retry_after_ms=max(1, retry_after_ms)),
    )


def _delete_conversation(state: UserLedger, c: DeleteConversation, policy: Policy, out: _Emitter) -> Decision:
    cid = c.conversation_id
    if cid in state.conversation_tombstones:
        return out.decision(OutcomeKind.EXISTING, conversation_id=cid)
    held = _held_conversation(state, cid, c.restore_revision, _restorable(c))
    if held is None:
        return out.reject(RejectionCode.NOT_FOUND, conversation_id=cid)
    conversation, _restored_from = held
    tombstones = state.conversation_tombstones
    if len(tombstones) >= policy.conversation_tombstones_max:
        # The oldest tombstone goes early once it is past the park minimum (no restore read before
        # its delete can still be within its decision deadline); else the delete waits.
        oldest_at, oldest = min((at, tid) for tid, at in tombstones.items())
        if oldest_at + policy.conversation_park_min_idle_ms > c.issued_at_ms:
            return out.reject(
                RejectionCode.RATE_LIMITED,
                details=RejectionDetails(
                    limit=policy.conversation_tombstones_max,
                    retry_after_ms=oldest_at + policy.conversation_park_min_idle_ms - c.issued_at_ms,
                ),
            )
        out.emit(ev.ConversationForgotten, "", conversation_id=oldest)
    if conversation.in_flight:
        record = state.record_of(conversation.in_flight)
        if record is not None and record.status.active:
            _stop(state, record, CancelReason.USER, out)
    out.emit(ev.ConversationDeleted, "", conversation_id=cid, revision=conversation.revision)
    return out.decision(OutcomeKind.APPLIED, conversation_id=cid, revision=conversation.revision)


def _commit_answer(state: UserLedger, c: CommitAnswer, out: _Emitter) -> Decision:
    """The history writer stored the answer: commit it if its generation has ended, else note it."""
    conversation = state.conversations.get(c.conversation_id)
    if conversation is None or conversation.in_flight != c.generation_id:
        # Committed already (a repeated commit), or the conversation was deleted meanwhile.
        return out.decision(OutcomeKind.EXISTING, conversation_id=c.conversation_id)
    if conversation.answer_pending:
        # Everything the commit needs is the conversation's: the request record may have been purged
        # meanwhile (its retention runs from its end, and the writer may come back much later).
        if c.epoch != conversation.pending_epoch:
            return out.decision(OutcomeKind.EXISTING, conversation_id=c.conversation_id)
        _emit_commit(
            conversation, c.generation_id, c.epoch, AnswerStatus(conversation.pending_status), c.conversation_id, out, spooled=True
        )
        return out.decision(
            OutcomeKind.APPLIED, generation_id=c.generation_id, conversation_id=c.conversation_id, revision=conversation.turn_revision + 1
        )
    record = state.record_of(c.generation_id)
    if record is None or c.epoch != record.epoch:
        return out.decision(OutcomeKind.EXISTING, conversation_id=c.conversation_id)
    if not conversation.answer_stored:
        out.emit(ev.ConversationAnswerStored, record.generation_id, conversation_id=c.conversation_id, epoch=c.epoch)
    return out.decision(OutcomeKind.APPLIED, record, conversation_id=c.conversation_id, revision=conversation.revision)


def _answer_status(status: RequestStatus) -> AnswerStatus:
    return AnswerStatus.COMPLETED if status is RequestStatus.COMPLETED else AnswerStatus.INCOMPLETE


def _emit_commit(
    conversation: Conversation, generation_id: str, epoch: int, status: AnswerStatus, conversation_id: str, out: _Emitter,
    spooled: bool,
) -> None:
    out.emit(
        ev.ConversationAnswerCommitted,
        generation_id,
        conversation_id=conversation_id,
        revision=conversation.turn_revision + 1,
        epoch=epoch,
        status=status,
        spooled=spooled,
        replaces_seq=conversation.turn_revision if conversation.regenerate else 0,
    )


def _end_turn(state: UserLedger, record: RequestRecord, out: _Emitter, status: RequestStatus, spooled: bool) -> None:
    """A conversation turn's generation ended (``status``, terminal or returned to admission).

    With a spooled answer it commits once the history writer has stored it (at once if the writer
    was first); without one (never started, fenced, or the worker could not spool) it commits now,
    incomplete and empty. A turn returned to admission is not retried under the conversation: its
    answer commits incomplete, so the conversation is not held for a retry that may never come."""
    cid = record.conversation_id
    conversation = state.conversations.get(cid) if cid else None
    if conversation is None or conversation.in_flight != record.generation_id:
        return
    if spooled and not conversation.answer_stored:
        out.emit(
            ev.ConversationAnswerPending, record.generation_id, conversation_id=cid, epoch=record.epoch, status=_answer_status(status)
        )
        return
    _emit_commit(conversation, record.generation_id, record.epoch, _answer_status(status), cid, out, spooled=spooled)


def _free_slot(state: UserLedger, concurrency_limit: int) -> int | None:
    if len(state.slots) >= concurrency_limit:
        return None
    for index in range(concurrency_limit):
        if index not in state.slots:
            return index
    return None


def _make_room(state: UserLedger, c: SubmitGeneration, policy: Policy, out: _Emitter) -> Decision | None:
    """A new key at the records bound: forget the records already past retention, or refuse.

    A record is never forgotten within its retention (a same-key retry of it would be admitted and
    charged again), so when none is due the new key is refused, holding nothing and storing nothing:
    nothing identifies it, and a retry after the delay is decided afresh. The delay is when the
    oldest record leaves retention, by this command's clock (the timer's ``ReconcileDue`` purges it).
    """
    due: list[tuple[tuple[int, str], RequestRecord]] = []
    earliest: int | None = None
    for record in state.requests.values():
        until = retained_until_ms(record, policy.dedup_retention_ms)
        if until is None:
            continue
        if until <= c.issued_at_ms:
            due.append((_canonical_order(record), record))
        elif earliest is None or until < earliest:
            earliest = until
    if due:
        due.sort(key=lambda item: item[0])
        for _, record in due:
            out.emit(ev.DedupRecordPurged, record.generation_id, idempotency_key=record.idempotency_key)
        return None
    # Every record is within retention. (All of them active is impossible while the bound exceeds the
    # concurrency limit; then the slot's own retry hint applies.)
    retry_after_ms = earliest - c.issued_at_ms if earliest is not None else CONCURRENCY_RETRY_AFTER_MS
    return out.reject(
        RejectionCode.IDEMPOTENCY_KEYS_EXHAUSTED,
        details=RejectionDetails(limit=policy.dedup_records_per_user_max, retry_after_ms=retry_after_ms),
    )


# --- worker commands ------------------------------------------------------------------------


def _ignore(out: _Emitter, record: RequestRecord, c: Any, reason: LateReportReason) -> Decision:
    out.emit(
        ev.LateReportIgnored,
        record.generation_id,
        epoch=c.epoch,
        command_type=c.type,
        worker_id=c.worker_id,
        reason=reason,
    )
    return out.reject(RejectionCode.STALE_ATTEMPT, record)


def _stale_reason(record: RequestRecord, epoch: int) -> LateReportReason:
    if epoch <= record.fenced_epoch:
        return LateReportReason.FENCED_EPOCH
    if record.status.terminal:
        return LateReportReason.TERMINAL
    if epoch != record.epoch:
        return LateReportReason.STALE_EPOCH
    return LateReportReason.NOT_CURRENT_OWNER


def _accept(state: UserLedger, c: AcceptAttempt, policy: Policy, out: _Emitter) -> Decision:
    record = state.record_of(c.generation_id)
    if record is None:
        return out.reject(RejectionCode.NOT_FOUND, generation_id=c.generation_id)
    attempt = record.attempt
    current = attempt is not None and attempt.epoch == c.epoch and c.epoch > record.fenced_epoch
    if current and record.status is RequestStatus.RUNNING:
        if attempt.owner_worker_id == c.worker_id:
            # A repeated acceptance (its acknowledgement was lost): a no-op that confirms ownership.
            return out.decision(OutcomeKind.EXISTING, record, status=record.status)
        return _ignore(out, record, c, LateReportReason.OWNED_ELSEWHERE)
    if current and record.status is RequestStatus.QUEUED:
        if c.issued_at_ms > attempt.queue_deadline_ms:
            _lapse(state, record, out, FenceReason.QUEUE_DEADLINE)
            return out.reject(RejectionCode.STALE_ATTEMPT, record, status=RequestStatus.ADMISSION_RETRYABLE)
        out.emit(
            ev.AttemptAccepted,
            record.generation_id,
            epoch=c.epoch,
            worker_id=c.worker_id,
            lease_deadline_ms=c.issued_at_ms + policy.lease_ms,
            run_deadline_ms=c.issued_at_ms + policy.generation_duration_max_ms + policy.run_deadline_grace_ms,
        )
        reservation = state.reservations[reservation_id(record.generation_id, c.epoch)]
        out.emit(
            ev.ReservationConsumed,
            record.generation_id,
            reservation_id=reservation.reservation_id,
            window_start_ms=reservation.window_start_ms,
            epoch=c.epoch,
        )
        return out.decision(OutcomeKind.APPLIED, record, status=RequestStatus.RUNNING)
    return _ignore(out, record, c, _stale_reason(record, c.epoch))


def _decline(state: UserLedger, c: DeclineAttempt, out: _Emitter) -> Decision:
    record = state.record_of(c.generation_id)
    if record is None:
        return out.reject(RejectionCode.NOT_FOUND, generation_id=c.generation_id)
    attempt = record.attempt
    if record.status is RequestStatus.QUEUED and attempt is not None and attempt.epoch == c.epoch:
        out.emit(ev.AttemptDeclined, record.generation_id, epoch=c.epoch, worker_id=c.worker_id, reason=c.reason)
        _lapse(state, record, out, FenceReason.DECLINED)
        return out.decision(OutcomeKind.APPLIED, record, status=RequestStatus.ADMISSION_RETRYABLE)
    if c.epoch <= record.fenced_epoch:
        # Already fenced and settled: repeating a decline changes nothing.
        return out.decision(OutcomeKind.EXISTING, record, status=record.status)
    return _ignore(out, record, c, _stale_reason(record, c.epoch))


def _renew(state: UserLedger, c: RenewLease, policy: Policy, out: _Emitter) -> Decision:
    record = state.record_of(c.generation_id)
    if record is None:
        return out.reject(RejectionCode.NOT_FOUND, generation_id=c.generation_id)
    attempt = record.attempt
    if (
        record.status is RequestStatus.RUNNING
        and attempt is not None
        and attempt.epoch == c.epoch
        and attempt.owner_worker_id == c.worker_id
        and c.epoch > record.fenced_epoch
    ):
        deadline = min(c.issued_at_ms + policy.lease_ms, attempt.run_deadline_ms)
        out.emit(
            ev.LeaseRenewed,
            record.generation_id,
            epoch=c.epoch,
            lease_deadline_ms=max(deadline, attempt.lease_deadline_ms),
            output_tokens=max(c.output_tokens, attempt.output_tokens_reported),
        )
        kind = OutcomeKind.CANCEL_REQUESTED if attempt.cancel_reason is not None else OutcomeKind.APPLIED
        return out.decision(kind, record, status=record.status)
    return _ignore(out, record, c, _stale_reason(record, c.epoch))


# --- cancel ---------------------------------------------------------------------------------


def _cancel(state: UserLedger, c: CancelGeneration, out: _Emitter) -> Decision:
    record = state.record_of(c.generation_id)
    if record is None:
        return out.reject(RejectionCode.NOT_FOUND, generation_id=c.generation_id)
    status = record.status
    if status is RequestStatus.QUEUED or status is RequestStatus.ADMISSION_RETRYABLE:
        _stop(state, record, c.reason, out)
        return out.decision(OutcomeKind.APPLIED, record, status=RequestStatus.CANCELLED)
    if status is RequestStatus.RUNNING:
        _stop(state, record, c.reason, out)
        return out.decision(OutcomeKind.CANCEL_REQUESTED, record, status=status)
    return out.decision(OutcomeKind.EXISTING, record, status=status, code=record.code)


def _stop(state: UserLedger, record: RequestRecord, reason: CancelReason, out: _Emitter) -> None:
    """Cancel a request that is not terminal: at once when no attempt can be running, else ask its owner."""
    status = record.status
    if status is RequestStatus.QUEUED:
        # Not accepted, and acceptance can only commit here: fencing the epoch proves it never starts.
        _release_unstarted(state, record, out, FenceReason.CANCELLED_IN_QUEUE)
        out.emit(ev.GenerationCancelled, record.generation_id, epoch=record.epoch, reason=reason, partial=False)
        _end_turn(state, record, out, RequestStatus.CANCELLED, spooled=False)
    elif status is RequestStatus.ADMISSION_RETRYABLE:
        out.emit(ev.GenerationCancelled, record.generation_id, epoch=record.epoch, reason=reason, partial=False)
        _end_turn(state, record, out, RequestStatus.CANCELLED, spooled=False)
    elif status is RequestStatus.RUNNING:
        attempt = record.attempt
        assert attempt is not None and attempt.owner_worker_id is not None
        if attempt.cancel_reason is None:
            out.emit(
                ev.CancelRequested,
                record.generation_id,
                epoch=attempt.epoch,
                owner_worker_id=attempt.owner_worker_id,
                reason=reason,
            )


# --- readers --------------------------------------------------------------------------------


def _being_cancelled(record: RequestRecord) -> bool:
    return record.attempt is not None and record.attempt.cancel_reason is not None


def _detach(state: UserLedger, c: DetachReader, out: _Emitter) -> Decision:
    """The reader is gone: the generation waits ``grace_ms`` for another, then the timer cancels it.

    Nothing changes for a settled request, one already detached (the first deadline stands), one
    being cancelled, or one another reader has attached to since ``c.reader_id`` read it.
    """
    record = state.record_of(c.generation_id)
    if record is None:
        return out.reject(RejectionCode.NOT_FOUND, generation_id=c.generation_id)
    if (
        not record.status.active
        or record.reader_id != c.reader_id
        or record.detached_until_ms
        or _being_cancelled(record)
    ):
        return out.decision(OutcomeKind.EXISTING, record, status=record.status, code=record.code)
    out.emit(
        ev.ReaderDetached,
        record.generation_id,
        reader_id=c.reader_id,
        detached_until_ms=c.issued_at_ms + c.grace_ms,
        reason=c.reason,
    )
    return out.decision(OutcomeKind.APPLIED, record, status=record.status)


def _attach(state: UserLedger, c: AttachReader, out: _Emitter) -> Decision:
    """A reader reads the generation again (on any edge): a pending detach is withdrawn."""
    record = state.record_of(c.generation_id)
    if record is None:
        return out.reject(RejectionCode.NOT_FOUND, generation_id=c.generation_id)
    unchanged = record.reader_id == c.reader_id and not record.detached_until_ms
    # A generation submitted without a reader (``background``) never gets one: no disconnect and no
    # edge's death may cancel it (it is bounded by its run deadline alone).
    background = not record.reader_id
    if not record.status.active or unchanged or background or _being_cancelled(record):
        return out.decision(OutcomeKind.EXISTING, record, status=record.status, code=record.code)
    out.emit(ev.ReaderAttached, record.generation_id, reader_id=c.reader_id)
    return out.decision(OutcomeKind.APPLIED, record, status=record.status)


def attached_reader(record: RequestRecord) -> str:
    """The reader (edge process) whose death would leave this request unread, or "": the one named
    by an active request that is neither detached nor being cancelled already."""
    if record.reader_id and record.status.active and not record.detached_until_ms and not _being_cancelled(record):
        return record.reader_id
    return ""


def attached_readers(state: UserLedger) -> frozenset[str]:
    """``attached_reader`` of every request of this user (the edges the processor watches for it)."""
    return frozenset(reader for record in state.requests.values() if (reader := attached_reader(record)))


def _detach_due(record: RequestRecord) -> int | None:
    """When the timer cancels this detached request; None while a reader is attached."""
    if record.detached_until_ms and record.status.active and not _being_cancelled(record):
        return record.detached_until_ms
    return None


# --- finalization ---------------------------------------------------------------------------


def _report(state: UserLedger, c: ReportAttemptFinished, policy: Policy, out: _Emitter) -> Decision:
    record = state.record_of(c.generation_id)
    if record is None:
        return out.reject(RejectionCode.NOT_FOUND, generation_id=c.generation_id)
    attempt = record.attempt
    if (
        record.status is RequestStatus.RUNNING
        and attempt is not None
        and attempt.epoch == c.epoch
        and attempt.owner_worker_id == c.worker_id
        and c.epoch > record.fenced_epoch
    ):
        _release_slot(state, record, out, SlotReleaseReason.STOP_ACKNOWLEDGED)
        delivered = c.output_tokens if c.delivered_tokens is None else min(c.delivered_tokens, c.output_tokens)
        _record_usage(
            state, record, out, policy, c.output_tokens, TerminalReason(c.finish_reason or c.outcome), c.outcome, delivered, lost=False,
            ttft_ms=c.ttft_ms,
        )
        partial = c.output_tokens > 0
        if c.outcome is FinishOutcome.COMPLETED:
            out.emit(
                ev.GenerationCompleted,
                record.generation_id,
                epoch=c.epoch,
                finish_reason=c.finish_reason,
                result_expires_at_ms=c.issued_at_ms + policy.result_ttl_ms,
                sequence=_terminal_sequence(c),
                result_stored=c.result_stored,
            )
            status = RequestStatus.COMPLETED
        elif c.outcome is FinishOutcome.STOPPED and attempt.cancel_reason is not None:
            out.emit(
                ev.GenerationCancelled,
                record.generation_id,
                epoch=c.epoch,
                reason=attempt.cancel_reason,
                partial=partial,
                sequence=_terminal_sequence(c),
            )
            status = RequestStatus.CANCELLED
        else:
            # A failure, or a stop nobody asked for: the worker could not finish the generation.
            code = c.error_code if c.error_code in _FAILURE_CODES else RejectionCode.MODEL_BACKEND_ERROR
            out.emit(
                ev.GenerationFailed, record.generation_id, epoch=c.epoch, code=code, partial=partial, sequence=_terminal_sequence(c)
            )
            status = RequestStatus.FAILED
        _end_turn(state, record, out, status, spooled=c.answer_spooled)
        return out.decision(OutcomeKind.APPLIED, record, status=status)
    if record.status.terminal and record.epoch == c.epoch and c.epoch > record.fenced_epoch:
        # The finalization was committed before and its acknowledgement lost: a repeat is a no-op.
        return out.decision(OutcomeKind.EXISTING, record, status=record.status, code=record.code)
    return _ignore(out, record, c, _stale_reason(record, c.epoch))


def _terminal_sequence(c: ReportAttemptFinished) -> int:
    """The terminal event's id: after the last delta the worker sent; 0 ("after the last delta the
    reader saw") when it names none (no delta, or a worker from before the field existed)."""
    return c.last_sequence + 1 if c.last_sequence else 0


def settle_tokens(reserved: int, input_tokens: int, output_tokens: int, policy: Policy, lost: bool) -> tuple[int, int]:
    """(billable, overshoot) of an attempt's token reservation: the settlement rules (docs/core.md).

    The admission's input count is authoritative. A report charges input + generated (a cancelled or
    failed attempt: what it generated before it stopped); above the reservation in full, recorded as
    overshoot, up to ``token_overshoot_max`` past it. A lost report (lease or run deadline) charges the
    last renewal's tokens plus ``token_lost_report_bound``, at most the reservation (unless the renewal
    itself reported more). A reservation of 0 (admitted before budgets) charges the actual usage.
    """
    actual = input_tokens + output_tokens
    if reserved <= 0:
        return actual, 0
    billable = max(actual, min(actual + policy.token_lost_report_bound, reserved)) if lost else actual
    billable = min(billable, reserved + policy.token_overshoot_max)
    return billable, max(0, billable - reserved)


def _record_usage(
    state: UserLedger,
    record: RequestRecord,
    out: _Emitter,
    policy: Policy,
    output_tokens: int,
    reason: TerminalReason,
    outcome: FinishOutcome | None,
    delivered_tokens: int,
    lost: bool,
    ttft_ms: int | None = None,
) -> None:
    if usage_key(record.generation_id, record.epoch) in state.usage:
        return
    # The attempt names the window its reservation was charged to (the reservation itself is gone
    # once consumed, and the window may have been retired while the generation ran).
    assert record.attempt is not None
    window_start_ms = record.attempt.window_start_ms
    reserved = record.attempt.tokens_reserved
    billable, overshoot = settle_tokens(reserved, record.input_tokens, output_tokens, policy, lost)
    out.emit(
        ev.UsageRecorded,
        record.generation_id,
        epoch=record.epoch,
        input_tokens=record.input_tokens,
        output_tokens=output_tokens,
        terminal_reason=reason,
        outcome=outcome,
        model_version=record.model_version,
        tier=record.tier,
        window_start_ms=window_start_ms,
        requested_output_tokens=record.max_output_tokens,
        delivered_tokens=delivered_tokens,
        billable_tokens=billable,
        tokens_reserved=reserved,
        overshoot_tokens=overshoot,
        ttft_ms=ttft_ms,  # the worker's acceptance -> first token (docs/slo.md)
    )


# --- shared transitions ---------------------------------------------------------------------


def _release_slot(state: UserLedger, record: RequestRecord, out: _Emitter, reason: SlotReleaseReason) -> None:
    for index, generation_id in state.slots.items():
        if generation_id == record.generation_id:
            out.emit(ev.ConcurrencySlotReleased, record.generation_id, slot_index=index, epoch=record.epoch, reason=reason)
            return


def _release_unstarted(state: UserLedger, record: RequestRecord, out: _Emitter, reason: FenceReason) -> None:
    """Fence a queued epoch, release its reservation once and free its slot."""
    out.emit(ev.AttemptFenced, record.generation_id, epoch=record.epoch, reason=reason)
    reservation = state.reservations.get(reservation_id(record.generation_id, record.epoch))
    if reservation is not None:
        out.emit(
            ev.ReservationReleased,
            record.generation_id,
            reservation_id=reservation.reservation_id,
            window_start_ms=reservation.window_start_ms,
            epoch=record.epoch,
            reason=reason,
            tokens_released=record.attempt.tokens_reserved if record.attempt is not None else 0,
        )
    _release_slot(state, record, out, SlotReleaseReason.NEVER_ACCEPTED)


def _lapse(state: UserLedger, record: RequestRecord, out: _Emitter, reason: FenceReason) -> None:
    """A dispatched attempt proven never started returns the request to its retryable admission state."""
    _release_unstarted(state, record, out, reason)
    out.emit(
        ev.GenerationReturnedToAdmission, record.generation_id, epoch=record.epoch, code=RejectionCode.CAPACITY_EXHAUSTED
    )
    _end_turn(state, record, out, RequestStatus.ADMISSION_RETRYABLE, spooled=False)


def _expire_running(state: UserLedger, record: RequestRecord, out: _Emitter, reason: FenceReason, policy: Policy) -> None:
    """A lease or run deadline passed: fence the epoch so nothing from it counts, then settle."""
    attempt = record.attempt
    assert attempt is not None
    out.emit(ev.AttemptFenced, record.generation_id, epoch=record.epoch, reason=reason)
    _release_slot(state, record, out, SlotReleaseReason.LEASE_FENCED)
    tokens = attempt.output_tokens_reported
    # The worker's report is lost (it stopped renewing): settle at its last renewal plus a bound.
    _record_usage(state, record, out, policy, tokens, TerminalReason(reason), None, tokens, lost=True)
    if attempt.cancel_reason is not None:
        out.emit(
            ev.GenerationCancelled, record.generation_id, epoch=record.epoch, reason=attempt.cancel_reason, partial=tokens > 0
        )
        _end_turn(state, record, out, RequestStatus.CANCELLED, spooled=False)
        return
    code = RejectionCode.GENERATION_TIMEOUT if reason is FenceReason.RUN_DEADLINE else RejectionCode.MODEL_BACKEND_ERROR
    out.emit(ev.GenerationFailed, record.generation_id, epoch=record.epoch, code=code, partial=tokens > 0)
    _end_turn(state, record, out, RequestStatus.FAILED, spooled=False)


# --- deadlines ------------------------------------------------------------------------------


def purge_at_ms(record: RequestRecord, policy: Policy) -> int | None:
    """When a settled request record may be forgotten; ``None`` while it is active."""
    return retained_until_ms(record, policy.dedup_retention_ms)


_QUEUED, _RUNNING = RequestStatus.QUEUED, RequestStatus.RUNNING
_TERMINAL_STATUSES = frozenset(status for status in RequestStatus if status.terminal)


def _canonical_order(record: RequestRecord) -> tuple[int, str]:
    return (record.created_at_ms, record.idempotency_key)


def _reconcile(state: UserLedger, c: ReconcileDue, policy: Policy, out: _Emitter) -> Decision:
    now = c.as_of_ms
    # Due records act in a canonical order, not the dict's: event ids are positional
    # (``<command_id>/<n>``), and a state read back from the processor's table holds its records in
    # another order than the one that built it, so a redelivered ReconcileDue must number its events
    # the same either way. Only the (few) due records are sorted.
    due: list[tuple[tuple[int, str], RequestRecord, FenceReason | CancelReason | None]] = []
    # One pass over every record; a settled one (most of them) costs one comparison: it is due for
    # its purge once ``retained_until_ms`` passed, inlined here (this loop was the largest part of a
    # ReconcileDue in bench/bench_core.py's profile).
    settled_before = now - policy.dedup_retention_ms  # settled at or before this: retention over
    for record in state.requests.values():
        status = record.status
        attempt = record.attempt
        if status is _QUEUED and attempt is not None:
            detach_at = _detach_due(record)
            if attempt.reconcile_deadline_ms <= now:
                due.append((_canonical_order(record), record, FenceReason.QUEUE_DEADLINE))
            elif detach_at is not None and detach_at <= now:
                due.append((_canonical_order(record), record, record.detach_reason or CancelReason.CLIENT_DISCONNECT))
        elif status is _RUNNING and attempt is not None:
            detach_at = _detach_due(record)
            if attempt.run_deadline_ms <= now:
                due.append((_canonical_order(record), record, FenceReason.RUN_DEADLINE))
            elif attempt.lease_deadline_ms <= now:
                due.append((_canonical_order(record), record, FenceReason.LEASE_EXPIRED))
            elif detach_at is not None and detach_at <= now:
                due.append((_canonical_order(record), record, record.detach_reason or CancelReason.CLIENT_DISCONNECT))
        elif status is not _QUEUED and status is not _RUNNING:
            settled_at = record.terminal_at_ms if status in _TERMINAL_STATUSES else record.updated_at_ms
            if settled_at <= settled_before:
                due.append((_canonical_order(record), record, None))
    due.sort(key=lambda item: item[0])
    for _, record, reason in due:
        if reason is None:
            out.emit(ev.DedupRecordPurged, record.generation_id, idempotency_key=record.idempotency_key)
        elif isinstance(reason, CancelReason):
            # Detached and no reader came back within the grace: cancel it as its reader would have.
            _stop(state, record, reason, out)
        elif reason is FenceReason.QUEUE_DEADLINE:
            _lapse(state, record, out, reason)
        else:
            _expire_running(state, record, out, reason, policy)
    # Usage settled above, by this command, is in its window's token count by the time it retires.
    settled_now: dict[int, int] = {}
    for e in out.events:
        if type(e) is ev.UsageRecorded:
            settled_now[e.window_start_ms] = settled_now.get(e.window_start_ms, 0) + e.billable_tokens
    for window in state.windows.values():
        # A window is retained while any reservation in it is unresolved, even past its end. (Token
        # reservations of generations still running may outlive it: no admission is charged to a
        # retired window, so their settlement later only records the usage.)
        if window.window_end_ms <= now and window.reserved == 0:
            out.emit(
                ev.QuotaWindowRetired,
                "",
                window_start_ms=window.window_start_ms,
                used=window.used,
                released=window.released,
                tokens_used=window.tokens_used + settled_now.get(window.window_start_ms, 0),
            )
    for cid in sorted(state.conversations):
        since = _parkable_since(state.conversations[cid])
        if since is not None and since + policy.conversation_idle_park_ms <= now:
            out.emit(ev.ConversationParked, "", conversation_id=cid, revision=state.conversations[cid].revision)
    for cid in sorted(state.conversation_tombstones):
        if state.conversation_tombstones[cid] + policy.conversation_tombstone_ms <= now:
            out.emit(ev.ConversationForgotten, "", conversation_id=cid)
    kind = OutcomeKind.APPLIED if out.events else OutcomeKind.EXISTING
    return out.decision(kind)


def next_deadline_ms(state: UserLedger, policy: Policy) -> int | None:
    """The earliest time a ``ReconcileDue`` would change this state (for the deadline timer)."""
    best: int | None = None

    def consider(t: int) -> None:
        nonlocal best
        if best is None or t < best:
            best = t

    retention = policy.dedup_retention_ms
    for record in state.requests.values():
        status = record.status
        attempt = record.attempt
        if status is _QUEUED or status is _RUNNING:
            detach_at = _detach_due(record)
            if detach_at is not None:
                consider(detach_at)
            if attempt is not None:
                if status is _QUEUED:
                    consider(attempt.reconcile_deadline_ms)
                else:
                    consider(min(attempt.lease_deadline_ms, attempt.run_deadline_ms))
        else:  # settled: its purge (retained_until_ms, inlined)
            consider((record.terminal_at_ms if status in _TERMINAL_STATUSES else record.updated_at_ms) + retention)
    for window in state.windows.values():
        if window.reserved == 0:
            consider(window.window_end_ms)
    for conversation in state.conversations.values():
        since = _parkable_since(conversation)
        if since is not None:
            consider(since + policy.conversation_idle_park_ms)
    for deleted_at in state.conversation_tombstones.values():
        consider(deleted_at + policy.conversation_tombstone_ms)
    return best


__all__ = [
    "CancelReason",
    "attached_reader",
    "attached_readers",
    "Decision",
    "decide",
    "next_deadline_ms",
    "purge_at_ms",
    "read_past_deadline",
]
