"""Commands: imperative requests appended to the ``commands`` topic (key ``user_id``).

Issuers: the edge (submit, cancel), workers (accept, decline, renew, report) and the processor's
deadline timer (reconcile). Every command carries a unique ``command_id`` and the issuer's clock
``issued_at_ms``; the core takes time only from there. Commands never carry prompt or output text:
the request is represented by an HMAC ``fingerprint`` computed at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from schemas.codes import CancelReason, FinishOutcome, FinishReason, RejectionCode, Tier

COMMAND_SCHEMA_VERSION = 1

Id = Annotated[str, Field(min_length=1, max_length=128)]
IdempotencyKey = Annotated[str, Field(min_length=1, max_length=255)]
Millis = Annotated[int, Field(ge=0, le=2**53)]
Count = Annotated[int, Field(ge=0, le=10_000_000)]
Epoch = Annotated[int, Field(ge=1, le=1_000_000)]


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


Command = (
    SubmitGeneration
    | AcceptAttempt
    | DeclineAttempt
    | RenewLease
    | CancelGeneration
    | ReportAttemptFinished
    | ReconcileDue
)
COMMAND_TYPES: tuple[type, ...] = (
    SubmitGeneration,
    AcceptAttempt,
    DeclineAttempt,
    RenewLease,
    CancelGeneration,
    ReportAttemptFinished,
    ReconcileDue,
)
