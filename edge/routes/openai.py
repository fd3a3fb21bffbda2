"""``POST /v1/chat/completions`` and ``GET /v1/models`` in OpenAI's shapes (edge/openai_compat.py says
what is served and how), on the pipeline of ``/v1/generations``.

``Idempotency-Key`` is optional here: the official ``openai`` client never sends one, so without it
every call is a new logical request. Its own retries (after a timeout, a dropped connection, a 5xx)
mark themselves with ``x-stainless-retry-count``; the processor attaches such a retry to the newest
running or completed generation of the same request within ``CHATPLANE_OPENAI_RETRY_ATTACH_S``
(``RetryAttach``, edge/followers.py), so it does not spend a second message. Passing a key with
``extra_headers={"Idempotency-Key": ...}`` ties tries together by the key instead.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, Request
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse, Response, StreamingResponse

from edge import sse
from edge.deps import CurrentPrincipal, EdgeDep, edge_state, idempotency_key
from edge.errors import ApiError, request_id_of
from edge.outcomes import note_refusal
from edge.openai_compat import (
    ChatCompletionFramer,
    ChatCompletionRequest,
    cancelled_response,
    completion_document,
    model_created_s,
    openai_error_response,
)
from edge.routes.generations import (
    SSE_HEADERS,
    ClientGone,
    HeldStreamResponse,
    admit,
    await_result,
    existing_result,
    read_body,
    refuse_while_draining,
    request_model_for,
    validated,
)
from edge.followers import Follower, FollowerGone
from edge.streams import GenerationView
from schemas.codes import RejectionCode, RequestStatus, RetryAttach
from schemas.messages import Outcome


class OpenAIRoute(APIRoute):
    """Every refusal of these routes (authentication included) in OpenAI's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as err:
                note_refusal(request, err.code)
                return openai_error_response(err, request_id_of(request))

        return answer


router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)


def _internal_request(req: ChatCompletionRequest, settings: Any) -> tuple[Any, str]:
    """The ``/v1/generations`` request this one is, and the name of the field that set its budget."""
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            # The trusted instructions are the server's (catalog); a client cannot supply its own.
            raise ApiError(RejectionCode.INVALID_REQUEST, field=f"messages.{i}.role")
        content = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content)
        messages.append({"role": m.role, "content": content})
    if req.max_completion_tokens is not None:
        budget, budget_field = req.max_completion_tokens, "max_completion_tokens"
    elif req.max_tokens is not None:
        budget, budget_field = req.max_tokens, "max_tokens"
    else:
        budget = min(settings.openai_max_tokens_default, settings.policy.max_output_tokens_max)
        budget_field = "max_completion_tokens"
    doc = {"model": req.model, "messages": messages, "stream": req.stream, "max_output_tokens": budget}
    return validated(doc, request_model_for(settings), {"max_output_tokens": budget_field}), budget_field


async def _optional_key(raw: str | None) -> str:
    if raw is None:
        return "oai-" + uuid.uuid4().hex  # no key: a new logical request
    return await idempotency_key(raw)


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its ``$defs`` written in place, for an operation's request body (a
    ``#/$defs/...`` reference would resolve against the OpenAPI document's root)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


_OPENAI_ERRORS = {
    status: {"description": "OpenAI's error shape: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"}
    for status in (400, 401, 403, 409, 410, 429, 502, 503, 504)
}


@router.post(
    "/chat/completions",
    summary="OpenAI-compatible chat completion (stream or not), on the same pipeline as /v1/generations",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _inlined(ChatCompletionRequest.model_json_schema())}},
        },
    },
    responses={
        200: {
            "description": "stream=true: text/event-stream of chat.completion.chunk data lines, then data: [DONE]; "
            "stream=false: a chat.completion document",
            "content": {"text/event-stream": {"schema": {"type": "string"}}, "application/json": {"schema": {"type": "object"}}},
        },
        **_OPENAI_ERRORS,
    },
)
async def chat_completions(
    request: Request,
    principal: CurrentPrincipal,
    edge: EdgeDep,
    raw_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    received_s = time.monotonic()
    settings = edge.settings
    refuse_while_draining(edge)
    body = await read_body(request, settings.request_body_bytes_max)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="body") from None
    oai = validated(doc, ChatCompletionRequest)
    req, _ = _internal_request(oai, settings)
    key = await _optional_key(raw_key)
    include_usage = bool(oai.stream_options and oai.stream_options.include_usage)
    framer = ChatCompletionFramer(req.model, req.max_output_tokens, include_usage) if req.stream else sse.NATIVE
    admitted = await admit(request, principal, key, req, received_s, framer, retry_attach_of(raw_key, request.headers))
    request_id = request.state.request_id
    if isinstance(admitted, Outcome):
        if admitted.attached and admitted.status is not None and admitted.status.active:
            return await _follow(request, principal.user_id, admitted, req, include_usage, request_id)
        view, text = await existing_result(edge, principal.user_id, admitted)
        return _settled(view, text, req, include_usage, request_id)
    if req.stream:
        return HeldStreamResponse(edge.hub, admitted, headers={**SSE_HEADERS, "X-Request-Id": request_id})
    try:
        view, text = await await_result(edge, request, admitted)
    except ClientGone:
        return Response(status_code=499)
    return _settled(view, text, req, include_usage, request_id)


# The official client numbers its tries in this header (0: the first). Only a short run of ASCII
# digits is read; anything else is taken as a first try (admitted as a new request, as before the
# header was read), never as a retry that could attach to another call's answer.
RETRY_COUNT_HEADER = "x-stainless-retry-count"
RETRY_COUNT_CHARS_MAX = 4


def retry_attach_of(raw_key: str | None, headers: Any) -> RetryAttach:
    """How the processor may match this try with earlier ones: by the client's key (``off``), or, with
    no key, by fingerprint as a first try or as a retry the client marked as one."""
    if raw_key is not None:
        return RetryAttach.OFF
    count = headers.get(RETRY_COUNT_HEADER, "")
    if 0 < len(count) <= RETRY_COUNT_CHARS_MAX and count.isascii() and count.isdigit() and int(count) >= 1:
        return RetryAttach.RETRY
    return RetryAttach.ORIGINAL


class _FollowerResponse(StreamingResponse):
    """A follower's event stream, which lets go of the follower however the response ends (as
    ``HeldStreamResponse`` does for a held stream: a generator never started runs no ``finally``)."""

    def __init__(self, follower: Follower, frames: Any, headers: dict[str, str]) -> None:
        super().__init__(frames, media_type="text/event-stream", headers=headers)
        self.follower = follower

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.follower.close()


async def _follow(request: Request, user_id: str, outcome: Outcome, req: Any, include_usage: bool, request_id: str) -> Response:
    """A keyless retry the processor attached to a generation still queued or running: follow it and
    answer as the first try would have (streamed or settled)."""
    assert outcome.generation_id is not None and outcome.status is not None
    follower = Follower(edge_state(request), user_id, outcome.generation_id)
    follower.open()
    if req.stream:
        framer = ChatCompletionFramer(req.model, req.max_output_tokens, include_usage)
        headers = {**SSE_HEADERS, "X-Request-Id": request_id}
        return _FollowerResponse(follower, follower.frames(framer, outcome.status), headers)
    try:
        await follower.wait(request)
        view, text = await follower.settled()
    except FollowerGone:
        return Response(status_code=499)
    finally:
        follower.close()
    if view.status is RequestStatus.COMPLETED and text is None:
        raise ApiError(RejectionCode.RESULT_UNAVAILABLE, extra={"generation_id": view.generation_id})
    return _settled(view, text, req, include_usage, request_id)


def _settled(view: GenerationView, text: str | None, req: Any, include_usage: bool, request_id: str) -> Response:
    """The answer for a generation already settled (a non-streaming wait that ended, or a same-key
    retry of finished work, streamed or not)."""
    if view.status is RequestStatus.CANCELLED:
        return cancelled_response(view.generation_id, view.partial, request_id)
    if view.status is not RequestStatus.COMPLETED or text is None:
        raise ApiError(view.code or RejectionCode.MODEL_BACKEND_ERROR, extra={"generation_id": view.generation_id})
    headers = {"Cache-Control": "no-store", "X-Request-Id": request_id}
    doc = completion_document(view.generation_id, req.model, text, view.input_tokens, view.output_tokens, req.max_output_tokens)
    if not req.stream:
        return JSONResponse(doc, headers=headers)
    # A same-key retry of a finished stream: the whole answer at once, in the stream's shape.
    framer = ChatCompletionFramer(req.model, req.max_output_tokens, include_usage)
    frames = (
        framer.created(view.generation_id, view.status.value)
        + framer.delta(view.generation_id, 1, 0, text)
        + framer.terminal(view.generation_id, 2, view.status, None, False, view.input_tokens, view.output_tokens)
    )
    return StreamingResponse(iter([frames]), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


@router.get("/models", summary="The model aliases the caller's tier may use (OpenAI's list shape)")
async def list_models(principal: CurrentPrincipal, edge: EdgeDep) -> Response:
    models = edge.settings.policy.models
    data = [
        {"id": alias, "object": "model", "created": model_created_s(edge.catalog, alias, edge.catalog_written_s), "owned_by": "chatplane"}
        for alias, entry in sorted(models.items())
        if principal.tier in entry.tiers
    ]
    return JSONResponse({"object": "list", "data": data}, headers={"Cache-Control": "no-store"})

