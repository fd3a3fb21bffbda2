"""The ledger invariants of the design reference, defined once.

Imported by the unit and property tests, the seeded simulator and the audit tool. Two kinds of check:

- ``check_state(state)``: what must hold of any per-user state (invariants 1, 2, 6, 7).
- ``InvariantMonitor``: what must hold of a history of events, checked one event at a time while
  folding the events into state (invariants 3, 4, 5, 7, 8, 9, plus event-id uniqueness).

They return ``Violation`` values instead of raising, so the auditor can report every violation of a
damaged ledger with its event id; tests and the simulator fail on the first one.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from control_plane.evolve import billable_of, evolve
from control_plane.state import RETRY_FINGERPRINTS_PER_USER_MAX, UserLedger, reservation_id, retained_until_ms
from schemas import events as ev
from schemas.codes import ReservationState, SlotReleaseReason
from schemas.wire import encode


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: int  # its number in the design's list of invariants; 0 for event-id uniqueness
    message: str
    user_id: str
    event_id: str | None = None

    def __str__(self) -> str:
        where = f" at {self.event_id}" if self.event_id else ""
        return f"invariant {self.invariant} ({self.user_id}){where}: {self.message}"


def check_state(state: UserLedger, concurrency_limit: int | None = None, event_id: str | None = None) -> list[Violation]:
    found: list[Violation] = []
    user = state.user_id

    def bad(invariant: int, message: str) -> None:
        found.append(Violation(invariant, message, user, event_id))

    held: Counter[int] = Counter(r.window_start_ms for r in state.reservations.values())
    tokens_held: Counter[int] = Counter()
    for record in state.requests.values():
        attempt = record.attempt
        if attempt is not None and attempt.tokens_reserved:
            tokens_held[attempt.window_start_ms] += attempt.tokens_reserved
    for start, window in state.windows.items():
        # Invariant 11: the token budget. Overshoot (a report above its reservation, bounded per
        # attempt by the policy) is charged in full, so it is the only way past the budget.
        if window.token_limit and window.tokens_used + window.tokens_reserved > window.token_limit + window.tokens_overshoot:
            bad(
                11,
                f"window {start}: tokens used {window.tokens_used} + reserved {window.tokens_reserved} > budget "
                f"{window.token_limit} + overshoot {window.tokens_overshoot}",
            )
        if window.tokens_used < 0 or window.tokens_reserved < 0 or window.tokens_overshoot < 0:
            bad(11, f"window {start}: negative token counter used={window.tokens_used} reserved={window.tokens_reserved}")
        if window.tokens_reserved != tokens_held[start]:
            bad(12, f"window {start}: tokens reserved={window.tokens_reserved} but attempts hold {tokens_held[start]}")
        if window.used + window.reserved > window.limit:
            bad(1, f"window {start}: used {window.used} + reserved {window.reserved} > limit {window.limit}")
        if window.used < 0 or window.reserved < 0 or window.released < 0:
            bad(1, f"window {start}: negative counter used={window.used} reserved={window.reserved} released={window.released}")
        if window.reserved != held[start]:
            bad(2, f"window {start}: counter reserved={window.reserved} but {held[start]} reservations held")
    for reservation in state.reservations.values():
        if reservation.state is not ReservationState.RESERVED:
            bad(2, f"reservation {reservation.reservation_id} is {reservation.state} but still held")
        if reservation.window_start_ms not in state.windows:
            bad(2, f"reservation {reservation.reservation_id} references a retired window")
    if concurrency_limit is not None and len(state.slots) > concurrency_limit:
        bad(6, f"{len(state.slots)} slots held > limit {concurrency_limit}")
    holders = Counter(state.slots.values())
    for generation_id, n in holders.items():
        if n > 1:
            bad(6, f"{generation_id} holds {n} slots")
        record = state.record_of(generation_id)
        if record is None or not record.status.active:
            bad(6, f"slot held by {generation_id}, which is not active")
    for record in state.requests.values():
        if record.status.active and record.generation_id not in holders:
            bad(6, f"active generation {record.generation_id} holds no slot")
        if state.by_generation.get(record.generation_id) != record.idempotency_key:
            bad(7, f"generation {record.generation_id} is not identified by exactly one key")
    if len(state.by_generation) != len(state.requests):
        bad(7, "generation index and request records disagree")
    if len(state.retry_fingerprints) > RETRY_FINGERPRINTS_PER_USER_MAX:
        bad(7, f"{len(state.retry_fingerprints)} remembered fingerprints > bound {RETRY_FINGERPRINTS_PER_USER_MAX}")
    return found


@dataclass
class _History:
    """What the monitor remembers of one generation (bounded by the generations it has seen)."""

    model_version: str
    accepted_epoch: int = 0
    fenced_epoch: int = 0
    terminal_event: str | None = None
    usage_epochs: set[int] = field(default_factory=set)
    window_of_epoch: dict[int, int] = field(default_factory=dict)  # epoch -> window its reservation is in


@dataclass
class _ConversationHistory:
    """What the monitor remembers of one conversation (invariant 10)."""

    revision: int = 0
    deleted: bool = False
    in_flight: str = ""
    turn_revision: int = 0
    turns: set[str] = field(default_factory=set)  # generations that committed a turn here
    answered: set[str] = field(default_factory=set)  # generations whose answer committed here


_CONVERSATION_EVENTS = (
    ev.ConversationCreated,
    ev.ConversationTurnCommitted,
    ev.ConversationAnswerPending,
    ev.ConversationAnswerStored,
    ev.ConversationAnswerCommitted,
    ev.ConversationDeleted,
    ev.ConversationParked,
    ev.ConversationRestored,
    ev.ConversationForgotten,
)


@dataclass
class InvariantMonitor:
    concurrency_limit: int | None = None
    # The policy's dedup retention and records bound; with them the monitor also checks that no
    # request record is forgotten within its retention and that no new key is recorded past the bound
    # (invariant 7). Without them (a ledger audited without its policy) those two checks are skipped.
    dedup_retention_ms: int | None = None
    records_max: int | None = None
    states: dict[str, UserLedger] = field(default_factory=dict)
    _history: dict[str, _History] = field(default_factory=dict)
    _settled: dict[str, ReservationState] = field(default_factory=dict)
    _seen_ids: dict[str, bytes] = field(default_factory=dict)
    # (user, window start) -> [limit, reservations consumed, reservations released] so far. Outlives
    # the window's retirement, which drops the live counters but not the entitlement (invariant 1
    # across time). The state keeps only counters for settled reservations, so invariant 2's check of
    # ``used`` and ``released`` is against these counts from the event history.
    _window_spent: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    events_seen: int = 0
    duplicates_skipped: int = 0
    # (user, conversation) -> its history so far (invariant 10).
    _conversations: dict[tuple[str, str], _ConversationHistory] = field(default_factory=dict)
    # The policy's overshoot bound per attempt (tokens); None: not checked (a ledger audited without it).
    token_overshoot_max: int | None = None
    # Token reservations (invariant 12): reservation id -> (user, window, tokens) while unsettled, and
    # the ids settled so far; (user, window) -> [billable, overshoot] settled in it (invariant 13).
    _tokens_held: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    _tokens_settled: set[str] = field(default_factory=set)
    _window_tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)

    def unsettled_token_reservations(self) -> dict[str, tuple[str, int, int]]:
        """Token reservations admitted and not yet settled (none once every attempt has ended)."""
        return dict(self._tokens_held)

    def observe_batch(self, events: list[ev.Event] | tuple[ev.Event, ...]) -> list[Violation]:
        """Observe the events of one command (one atomic change), then check the states they touched.

        State invariants hold between commands, not between the events of one command (a slot is
        released one event before the terminal transition that justifies it).
        """
        found: list[Violation] = []
        users: dict[str, str] = {}
        for event in events:
            found.extend(self.observe(event))
            users[event.user_id] = event.event_id
        for user_id, last_event_id in users.items():
            found.extend(check_state(self.states[user_id], self.concurrency_limit, last_event_id))
            found.extend(self._check_counters(self.states[user_id], last_event_id))
        return found

    def _check_counters(self, state: UserLedger, event_id: str | None = None) -> list[Violation]:
        """Invariant 2 for settled reservations: each live window counts what the history settled in it."""
        found: list[Violation] = []
        for start, window in state.windows.items():
            _, consumed, released = self._window_spent.get((state.user_id, start), (0, 0, 0))
            if window.used != consumed or window.released != released:
                message = (
                    f"window {start}: counters used={window.used} released={window.released} but the history "
                    f"consumed={consumed} released={released}"
                )
                found.append(Violation(2, message, state.user_id, event_id))
            billable, overshoot = self._window_tokens.get((state.user_id, start), (0, 0))
            if window.tokens_used != billable or window.tokens_overshoot != overshoot:
                message = (
                    f"window {start}: tokens used={window.tokens_used} overshoot={window.tokens_overshoot} but its "
                    f"usage records charged {billable} (overshoot {overshoot})"
                )
                found.append(Violation(13, message, state.user_id, event_id))
        return found

    def observe(self, event: ev.Event) -> list[Violation]:
        """Check one event against the history so far, then fold it. Duplicates are skipped.

        State invariants are not checked here; see ``observe_batch`` and ``check_all_states``.
        """
        body = hashlib.blake2b(encode(event), digest_size=16).digest()
        previous = self._seen_ids.get(event.event_id)
        if previous is not None:
            self.duplicates_skipped += 1
            if previous != body:
                return [Violation(0, "event id reused with different content", event.user_id, event.event_id)]
            return []
        self._seen_ids[event.event_id] = body
        self.events_seen += 1
        found = self._check_history(event)
        state = self.states.get(event.user_id) or UserLedger(event.user_id)
        state = evolve(state, event)
        self.states[event.user_id] = state
        return found

    def check_all_states(self) -> list[Violation]:
        found: list[Violation] = []
        for state in self.states.values():
            found.extend(check_state(state, self.concurrency_limit))
            found.extend(self._check_counters(state))
        return found

    def _check_key(self, e: ev.Event, bad: Callable[[int, str], None]) -> None:
        """Invariant 7 on the user's request records: within retention a key names one generation."""
        state = self.states.get(e.user_id)
        if state is None:
            return
        if isinstance(e, (ev.GenerationAdmitted, ev.AdmissionRejected)):
            held = state.requests.get(e.idempotency_key)
            if held is not None and held.generation_id != e.generation_id:
                bad(7, f"key {e.idempotency_key} names {held.generation_id} and {e.generation_id} within retention")
            elif held is None and self.records_max is not None and len(state.requests) >= self.records_max:
                bad(7, f"new key {e.idempotency_key} recorded with {len(state.requests)} records held (bound {self.records_max})")
        elif isinstance(e, ev.DedupRecordPurged):
            held = state.requests.get(e.idempotency_key)
            if held is None:
                return
            if held.status.active:
                bad(7, f"key {e.idempotency_key} of active {held.generation_id} forgotten")
            elif self.dedup_retention_ms is not None:
                until = retained_until_ms(held, self.dedup_retention_ms)
                assert until is not None
                if e.occurred_at_ms < until:
                    early = until - e.occurred_at_ms
                    bad(7, f"key {e.idempotency_key} of {held.generation_id} forgotten {early} ms within its retention")

    def _check_conversation(self, e: ev.Event, bad: Callable[[int, str], None]) -> None:
        """Invariant 10: a conversation's revisions are contiguous; each turn and each answer commits
        once; at most one generation of it is in flight; nothing is appended to a deleted one."""
        key = (e.user_id, e.conversation_id)  # type: ignore[attr-defined]
        conv = self._conversations.get(key)
        name = e.conversation_id  # type: ignore[attr-defined]
        match e:
            case ev.ConversationCreated():
                if conv is not None and not conv.deleted:
                    bad(10, f"conversation {name} created twice")
                self._conversations[key] = _ConversationHistory()
            case ev.ConversationRestored():
                if conv is None:
                    # Parked before this history began (an audit of a retained suffix): take its word.
                    self._conversations[key] = _ConversationHistory(revision=e.revision)
                elif conv.deleted:
                    bad(10, f"deleted conversation {name} restored")
                elif e.revision != conv.revision:
                    bad(10, f"conversation {name} restored at {e.revision}, parked at {conv.revision}")
            case ev.ConversationTurnCommitted():
                if conv is None:
                    bad(10, f"turn {e.generation_id} committed to unknown conversation {name}")
                    return
                if conv.deleted:
                    bad(10, f"turn {e.generation_id} appended to deleted conversation {name}")
                if conv.in_flight:
                    bad(10, f"turn {e.generation_id} committed while {conv.in_flight} is in flight in {name}")
                if e.generation_id in conv.turns:
                    bad(10, f"turn {e.generation_id} committed twice in {name}")
                expected = conv.revision if e.regenerate else conv.revision + 1
                if e.revision != expected:
                    bad(10, f"turn {e.generation_id} in {name} at revision {e.revision}, expected {expected}")
                conv.turns.add(e.generation_id)
                conv.in_flight, conv.turn_revision, conv.revision = e.generation_id, e.revision, e.revision
            case ev.ConversationAnswerCommitted():
                if conv is None:
                    bad(10, f"answer {e.generation_id} committed to unknown conversation {name}")
                    return
                if conv.deleted:
                    bad(10, f"answer {e.generation_id} appended to deleted conversation {name}")
                if conv.in_flight != e.generation_id:
                    bad(10, f"answer {e.generation_id} committed in {name}, whose turn in flight is {conv.in_flight!r}")
                if e.generation_id in conv.answered:
                    bad(10, f"answer {e.generation_id} committed twice in {name}")
                if e.revision != conv.revision + 1:
                    bad(10, f"answer {e.generation_id} in {name} at revision {e.revision} after {conv.revision}")
                conv.answered.add(e.generation_id)
                conv.in_flight, conv.revision = "", e.revision
            case ev.ConversationDeleted():
                if conv is not None:
                    conv.deleted, conv.in_flight = True, ""
                else:
                    self._conversations[key] = _ConversationHistory(revision=e.revision, deleted=True)
            case _:
                pass

    def _check_tokens(self, e: ev.Event, bad: Callable[[int, str], None]) -> None:
        """Invariants 11-13 on the history: an admission fits the budget it applied; each token
        reservation is settled exactly once, by its release (never started) or its usage record, for
        the amount it reserved; a usage record's charge follows the settlement rules."""
        match e:
            case ev.GenerationAdmitted():
                if not e.tokens_reserved:
                    return
                if e.reservation_id in self._tokens_held or e.reservation_id in self._tokens_settled:
                    bad(12, f"token reservation {e.reservation_id} admitted twice")
                if e.token_limit:
                    live = self.states.get(e.user_id)
                    window = live.windows.get(e.window_start_ms) if live is not None else None
                    used = window.tokens_used - window.tokens_overshoot if window is not None else 0
                    held = window.tokens_reserved if window is not None else 0
                    if used + held + e.tokens_reserved > e.token_limit:
                        bad(11, f"window {e.window_start_ms}: {used} used + {held} reserved + {e.tokens_reserved} > budget {e.token_limit}")
                self._tokens_held[e.reservation_id] = (e.user_id, e.window_start_ms, e.tokens_reserved)
            case ev.ReservationReleased() if e.tokens_released:
                self._settle_tokens(e.user_id, e.reservation_id, e.window_start_ms, e.tokens_released, 0, 0, bad)
            case ev.UsageRecorded():
                rid = reservation_id(e.generation_id, e.epoch)
                billable = billable_of(e)
                if e.tokens_reserved:
                    self._settle_tokens(e.user_id, rid, e.window_start_ms, e.tokens_reserved, billable, e.overshoot_tokens, bad)
                    if e.overshoot_tokens != max(0, billable - e.tokens_reserved):
                        bad(13, f"usage of {rid}: overshoot {e.overshoot_tokens} but {billable} charged on {e.tokens_reserved} reserved")
                    if self.token_overshoot_max is not None and e.overshoot_tokens > self.token_overshoot_max:
                        bad(13, f"usage of {rid}: overshoot {e.overshoot_tokens} > bound {self.token_overshoot_max}")
                    if billable < min(e.input_tokens + e.output_tokens, e.tokens_reserved):
                        bad(13, f"usage of {rid}: {billable} charged for {e.input_tokens + e.output_tokens} used")
                else:
                    spent = self._window_tokens.setdefault((e.user_id, e.window_start_ms), [0, 0])
                    spent[0] += billable
                if e.delivered_tokens > e.output_tokens:
                    bad(13, f"usage of {rid}: {e.delivered_tokens} delivered > {e.output_tokens} generated")
            case ev.QuotaWindowRetired():
                billable, _ = self._window_tokens.get((e.user_id, e.window_start_ms), (0, 0))
                if e.tokens_used != billable:
                    bad(13, f"window {e.window_start_ms} retired with tokens_used={e.tokens_used} but usage records charged {billable}")
            case _:
                pass

    def _settle_tokens(
        self,
        user_id: str,
        rid: str,
        window_start_ms: int,
        reserved: int,
        billable: int,
        overshoot: int,
        bad: Callable[[int, str], None],
    ) -> None:
        held = self._tokens_held.pop(rid, None)
        if held is None:
            bad(12, f"token reservation {rid} settled {'twice' if rid in self._tokens_settled else 'but never held'}")
        elif held[1:] != (window_start_ms, reserved):
            bad(12, f"token reservation {rid} of {held[2]} in window {held[1]} settled as {reserved} in {window_start_ms}")
        self._tokens_settled.add(rid)
        spent = self._window_tokens.setdefault((user_id, window_start_ms), [0, 0])
        spent[0] += billable
        spent[1] += overshoot

    def _check_history(self, e: ev.Event) -> list[Violation]:
        found: list[Violation] = []

        def bad(invariant: int, message: str) -> None:
            found.append(Violation(invariant, message, e.user_id, e.event_id))

        self._check_key(e, bad)
        self._check_tokens(e, bad)
        if isinstance(e, _CONVERSATION_EVENTS):
            self._check_conversation(e, bad)
            return found
        history = self._history.get(e.generation_id)
        if isinstance(e, ev.GenerationAdmitted):
            spent = self._window_spent.setdefault((e.user_id, e.window_start_ms), [e.window_limit, 0, 0])
            live = self.states.get(e.user_id)
            window = live.windows.get(e.window_start_ms) if live is not None else None
            reserved = window.reserved if window is not None else 0
            if spent[1] + reserved + 1 > spent[0]:
                bad(1, f"window {e.window_start_ms}: {spent[1]} consumed + {reserved + 1} reserved > limit {spent[0]}")
        elif isinstance(e, ev.ReservationConsumed):
            spent = self._window_spent.setdefault((e.user_id, e.window_start_ms), [0, 0, 0])
            spent[1] += 1
            if spent[1] > spent[0]:
                bad(1, f"window {e.window_start_ms}: {spent[1]} reservations consumed > limit {spent[0]}")
        elif isinstance(e, ev.ReservationReleased):
            self._window_spent.setdefault((e.user_id, e.window_start_ms), [0, 0, 0])[2] += 1
        elif isinstance(e, ev.QuotaWindowRetired):
            _, consumed, released = self._window_spent.get((e.user_id, e.window_start_ms), (0, 0, 0))
            if (e.used, e.released) != (consumed, released):
                bad(
                    2,
                    f"window {e.window_start_ms} retired with used={e.used} released={e.released} but the history "
                    f"consumed={consumed} released={released}",
                )
        if isinstance(e, (ev.GenerationAdmitted, ev.AdmissionRejected)):
            if history is None:
                history = self._history[e.generation_id] = _History(e.model_version)
                if isinstance(e, ev.GenerationAdmitted):
                    history.window_of_epoch[e.epoch] = e.window_start_ms
                return found
            if isinstance(e, ev.GenerationAdmitted):
                history.window_of_epoch[e.epoch] = e.window_start_ms
            if history.model_version != e.model_version:
                bad(9, f"{e.generation_id} re-resolved {history.model_version} -> {e.model_version}")
            if history.terminal_event is not None:
                bad(7, f"terminal {e.generation_id} restarted by its key ({history.terminal_event})")
            return found
        if history is None:
            if not isinstance(e, (ev.QuotaWindowRetired, ev.DedupRecordPurged)):
                bad(4, f"{type(e).__name__} for unknown generation {e.generation_id}")
            return found
        # A keyless retry may attach to a completed generation (it reads its result and changes
        # nothing of it); never to one that ended otherwise, which is a new request's to answer.
        attached_to_completed = isinstance(e, ev.RequestAttached) and history.terminal_event == "GenerationCompleted"
        if (
            history.terminal_event is not None
            and not isinstance(e, (ev.LateReportIgnored, ev.DedupRecordPurged))
            and not attached_to_completed
        ):
            bad(4, f"{type(e).__name__} after terminal {history.terminal_event} of {e.generation_id}")
        match e:
            case ev.AttemptAccepted():
                if history.accepted_epoch:
                    bad(5, f"{e.generation_id}: epoch {e.epoch} accepted after epoch {history.accepted_epoch}")
                if e.epoch <= history.fenced_epoch:
                    bad(5, f"{e.generation_id}: fenced epoch {e.epoch} accepted")
                history.accepted_epoch = e.epoch
            case ev.ReservationConsumed() | ev.ReservationReleased():
                if e.reservation_id in self._settled:
                    bad(3, f"reservation {e.reservation_id} left RESERVED twice")
                to = ReservationState.CONSUMED if isinstance(e, ev.ReservationConsumed) else ReservationState.RELEASED
                self._settled[e.reservation_id] = to
                if to is ReservationState.CONSUMED and history.accepted_epoch != e.epoch:
                    bad(3, f"reservation {e.reservation_id} consumed without a committed acceptance")
                if to is ReservationState.RELEASED and history.accepted_epoch == e.epoch:
                    bad(3, f"reservation {e.reservation_id} released after its acceptance")
            case ev.AttemptFenced():
                history.fenced_epoch = max(history.fenced_epoch, e.epoch)
            case ev.ConcurrencySlotReleased():
                if e.reason is SlotReleaseReason.NEVER_ACCEPTED and history.accepted_epoch == e.epoch:
                    bad(6, f"slot of accepted {e.generation_id} freed as never accepted")
                if e.reason is SlotReleaseReason.LEASE_FENCED and history.fenced_epoch < e.epoch:
                    bad(6, f"slot of {e.generation_id} freed on a lease that was not fenced")
            case ev.UsageRecorded():
                if e.epoch in history.usage_epochs:
                    bad(8, f"usage of {e.generation_id} epoch {e.epoch} recorded twice")
                history.usage_epochs.add(e.epoch)
                charged = history.window_of_epoch.get(e.epoch)
                if charged is not None and e.window_start_ms != charged:
                    bad(8, f"usage of {e.generation_id} epoch {e.epoch} names window {e.window_start_ms}, not {charged}")
            case ev.GenerationCompleted() | ev.GenerationCancelled() | ev.GenerationFailed():
                history.terminal_event = type(e).__name__
            case ev.DedupRecordPurged():
                del self._history[e.generation_id]
            case _:
                pass
        return found
