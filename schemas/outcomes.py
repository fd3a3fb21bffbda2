"""Edge outcomes: one content-free ``EdgeOutcome`` per admission request, on the ``outcomes`` topic.

Where this sits (docs/slo.md)::

    client --POST /v1/generations, /v1/chat/completions--> edge --EdgeOutcomeBatch(key edge_id)--> OUTCOMES
                                                                                         |
    processor, workers --LedgerEntry--> LEDGER ----------------------------------------+--> projections.reports.slo

Refusals the edge makes itself (invalid, unauthorized, rate limited, shed, a decision that did not
come in time) and the edge-side latencies never reach the ledger, so the edge records an outcome for
every request to an admission route, refused or not, when its response has ended. It carries ids,
codes and durations only: no prompt or output text, no token content, no bearer credential, and the
user only as an opaque digest (``user_ref``).

The edge sends its buffered outcomes together: one ``EdgeOutcomeBatch`` record per flush (at most
``CHATPLANE_EDGE_OUTCOMES_PER_RECORD_MAX`` outcomes and ``OUTCOME_BATCH_BYTES_MAX`` bytes each), not
one record per request. Records written before the batch, one bare ``EdgeOutcome`` each (key
request_id), may still be in the topic: ``decode_outcomes`` reads both forms.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import Field, TypeAdapter, ValidationError

from schemas.codes import CancelReason, RejectionCode, RequestStatus

OUTCOME_SCHEMA_VERSION = 1
OUTCOME_BATCH_SCHEMA_VERSION = 1
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


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeOutcomeBatch:
    """One record on the outcomes topic: the outcomes one edge sent together (one flush of its buffer,
    split when over ``CHATPLANE_EDGE_OUTCOMES_PER_RECORD_MAX`` or ``OUTCOME_BATCH_BYTES_MAX``), in the
    order their responses ended. Each outcome is complete on its own (it names its edge)."""

    type: Literal["EdgeOutcomeBatch"] = "EdgeOutcomeBatch"
    schema_version: int = OUTCOME_BATCH_SCHEMA_VERSION
    outcomes: tuple[EdgeOutcome, ...]


EdgeOutcome.__pydantic_config__ = {"extra": "forbid"}  # type: ignore[attr-defined]
EdgeOutcomeBatch.__pydantic_config__ = {"extra": "forbid"}  # type: ignore[attr-defined]
# Largest outcome accepted (one is about 300 to 550 bytes encoded), alone in a record of the old form
# or as one of a batch's.
OUTCOME_BYTES_MAX = 4 * 1024
# Largest batch record accepted, and the size past which the edge splits a batch in two: Kafka's default
# limit on one record (the broker's message.max.bytes and the producer's max_request_size, 1 MiB) less
# room for the record's own overhead.
OUTCOME_BATCH_BYTES_MAX = 1024 * 1024 - 16 * 1024
# A default of outcomes per batch record that fits OUTCOME_BATCH_BYTES_MAX even if every outcome took
# OUTCOME_BYTES_MAX: 200 x 4 KiB = 800 KiB (about 100 KiB in practice).
OUTCOMES_PER_RECORD_DEFAULT = 200


@cache
def _adapter() -> TypeAdapter[EdgeOutcome]:
    return TypeAdapter(EdgeOutcome)


@cache
def _record_adapter() -> TypeAdapter[Any]:
    return TypeAdapter(Annotated[Union[EdgeOutcomeBatch, EdgeOutcome], Field(discriminator="type")])


def outcome_json_schema() -> dict[str, Any]:
    """The OUTCOMES topic's record, either form, for readers in other languages (``schemas.export``)."""
    schema = _record_adapter().json_schema()
    schema["description"] = (
        "A record on the chatplane.outcomes topic: an EdgeOutcomeBatch (key: edge_id), the admission "
        "requests' outcomes one edge sent together, or, in records written before batches, one EdgeOutcome "
        "(key: request_id). An EdgeOutcome is appended by the edge when the response ended; ids, codes and "
        "durations only."
    )
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
    """One outcome in the old form (a bare ``EdgeOutcome`` record)."""
    if len(data) > OUTCOME_BYTES_MAX:
        raise ValueError(f"outcome record of {len(data)} bytes exceeds {OUTCOME_BYTES_MAX}")
    return outcome_from_dict(orjson.loads(data))


def outcomes_from_dict(doc: dict[str, Any]) -> list[EdgeOutcome]:
    """The outcomes of a parsed outcomes-topic record of either form (``ValueError`` otherwise)."""
    kind = doc.get("type")
    if kind == "EdgeOutcome":
        return [outcome_from_dict(doc)]
    if kind != "EdgeOutcomeBatch":
        raise ValueError(f"not an EdgeOutcomeBatch or EdgeOutcome: type {kind!r}"[:120])
    version = doc.get("schema_version", 1)
    if version != OUTCOME_BATCH_SCHEMA_VERSION:
        raise ValueError(f"unsupported EdgeOutcomeBatch schema_version {version!r}"[:120])
    if set(doc) - {"type", "schema_version", "outcomes"}:
        raise ValueError(f"unexpected field in EdgeOutcomeBatch: {sorted(set(doc) - {'type', 'schema_version', 'outcomes'})[0]}"[:120])
    items = doc.get("outcomes")
    if not isinstance(items, list):
        raise ValueError("field outcomes is not a list")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"outcomes.{i} is not a JSON object")
        try:
            out.append(outcome_from_dict(item))
        except ValueError as exc:
            raise ValueError(f"outcomes.{i}: {exc}"[:200]) from None
    return out


def decode_outcomes(data: bytes | str) -> list[EdgeOutcome]:
    """The outcomes of one outcomes-topic record: an ``EdgeOutcomeBatch``, or one ``EdgeOutcome`` in
    the old form (records written before batches)."""
    if len(data) > OUTCOME_BATCH_BYTES_MAX:
        raise ValueError(f"outcome record of {len(data)} bytes exceeds {OUTCOME_BATCH_BYTES_MAX}")
    doc = orjson.loads(data)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("type") == "EdgeOutcome":
        return [decode_outcome(data)]
    return outcomes_from_dict(doc)


def encode_outcomes(outcomes: Sequence[EdgeOutcome]) -> bytes:
    """One batch record of ``outcomes`` (the writer splits a list whose record would exceed
    ``OUTCOME_BATCH_BYTES_MAX``)."""
    return orjson.dumps(EdgeOutcomeBatch(outcomes=tuple(outcomes)))
