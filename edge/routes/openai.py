"""``POST /v1/chat/completions`` and ``GET /v1/models`` in OpenAI's shapes (edge/openai_compat.py says
what is served and how), on the pipeline of ``/v1/generations``.

``Idempotency-Key`` is optional here: the official ``openai`` client never sends one, so without it
every call is a new logical request (and the client's own retries after a timeout may run twice);
pass one with ``extra_headers={"Idempotency-Key": ...}`` to make those retries safe.
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
from edge.deps import CurrentPrincipal, idempotency_key
from edge.errors import ApiError, request_id_of
from edge.outcomes import note_refusal
from edge.openai_compat import (
    ChatCompletionFramer,
    ChatCompletionRequest,
    cancelled_response,
    completion_document,
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
from edge.streams import GenerationView
from schemas.codes import RejectionCode, RequestStatus
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
    raw_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    edge = request.app.state.edge
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
    admitted = await admit(request, principal, key, req, received_s, framer)
    request_id = request.state.request_id
    if isinstance(admitted, Outcome):
        view, text = await existing_result(edge, principal.user_id, admitted)
        return _settled(view, text, req, include_usage, request_id)
    if req.stream:
        return HeldStreamResponse(edge.hub, admitted, headers={**SSE_HEADERS, "X-Request-Id": request_id})
    try:
        view, text = await await_result(edge, request, admitted)
    except ClientGone:
        return Response(status_code=499)
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
async def list_models(request: Request, principal: CurrentPrincipal) -> Response:
    models = request.app.state.edge.settings.policy.models
    data = [
        {"id": alias, "object": "model", "created": 0, "owned_by": "chatplane"}
        for alias, entry in sorted(models.items())
        if principal.tier in entry.tiers
    ]
    return JSONResponse({"object": "list", "data": data}, headers={"Cache-Control": "no-store"})

