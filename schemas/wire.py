"""Bytes on the wire: orjson encoding, validation at the boundary, upcasting of older versions.

Every wire object is a frozen dataclass with a ``type`` discriminator and a ``schema_version``.
``encode`` writes it with orjson; ``decode_*`` parse and validate bytes into the typed object (or raise
``WireError`` with the reason, which the processor sends to the dead-letter topic). Older schema
versions are upgraded by the functions registered in ``UPCASTERS`` before validation, so a ledger
written years ago still reads.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, TypeVar, Union

import orjson
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from schemas.commands import COMMAND_TYPES, Command
from schemas.events import EVENT_TYPES, Event, LedgerEntry
from schemas.messages import MESSAGE_TYPES

T = TypeVar("T")

# Largest command or ledger entry accepted; a bigger one is dead-lettered, never parsed.
WIRE_MESSAGE_BYTES_MAX = 64 * 1024
# Largest message between edge and workers (a prompt payload carries a request body of <= 256 KiB).
WIRE_CONTENT_MESSAGE_BYTES_MAX = 1024 * 1024

_STRICT = ConfigDict(extra="forbid")
for _cls in (*COMMAND_TYPES, *EVENT_TYPES, *MESSAGE_TYPES, LedgerEntry):
    _cls.__pydantic_config__ = _STRICT  # type: ignore[attr-defined]


class WireError(ValueError):
    """A message that cannot be decoded or validated; ``reason`` is safe to log (no content)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# (type name, schema_version) -> function upgrading a decoded dict by one version.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(type_name: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    def register(fn: Upcaster) -> Upcaster:
        UPCASTERS[(type_name, from_version)] = fn
        return fn

    return register


# Every deployment before v2 of GenerationAdmitted used fixed 3-hour windows.
_V1_WINDOW_MS = 3 * 3600 * 1000


@upcaster("GenerationAdmitted", 1)
def _admitted_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    doc.setdefault("window_end_ms", doc["window_start_ms"] + _V1_WINDOW_MS)
    return doc


@upcaster("GenerationAdmitted", 2)
def _admitted_v2_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    # Before readers were named no generation was detached when its edge died.
    doc.setdefault("reader_id", "")
    return doc


@upcaster("AdmissionRejected", 1)
def _rejected_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    # Unknown for v1 records: a same-key retry resolves the pool from the current catalog (decide).
    doc.setdefault("pool", "")
    return doc


@upcaster("AdmissionRejected", 2)
def _rejected_v2_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    # Before decision deadlines no refusal was for a submit read too late.
    doc.setdefault("read_at_ms", 0)
    doc.setdefault("decide_by_ms", 0)
    return doc


def _union(types: tuple[type, ...]) -> TypeAdapter[Any]:
    return TypeAdapter(Annotated[Union[types], Field(discriminator="type")])  # type: ignore[valid-type]


_COMMANDS: TypeAdapter[Command] = _union(COMMAND_TYPES)
_EVENTS: TypeAdapter[Event] = _union(EVENT_TYPES)
_MESSAGES: TypeAdapter[Any] = _union(MESSAGE_TYPES)
_LEDGER_ENTRY: TypeAdapter[LedgerEntry] = TypeAdapter(LedgerEntry)
_VERSIONS = {
    cls.__name__: cls.__dataclass_fields__["schema_version"].default
    for cls in (*COMMAND_TYPES, *EVENT_TYPES, *MESSAGE_TYPES, LedgerEntry)
}


def encode(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _upcast(doc: Any) -> Any:
    if not isinstance(doc, dict):
        raise WireError("not a JSON object")
    name = doc.get("type")
    current = _VERSIONS.get(name) if isinstance(name, str) else None
    if current is None:
        raise WireError(f"unknown type {name!r}"[:120])
    version = doc.get("schema_version", 1)
    if not isinstance(version, int) or version < 1 or version > current:
        raise WireError(f"unsupported schema_version {version!r} for {name}"[:120])
    while version < current:
        step = UPCASTERS.get((name, version))
        if step is None:
            raise WireError(f"no upcaster for {name} v{version}")
        doc = step(dict(doc))
        version += 1
        doc["schema_version"] = version
    return doc


def _decode(
    adapter: TypeAdapter[T], data: bytes | str, nested: str | None = None, max_bytes: int = WIRE_MESSAGE_BYTES_MAX
) -> T:
    if len(data) > max_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"invalid JSON at position {exc.pos}") from None
    doc = _upcast(doc)
    if nested is not None:
        items = doc.get(nested)
        if not isinstance(items, list):
            raise WireError(f"field {nested} is not a list")
        doc[nested] = [_upcast(item) for item in items]
    try:
        return adapter.validate_python(doc)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise WireError(f"invalid field {where}: {first['msg']}"[:200]) from None


def decode_command(data: bytes | str) -> Command:
    return _decode(_COMMANDS, data)


def decode_event(data: bytes | str) -> Event:
    return _decode(_EVENTS, data)


def decode_ledger_entry(data: bytes | str) -> LedgerEntry:
    return _decode(_LEDGER_ENTRY, data, nested="events")


def decode_message(data: bytes | str) -> Any:
    return _decode(_MESSAGES, data, max_bytes=WIRE_CONTENT_MESSAGE_BYTES_MAX)


@cache
def json_schemas() -> dict[str, Any]:
    """JSON Schema of every wire type, for readers in other languages (exported into docs/)."""
    return {
        "commands": _COMMANDS.json_schema(),
        "ledger_events": _EVENTS.json_schema(),
        "messages": _MESSAGES.json_schema(),
        "ledger_entry": _LEDGER_ENTRY.json_schema(),
    }


def event_from_dict(doc: dict[str, Any]) -> Event:
    """Validate an already-parsed event (for containers that embed events, such as stored state)."""
    return _EVENTS.validate_python(_upcast(doc))


def message_from_dict(doc: dict[str, Any]) -> Any:
    return _MESSAGES.validate_python(_upcast(doc))
