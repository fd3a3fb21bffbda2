"""Edge outcomes: one content-free record per admission request, on the ``outcomes`` topic.

Where this sits (docs/slo.md)::

    client --POST /v1/generations, /v1/chat/completions--> edge --EdgeOutcome(key request_id)--> OUTCOMES
                                                                                      |
    processor, workers --LedgerEntry--> LEDGER -------------------------------------+--> projections.reports.slo

Refusals the edge makes itself (invalid, unauthorized, rate limited, shed, a decision that did not
come in time) and the edge-side latencies never reach the ledger, so the edge appends this record for
every request to an admission route, refused or not, when its response has ended. It carries ids,
codes and durations only: no prompt or output text, no token content, no bearer credential, and the
user only as an opaque digest (``user_ref``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Any, Literal

import orjson
from pydantic import TypeAdapter, ValidationError

from schemas.codes import CancelReason, RejectionCode, RequestStatus

OUTCOME_SCHEMA_VERSION = 1
# Digest size of ``user_ref`` (bytes): enough to tell users apart in a report, not an id to look up.
USER_REF_DIGEST_BYTES = 8


def user_ref(user_id: str, key: str = "") -> str:
    """The opaque reference an outcome record carries instead of the user id ("" when unauthenticated).

    Keyed (the edge passes its fingerprint key), so a guessed user id cannot be checked against it
    without the key; the same user gets the same reference within a deployment."""
    if not user_id:
        return ""
    mac_key = hashlib.sha256(key.encode()).digest()
    return hashlib.blake2b(
        user_id.encode(), digest_size=USER_REF_DIGEST_BYTES, key=mac_key, person=b"chatplane-slo"
    ).hexdigest()


class OutcomeRoute(StrEnum):
    """The admission route the request came to."""

    GENERATIONS = "generations"  # POST /v1/generations
    CHAT_COMPLETIONS = "chat_completions"  # POST /v1/chat/completions


class AdmissionResult(StrEnum):
    """What the edge answered the admission with (``code`` says which refusal)."""

    ADMITTED = "admitted"  # a new generation was admitted by the processor
    EXISTING = "existing"  # a same-key retry named existing work (its state or result was served)
    REFUSED = "refused"  # a typed refusal (``code``), by the edge or by the processor
    NONE = "none"  # no typed answer: the client left first, or the edge hit a bug (``http_status`` 503/499)


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeOutcome:
    """One admission request as the edge answered it. Durations are milliseconds on the edge's
    monotonic clock, from the moment the request reached the edge's application (``received_at_ms``,
    wall clock, is the same moment)."""

    type: Literal["EdgeOutcome"] = "EdgeOutcome"
    schema_version: int = OUTCOME_SCHEMA_VERSION
    request_id: str  # the X-Request-Id the client got
    edge_id: str  # the edge process (new at every start)
    route: OutcomeRoute
    user_ref: str  # user_ref(user id, the edge's fingerprint key); "" when the request was not authenticated
    generation_id: str  # "" when no generation was named (refused before the processor, or by it)
    stream: bool | None  # None when the body was not read (refused before it was parsed)
    result: AdmissionResult
    # The refusal's code (result refused), or, for an admitted generation, the code it failed with.
    code: RejectionCode | None
    http_status: int
    received_at_ms: int
    # Received -> the typed decision (admitted, existing, or the refusal); None when none was made.
    decision_ms: float | None
    # Received -> the first text delta forwarded to the client (seed: admission, queueing, prefill);
    # None when no text came (refused, failed before any token, or an empty answer).
    ttft_ms: float | None
    total_ms: float  # received -> the response's end
    # An admitted generation's end as this edge saw it: completed, cancelled or failed; None when the
    # reader left before the end (the generation is then detached; the ledger has its end).
    final_status: RequestStatus | None
    # Why this edge stopped the generation itself (client_disconnect, slow_consumer, drain); None otherwise.
    cancel_reason: CancelReason | None


EdgeOutcome.__pydantic_config__ = {"extra": "forbid"}  # type: ignore[attr-defined]
# Largest outcome record accepted (one is a few hundred bytes).
OUTCOME_BYTES_MAX = 4 * 1024


@cache
def _adapter() -> TypeAdapter[EdgeOutcome]:
    return TypeAdapter(EdgeOutcome)


def outcome_json_schema() -> dict[str, Any]:
    """The OUTCOMES topic's record, for readers in other languages (``schemas.export``)."""
    schema = _adapter().json_schema()
    schema["description"] = (
        "One record per admission request on the chatplane.outcomes topic (key: request_id), appended by "
        "the edge when the response ended; ids, codes and durations only. " + (schema.get("description") or "")
    ).strip()
    return schema


def outcome_from_dict(doc: dict[str, Any]) -> EdgeOutcome:
    """Validate a parsed outcome record (``ValueError`` naming the reason otherwise)."""
    if doc.get("type") != "EdgeOutcome":
        raise ValueError(f"not an EdgeOutcome: type {doc.get('type')!r}"[:120])
    version = doc.get("schema_version", 1)
    if version != OUTCOME_SCHEMA_VERSION:
        raise ValueError(f"unsupported EdgeOutcome schema_version {version!r}"[:120])
    try:
        return _adapter().validate_python(doc)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        raise ValueError(f"invalid field {'.'.join(str(p) for p in first['loc'])}: {first['msg']}"[:200]) from None


def decode_outcome(data: bytes | str) -> EdgeOutcome:
    if len(data) > OUTCOME_BYTES_MAX:
        raise ValueError(f"outcome record of {len(data)} bytes exceeds {OUTCOME_BYTES_MAX}")
    return outcome_from_dict(orjson.loads(data))
