"""Ledger events: the facts the admission processor commits to the ``ledger`` topic (key ``user_id``).

Each event has a deterministic ``event_id`` (``<command_id>/<index>``) derived from the command that
caused it, so readers de-duplicate by it; a duplicate id with different content is an invariant
violation. Replaying these events through ``control_plane.evolve`` rebuilds the per-user state.
No event carries prompt or output text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from schemas.codes import (
    AnswerStatus,
    CancelReason,
    FenceReason,
    FinishOutcome,
    FinishReason,
    LateReportReason,
    RejectionCode,
    RequestStatus,
    RetryAttach,
    SlotReleaseReason,
    TerminalReason,
    Tier,
)
from schemas.commands import ReplyTo

EVENT_SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class _EventBase:
    schema_version: int = EVENT_SCHEMA_VERSION
    event_id: str
    command_id: str
    user_id: str
    generation_id: str
    occurred_at_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationAdmitted(_EventBase):
    """A request reserved a message in ``window_start_ms``, took a slot and was dispatched as ``epoch``."""

    type: Literal["GenerationAdmitted"] = "GenerationAdmitted"
    # v2 added window_end_ms (v1 readers derived it from the fixed 3-hour width).
    # v3 added reader_id (v2 records upcast to "": no reader named, never detached by an edge's death).
    schema_version: int = 3
    idempotency_key: str
    fingerprint: str
    model_alias: str
    model_version: str
    pool: str
    tier: Tier
    stream: bool
    max_output_tokens: int
    input_tokens: int
    epoch: int
    reservation_id: str
    window_start_ms: int
    window_end_ms: int
    window_limit: int
    slot_index: int
    queue_deadline_ms: int
    reconcile_deadline_ms: int
    reader_id: str
    reply_to: ReplyTo | None = None
    # Token budget (docs/core.md, "Token budget"); absent from events recorded before it: 0 = none.
    # ``tokens_reserved`` (input + max output) is held until the attempt's usage settles it (or its
    # release, if it never started); ``window_token_limit`` is the tier's budget for the window.
    tokens_reserved: int = 0
    window_token_limit: int = 0
    token_limit: int = 0  # the budget this decision applied (the tier's or a stricter risk class's); 0 = none
    risk_class: str = ""  # the risk class whose limits applied ("" = none)
    # A request without the client's own key (``RetryAttach``): remembered by its fingerprint until
    # ``retry_attach_until_ms`` so that the client's retries attach to this generation; ``retry`` when
    # a retry was admitted because nothing matched (its first try may still come). Absent from events
    # recorded before it: ``off``, 0 (not remembered).
    retry_attach: RetryAttach = RetryAttach.OFF
    retry_attach_until_ms: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionRejected(_EventBase):
    """A request was refused holding nothing; the key is retained with ``status`` (retryable or not)."""

    type: Literal["AdmissionRejected"] = "AdmissionRejected"
    # v2 added pool: a retryable refusal is re-admitted on a same-key retry, into the pool of the version
    # resolved here (v1 readers assumed the one pool "default"; v1 records upcast to "").
    # v3 added read_at_ms and decide_by_ms (v2 records upcast to 0, 0).
    schema_version: int = 3
    idempotency_key: str
    fingerprint: str
    model_alias: str
    model_version: str
    pool: str
    tier: Tier
    code: RejectionCode
    status: RequestStatus
    window_start_ms: int
    window_limit: int
    reset_at_ms: int
    # Set only when the submit was refused for being read after its decision deadline
    # (code quota_service_unavailable): when the processor read it and the deadline it carried.
    read_at_ms: int
    decide_by_ms: int
    # quota_exhausted / concurrency_limited: the limit that refused ("tokens"; "" = messages, as
    # every refusal before token budgets), and for "tokens" the budget that applied.
    kind: str = ""
    token_limit: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptAccepted(_EventBase):
    """The processor committed ``worker_id``'s acceptance of ``epoch``: inference may start."""

    type: Literal["AttemptAccepted"] = "AttemptAccepted"
    epoch: int
    worker_id: str
    lease_deadline_ms: int
    run_deadline_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReservationConsumed(_EventBase):
    """RESERVED -> CONSUMED: the message is spent (acceptance evidence: ``command_id``)."""

    type: Literal["ReservationConsumed"] = "ReservationConsumed"
    reservation_id: str
    window_start_ms: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReservationReleased(_EventBase):
    """RESERVED -> RELEASED: proven never accepted, the message is given back."""

    type: Literal["ReservationReleased"] = "ReservationReleased"
    reservation_id: str
    window_start_ms: int
    epoch: int
    reason: FenceReason
    # The attempt's token reservation, released whole with it (it never started). 0 before budgets.
    tokens_released: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptDeclined(_EventBase):
    type: Literal["AttemptDeclined"] = "AttemptDeclined"
    epoch: int
    worker_id: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptFenced(_EventBase):
    """``epoch`` and every lower epoch can no longer accept, publish or report."""

    type: Literal["AttemptFenced"] = "AttemptFenced"
    epoch: int
    reason: FenceReason


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRenewed(_EventBase):
    type: Literal["LeaseRenewed"] = "LeaseRenewed"
    epoch: int
    lease_deadline_ms: int
    output_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelRequested(_EventBase):
    """Cancel intent on a running attempt; routed to ``owner_worker_id``. Not yet cancelled."""

    type: Literal["CancelRequested"] = "CancelRequested"
    epoch: int
    owner_worker_id: str
    reason: CancelReason


@dataclass(frozen=True, slots=True, kw_only=True)
class ReaderDetached(_EventBase):
    """The generation's reader (``reader_id``) is gone; unless a reader reattaches, the deadline timer
    cancels it with ``reason`` at ``detached_until_ms``."""

    type: Literal["ReaderDetached"] = "ReaderDetached"
    reader_id: str
    detached_until_ms: int
    reason: CancelReason


@dataclass(frozen=True, slots=True, kw_only=True)
class ReaderAttached(_EventBase):
    """``reader_id`` reads the generation now; a pending detach is withdrawn."""

    type: Literal["ReaderAttached"] = "ReaderAttached"
    reader_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestAttached(_EventBase):
    """A submit without the client's own key was answered by ``generation_id``, admitted earlier for
    the same fingerprint, instead of being admitted: nothing is reserved or charged for it.

    ``retry_attach`` is how it matched: ``retry`` (a retry found its first try's generation, or an
    earlier retry's) or ``original`` (a first try read after one of its retries was admitted: the
    generation is no longer waiting for its first try).
    """

    type: Literal["RequestAttached"] = "RequestAttached"
    idempotency_key: str  # the key the edge made up for this try (never stored as a request record)
    fingerprint: str
    reader_id: str
    retry_attach: RetryAttach


@dataclass(frozen=True, slots=True, kw_only=True)
class ConcurrencySlotReleased(_EventBase):
    type: Literal["ConcurrencySlotReleased"] = "ConcurrencySlotReleased"
    slot_index: int
    epoch: int
    reason: SlotReleaseReason


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationReturnedToAdmission(_EventBase):
    """A dispatched attempt was proven never started; the request is retryable with its key."""

    type: Literal["GenerationReturnedToAdmission"] = "GenerationReturnedToAdmission"
    epoch: int
    code: RejectionCode


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationCompleted(_EventBase):
    type: Literal["GenerationCompleted"] = "GenerationCompleted"
    epoch: int
    finish_reason: FinishReason
    result_expires_at_ms: int
    # The terminal event's sequence (its SSE id, after the last text delta): fixed here, with the
    # terminal state, so every edge replays the same ids. Added within version 1; 0 (the
    # default, and a terminal no worker reported) means "after the last stored delta".
    sequence: int = 0
    # The worker's ``ReportAttemptFinished.result_stored``: False means its result sink still held
    # the text for a later write when it reported (the read model answers result_pending, not
    # result_unavailable, while that write may still land). Added within version 1; None: unknown.
    result_stored: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationCancelled(_EventBase):
    type: Literal["GenerationCancelled"] = "GenerationCancelled"
    epoch: int  # 0 when no attempt was ever dispatched
    reason: CancelReason
    partial: bool
    sequence: int = 0  # as GenerationCompleted.sequence


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationFailed(_EventBase):
    type: Literal["GenerationFailed"] = "GenerationFailed"
    epoch: int
    code: RejectionCode
    partial: bool
    sequence: int = 0  # as GenerationCompleted.sequence


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageRecorded(_EventBase):
    """Actual token usage of one (generation, epoch); at most once each (invariant 8)."""

    type: Literal["UsageRecorded"] = "UsageRecorded"
    epoch: int
    input_tokens: int
    output_tokens: int
    terminal_reason: TerminalReason
    outcome: FinishOutcome | None
    model_version: str
    tier: Tier
    window_start_ms: int
    metering_revision: int = 1
    # Token settlement (docs/core.md, "Token budget"): this record settles the attempt's token
    # reservation once. ``input_tokens`` is the admission's count (authoritative); ``output_tokens``
    # what the worker generated (as reported, never dropped); ``requested_output_tokens`` the
    # request's max; ``delivered_tokens`` what was sent to the client; ``billable_tokens`` what the
    # window's ``tokens_used`` was charged; ``overshoot_tokens`` the part of it above the reservation.
    # Absent from records before budgets (0; ``billable_tokens`` then reads as input + output).
    requested_output_tokens: int = 0
    delivered_tokens: int = 0
    billable_tokens: int = 0
    tokens_reserved: int = 0
    overshoot_tokens: int = 0
    # The worker's time from its acceptance to the engine's first token (ms; None: no token, or a
    # worker or record from before the field). The SLO report's TTFT falls back to it only where the
    # edge recorded none (docs/slo.md): it leaves out admission and queueing.
    ttft_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LateReportIgnored(_EventBase):
    """A command from a stale, fenced or foreign attempt, or for a terminal generation, was dropped."""

    type: Literal["LateReportIgnored"] = "LateReportIgnored"
    epoch: int
    command_type: str
    worker_id: str
    reason: LateReportReason


@dataclass(frozen=True, slots=True, kw_only=True)
class DedupRecordPurged(_EventBase):
    """The request record for ``idempotency_key`` passed its retention and was forgotten."""

    type: Literal["DedupRecordPurged"] = "DedupRecordPurged"
    idempotency_key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class QuotaWindowRetired(_EventBase):
    """A past window with no RESERVED reservation left is dropped with its settled reservations."""

    type: Literal["QuotaWindowRetired"] = "QuotaWindowRetired"
    window_start_ms: int
    used: int
    released: int
    tokens_used: int = 0  # settled token usage charged to the window (0 before token budgets)


# --- conversations (docs/conversations.md) ----------------------------------------------------
# The ledger holds a conversation's existence, committed revision, in-flight generation and
# deletion; never a title or a message's text. ``generation_id`` is "" for events about the
# conversation alone (created, parked, restored, deleted).


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationCreated(_EventBase):
    """A conversation exists, at revision 0."""

    type: Literal["ConversationCreated"] = "ConversationCreated"
    conversation_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationTurnCommitted(_EventBase):
    """A turn was admitted with ``generation_id`` (in the same decision as its ``GenerationAdmitted``).

    A user turn appends the user message at ``revision`` (the expected revision + 1); a regeneration
    appends nothing (``revision`` is the committed one, its answer being replaced)."""

    type: Literal["ConversationTurnCommitted"] = "ConversationTurnCommitted"
    conversation_id: str
    revision: int
    regenerate: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationAnswerPending(_EventBase):
    """The turn's generation ended and its worker spooled the answer: it commits once stored."""

    type: Literal["ConversationAnswerPending"] = "ConversationAnswerPending"
    conversation_id: str
    epoch: int
    # How the generation ended ("completed" | "incomplete"): the answer commits with it even if the
    # generation's request record is purged before the writer's CommitAnswer arrives.
    status: AnswerStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationAnswerStored(_EventBase):
    """The history writer stored the answer before the generation's end reached the ledger."""

    type: Literal["ConversationAnswerStored"] = "ConversationAnswerStored"
    conversation_id: str
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationAnswerCommitted(_EventBase):
    """The answer of the turn ``generation_id`` committed at ``revision`` (its turn's revision + 1).

    ``status`` is "completed" or "incomplete" (cancelled, failed, or never started; never appended
    to later). ``spooled``: its text was stored from the worker's spool before this commit; False:
    no worker spooled one (the answer is empty, or whatever a fenced worker spools later).
    ``replaces_seq``: a regeneration's answer replaces the answer at that seq in the active branch
    (0: none)."""

    type: Literal["ConversationAnswerCommitted"] = "ConversationAnswerCommitted"
    conversation_id: str
    revision: int
    epoch: int
    status: AnswerStatus
    spooled: bool
    replaces_seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationDeleted(_EventBase):
    """The conversation is deleted at ``revision``; nothing is appended to it afterwards."""

    type: Literal["ConversationDeleted"] = "ConversationDeleted"
    conversation_id: str
    revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationParked(_EventBase):
    """An idle conversation left the hot state at ``revision``: its stored row carries that revision,
    and a later turn restores it from there (``ConversationRestored``)."""

    type: Literal["ConversationParked"] = "ConversationParked"
    conversation_id: str
    revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationRestored(_EventBase):
    """A parked conversation is back in the hot state at ``revision``."""

    type: Literal["ConversationRestored"] = "ConversationRestored"
    conversation_id: str
    revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationForgotten(_EventBase):
    """A deleted conversation's tombstone passed its retention and left the state."""

    type: Literal["ConversationForgotten"] = "ConversationForgotten"
    conversation_id: str


Event = (
    GenerationAdmitted
    | AdmissionRejected
    | AttemptAccepted
    | ReservationConsumed
    | ReservationReleased
    | AttemptDeclined
    | AttemptFenced
    | LeaseRenewed
    | CancelRequested
    | ReaderDetached
    | ReaderAttached
    | RequestAttached
    | ConcurrencySlotReleased
    | GenerationReturnedToAdmission
    | GenerationCompleted
    | GenerationCancelled
    | GenerationFailed
    | UsageRecorded
    | LateReportIgnored
    | DedupRecordPurged
    | QuotaWindowRetired
    | ConversationCreated
    | ConversationTurnCommitted
    | ConversationAnswerPending
    | ConversationAnswerStored
    | ConversationAnswerCommitted
    | ConversationDeleted
    | ConversationParked
    | ConversationRestored
    | ConversationForgotten
)
EVENT_TYPES: tuple[type, ...] = Event.__args__  # type: ignore[attr-defined]
TERMINAL_EVENT_TYPES = (GenerationCompleted, GenerationCancelled, GenerationFailed)


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerEntry:
    """One record on the ``ledger`` topic: every event one command caused, committed together.

    A reader never sees half of a command's effect. A redelivered command re-sends the same entry
    (same ``command_id`` and event ids), so readers de-duplicate by event id.
    """

    type: Literal["LedgerEntry"] = "LedgerEntry"
    schema_version: int = EVENT_SCHEMA_VERSION
    command_id: str
    command_type: str
    user_id: str
    events: tuple[Annotated[Event, Field(discriminator="type")], ...]
    # The processor's read stamp of a SubmitGeneration that carried a decision deadline (0 for every
    # other command): the one non-derived input of its decision, kept here so that a processor
    # deciding the command again after a crash uses the same stamp (projections/ledger/read_stamps.py).
    read_at_ms: int = 0
