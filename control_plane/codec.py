"""Bytes for the processor's table value: the ``Aggregate`` of one user, as orjson JSON.

Encoding is orjson's native dataclass serialization (one pass in Rust, on every command). Decoding
rebuilds the typed frozen values; it runs only when a value is first read after a recovery or a
rebalance, so it favours exactness over speed (embedded events go through ``schemas.wire``).
"""

from __future__ import annotations

from typing import Any

import orjson

from control_plane.aggregate import Aggregate, Remembered
from control_plane.state import Attempt, QuotaWindow, RequestRecord, Reservation, UsageEntry, UserLedger
from schemas.codes import CancelReason, RejectionCode, RequestStatus, ReservationState, Tier
from schemas.commands import ReplyTo

STATE_CODEC_VERSION = 1
_OPTIONS = orjson.OPT_NON_STR_KEYS


def dump_aggregate(aggregate: Aggregate) -> bytes:
    # Remembered decisions are already JSON: embedded as fragments, never re-serialized.
    recent = [[r.command_id, orjson.Fragment(r.encoded)] for r in aggregate.recent]
    return orjson.dumps(
        {"v": STATE_CODEC_VERSION, "ledger": aggregate.ledger, "recent": recent, "offset": aggregate.source_offset},
        option=_OPTIONS,
    )


def load_aggregate(data: bytes) -> Aggregate:
    doc = orjson.loads(data)
    if doc.get("v") != STATE_CODEC_VERSION:
        raise ValueError(f"unsupported state codec version {doc.get('v')!r}")
    recent = tuple(Remembered(command_id, orjson.dumps(d)) for command_id, d in doc["recent"])
    return Aggregate(load_ledger(doc["ledger"]), recent, doc.get("offset", -1))


def _reply_to(d: dict[str, Any] | None) -> ReplyTo | None:
    return None if d is None else ReplyTo(**d)


def _attempt(d: dict[str, Any] | None) -> Attempt | None:
    if d is None:
        return None
    reason = d["cancel_reason"]
    return Attempt(**{**d, "cancel_reason": None if reason is None else CancelReason(reason)})


def load_record(d: dict[str, Any]) -> RequestRecord:
    """A ``RequestRecord`` from its decoded JSON document."""
    code = d["code"]
    detach_reason = d.get("detach_reason")
    return RequestRecord(
        **{
            **d,
            "tier": Tier(d["tier"]),
            "status": RequestStatus(d["status"]),
            "attempt": _attempt(d["attempt"]),
            "code": None if code is None else RejectionCode(code),
            "reply_to": _reply_to(d["reply_to"]),
            "detach_reason": None if detach_reason is None else CancelReason(detach_reason),
        }
    )


def load_ledger(d: dict[str, Any]) -> UserLedger:
    """A ``UserLedger`` from its decoded JSON document."""
    return UserLedger(
        user_id=d["user_id"],
        requests={k: load_record(v) for k, v in d["requests"].items()},
        by_generation=dict(d["by_generation"]),
        windows={int(k): QuotaWindow(**v) for k, v in d["windows"].items()},
        reservations={
            k: Reservation(**{**v, "state": ReservationState(v["state"])}) for k, v in d["reservations"].items()
        },
        slots={int(k): v for k, v in d["slots"].items()},
        usage={k: UsageEntry(**v) for k, v in d["usage"].items()},
        last_event_ms=d["last_event_ms"],
        open_windows_from_ms=d.get("open_windows_from_ms", 0),
    )
