"""The per-user ledger aggregate: the seed's records (section 6) as frozen values.

``UserLedger`` is one table value per user. It is changed only by ``control_plane.evolve`` and read
by ``control_plane.decide``. Containers are plain dicts treated as immutable: ``evolve`` copies the
ones it changes, so a state value handed out is never mutated afterwards.

Mapping onto the seed's records:

- Request ``(user_id, idempotency_key)`` -> ``RequestRecord`` in ``requests``.
- Worker ownership (epoch, owner, lease deadline, cancel intent) -> ``RequestRecord.attempt``.
- Quota window ``(user_id, window_start)`` -> ``QuotaWindow`` in ``windows``.
- Reservation -> ``Reservation`` in ``reservations`` while it is RESERVED; once consumed or released
  it is dropped and counted in its window (``QuotaWindow.used`` / ``released``), so the hot value
  does not grow with the requests of a window (the event history keeps every reservation).
- Concurrency slots -> ``slots`` (slot index -> generation id).
- Usage record ``(generation, epoch)`` -> ``UsageEntry`` in ``usage``.
- The generation's reader (the edge holding the client) and a pending detach -> ``RequestRecord``.
- Keyless requests' fingerprints, so that a client's automatic retries attach -> ``retry_fingerprints``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from schemas.codes import CancelReason, RejectionCode, RequestStatus, ReservationState, Tier
from schemas.commands import ReplyTo


@dataclass(frozen=True, slots=True)
class Attempt:
    """Ownership of the current attempt of a generation."""

    epoch: int
    owner_worker_id: str | None  # None while queued (dispatched, not accepted)
    queue_deadline_ms: int
    reconcile_deadline_ms: int
    lease_deadline_ms: int = 0  # 0 until accepted
    run_deadline_ms: int = 0
    cancel_reason: CancelReason | None = None  # cancel intent; not yet confirmed
    output_tokens_reported: int = 0
    # The window this epoch's reservation is charged to; kept here because a long generation can
    # outlive its window's retirement (which drops the reservation) and its usage still names it.
    window_start_ms: int = 0
    # The epoch's token reservation (input + max output), held from admission until its usage
    # record settles it (or its release, if it never started); 0 once settled, or before budgets.
    tokens_reserved: int = 0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    idempotency_key: str
    fingerprint: str
    generation_id: str
    model_alias: str
    model_version: str
    pool: str
    tier: Tier
    stream: bool
    max_output_tokens: int
    input_tokens: int
    status: RequestStatus
    epoch: int  # the latest epoch dispatched; 0 if never dispatched
    fenced_epoch: int  # every epoch <= this can never accept
    created_at_ms: int
    updated_at_ms: int
    attempt: Attempt | None = None
    code: RejectionCode | None = None  # rejection or failure code of the latest transition
    terminal_at_ms: int = 0
    result_expires_at_ms: int = 0
    reset_at_ms: int = 0  # for a quota rejection: the end of the window it was refused in
    reply_to: ReplyTo | None = None
    # The edge process holding the client's connection ("" = none named), and, while no reader is
    # attached, when the timer cancels the generation and with which reason (0 / None: attached).
    reader_id: str = ""
    detached_until_ms: int = 0
    detach_reason: CancelReason | None = None
    conversation_id: str = ""  # the conversation this generation answers a turn of ("" = stateless)
    # The revision the turn committed at (``ConversationTurnCommitted.revision``; its answer commits
    # at the next one): a same-key retry of the turn answers with it, as its first answer did. 0 for
    # a stateless request and for records stored before it was kept (then answered without it).
    turn_revision: int = 0
    terminal_sequence: int = 0  # the terminal event's sequence (its SSE id); 0: after the last stored delta
    refusal_kind: str = ""  # for a quota refusal: "tokens" when the token budget refused ("" = messages)
    token_limit: int = 0  # for a token refusal: the budget that applied


@dataclass(frozen=True, slots=True)
class QuotaWindow:
    window_start_ms: int
    window_end_ms: int
    limit: int
    used: int = 0  # reservations consumed in this window
    reserved: int = 0  # reservations still RESERVED (each one is in ``UserLedger.reservations``)
    released: int = 0  # reservations released in this window
    # Token budget (docs/core.md, "Token budget"): 0 = none for this window's tier. Tokens are
    # counted even without a budget (``GET /v1/usage``); the budget only refuses when it is set.
    token_limit: int = 0
    tokens_used: int = 0  # settled: billable tokens of the usage records charged here
    tokens_reserved: int = 0  # held by attempts not yet settled (each one's ``Attempt.tokens_reserved``)
    tokens_overshoot: int = 0  # the part of ``tokens_used`` charged above its reservations (bounded per attempt)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A RESERVED reservation. Settling one removes it from the state (see ``QuotaWindow``)."""

    reservation_id: str
    generation_id: str
    epoch: int
    window_start_ms: int
    state: ReservationState
    reconcile_deadline_ms: int


@dataclass(frozen=True, slots=True)
class UsageEntry:
    input_tokens: int
    output_tokens: int  # generated
    terminal_reason: str
    requested_output_tokens: int = 0
    delivered_tokens: int = 0
    billable_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Conversation:
    """What decisions need of one conversation (docs/conversations.md): never its text or title.

    ``in_flight`` is the generation of the turn being answered ("" = none); the answer commits at
    ``turn_revision + 1``. ``answer_pending``: the generation ended with a spooled answer not yet
    stored; ``answer_stored``: the writer stored it before the end reached the ledger.
    """

    revision: int
    updated_at_ms: int
    in_flight: str = ""
    turn_revision: int = 0
    regenerate: bool = False
    answer_pending: bool = False
    answer_stored: bool = False
    # While ``answer_pending``: the ended attempt's epoch and how it ended ("completed"/"incomplete").
    pending_epoch: int = 0
    pending_status: str = ""


# Fingerprints of keyless requests a user's state remembers at once (``UserLedger.retry_fingerprints``).
# A client's automatic retries come within seconds of their first try, and a user runs at most its
# concurrency limit of generations at a time, so only the newest few entries are ever matched; past
# the bound the one whose window ends first leaves, which can only cost a late retry its attach
# (it is then admitted as a new request, as before retries were matched). ~150 bytes each.
RETRY_FINGERPRINTS_PER_USER_MAX = 32


@dataclass(frozen=True, slots=True)
class RetryFingerprint:
    """The newest generation admitted for one fingerprint of a keyless request (``RetryAttach``)."""

    generation_id: str
    attach_until_ms: int  # a try issued at or after this is a new request (the attach window ended)
    # Admitted for a retry that matched nothing: its first try may still be read after it (the edge
    # appended the two out of order), and attaches to it then, once.
    awaiting_original: bool = False


@dataclass(frozen=True, slots=True)
class UserLedger:
    user_id: str
    requests: dict[str, RequestRecord] = field(default_factory=dict)
    # generation_id -> idempotency_key; derived from ``requests``, kept for O(1) look-ups.
    by_generation: dict[str, str] = field(default_factory=dict)
    windows: dict[int, QuotaWindow] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    slots: dict[int, str] = field(default_factory=dict)
    usage: dict[str, UsageEntry] = field(default_factory=dict)  # "<generation_id>/<epoch>" -> usage
    last_event_ms: int = 0
    # Admission never charges a window that starts before this: every earlier window was retired
    # (its counters dropped), so a late command stamped inside one is charged to a later window.
    open_windows_from_ms: int = 0
    # Conversations in the hot state (bounded by ``Policy.conversations_hot_max``; idle ones are parked
    # out of it) and deleted ones' tombstones (conversation id -> when it was deleted).
    conversations: dict[str, Conversation] = field(default_factory=dict)
    conversation_tombstones: dict[str, int] = field(default_factory=dict)
    # Keyless requests' fingerprints -> the newest generation admitted for each, within its attach
    # window (at most ``RETRY_FINGERPRINTS_PER_USER_MAX``; an entry past its window is never matched
    # and leaves at the user's next admission that remembers one).
    retry_fingerprints: dict[str, RetryFingerprint] = field(default_factory=dict)

    def record_of(self, generation_id: str) -> RequestRecord | None:
        key = self.by_generation.get(generation_id)
        return None if key is None else self.requests.get(key)


def retained_until_ms(record: RequestRecord, dedup_retention_ms: int) -> int | None:
    """When a settled request record may be forgotten; ``None`` while it is active (never forgotten).

    A terminal record is kept ``dedup_retention_ms`` after it became terminal, an admission-retryable
    one (settled but not terminal) as long after its latest change. The one definition of the
    retention, used by ``decide`` (purges, the bound's refusal) and by the invariant monitor.
    ``decide._reconcile`` and ``decide.next_deadline_ms`` inline the same rule in their scan over every
    record (a call per record was most of a ``ReconcileDue``); the monitor, which calls this function,
    reports a purge that diverges from it (invariant 7).
    """
    if record.status.active:
        return None
    settled_at = record.terminal_at_ms if record.status.terminal else record.updated_at_ms
    return settled_at + dedup_retention_ms


def usage_key(generation_id: str, epoch: int) -> str:
    return f"{generation_id}/{epoch}"


def reservation_id(generation_id: str, epoch: int) -> str:
    return f"{generation_id}.{epoch}"


_T = TypeVar("_T")
_FIELDS: dict[type, tuple[tuple[str, ...], frozenset[str]]] = {}
_set = object.__setattr__


def with_changes(obj: _T, /, **changes: Any) -> _T:
    """``dataclasses.replace`` for the frozen, slotted state values, without its generic machinery.

    ``evolve`` rebuilds a record, an attempt or the ledger a few times per event, and
    ``dataclasses.replace`` (keyword arguments rebuilt, ``__init__`` called, every field checked) was
    the largest single cost of ``handle`` in bench/bench_core.py's profile. These classes have no
    ``__post_init__`` and no init-only fields, so copying the fields gives the same value.
    """
    cls = type(obj)
    known = _FIELDS.get(cls)
    if known is None:
        names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
        known = _FIELDS[cls] = (names, frozenset(names))
    names, name_set = known
    if not name_set.issuperset(changes):
        raise TypeError(f"{cls.__name__} has no field {sorted(set(changes) - name_set)[0]!r}")
    new = object.__new__(cls)
    for name in names:
        _set(new, name, changes[name] if name in changes else getattr(obj, name))
    return new
