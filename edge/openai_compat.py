"""OpenAI's chat-completions shapes over the same pipeline, for OpenAI's clients: request, chunks, errors.

``POST /v1/chat/completions`` (edge/routes/openai.py) turns an OpenAI request into the request of
``/v1/generations`` and runs the same admission (``routes.generations.admit``): same quota,
concurrency, burst bucket, idempotency, cancel on disconnect, model aliases. Only the wire shapes
differ, and they are all here:

- the request: ``model``, ``messages`` (``user`` / ``assistant`` turns; text content, as a string or
  as ``{"type": "text"}`` parts), ``stream``, ``max_tokens`` or ``max_completion_tokens`` (default
  ``CHATPLANE_EDGE_OPENAI_MAX_TOKENS_DEFAULT``), ``stream_options.include_usage``. ``system`` and
  ``developer`` messages are refused as ``/v1/generations`` refuses them (the trusted instructions
  are the server's). Sampling fields the engines take from the catalog (``temperature``, ``top_p``,
  ``seed``, ``user``, ``presence_penalty``, ``frequency_penalty``) are accepted and not applied;
  ``n`` other than 1 and any other field (``tools``, ``stop``, ``logprobs``, ...) are a 400 naming
  the field. Parsed strictly, like every request body here;
- the stream: ``ChatCompletionFramer`` writes ``chat.completion.chunk`` events (``data: {...}``,
  no event names): the role, then one chunk per delta, then one with ``finish_reason`` (``stop``, or
  ``length`` when the answer used its whole budget), the usage chunk (``choices: []``) when asked,
  and ``data: [DONE]``. A cancel or a failure after the headers ends the stream with
  ``data: {"error": {...}}`` and no ``[DONE]`` (the official client raises on it, and takes
  ``[DONE]`` for a finished answer); its ``code`` is the failure's code, or ``cancelled``;
- errors: ``{"error": {"message", "type", "param", "code"}}`` with our code in ``code`` and the
  generation id where there is one, the same HTTP status and ``Retry-After`` as ``/v1/generations``,
  plus ``retry-after-ms`` and ``x-should-retry`` (``false`` where an automatic retry cannot help:
  the official client otherwise retries 408, 409, 429 and 5xx by itself).
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from edge.errors import ApiError, error_response
from infra.models.catalog import Catalog
from schemas.codes import REJECTIONS, RejectionCode, RequestStatus

_STRICT = ConfigDict(extra="forbid", strict=True)
DONE = b"data: [DONE]\n\n"


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The fields of OpenAI's request this endpoint serves; any other is refused (``extra="forbid"``)."""

    model_config = _STRICT
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    # Accepted, not applied: the catalog's model runs with its own sampling settings.
    temperature: float | int | None = None
    top_p: float | int | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | int | None = None
    frequency_penalty: float | int | None = None


def completion_id(generation_id: str) -> str:
    return "chatcmpl-" + generation_id


def _finish_reason(output_tokens: int, max_output_tokens: int) -> str:
    return "length" if output_tokens >= max_output_tokens else "stop"


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": input_tokens, "completion_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}


def completion_document(
    generation_id: str, model: str, text: str, input_tokens: int, output_tokens: int, max_output_tokens: int
) -> dict[str, Any]:
    """A completed, non-streaming answer as OpenAI's ``chat.completion``."""
    return {
        "id": completion_id(generation_id),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": _finish_reason(output_tokens, max_output_tokens),
            }
        ],
        "usage": usage(input_tokens, output_tokens),
    }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def catalog_written_s(catalog: Catalog) -> int:
    """When the catalog file was last written (Unix seconds; a catalog not read from a file: now).
    ``GET /v1/models`` reports it as ``created`` for an alias whose entry gives no ``created``."""
    try:
        return int(os.stat(catalog.source).st_mtime)
    except OSError:
        return int(time.time())


def model_created_s(catalog: Catalog, alias: str, fallback_s: int) -> int:
    """``created`` of ``alias`` in ``GET /v1/models``: when its pinned version was published (the
    catalog's ``created``), else ``fallback_s``. Never 0."""
    model = catalog.models.get(alias)
    return model.created_s if model is not None and model.created_s is not None else fallback_s


def error_type(code: RejectionCode) -> str:
    if code is RejectionCode.QUOTA_EXHAUSTED:
        return "insufficient_quota"
    return _ERROR_TYPES.get(REJECTIONS[code].http_status, "server_error")


def error_object(code: str, message: str, type_: str, param: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}


def openai_error_response(err: ApiError, request_id: str) -> Response:
    """``err`` in OpenAI's error shape, with the status and retry headers ``/v1/generations`` gives it."""
    native = error_response(err, request_id)
    spec = REJECTIONS[err.code]
    extra = {k: v for k, v in err.extra.items() if k in ("generation_id", "status", "partial")}
    native_error = orjson.loads(native.body)["error"]
    details = native_error["details"]
    for key in ("limit", "remaining", "reset_at", "retry_after_ms", "scope"):
        if key in details:
            extra[key] = details[key]
    body = error_object(err.code.value, native_error["message"], error_type(err.code), err.field, request_id=request_id, **extra)
    headers = {k: v for k, v in native.headers.items() if k.lower() not in ("content-length", "content-type")}
    if "retry_after_ms" in details:
        headers["retry-after-ms"] = str(details["retry_after_ms"])
    headers["x-should-retry"] = "true" if spec.retryable else "false"
    return Response(orjson.dumps(body), status_code=spec.http_status, media_type="application/json", headers=headers)


def cancelled_response(generation_id: str, partial: bool, request_id: str) -> Response:
    """A non-streaming request whose generation was cancelled (by a cancel call, or a drain): not a
    completion, and nothing an automatic retry changes."""
    body = error_object(
        "cancelled", "The generation was cancelled.", "conflict_error", None,
        request_id=request_id, generation_id=generation_id, status=RequestStatus.CANCELLED.value, partial=partial,
    )
    headers = {"Cache-Control": "no-store", "X-Request-Id": request_id, "x-should-retry": "false"}
    return Response(orjson.dumps(body), status_code=409, media_type="application/json", headers=headers)


class ChatCompletionFramer:
    """One streamed answer's events as ``chat.completion.chunk``s (``edge.sse.Framer``)."""

    def __init__(self, model: str, max_output_tokens: int, include_usage: bool) -> None:
        self.model = model
        self.max_output_tokens = max_output_tokens
        self.include_usage = include_usage
        self.created_s = int(time.time())

    def _chunk(self, generation_id: str, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        doc = {
            "id": completion_id(generation_id), "object": "chat.completion.chunk", "created": self.created_s,
            "model": self.model, "choices": choices, **extra,
        }
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    def created(self, generation_id: str, status: str) -> bytes:
        return self._chunk(generation_id, [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def delta(self, generation_id: str, sequence: int, index: int, text: str) -> bytes:
        return self._chunk(generation_id, [{"index": 0, "delta": {"content": text}, "finish_reason": None}])

    def terminal(
        self,
        generation_id: str,
        sequence: int,
        status: RequestStatus,
        code: RejectionCode | None,
        partial: bool,
        input_tokens: int,
        output_tokens: int,
    ) -> bytes:
        if status is RequestStatus.COMPLETED:
            reason = _finish_reason(output_tokens, self.max_output_tokens)
            out = self._chunk(generation_id, [{"index": 0, "delta": {}, "finish_reason": reason}])
            if self.include_usage:
                out += self._chunk(generation_id, [], usage=usage(input_tokens, output_tokens))
            return out + DONE
        if status is RequestStatus.CANCELLED:
            error = error_object(
                "cancelled", "The generation was cancelled.", "conflict_error",
                generation_id=generation_id, partial=partial, usage=usage(input_tokens, output_tokens),
            )
        else:
            failure = code or RejectionCode.MODEL_BACKEND_ERROR
            error = error_object(
                failure.value, REJECTIONS[failure].message, error_type(failure),
                generation_id=generation_id, partial=partial, usage=usage(input_tokens, output_tokens),
            )
        return b"data: " + orjson.dumps(error) + b"\n\n"
