"""Bytes for the processor's table value: the ``Aggregate`` of one user, as orjson JSON.

Encoding is orjson's native dataclass serialization (one pass in Rust, on every command). Decoding
rebuilds the typed frozen values; it runs only when a value is first read after a recovery or a
rebalance, so it favours exactness over speed (embedded events go through ``schemas.wire``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from control_plane.aggregate import Aggregate, Remembered
from control_plane.state import (
    Attempt,
    Conversation,
    QuotaWindow,
    RequestRecord,
    Reservation,
    RetryFingerprint,
    UsageEntry,
    UserLedger,
    reservation_id,
)
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


def _fold_settled(d: dict[str, Any]) -> tuple[dict[int, QuotaWindow], dict[str, Reservation]]:
    """Windows and RESERVED reservations; settled ones of an older stored state become counters.

    States written before settled reservations left the hot value (2026-12-05) kept every consumed
    and released reservation of a retained window beside the window's ``used`` and ``reserved``
    counters (``used`` already counted the consumed ones); their ``released`` count is taken from the
    released ones, and every settled reservation is dropped.
    """
    released: dict[int, int] = {}
    reservations: dict[str, Reservation] = {}
    for key, v in d["reservations"].items():
        state = ReservationState(v["state"])
        if state is ReservationState.RESERVED:
            reservations[key] = Reservation(
                v["reservation_id"], v["generation_id"], v["epoch"], v["window_start_ms"], state, v["reconcile_deadline_ms"]
            )
        elif state is ReservationState.RELEASED:
            released[v["window_start_ms"]] = released.get(v["window_start_ms"], 0) + 1
    windows = {}
    for key, v in d["windows"].items():
        start = int(key)
        windows[start] = QuotaWindow(**{**v, "released": v.get("released", released.get(start, 0))})
    return windows, reservations


def load_ledger(d: dict[str, Any]) -> UserLedger:
    """A ``UserLedger`` from its decoded JSON document."""
    windows, reservations = _fold_settled(d)
    requests = {k: load_record(v) for k, v in d["requests"].items()}
    for key, record in requests.items():
        attempt = record.attempt
        if attempt is not None and attempt.window_start_ms == 0:
            # An attempt written before it named its window (2026-12-02): its reservation does.
            held = d["reservations"].get(reservation_id(record.generation_id, attempt.epoch))
            if held is not None:
                requests[key] = replace(record, attempt=replace(attempt, window_start_ms=held["window_start_ms"]))
    return UserLedger(
        user_id=d["user_id"],
        requests=requests,
        by_generation=dict(d["by_generation"]),
        windows=windows,
        reservations=reservations,
        slots={int(k): v for k, v in d["slots"].items()},
        usage={k: UsageEntry(**v) for k, v in d["usage"].items()},
        last_event_ms=d["last_event_ms"],
        open_windows_from_ms=d.get("open_windows_from_ms", 0),
        # Absent from values stored before conversations (2026-12-05).
        conversations={k: Conversation(**v) for k, v in d.get("conversations", {}).items()},
        conversation_tombstones=dict(d.get("conversation_tombstones", {})),
        # Absent from values stored before keyless retries were matched: nothing remembered.
        retry_fingerprints={k: RetryFingerprint(**v) for k, v in d.get("retry_fingerprints", {}).items()},
    )
