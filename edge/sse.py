"""Server-sent event framing of the application contract (seed section 4).

One event is ``event: <name>\\ndata: <one JSON line>\\n\\n`` in UTF-8; a heartbeat is the comment
``: keep-alive\\n\\n``. The JSON is produced by orjson (no raw newlines inside a data line), so one
``data`` line per event is always a valid frame. Event names::

    generation.created      {generation_id, sequence: 0, status[, conversation_id, revision]}
    generation.text.delta   {generation_id, sequence, index, delta}
    generation.completed    {generation_id, sequence, usage: {input_tokens, output_tokens}[, conversation_id, next_expected_revision]}
    generation.cancelled    {generation_id, sequence, partial, usage[, conversation_id, next_expected_revision]}
    generation.error        {generation_id, sequence, code, action, partial, usage[, conversation_id, next_expected_revision]}
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from schemas.codes import REJECTIONS, RejectionCode, RequestStatus

HEARTBEAT = b": keep-alive\n\n"

CREATED = "generation.created"
DELTA = "generation.text.delta"
COMPLETED = "generation.completed"
CANCELLED = "generation.cancelled"
ERROR = "generation.error"
TERMINAL_EVENTS = frozenset({COMPLETED, CANCELLED, ERROR})


def frame(event: str, data: dict[str, Any]) -> bytes:
    """One SSE event; a generation's events carry ``id: <sequence>`` (the resume point of
    ``Last-Event-ID``): the ``sequence`` of their data."""
    sequence = data.get("sequence")
    head = b"id: %d\n" % sequence if isinstance(sequence, int) else b""
    return head + b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def created(generation_id: str, status: str, conversation_id: str | None = None, revision: int | None = None) -> bytes:
    data: dict[str, Any] = {"generation_id": generation_id, "sequence": 0, "status": status}
    if conversation_id is not None:
        data["conversation_id"], data["revision"] = conversation_id, revision
    return frame(CREATED, data)


def delta(generation_id: str, sequence: int, index: int, text: str) -> bytes:
    return frame(DELTA, {"generation_id": generation_id, "sequence": sequence, "index": index, "delta": text})


def terminal(
    generation_id: str,
    sequence: int,
    status: RequestStatus,
    code: RejectionCode | None,
    partial: bool,
    input_tokens: int,
    output_tokens: int,
    conversation_id: str | None = None,
    next_expected_revision: int | None = None,
) -> bytes:
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens}
    # A conversation turn's end names the revision the conversation's next turn must send (every
    # turn's answer commits, completed or incomplete, so each terminal event carries it).
    turn = {} if conversation_id is None else {"conversation_id": conversation_id, "next_expected_revision": next_expected_revision}
    if status is RequestStatus.COMPLETED:
        return frame(COMPLETED, {"generation_id": generation_id, "sequence": sequence, "usage": usage, **turn})
    if status is RequestStatus.CANCELLED:
        return frame(
            CANCELLED, {"generation_id": generation_id, "sequence": sequence, "partial": partial, "usage": usage, **turn}
        )
    error_code = code or RejectionCode.MODEL_BACKEND_ERROR
    return frame(
        ERROR,
        {
            "generation_id": generation_id,
            "sequence": sequence,
            "code": error_code.value,
            "action": REJECTIONS[error_code].action.value,
            "partial": partial,
            "usage": usage,
            **turn,
        },
    )


class Framer(Protocol):
    """How a held stream's events become bytes on the wire: this module's events (``NATIVE``) for
    ``/v1/generations``, OpenAI's chunks for ``/v1/chat/completions`` (``edge.openai_compat``)."""

    def created(self, generation_id: str, status: str) -> bytes: ...

    def delta(self, generation_id: str, sequence: int, index: int, text: str) -> bytes: ...

    def terminal(
        self,
        generation_id: str,
        sequence: int,
        status: RequestStatus,
        code: RejectionCode | None,
        partial: bool,
        input_tokens: int,
        output_tokens: int,
    ) -> bytes: ...


class _Native:
    created = staticmethod(created)
    delta = staticmethod(delta)
    terminal = staticmethod(terminal)


NATIVE: Framer = _Native()
