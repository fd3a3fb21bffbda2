"""``/v1/generations``: submit (stream or one JSON document), read, cancel.

Where this sits: client --HTTP--> here --SubmitGeneration/CancelGeneration--> commands topic; the
decision comes back on this edge's inbox (``CommandClient.decide``), and the generation's deltas and
terminal event through ``edge.streams.StreamHub``. Every refusal is raised as ``ApiError`` and
rendered by ``edge.errors`` (the one place codes become HTTP). Bounds are checked before any work,
in this order: authentication, Idempotency-Key, drain/stream capacity, body bytes (counted while
reading), JSON shape (the message count and ``max_output_tokens`` included) and roles, model, input
tokens, burst bucket; only then is a command appended. The shape's bounds come from the settings
(``request_model``), so the OpenAPI document shows the configured ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from control_plane.ids import generation_id_for
from control_plane.policy import ModelEntry
from edge.body import read_body  # the one body reader; re-exported for the routes that import it from here
from edge.deps import CurrentPrincipal, EdgeDep, IdempotencyKey, edge_state
from edge.errors import DRAINING_RETRY_AFTER_S, ApiError
from edge.fingerprint import fingerprint
from edge.history import PreparedTurn, answer_visible, prepare_turn
from edge.outcomes import note_decision, note_stream
from edge.readmodel import result_pending
from edge.replay import REPLAY_LOOKUP_WAIT_S, Replay, resume_point
from edge.settings import EdgeSettings
from edge import sse
from edge.state import Edge
from edge.streams import GenerationStream, GenerationView, StreamHub
from infra.runtime import tracing
from infra.runtime.command_client import DecisionTimeout, TooManyPending
from schemas.codes import REJECTIONS, RateLimitScope, RejectionCode, RequestStatus, RetryAttach
from schemas.commands import CancelGeneration, SubmitGeneration
from schemas.messages import ChatMessage, Outcome, OutcomeKind, RejectionDetails
from schemas.outcomes import AdmissionResult

router = APIRouter(prefix="/v1/generations", tags=["generations"])
log = logging.getLogger("chatplane.edge")

MESSAGE_CONTENT_CHARS_MAX = 256 * 1024
GENERATION_ID_CHARS_MAX = 128
# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 1.0

SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


# Request bodies are parsed strictly: a value of the wrong JSON type is refused, never converted
# ("stream": "yes" or "max_output_tokens": "16" is a 400 invalid_request naming the field, not true or
# 16), and unknown fields are refused. The OpenAPI document says so in each model's description.
_STRICT = ConfigDict(extra="forbid", strict=True)
STRICT_PARSING_NOTE = (
    "Parsed strictly: every field must have its JSON type (a string is never read as a boolean or a "
    "number), and unknown fields are refused; either is a 400 invalid_request naming the field."
)


def _whole_number(value: Any) -> Any:
    """JSON has one number type: ``16.0`` is the integer 16 (as JSON Schema's ``integer`` says), so a
    float with no fractional part becomes an int before the strict check; ``16.5``, ``"16"`` and
    ``true`` still fail it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer field of a request body: strict (no strings, no booleans), whole JSON numbers accepted.
JsonInt = Annotated[int, BeforeValidator(_whole_number)]


class InputMessage(BaseModel):
    model_config = ConfigDict(**_STRICT, json_schema_extra={"description": STRICT_PARSING_NOTE})
    # A client cannot supply system or developer instructions: the orchestrator installs the
    # model's trusted instructions itself.
    role: Literal["user", "assistant"]
    content: str = Field(min_length=1, max_length=MESSAGE_CONTENT_CHARS_MAX)


@functools.cache
def request_model(messages_count_max: int, max_output_tokens_max: int) -> type[BaseModel]:
    """The request body's model with these bounds (one class per pair of bounds, built once).

    Built from the settings (``request_model_for``) rather than written as literals, so that raising
    ``CHATPLANE_MAX_OUTPUT_TOKENS_MAX`` or ``CHATPLANE_EDGE_MESSAGES_COUNT_MAX`` really lets larger
    requests through, and the OpenAPI document states the bounds this edge enforces.
    """

    class GenerationRequest(BaseModel):
        model_config = ConfigDict(**_STRICT, json_schema_extra={"description": STRICT_PARSING_NOTE + " " + TURN_NOTE})
        model: str = Field(min_length=1, max_length=128, examples=["fast-text-model"])
        messages: list[InputMessage] = Field(default_factory=list, max_length=messages_count_max)
        stream: bool = False
        max_output_tokens: JsonInt = Field(ge=1, le=max_output_tokens_max)
        conversation_id: str | None = Field(default=None, min_length=1, max_length=CONVERSATION_ID_CHARS_MAX)
        expected_revision: JsonInt | None = Field(default=None, ge=0, le=10_000_000)
        regenerate: bool = False
        # Never cancelled by a disconnect or an edge's death (bounded by the maximum duration); the
        # client follows it later with GET /v1/generations/{id}/events or GET /v1/generations/{id}.
        background: bool = False

    return GenerationRequest


CONVERSATION_ID_CHARS_MAX = 64
TURN_NOTE = (
    "Stateless: `messages` holds the whole context (at least one message, the last one the user's). "
    "A conversation turn (docs/conversations.md): `conversation_id`, `expected_revision` (its committed "
    "revision) and `messages` holding exactly the new user message; the server builds the context from "
    "the stored history by tokens. Regenerate: `conversation_id`, `expected_revision`, `regenerate: true` "
    "and no `messages`."
)


def check_turn_shape(req: Any) -> None:
    """The message count and the conversation fields agree (one 400 naming the field otherwise)."""
    if req.conversation_id is None:
        if req.expected_revision is not None or req.regenerate:
            raise ApiError(RejectionCode.INVALID_REQUEST, field="conversation_id")
        if not req.messages:
            raise ApiError(RejectionCode.INVALID_REQUEST, field="messages", details=RejectionDetails(limit=1))
        return
    if req.expected_revision is None:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="expected_revision")
    if req.regenerate:
        if req.messages:
            raise ApiError(RejectionCode.INVALID_REQUEST, field="messages", details=RejectionDetails(limit=0))
    elif len(req.messages) != 1 or req.messages[0].role != "user":
        raise ApiError(RejectionCode.INVALID_REQUEST, field="messages", details=RejectionDetails(limit=1))


def request_model_for(settings: EdgeSettings) -> type[BaseModel]:
    """The request body's model with this edge's bounds."""
    return request_model(settings.messages_count_max, settings.policy.max_output_tokens_max)


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class OutputText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class GenerationDocument(BaseModel):
    id: str
    status: str
    conversation_id: str | None = None
    revision: int | None = None  # the revision the turn's user message committed at
    # Once the turn has ended: the revision its answer committed at, which the conversation's next
    # turn sends as ``expected_revision`` (no arithmetic on ``revision`` needed). The answer is in
    # the store when this is sent, so a read made after it shows at least this revision.
    next_expected_revision: int | None = Field(
        default=None,
        description="Conversation turns, once ended: the revision the next turn must send as expected_revision.",
    )
    model_version: str | None = None
    output: list[OutputText] = []
    usage: Usage | None = None
    partial: bool | None = None
    error: dict[str, Any] | None = None


class CancelDocument(BaseModel):
    id: str
    status: str


class ErrorBody(BaseModel):
    code: str
    message: str
    retryable: bool
    action: str
    request_id: str
    details: dict[str, Any]


class ErrorDocument(BaseModel):
    error: ErrorBody


_ERRORS = {
    status: {"model": ErrorDocument, "description": ", ".join(s.code.value for s in REJECTIONS.values() if s.http_status == status)}
    for status in sorted({s.http_status for s in REJECTIONS.values()})
}

GenerationId = Annotated[str, Path(min_length=1, max_length=GENERATION_ID_CHARS_MAX)]


def _now_ms() -> int:
    return int(time.time() * 1000)


# Pydantic's error types for a value over its upper bound, and where the error names that bound.
_LIMIT_CONTEXT_KEYS = {"too_long": "max_length", "less_than_equal": "le"}


def _parse(body: bytes, model: type[BaseModel]) -> Any:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="body") from None
    return validated(doc, model)


def validated(doc: Any, model: type[BaseModel], renamed: dict[str, str] | None = None) -> Any:
    """``doc`` as ``model``; the first error is a 400 naming the field (``renamed`` maps a field's
    name in ``model`` to the one the client sent) and the bound it passed, if any."""
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        if renamed:
            head, _, rest = where.partition(".")
            where = renamed.get(head, head) + (f".{rest}" if rest else "")
        limit = first.get("ctx", {}).get(_LIMIT_CONTEXT_KEYS.get(first["type"], ""))
        details = RejectionDetails(limit=limit) if isinstance(limit, int) else None
        raise ApiError(RejectionCode.INVALID_REQUEST, details, field=where) from None


# A turn in one of these states has committed its answer (completed or incomplete) at revision + 1.
_TURN_ENDED = frozenset({RequestStatus.COMPLETED, RequestStatus.CANCELLED, RequestStatus.FAILED})


def _document(view: GenerationView, text: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"id": view.generation_id, "status": view.status.value, "model_version": view.model_version}
    if view.conversation_id:
        doc["conversation_id"], doc["revision"] = view.conversation_id, view.revision
        if view.revision is not None and view.status in _TURN_ENDED:
            doc["next_expected_revision"] = view.revision + 1
    doc["output"] = [{"type": "text", "text": text}] if text is not None else []
    doc["usage"] = {"input_tokens": view.input_tokens, "output_tokens": view.output_tokens}
    if view.status in (RequestStatus.CANCELLED, RequestStatus.FAILED):
        doc["partial"] = view.partial
    if view.code is not None:
        spec = REJECTIONS[view.code]
        doc["error"] = {"code": view.code.value, "action": spec.action.value, "retryable": spec.retryable}
    return doc


@router.post(
    "",
    summary="Submit a generation (SSE stream or one JSON document)",
    responses={
        200: {
            "description": (
                "stream=true: text/event-stream of generation.* events (a conversation turn's terminal event carries "
                "conversation_id and next_expected_revision; a same-key retry of a finished stream replays its events); "
                "stream=false: the generation document"
            ),
            "content": {"text/event-stream": {"schema": {"type": "string"}}, "application/json": {"schema": GenerationDocument.model_json_schema()}},
        },
        **_ERRORS,
    },
)
async def submit(request: Request, principal: CurrentPrincipal, key: IdempotencyKey, edge: EdgeDep) -> Response:
    received_s = time.monotonic()
    settings = edge.settings
    refuse_while_draining(edge)
    body = await read_body(request, settings.request_body_bytes_max)
    req = _parse(body, request_model_for(settings))
    check_turn_shape(req)
    admitted = await admit(request, principal, key, req, received_s)
    if isinstance(admitted, Outcome):
        if req.stream:
            return await _existing_stream(request, principal.user_id, admitted)
        return await _existing(edge, principal.user_id, admitted)
    headers = {"X-Request-Id": request.state.request_id}
    if req.background and not req.stream:
        # Accepted: the client follows it by id (its events, or GET). Nothing waits here.
        edge.hub.release(admitted)
        doc = {"id": admitted.generation_id, "status": RequestStatus.QUEUED.value, "background": True}
        return JSONResponse(doc, status_code=202, headers={"Cache-Control": "no-store", **headers})
    if req.stream:
        return HeldStreamResponse(edge.hub, admitted, headers={**SSE_HEADERS, **headers})
    try:
        view, text = await await_result(edge, request, admitted)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(_document(view, text), headers={"Cache-Control": "no-store", **headers})


def refuse_while_draining(edge: Any) -> None:
    if edge.hub.draining or edge.hub.full():
        raise ApiError(RejectionCode.CAPACITY_EXHAUSTED, retry_after_s=DRAINING_RETRY_AFTER_S)


async def admit(
    request: Request,
    principal: Any,
    key: str,
    req: Any,
    received_s: float,
    framer: sse.Framer = sse.NATIVE,
    retry_attach: RetryAttach = RetryAttach.OFF,
) -> GenerationStream | Outcome:
    """The admission pipeline of one parsed request (``request_model_for``'s shape), shared by
    ``/v1/generations`` and ``/v1/chat/completions``: checks, shedding, tokens, the burst bucket, the
    capacity estimate, the processor's decision. Returns the held stream of an admitted generation
    (its events written by ``framer``), or the outcome of a same-key retry of existing work (or of a
    keyless try the processor attached to an earlier try's generation: ``retry_attach``); a refusal
    raises ``ApiError``. Its steps, in order, are the functions that follow it."""
    edge = edge_state(request)
    note_stream(request, req.stream)
    model = _allowed_model(edge.settings, req, principal)
    # Shed before counting tokens (the costliest check) and before the burst bucket: a submit refused
    # for the stack's load costs the edge little and the user no burst token.
    _refuse_if_shedding(edge)
    counted = await _count_input(edge, req, principal)
    _take_burst_token(edge, principal)
    _check_prompt(edge, request, counted.client_messages)
    command = _submit_command(edge, request, principal, key, req, model, counted, retry_attach)
    await _before_append(edge, principal, command, model, counted)
    outcome, traced = await _append_and_decide(edge, command, received_s)
    _refuse_rejected(edge.settings, outcome)
    if outcome.kind is OutcomeKind.EXISTING or outcome.attached:
        note_decision(request, AdmissionResult.EXISTING, req.stream, outcome.generation_id)
        return outcome
    return _hold_admitted(edge, request, principal, req, model, counted, outcome, traced, received_s, framer)


@dataclass(frozen=True)
class _CountedInput:
    """A request's input, as ``admit`` counted it."""

    messages: tuple[ChatMessage, ...]  # what the model reads (a turn's: the stored history and the new message)
    client_messages: tuple[ChatMessage, ...]  # what the client sent (the prompt check reads these)
    fingerprinted: tuple[ChatMessage, ...]  # what the fingerprint covers
    input_tokens: int
    turn: PreparedTurn | None  # a conversation turn's prepared context; None: stateless


def _allowed_model(settings: EdgeSettings, req: Any, principal: Any) -> ModelEntry:
    """The requested model, once the request's last message is the user's (stateless requests) and
    the caller's tier may use the model; a 400 or 403 naming the field otherwise."""
    conversation_id = getattr(req, "conversation_id", None)
    if not conversation_id and req.messages[-1].role != "user":
        raise ApiError(RejectionCode.INVALID_REQUEST, field=f"messages.{len(req.messages) - 1}.role")
    model = settings.policy.models.get(req.model)
    if model is None:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="model")
    if principal.tier not in model.tiers:
        raise ApiError(RejectionCode.MODEL_NOT_ALLOWED, field="model")
    return model


def _refuse_if_shedding(edge: Edge) -> None:
    """The load shedder's refusal, counted, if it refuses submits now."""
    shed = edge.shedder.refusal()
    if shed is not None:
        reason, refusal = shed
        edge.metrics.shed.labels(reason).inc()
        edge.metrics.admissions.labels(refusal.code.value).inc()
        raise refusal


async def _count_input(edge: Edge, req: Any, principal: Any) -> _CountedInput:
    """The model's input and its tokens (a conversation turn's context is built from the stored
    history here), refused past ``input_tokens_max``."""
    settings = edge.settings
    conversation_id = getattr(req, "conversation_id", None)
    messages = tuple(ChatMessage(role=m.role, content=m.content) for m in req.messages)
    client_messages = messages  # what the client sent (a turn's context adds stored, checked history)
    turn: PreparedTurn | None = None
    if conversation_id:
        turn = await prepare_turn(
            edge.history, edge.catalog.get(req.model), principal.user_id, conversation_id, req.expected_revision,
            req.regenerate, messages[0] if messages else None, req.max_output_tokens,
        )
        fingerprinted = (ChatMessage(role="user", content=f"conversation {conversation_id} at {req.expected_revision} regenerate={req.regenerate}"), *messages)
        messages, input_tokens = turn.messages, turn.input_tokens
    else:
        fingerprinted = messages
        input_tokens = edge.count_tokens(req.model, messages)
    if input_tokens > settings.input_tokens_max:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="messages", details=RejectionDetails(limit=settings.input_tokens_max))
    return _CountedInput(messages, client_messages, fingerprinted, input_tokens, turn)


def _take_burst_token(edge: Edge, principal: Any) -> None:
    """One token of the caller's burst bucket; ``429 rate_limited`` (scope user) while it is empty."""
    wait_s = edge.buckets.take(principal.user_id)
    if wait_s > 0:
        edge.metrics.admissions.labels(RejectionCode.RATE_LIMITED.value).inc()
        raise ApiError(
            RejectionCode.RATE_LIMITED, details=RejectionDetails(retry_after_ms=int(wait_s * 1000)), scope=RateLimitScope.USER
        )


def _check_prompt(edge: Edge, request: Request, client_messages: tuple[ChatMessage, ...]) -> None:
    """The prompt check, when one is configured."""
    if edge.policy_check is not None:
        # The prompt check (docs/policy.md), after the buckets (probing a check costs burst tokens) and
        # before the command: a refused prompt reserves nothing. The log names ids and the check only.
        verdict = edge.policy_check.check_prompt(client_messages)
        if verdict.refused:
            log.info("prompt refused request_id=%s check=%s", request.state.request_id, verdict.check)
            edge.metrics.admissions.labels(RejectionCode.PROMPT_REFUSED.value).inc()
            raise ApiError(RejectionCode.PROMPT_REFUSED)


def _submit_command(
    edge: Edge,
    request: Request,
    principal: Any,
    key: str,
    req: Any,
    model: ModelEntry,
    counted: _CountedInput,
    retry_attach: RetryAttach,
) -> SubmitGeneration:
    """The ``SubmitGeneration`` command of a checked request, with the capacity estimate."""
    settings = edge.settings
    input_tokens = counted.input_tokens
    estimate_ms = (
        edge.capacity.estimate_wait_ms(model.pool, input_tokens, req.max_output_tokens) if settings.capacity_check else 0
    )
    request_id = request.state.request_id
    issued_at_ms = _now_ms()
    return SubmitGeneration(
        command_id=uuid.uuid4().hex,
        user_id=principal.user_id,
        issued_at_ms=issued_at_ms,
        idempotency_key=key,
        fingerprint=fingerprint(settings.fingerprint_key, req.model, counted.fingerprinted, req.max_output_tokens),
        model_alias=req.model,
        tier=principal.tier,
        risk_class=principal.risk_class,
        stream=req.stream,
        max_output_tokens=req.max_output_tokens,
        input_tokens=input_tokens,
        estimated_queue_wait_ms=min(estimate_ms, 2**53),
        # The wait below starts after the append, so the deadline falls at least the skew margin
        # before this edge gives up: a submit the processor reads later is refused holding nothing,
        # and the 503 below never charges the client.
        decide_by_ms=settings.decide_by_ms(issued_at_ms),
        reader_id="" if getattr(req, "background", False) else edge.edge_id,
        reply_to=edge.client.reply_to(request_id),
        retry_attach=retry_attach,
        **_turn_command_fields(counted.turn),
    )


async def _before_append(
    edge: Edge, principal: Any, command: SubmitGeneration, model: ModelEntry, counted: _CountedInput
) -> None:
    """What goes out before the command: a turn's new user message to the history store, and the
    prompt to its pool's prompt topic (when prompts travel on one)."""
    settings = edge.settings
    turn, messages = counted.turn, counted.messages
    issued_at_ms = command.issued_at_ms
    if turn is not None and turn.new_message is not None:
        # The user message is stored before the submit: a turn the processor commits is never lost
        # to a crash after it (edge/history.py). Keyed by the generation id this submit will get.
        await edge.history.put_turn_input(
            generation_id_for(principal.user_id, command.command_id), turn.conversation_id,
            turn.new_message.content, issued_at_ms,
        )
    if settings.prompt_topic:
        # The generation id a new key's submit gets; the prompt goes where its dispatch will.
        generation_id = generation_id_for(principal.user_id, command.command_id)
        edge.prompts.publish(settings.topology.prompts(model.pool).name, generation_id, principal.user_id, messages)


async def _append_and_decide(edge: Edge, command: SubmitGeneration, received_s: float) -> tuple[Outcome, Any]:
    """The command appended and the processor's decision awaited (fail closed: ``503
    quota_service_unavailable`` when none comes in time), timed for the shedder and the metrics; the
    outcome and the generation's trace (None when tracing is off)."""
    settings = edge.settings
    sent_s = time.monotonic()
    traced = tracing.begin_generation(received_s, command)  # None when tracing is off (docs/tracing.md)
    edge.shedder.deciding += 1
    try:
        outcome: Outcome = await edge.client.decide(
            command, timeout_s=settings.decision_timeout_s, headers=tracing.generation_headers(traced)
        )
    except (DecisionTimeout, TooManyPending):
        # Fail closed. Nothing is charged: the processor refuses this submit if it reads it after
        # decide_by_ms, and a decision made before that reaches this edge within the margin.
        edge.metrics.admissions.labels(RejectionCode.QUOTA_SERVICE_UNAVAILABLE.value).inc()
        edge.shedder.observe(time.monotonic() - sent_s)
        edge.metrics.shed_limit.set(edge.shedder.limit)
        raise ApiError(RejectionCode.QUOTA_SERVICE_UNAVAILABLE) from None
    finally:
        edge.shedder.deciding -= 1
        tracing.end_generation(traced)
    edge.metrics.decision_latency.observe(time.monotonic() - received_s)
    edge.shedder.observe(time.monotonic() - sent_s)
    edge.metrics.shed_limit.set(edge.shedder.limit)
    label = outcome.code.value if outcome.code is not None else outcome.kind.value
    edge.metrics.admissions.labels(label).inc()
    return outcome, traced


def _refuse_rejected(settings: EdgeSettings, outcome: Outcome) -> None:
    """The processor's refusal as the client's ``ApiError`` (with what a retry needs to know)."""
    if outcome.kind is OutcomeKind.REJECTED:
        assert outcome.code is not None
        extra = None
        if outcome.code is RejectionCode.GENERATION_IN_PROGRESS:
            extra = {
                "generation_id": outcome.generation_id, "status": outcome.status.value if outcome.status else None,
                "same_request": outcome.same_request,
            }
            if outcome.conversation_id:
                extra["conversation_id"] = outcome.conversation_id
        if outcome.code is RejectionCode.RESULT_UNAVAILABLE:
            extra = {"generation_id": outcome.generation_id}
        details = outcome.details
        if outcome.code is RejectionCode.CONCURRENCY_LIMITED and details.limit is None:
            # The core says when to retry; the limit itself is the shared policy's.
            details = replace(details, limit=settings.policy.concurrency_limit)
        raise ApiError(outcome.code, details, extra=extra)


def _hold_admitted(
    edge: Edge,
    request: Request,
    principal: Any,
    req: Any,
    model: ModelEntry,
    counted: _CountedInput,
    outcome: Outcome,
    traced: Any,
    received_s: float,
    framer: sse.Framer,
) -> GenerationStream:
    """An admitted generation's stream, held by the hub for its events."""
    assert outcome.kind is OutcomeKind.ADMITTED and outcome.generation_id is not None
    stream = GenerationStream(
        generation_id=outcome.generation_id,
        user_id=principal.user_id,
        tier=principal.tier,
        epoch=outcome.epoch,
        streaming=req.stream,
        messages=counted.messages,
        input_tokens=counted.input_tokens,
        model_version=outcome.model_version or model.version,
        received_s=received_s,
        admitted_s=time.monotonic(),
        max_output_tokens=req.max_output_tokens,
        framer=framer,
        conversation_id=outcome.conversation_id,
        revision=outcome.revision,
        # Read-your-writes: a turn's end is told once the store shows its answer's revision.
        before_terminal=(
            functools.partial(answer_visible, edge.history, edge.metrics, outcome.conversation_id, outcome.revision + 1)
            if outcome.conversation_id and outcome.revision is not None
            else None
        ),
    )
    edge.hub.hold(stream)
    tracing.remember(stream.generation_id, traced)  # its cancel joins the trace (tracing.recall)
    note_decision(request, AdmissionResult.ADMITTED, req.stream, stream.generation_id, stream)
    return stream


def _turn_command_fields(turn: PreparedTurn | None) -> dict[str, Any]:
    if turn is None:
        return {}
    return {
        "conversation_id": turn.conversation_id,
        "expected_revision": turn.expected_revision,
        "regenerate": turn.regenerate,
        "restore_revision": turn.restore_revision,
    }


class HeldStreamResponse(StreamingResponse):
    """The SSE answer of a held stream, which lets go of the stream however the response ends.

    ``StreamHub.frames`` releases the stream when its iteration ends, but Starlette never starts that
    iteration when the client is gone before the headers are written (``send`` raises, or the
    disconnect listener wins), and a generator never started runs no ``finally``: the stream, its
    buffered frames and its place under ``streams_max`` were then held until the process ended.
    ``StreamHub.release`` is idempotent, so the normal path releases once.
    """

    def __init__(self, hub: StreamHub, stream: GenerationStream, headers: dict[str, str]) -> None:
        super().__init__(hub.frames(stream), media_type="text/event-stream", headers=headers)
        self.hub, self.stream = hub, stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.hub.release(self.stream)


async def await_result(edge: Any, request: Request, stream: GenerationStream) -> tuple[GenerationView, str]:
    """Non-streaming: the same pipeline into the bounded result buffer; the settled generation and its
    text. A failure before any header went out is the HTTP answer itself (raised as ``ApiError``); a
    client gone while waiting ends the request (``ClientGone``)."""
    deadline = time.monotonic() + edge.settings.generation_wait_s_max
    try:
        while not stream.done.is_set():
            if time.monotonic() >= deadline:
                raise ApiError(RejectionCode.GENERATION_TIMEOUT, extra={"generation_id": stream.generation_id})
            await edge.hub.wait_done(stream, DISCONNECT_POLL_S)
            if not stream.done.is_set() and await request.is_disconnected():
                raise ClientGone()
    finally:
        edge.hub.release(stream)
    f = stream.finalized
    if f is None:  # drained past its deadline without a committed terminal state
        raise ApiError(RejectionCode.GENERATION_TIMEOUT, extra={"generation_id": stream.generation_id})
    if stream.before_terminal is not None:
        await stream.before_terminal()
    status = stream.terminal_status or f.status
    code = f.code if status is not RequestStatus.FAILED or f.code else RejectionCode.MODEL_BACKEND_ERROR
    if f.status is RequestStatus.ADMISSION_RETRYABLE:
        code = RejectionCode.CAPACITY_EXHAUSTED
    if status is RequestStatus.FAILED and code is not None:
        # No header has gone out yet: the failure is the HTTP answer itself (seed section 5 table:
        # 502 model_backend_error / 504 generation_timeout; 503 capacity_exhausted when no worker
        # took it in time, retryable with the same key). The generation id lets the client inspect it.
        extra: dict[str, Any] = {"generation_id": stream.generation_id, "status": f.status.value, "partial": f.partial}
        if stream.conversation_id is not None and stream.revision is not None:
            # The turn's answer committed (incomplete) all the same: the next turn sends this.
            extra.update(conversation_id=stream.conversation_id, next_expected_revision=stream.revision + 1)
        raise ApiError(code, extra=extra)
    view = GenerationView(
        stream.generation_id, stream.user_id, status, stream.model_version, f.input_tokens, f.output_tokens, code, f.partial
    )
    view.conversation_id, view.revision = stream.conversation_id, stream.revision
    return view, "".join(stream.result_parts)


class ClientGone(Exception):
    """The client of a non-streaming request disconnected while it waited (answered 499, which no
    one reads); the edge's disconnect handling has detached the generation."""


async def _existing(edge: Any, user_id: str, outcome: Outcome) -> Response:
    """A same-key retry of a settled generation: its state, and its result while retained."""
    view, text = await existing_result(edge, user_id, outcome)
    await _turn_end_visible(edge, view)
    return JSONResponse(_document(view, text), headers={"Cache-Control": "no-store"})


async def _turn_end_visible(edge: Any, view: GenerationView) -> None:
    """Read-your-writes for a retry of an ended conversation turn, as for its first answer: the
    retry names ``next_expected_revision`` only once the history store shows it (bounded; the first
    answer may have been lost before the store caught up, e.g. the processor had just committed it)."""
    if view.conversation_id and view.revision is not None and view.status in _TURN_ENDED:
        await answer_visible(edge.history, edge.metrics, view.conversation_id, view.revision + 1)


async def _existing_stream(request: Request, user_id: str, outcome: Outcome) -> Response:
    """A same-key retry of a settled generation that asked for a stream: its events replayed from the
    start (created, the stored deltas, the terminal event, with the ids the first stream had), the
    form the request asked for, exactly as ``GET /v1/generations/{id}/events`` would send them."""
    edge = edge_state(request)
    view, text = await existing_result(edge, user_id, outcome)  # result_unavailable past the text's retention
    await _turn_end_visible(edge, view)
    headers = {**SSE_HEADERS, "X-Request-Id": request.state.request_id}
    try:
        await edge.replay.store()
    except ApiError:
        # The stored deltas cannot be read: the settled result itself, as one delta (as
        # /v1/chat/completions answers), rather than refuse an answer this edge holds.
        status = RequestStatus.FAILED if view.status is RequestStatus.REJECTED else view.status
        cid, revision = view.conversation_id, view.revision
        next_revision = revision + 1 if cid is not None and revision is not None else None
        frames = sse.created(view.generation_id, RequestStatus.QUEUED.value, cid, revision)
        if text:
            frames += sse.delta(view.generation_id, 1, 0, text)
        frames += sse.terminal(
            view.generation_id, view.terminal_sequence or 2, status, view.code, view.partial, view.input_tokens,
            view.output_tokens, cid if next_revision is not None else None, next_revision,
        )
        return StreamingResponse(iter([frames]), media_type="text/event-stream", headers=headers)
    replay = Replay(edge, user_id, view, resume_point(None, None))
    return StreamingResponse(replay.frames(), media_type="text/event-stream", headers=headers)


async def existing_result(edge: Any, user_id: str, outcome: Outcome) -> tuple[GenerationView, str | None]:
    """The state of the generation a same-key retry named, and its text when it completed (a
    completed one whose text is past its retention is ``result_unavailable``)."""
    assert outcome.generation_id is not None and outcome.status is not None
    view = await edge.lookup(outcome.generation_id, user_id)
    if view is None:
        view = GenerationView(outcome.generation_id, user_id, outcome.status, outcome.model_version or "", code=outcome.code)
    view.status = outcome.status
    if outcome.conversation_id and outcome.revision is not None:
        # The processor's answer names the turn (the read model may not have projected it yet): the
        # retry's answer carries the revision the next turn sends, as the first answer did.
        view.conversation_id, view.revision = outcome.conversation_id, outcome.revision
    text = None
    if outcome.status is RequestStatus.COMPLETED:
        text = await edge.result(outcome.generation_id, user_id)
        if text is None:
            raise ApiError(RejectionCode.RESULT_UNAVAILABLE, extra={"generation_id": outcome.generation_id})
    return view, text


@router.get(
    "/{generation_id}",
    summary="Read a generation's state (owner only)",
    response_model=GenerationDocument,
    responses=_ERRORS,
)
async def get_generation(principal: CurrentPrincipal, generation_id: GenerationId, edge: EdgeDep) -> Response:
    view, text = await edge.lookup_with_result(generation_id, principal.user_id)
    if view is None:
        raise ApiError(RejectionCode.NOT_FOUND)
    if view.status is RequestStatus.RUNNING:
        # The text so far, from the stored deltas (any edge), marked partial.
        with contextlib.suppress(ApiError):
            doc = _document(view, await edge.replay.text_so_far(generation_id))
            doc["partial"] = True
            return JSONResponse(doc, headers={"Cache-Control": "no-store"})
    if view.status in (RequestStatus.CANCELLED, RequestStatus.FAILED) and view.partial and text is None:
        # Ended with part of an answer: that part, from the stored deltas (the result store keeps
        # only completed texts), up to the terminal event, as GET showed it while it ran.
        with contextlib.suppress(ApiError):
            partial_text = await edge.replay.text_so_far(generation_id, view.terminal_sequence or None)
            return JSONResponse(_document(view, partial_text or None), headers={"Cache-Control": "no-store"})
    if view.status is RequestStatus.COMPLETED and text is None:
        # The content is past its retention (410), or not stored yet (503, retry); the metadata is
        # served with either.
        doc = _document(view, None)
        extra = {"status": doc["status"], "model_version": doc["model_version"], "usage": doc["usage"]}
        if view.result_pending:
            raise result_pending(generation_id, extra)
        raise ApiError(RejectionCode.RESULT_UNAVAILABLE, extra={"generation_id": generation_id, **extra})
    return JSONResponse(_document(view, text), headers={"Cache-Control": "no-store"})


@router.get(
    "/{generation_id}/events",
    summary="Replay a generation's events after Last-Event-ID (else ?after=N), then follow it live (any edge)",
    description=(
        "Last-Event-ID wins over ?after=: a reconnecting EventSource repeats the URL it first opened and adds "
        "the id of the last event it received."
    ),
    responses={200: {"description": "text/event-stream of generation.* events, each with id: <sequence>",
                     "content": {"text/event-stream": {"schema": {"type": "string"}}}}, **_ERRORS},
)
async def generation_events(
    request: Request,
    principal: CurrentPrincipal,
    generation_id: GenerationId,
    edge: EdgeDep,
    after: Annotated[int | None, Query(ge=0, le=10_000_000)] = None,
) -> Response:
    start = resume_point(request.headers.get("last-event-id"), after)
    view = await edge.lookup(generation_id, principal.user_id)
    if view is None and await edge.replay.has_deltas(generation_id):
        # Running, with text stored, but the read model has not shown it yet (it trails the ledger
        # by a fraction of a second): a client reconnecting at once to another edge waits for it.
        deadline = time.monotonic() + REPLAY_LOOKUP_WAIT_S
        while view is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            view = await edge.lookup(generation_id, principal.user_id)
    if view is None:
        raise ApiError(RejectionCode.NOT_FOUND)
    if view.status is RequestStatus.COMPLETED:
        # Past the result TTL its deltas are gone with its text: 410, as GET answers (503
        # result_pending while the worker still holds a text it could not store yet).
        expires = view.result_expires_at_ms
        read, text = await edge.lookup_with_result(generation_id, principal.user_id)
        if text is None and read is not None and read.result_pending:
            raise result_pending(generation_id)
        if text is None or (expires is not None and expires <= _now_ms()):
            raise ApiError(RejectionCode.RESULT_UNAVAILABLE, extra={"generation_id": generation_id})
    await edge.replay.store()  # 503 now, not an empty stream, when the store cannot be reached
    replay = Replay(edge, principal.user_id, view, start)
    headers = {**SSE_HEADERS, "X-Request-Id": request.state.request_id}
    return StreamingResponse(replay.frames(), media_type="text/event-stream", headers=headers)


@router.post(
    "/{generation_id}/cancel",
    summary="Cancel a generation (idempotent; 202 while the worker stops)",
    response_model=CancelDocument,
    responses={202: {"model": CancelDocument, "description": "cancel_requested"}, **_ERRORS},
)
async def cancel_generation(
    request: Request, principal: CurrentPrincipal, generation_id: GenerationId, edge: EdgeDep
) -> Response:
    # The command goes to the principal's own ledger partition: another user's generation is simply
    # not there, so the answer is the same 404 as for an id that never existed.
    command = CancelGeneration(
        command_id=uuid.uuid4().hex,
        user_id=principal.user_id,
        issued_at_ms=_now_ms(),
        generation_id=generation_id,
        reply_to=edge.client.reply_to(request.state.request_id),
    )
    span = tracing.start("edge.cancel", tracing.recall(generation_id), root=True, generation_id=generation_id)
    try:
        outcome: Outcome = await edge.client.decide(
            command, timeout_s=edge.settings.decision_timeout_s, headers=tracing.headers(span)
        )
    except (DecisionTimeout, TooManyPending):
        raise ApiError(RejectionCode.QUOTA_SERVICE_UNAVAILABLE) from None
    finally:
        tracing.end(span)
    if outcome.kind is OutcomeKind.REJECTED:
        raise ApiError(outcome.code or RejectionCode.NOT_FOUND)
    if outcome.kind is OutcomeKind.CANCEL_REQUESTED:
        return JSONResponse({"id": generation_id, "status": "cancel_requested"}, status_code=202)
    status = outcome.status.value if outcome.status else RequestStatus.CANCELLED.value
    return JSONResponse({"id": generation_id, "status": status})
