"""Commands: imperative requests appended to the ``commands`` topic (key ``user_id``).

Issuers: the edge (submit, cancel, detach and attach readers), workers (accept, decline, renew, report) and the processor's
deadline timer (reconcile). Every command carries a unique ``command_id`` and the issuer's clock
``issued_at_ms``; the core takes time only from there. Commands never carry prompt or output text:
the request is represented by an HMAC ``fingerprint`` computed at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from schemas.codes import CancelReason, FinishOutcome, FinishReason, RejectionCode, RetryAttach, Tier

COMMAND_SCHEMA_VERSION = 1

Id = Annotated[str, Field(min_length=1, max_length=128)]
IdempotencyKey = Annotated[str, Field(min_length=1, max_length=255)]
Millis = Annotated[int, Field(ge=0, le=2**53)]
Count = Annotated[int, Field(ge=0, le=10_000_000)]
Epoch = Annotated[int, Field(ge=1, le=1_000_000)]
ConversationId = Annotated[str, Field(min_length=0, max_length=64)]
# The reader of a generation: the edge process (its ``edge_id``, new at each start) holding the
# client's connection; "" = none named (workers, tests, commands written before readers existed).
ReaderId = Annotated[str, Field(min_length=0, max_length=64)]
# How long a detached generation waits for a reader to reattach before it is cancelled.
DETACH_GRACE_MS_MAX = 3_600_000
RiskClassName = Annotated[str, Field(min_length=0, max_length=32, pattern=r"^[a-z0-9_]*$")]


@dataclass(frozen=True, slots=True)
class ReplyTo:
    """Where the decision goes: a topic partition the issuer reads, and the issuer's request id."""

    topic: Annotated[str, Field(min_length=1, max_length=249)]
    partition: Annotated[int, Field(ge=0, le=100_000)]
    request_id: Id


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitGeneration:
    """Admit a new logical generation, or identify the existing one for this key."""

    type: Literal["SubmitGeneration"] = "SubmitGeneration"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    idempotency_key: IdempotencyKey
    fingerprint: Annotated[str, Field(min_length=8, max_length=128)]
    model_alias: Id
    tier: Tier
    stream: bool
    max_output_tokens: Annotated[int, Field(ge=1, le=1_000_000)]
    input_tokens: Count
    # The edge's view of the pool (from worker heartbeats) at submit time, carried in the command so
    # the decision stays a pure function of its input: expected wait before a worker accepts.
    estimated_queue_wait_ms: Millis = 0
    # The issuer's decision deadline (its clock): a submit the processor reads after it is refused,
    # holding nothing, because the issuer has stopped waiting and told its client admission failed.
    # The edge sets it a clock-skew margin before its own wait ends; 0 = no deadline (workers, tests,
    # commands written before the deadline existed).
    decide_by_ms: Millis = 0
    # When the processor read the command (its clock), stamped by the processor's consuming shell
    # after decoding and before ``decide``; issuers leave it 0. The core never reads a clock: this
    # stamp is the decision's input, recorded on the ledger entry, and a command decided again
    # after a crash is given the stamp its first decision recorded.
    read_at_ms: Millis = 0
    # The edge process that holds the client's connection (its liveness lease is watched by the
    # processor: a generation whose reader's edge died is detached, then cancelled; DetachReader).
    reader_id: ReaderId = ""
    # A conversation turn (docs/conversations.md); "" = a stateless request. The turn is admitted only
    # if ``expected_revision`` is the conversation's committed revision and no other generation of it
    # runs; its user message then commits at ``expected_revision + 1`` in the same decision. With
    # ``regenerate`` no user message is appended: a new answer to the last user turn.
    conversation_id: ConversationId = ""
    expected_revision: Count = 0
    regenerate: bool = False
    # The revision the issuer read from a parked conversation's stored row (-1: none). The processor
    # restores a conversation it parked from this only if the command is not late (``decide_by_ms``).
    restore_revision: Annotated[int, Field(ge=-1, le=10_000_000)] = -1
    # The account's risk class from its token's claim ("" = none); the processor's per-account
    # setting may add one. Each names stricter limits (quota, tokens, concurrency) applied in the
    # same decision (docs/core.md, "Account risk classes").
    risk_class: RiskClassName = ""
    # A request without the client's own Idempotency-Key (``RetryAttach``): whether it is remembered
    # by fingerprint (a first try) or may attach to the generation an earlier try was admitted as (a
    # retry the client marked as one). ``off`` (commands written before it): the key alone identifies it.
    retry_attach: RetryAttach = RetryAttach.OFF
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateConversation:
    """Create a conversation at revision 0 (its id derived from the user and the Idempotency-Key, so a
    same-key retry names the same conversation). No title or text: those live in Cassandra."""

    type: Literal["CreateConversation"] = "CreateConversation"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    conversation_id: ConversationId
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteConversation:
    """Delete a conversation (idempotent); a generation of it still running is cancelled."""

    type: Literal["DeleteConversation"] = "DeleteConversation"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    conversation_id: ConversationId
    # The revision the issuer read from a parked conversation's stored row (-1: none); see SubmitGeneration.
    restore_revision: Annotated[int, Field(ge=-1, le=10_000_000)] = -1
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitAnswer:
    """The history writer stored a turn's user message and answer (from the worker's spool) in
    Cassandra: the answer may now commit. Issued after the writes, so a commit never precedes them."""

    type: Literal["CommitAnswer"] = "CommitAnswer"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    conversation_id: ConversationId
    generation_id: Id
    epoch: Epoch
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AcceptAttempt:
    """A worker asks to own ``epoch`` of a generation; inference may start only once accepted."""

    type: Literal["AcceptAttempt"] = "AcceptAttempt"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    generation_id: Id
    epoch: Epoch
    worker_id: Id
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclineAttempt:
    """A worker proves it did not start ``epoch`` (for example: it arrived past its queue deadline)."""

    type: Literal["DeclineAttempt"] = "DeclineAttempt"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    generation_id: Id
    epoch: Epoch
    worker_id: Id
    reason: Annotated[str, Field(min_length=1, max_length=64)]
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RenewLease:
    """The owning worker extends its lease and reports progress so far."""

    type: Literal["RenewLease"] = "RenewLease"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    generation_id: Id
    epoch: Epoch
    worker_id: Id
    output_tokens: Count = 0
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelGeneration:
    """Stop a generation (idempotent)."""

    type: Literal["CancelGeneration"] = "CancelGeneration"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    generation_id: Id
    reason: CancelReason = CancelReason.USER
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DetachReader:
    """The generation's reader is gone: cancel it ``grace_ms`` after ``issued_at_ms`` unless a reader
    reattaches first (idempotent; ignored when the generation is settled, already detached, or read
    by another reader than ``reader_id`` by then).

    Issued by the edge when the client's socket closes (reason ``client_disconnect``), and by the
    processor's shell when the reader's edge stopped renewing its liveness lease (``edge_lost``):
    one mechanism, so a generation is never left running for a reader nobody serves.
    """

    type: Literal["DetachReader"] = "DetachReader"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    generation_id: Id
    reader_id: ReaderId
    grace_ms: Annotated[int, Field(ge=0, le=DETACH_GRACE_MS_MAX)]
    reason: CancelReason = CancelReason.CLIENT_DISCONNECT
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachReader:
    """A reader (on any edge) is reading the generation again: a pending detach is withdrawn."""

    type: Literal["AttachReader"] = "AttachReader"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    generation_id: Id
    reader_id: Annotated[str, Field(min_length=1, max_length=64)]
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportAttemptFinished:
    """The owning worker reports how ``epoch`` ended, with actual usage (also on cancel)."""

    type: Literal["ReportAttemptFinished"] = "ReportAttemptFinished"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    generation_id: Id
    epoch: Epoch
    worker_id: Id
    outcome: FinishOutcome
    input_tokens: Count
    output_tokens: Count
    finish_reason: FinishReason = FinishReason.NONE
    error_code: RejectionCode | None = None
    # A conversation turn's worker spooled the answer (AnswerSpooled) before this report: the answer
    # commits once the history writer has stored it (CommitAnswer). False: nothing to wait for.
    answer_spooled: bool = False
    # The sequence of the last text delta sent to the client (0: none): the terminal event's id is
    # the next one, fixed with the terminal state (resumable streams, docs/edge.md).
    last_sequence: Count = 0
    # Output tokens the worker published to the client's stream (<= output_tokens: a stop can
    # generate tokens that are never sent). None: a worker from before the field (taken as all).
    delivered_tokens: Count | None = None
    # Acceptance -> the engine's first token, in ms (None: no token came); recorded with the usage.
    ttft_ms: Count | None = None
    # A completed attempt's final text: True when the worker's result sink had stored it before this
    # report; False when the sink holds it for a later write (the read model answers result_pending
    # for a while instead of result_unavailable); None when no result store is in use (or a worker
    # from before the field).
    result_stored: bool | None = None
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconcileDue:
    """Appended by the deadline timer: apply every deadline of this user that passed by ``as_of_ms``."""

    type: Literal["ReconcileDue"] = "ReconcileDue"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    as_of_ms: Millis
    reply_to: ReplyTo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryUsage:
    """Read-only: the user's current quota window, reservations and concurrency slots as the
    processor holds them when it reads this command (``GET /v1/usage``). Decides nothing, appends no
    event and changes no state; riding the user's partition, it sees every command of the user
    appended before it."""

    type: Literal["QueryUsage"] = "QueryUsage"
    schema_version: int = COMMAND_SCHEMA_VERSION
    command_id: Id
    user_id: Id
    issued_at_ms: Millis
    tier: Tier
    risk_class: RiskClassName = ""  # as SubmitGeneration.risk_class: the limits reported are the account's
    reply_to: ReplyTo | None = None


Command = (
    SubmitGeneration
    | AcceptAttempt
    | DeclineAttempt
    | RenewLease
    | CancelGeneration
    | DetachReader
    | AttachReader
    | ReportAttemptFinished
    | ReconcileDue
    | QueryUsage
    | CreateConversation
    | DeleteConversation
    | CommitAnswer
)
COMMAND_TYPES: tuple[type, ...] = (
    SubmitGeneration,
    AcceptAttempt,
    DeclineAttempt,
    RenewLease,
    CancelGeneration,
    DetachReader,
    AttachReader,
    ReportAttemptFinished,
    ReconcileDue,
    QueryUsage,
    CreateConversation,
    DeleteConversation,
    CommitAnswer,
)
