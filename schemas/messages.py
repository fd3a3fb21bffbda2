"""Messages that are not ledger facts: decisions back to issuers, dispatch, worker control, stream events.

- ``Outcome``: the processor's answer to one command, sent to the command's ``reply_to``.
- ``DispatchAuthorized``: to ``dispatch.<pool>.<tier>``; a worker may try to accept it.
- ``StopAttempt``: to the owning worker's control partition (cancel intent or fence).
- ``TextDelta``: worker -> edge inbox, incremental text of one (generation, epoch); the only message
  kind that carries generated text, so it lives only on the short-retention edge inbox.
- ``GenerationFinalized``: processor -> edge inbox, sent after the terminal transition committed.
- ``WorkerHeartbeat``: worker -> ``capacity``.
- ``EdgePresence``: edge -> ``edge-presence``, its liveness lease: a processor that hears nothing
  from an edge for the lease detaches the generations that edge was reading (``DetachReader``).
- ``PromptRequest`` / ``PromptPayload``: the request content never enters commands, the ledger or
  dispatch. The edge that admitted a generation holds its messages in memory (bounded) while it
  holds the client's connection; a worker that received a dispatch asks that edge for them (on the
  dispatch's ``stream_to`` partition) *before* it accepts, and the edge answers on the worker's
  control partition. No answer in time (the edge is gone, so is the client) -> the worker declines,
  which proves the attempt never started and releases the reservation.
- ``PromptPublished``: edge -> ``prompts.<pool>``, the same content published beside the submit,
  keyed by the generation id a new key's submit will have (``generation_id_for``), so it lands in
  the partition its dispatch will: the worker holding that dispatch partition has usually read it
  before the dispatch arrives and skips the request above (one hop pair off the first-token path).
  A worker that does not find it in time asks the edge as above (a same-key retry of a
  retryable key, whose generation id the edge cannot know in advance, always does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from schemas.codes import CancelReason, FenceReason, RejectionCode, RequestStatus, Tier
from schemas.commands import ReplyTo

MESSAGE_SCHEMA_VERSION = 1


class OutcomeKind(StrEnum):
    ADMITTED = "admitted"  # a new reservation was taken and the attempt dispatched
    EXISTING = "existing"  # the command identified existing state and changed nothing
    APPLIED = "applied"  # the command changed state (accept, cancel, report, reconcile)
    CANCEL_REQUESTED = "cancel_requested"  # a running attempt was asked to stop; not yet stopped
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True, kw_only=True)
class RejectionDetails:
    limit: int | None = None
    remaining: int | None = None
    reset_at_ms: int | None = None
    retry_after_ms: int | None = None
    field: str | None = None
    revision: int | None = None  # conversation_conflict: the conversation's committed revision
    # quota_exhausted / concurrency_limited: which limit refused ("messages", "tokens"); None = messages
    # (refusals recorded before token budgets existed name none).
    kind: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageSnapshot:
    """A ``QueryUsage``'s answer: the quota window of the query's time and the slots held."""

    window_start_ms: int
    window_end_ms: int
    limit: int
    used: int  # messages consumed in the window
    reserved: int  # messages reserved, not yet consumed or released
    remaining: int
    active: int  # concurrency slots held
    concurrency_limit: int
    # The token budget of the same window (docs/core.md, "Token budget"): 0 = no budget (off).
    # ``tokens_used`` is settled usage, ``tokens_reserved`` what running or queued generations hold.
    token_limit: int = 0
    tokens_used: int = 0
    tokens_reserved: int = 0
    tokens_remaining: int = 0
    risk_class: str = ""  # the account's risk class applied to these limits ("" = none)


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    type: Literal["Outcome"] = "Outcome"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    command_id: str
    request_id: str | None = None
    kind: OutcomeKind
    code: RejectionCode | None = None
    generation_id: str | None = None
    status: RequestStatus | None = None
    epoch: int = 0
    model_version: str | None = None
    details: RejectionDetails = field(default_factory=RejectionDetails)
    # Set when a completed generation's result is still retained (the edge then reads the store).
    result_expires_at_ms: int | None = None
    usage: UsageSnapshot | None = None  # the answer to a QueryUsage
    # Conversations: the conversation a decision is about and its revision (for an admitted turn, the
    # revision its user message committed at, and the same for a same-key retry of a turn, whatever
    # its state; for a create or delete, the committed revision).
    conversation_id: str | None = None
    revision: int | None = None
    # generation_in_progress: True when the running generation is this idempotency key's own (a
    # retry of the same request; follow it), False when it is another request's (a conversation's
    # other turn, e.g. from another tab).
    same_request: bool = False
    # A submit without the client's own key attached to ``generation_id`` (kind ``applied``: nothing
    # was reserved), the generation an earlier try of the same request was admitted as; ``status`` may
    # be queued or running: the issuer follows it to its end instead of answering its state.
    attached: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchAuthorized:
    type: Literal["DispatchAuthorized"] = "DispatchAuthorized"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    event_id: str
    user_id: str
    generation_id: str
    epoch: int
    model_version: str
    tier: Tier
    max_output_tokens: int
    input_tokens: int
    authorized_at_ms: int
    queue_deadline_ms: int
    stream_to: ReplyTo | None
    # A conversation turn (docs/conversations.md): the worker spools the answer (``AnswerSpooled``)
    # before it reports the end, and the history writer persists it. "" = a stateless request.
    # ``turn_revision``: the revision the turn committed at (its user message's seq; for a
    # regeneration, the seq of the answer it replaces); the answer's seq is ``turn_revision + 1``.
    conversation_id: str = ""
    turn_revision: int = 0
    regenerate: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class StopAttempt:
    type: Literal["StopAttempt"] = "StopAttempt"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    event_id: str
    user_id: str
    generation_id: str
    epoch: int
    worker_id: str
    cancel_reason: CancelReason | None = None
    fence_reason: FenceReason | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TextDelta:
    type: Literal["TextDelta"] = "TextDelta"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    generation_id: str
    epoch: int
    sequence: int
    index: int
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationFinalized:
    type: Literal["GenerationFinalized"] = "GenerationFinalized"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    event_id: str
    user_id: str
    generation_id: str
    epoch: int
    status: RequestStatus
    code: RejectionCode | None
    partial: bool
    input_tokens: int
    output_tokens: int
    # The terminal event's sequence fixed by the processor (0: after the last delta, as the edge saw them).
    sequence: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerHeartbeat:
    type: Literal["WorkerHeartbeat"] = "WorkerHeartbeat"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    worker_id: str
    pool: str
    sent_at_ms: int
    free_slots: int
    active_sequences: int
    queued: int
    kv_pressure: float
    tokens_per_s: float
    # The work behind the counts (workers/work.py says how each is measured). Added within version 1
    # with defaults meaning "not reported", so an older worker's heartbeat still decodes; the edge
    # then falls back to its count-based estimate (edge/capacity.py).
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    output_fill: float = 1.0
    queued_input_tokens: int = 0
    queued_output_tokens: int = 0
    output_tokens_left: int = 0
    kv_tokens_free: int = -1  # -1: unknown (no KV bound configured)
    dispatch_backlog: int = 0
    queue_age_ms: int = 0
    reports_work: bool = False  # True from a worker that fills the fields above


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgePresence:
    """An edge process is alive and reading its clients' generations; sent every ``interval_ms``."""

    type: Literal["EdgePresence"] = "EdgePresence"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    edge_id: str  # new at every start of the process: a restarted edge is another reader
    sent_at_ms: int
    interval_ms: int


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # "user" or "assistant": a client cannot supply system or developer instructions
    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptRequest:
    type: Literal["PromptRequest"] = "PromptRequest"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    generation_id: str
    epoch: int
    worker_id: str
    reply_to: ReplyTo


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptPayload:
    type: Literal["PromptPayload"] = "PromptPayload"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    generation_id: str
    epoch: int
    worker_id: str
    found: bool
    messages: tuple[ChatMessage, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptPublished:
    type: Literal["PromptPublished"] = "PromptPublished"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    generation_id: str
    user_id: str
    published_at_ms: int
    messages: tuple[ChatMessage, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class AnswerSpooled:
    """A conversation turn's answer, spooled by its worker on the answers topic (key ``user_id``)
    before the worker reports the attempt's end: the recoverable copy the history writer persists
    to Cassandra before the ledger commits the answer (``CommitAnswer``). Content lives here and in
    Cassandra only, never on the commands or ledger topics."""

    type: Literal["AnswerSpooled"] = "AnswerSpooled"
    schema_version: int = MESSAGE_SCHEMA_VERSION
    user_id: str
    conversation_id: str
    generation_id: str
    epoch: int
    worker_id: str
    turn_revision: int
    regenerate: bool
    text: str
    # The worker's view of how the attempt ended; the ledger's own verdict (ConversationAnswerCommitted)
    # is what reads show once committed.
    completed: bool
    output_tokens: int
    spooled_at_ms: int


MESSAGE_TYPES: tuple[type, ...] = (
    Outcome,
    DispatchAuthorized,
    StopAttempt,
    TextDelta,
    GenerationFinalized,
    WorkerHeartbeat,
    EdgePresence,
    PromptRequest,
    PromptPayload,
    PromptPublished,
    AnswerSpooled,
)
