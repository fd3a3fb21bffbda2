"""Where a decision's consequences go: a pure function from one handled command to outbound records.

The admission processor writes whatever ``route`` returns, after its table write, through one
producer; faust flushes that producer before it commits the command's offset, so every record here is
sent at least once per command (and re-sent, identical, on redelivery).

    ledger entry     -> LEDGER, the command's own partition (co-partitioned with COMMANDS), with the
                        processor's read stamp of a submit (``LedgerEntry.read_at_ms``)
    outcome          -> the command's reply_to (edge inbox partition, or a worker's control partition)
    GenerationAdmitted -> DispatchAuthorized on dispatch.<pool>.<tier> (key generation_id)
    CancelRequested, or a fence of a running attempt -> StopAttempt to the owner's control partition
    terminal or return-to-admission -> GenerationFinalized to the edge inbox that holds the stream
    UsageRecorded    -> USAGE, the command's own partition
"""

from __future__ import annotations

from dataclasses import dataclass

from control_plane.decide import Decision
from control_plane.state import RequestRecord, UserLedger, usage_key
from schemas import events as ev
from schemas import topics
from schemas.codes import CancelReason, RequestStatus
from schemas.commands import Command, SubmitGeneration
from schemas.messages import DispatchAuthorized, GenerationFinalized, OutcomeKind, StopAttempt
from schemas.wire import encode


@dataclass(frozen=True, slots=True)
class Outbound:
    topic: str
    partition: int | None  # None: the producer's key partitioner decides
    key: bytes | None
    value: bytes


_TERMINAL_STATUS = {
    ev.GenerationCompleted: RequestStatus.COMPLETED,
    ev.GenerationCancelled: RequestStatus.CANCELLED,
    ev.GenerationFailed: RequestStatus.FAILED,
    ev.GenerationReturnedToAdmission: RequestStatus.ADMISSION_RETRYABLE,
}


def route(
    topology: topics.Topology,
    before: UserLedger,
    after: UserLedger,
    command: Command,
    decision: Decision,
    partition: int,
) -> list[Outbound]:
    user_key = command.user_id.encode()
    out: list[Outbound] = []
    if decision.events:
        entry = ev.LedgerEntry(
            command_id=command.command_id,
            command_type=command.type,
            user_id=command.user_id,
            events=decision.events,
            read_at_ms=command.read_at_ms if isinstance(command, SubmitGeneration) else 0,
        )
        out.append(Outbound(topology.ledger.name, partition, user_key, encode(entry)))
    if command.reply_to is not None:
        out.append(Outbound(command.reply_to.topic, command.reply_to.partition, None, encode(decision.outcome)))
    usage = {e.generation_id: e for e in decision.events if isinstance(e, ev.UsageRecorded)}
    turns = {e.generation_id: e for e in decision.events if isinstance(e, ev.ConversationTurnCommitted)}
    stopped: set[str] = set()
    for e in decision.events:
        if isinstance(e, ev.GenerationAdmitted):
            dispatch = DispatchAuthorized(
                event_id=e.event_id,
                user_id=e.user_id,
                generation_id=e.generation_id,
                epoch=e.epoch,
                model_version=e.model_version,
                tier=e.tier,
                max_output_tokens=e.max_output_tokens,
                input_tokens=e.input_tokens,
                authorized_at_ms=e.occurred_at_ms,
                queue_deadline_ms=e.queue_deadline_ms,
                stream_to=e.reply_to,
                **_turn_fields(turns.get(e.generation_id)),
            )
            out.append(Outbound(topology.dispatch(e.pool, e.tier).name, None, e.generation_id.encode(), encode(dispatch)))
        elif isinstance(e, ev.CancelRequested):
            out.append(_stop(topology, e.event_id, e.user_id, e.generation_id, e.epoch, e.owner_worker_id, cancel=e))
            stopped.add(e.generation_id)
        elif isinstance(e, ev.AttemptFenced):
            record = before.record_of(e.generation_id)
            owner = record.attempt.owner_worker_id if record and record.attempt else None
            if owner is not None and e.generation_id not in stopped:
                out.append(_stop(topology, e.event_id, e.user_id, e.generation_id, e.epoch, owner, fence=e))
                stopped.add(e.generation_id)
        elif type(e) in _TERMINAL_STATUS:
            record = before.record_of(e.generation_id)
            if record is not None and record.reply_to is not None and not _answer_commit_follows(before, record):
                used = usage.get(e.generation_id)
                finalized = GenerationFinalized(
                    event_id=e.event_id,
                    user_id=e.user_id,
                    generation_id=e.generation_id,
                    epoch=e.epoch,
                    status=_TERMINAL_STATUS[type(e)],
                    code=getattr(e, "code", None),
                    partial=getattr(e, "partial", False),
                    input_tokens=used.input_tokens if used else record.input_tokens,
                    output_tokens=used.output_tokens if used else 0,
                    sequence=getattr(e, "sequence", 0),
                )
                out.append(Outbound(record.reply_to.topic, record.reply_to.partition, None, encode(finalized)))
        elif isinstance(e, ev.ConversationAnswerCommitted):
            # A conversation turn is announced ended only now: its answer is stored and committed.
            record = after.record_of(e.generation_id)
            if record is not None and record.reply_to is not None:
                used = usage.get(e.generation_id)
                output_tokens = used.output_tokens if used else _usage_of(after, record)
                finalized = GenerationFinalized(
                    event_id=e.event_id,
                    user_id=e.user_id,
                    generation_id=e.generation_id,
                    epoch=e.epoch,
                    status=record.status,
                    code=record.code,
                    partial=output_tokens > 0 and record.status is not RequestStatus.COMPLETED,
                    input_tokens=used.input_tokens if used else record.input_tokens,
                    output_tokens=output_tokens,
                    sequence=record.terminal_sequence,
                )
                out.append(Outbound(record.reply_to.topic, record.reply_to.partition, None, encode(finalized)))
        elif isinstance(e, ev.UsageRecorded):
            out.append(Outbound(topology.usage.name, partition, user_key, encode(e)))
    if decision.outcome.kind is OutcomeKind.CANCEL_REQUESTED and not decision.events:
        # A repeated cancel re-sends the stop: the first control message may have been lost.
        record = after.record_of(decision.outcome.generation_id or "")
        if record is not None and record.attempt is not None and record.attempt.owner_worker_id is not None:
            out.append(
                _stop(
                    topology,
                    f"{command.command_id}/stop",
                    command.user_id,
                    record.generation_id,
                    record.attempt.epoch,
                    record.attempt.owner_worker_id,
                    reason=record.attempt.cancel_reason,
                )
            )
    return out


def _turn_fields(turn: ev.ConversationTurnCommitted | None) -> dict[str, object]:
    if turn is None:
        return {}
    return {"conversation_id": turn.conversation_id, "turn_revision": turn.revision, "regenerate": turn.regenerate}


def _answer_commit_follows(before: UserLedger, record: RequestRecord) -> bool:
    """Whether this generation answers a turn whose answer is still to commit: its end is then
    announced with ``ConversationAnswerCommitted`` (in this decision or a later one), never before."""
    if not record.conversation_id:
        return False
    conversation = before.conversations.get(record.conversation_id)
    return conversation is not None and conversation.in_flight == record.generation_id


def _usage_of(state: UserLedger, record: RequestRecord) -> int:
    entry = state.usage.get(usage_key(record.generation_id, record.epoch))
    return entry.output_tokens if entry is not None else 0


def _stop(
    topology: topics.Topology,
    event_id: str,
    user_id: str,
    generation_id: str,
    epoch: int,
    worker_id: str,
    cancel: ev.CancelRequested | None = None,
    fence: ev.AttemptFenced | None = None,
    reason: CancelReason | None = None,
) -> Outbound:
    message = StopAttempt(
        event_id=event_id,
        user_id=user_id,
        generation_id=generation_id,
        epoch=epoch,
        worker_id=worker_id,
        cancel_reason=cancel.reason if cancel else reason,
        fence_reason=fence.reason if fence else None,
    )
    return Outbound(
        topology.worker_control.name, topics.worker_control_partition(worker_id), worker_id.encode(), encode(message)
    )
