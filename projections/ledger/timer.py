"""The processor's timer: what it appends to COMMANDS by itself, for the users of its partitions.

    every ``reconcile_tick_s`` (faust timer ``reconcile``, projections/ledger/processor.py):
        ReconcileDue   for users whose next deadline passed (``decide`` does the rest)
        DetachReader   for generations read by an edge that stopped renewing its liveness lease
                       (``PresenceView.lost``, presence.py)
        AttachReader   for those whose edge was heard again before their detach lapsed

The timer holds the deadline index (user -> when its next ReconcileDue is due) and the readers it
watches (user -> the edges reading its active generations), both for the partitions assigned to the
processor only. The processor tells it what a decision changed (``decided``), when the assignment
changed (``rescan_needed``, ``forget``); the timer reads everything else through the functions it
was given (the hot table's entries, the aggregates decided ahead of it, a user's aggregate, the
assigned partitions) and sends through ``send``. It never decides: every command it appends is read
and decided by the agent like any other.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from aiokafka.partitioner import murmur2

from control_plane.aggregate import Aggregate
from control_plane.decide import attached_reader, attached_readers, next_deadline_ms
from control_plane.policy import Policy
from projections.ledger.presence import PresenceView, monotonic_ms
from projections.ledger.table_store import is_settled_key, unpack_deadline, unpack_readers
from schemas.codes import CancelReason
from schemas.commands import AttachReader, DetachReader, ReconcileDue
from schemas.wire import encode


def user_partition(user_id: bytes, partitions: int) -> int:
    """The partition the default (murmur2) partitioner gives a user's key, as every producer uses."""
    return (murmur2(user_id) & 0x7FFFFFFF) % partitions


class TimerStats(Protocol):
    """The counters the timer adds to (the processor's ``ProcessorStats``)."""

    reconciles_appended: int
    readers_detached: int
    readers_reattached: int
    readers_unwatched: int


@dataclass(frozen=True, slots=True)
class TimerLimits:
    """The timer's settings (from ``ProcessorSettings``, same names there)."""

    instance_id: str  # in the ReconcileDue command ids
    reconcile_commands_per_tick_max: int  # commands appended per tick at most, reconciles and readers each
    reconcile_resend_ms: int  # before a user gets another ReconcileDue, or another round of reader commands
    readers_tracked_max: int  # users whose readers are watched, and detaches remembered for a reattach
    edge_lost_grace_ms: int  # a detached generation's grace (DetachReader.grace_ms)

    @classmethod
    def of(cls, settings: Any) -> TimerLimits:
        return cls(
            instance_id=settings.instance_id,
            reconcile_commands_per_tick_max=settings.reconcile_commands_per_tick_max,
            reconcile_resend_ms=settings.reconcile_resend_ms,
            readers_tracked_max=settings.readers_tracked_max,
            edge_lost_grace_ms=settings.edge_lost_grace_ms,
        )


class ReconcileTimer:
    """The deadline index and the reader watch of the partitions assigned here, and the tick.

    Args:
        limits: see ``TimerLimits``.
        policy: for the next deadline of an aggregate decided ahead of the table.
        partitions: the commands topic's partition count (a user's partition, ``user_partition``).
        presence: the edges heard recently (fed by ``PresenceWatch``, presence.py).
        stats: the counters it adds to.
        assigned: the command partitions assigned now.
        table_entries: the hot table's (user key, value) pairs (the table's items; settled keys are skipped here).
        unwritten: (user key, aggregate) decided here and not yet written to the table.
        aggregate_of: a user's aggregate as decided here (``(user key, user id) -> Aggregate``).
        send: appends an encoded command under a user key to COMMANDS.
    """

    def __init__(
        self,
        limits: TimerLimits,
        policy: Policy,
        partitions: int,
        presence: PresenceView,
        stats: TimerStats,
        *,
        assigned: Callable[[], set[int]],
        table_entries: Callable[[], Iterable[tuple[bytes, bytes | None]]],
        unwritten: Callable[[], Iterable[tuple[bytes, Aggregate]]],
        aggregate_of: Callable[[bytes, str], Aggregate],
        send: Callable[[bytes, bytes], Awaitable[Any]],
    ) -> None:
        self.limits = limits
        self.policy = policy
        self.partitions = partitions
        self.presence = presence
        self.stats = stats
        self._assigned = assigned
        self._table_entries = table_entries
        self._unwritten = unwritten
        self._aggregate_of = aggregate_of
        self._send = send
        # user key -> the time its next ReconcileDue is due (only users of partitions assigned here).
        self.deadlines: dict[bytes, int] = {}
        # user key -> the readers (edges) of its active generations whose liveness is watched here
        # (attached_readers; only users of partitions assigned here that have any).
        self.readers: dict[bytes, frozenset[str]] = {}
        # (user key, generation id) -> (the lost edge it was detached from, when its detach lapses):
        # reattached by the timer if that edge is heard again in time (it was slow, not dead).
        self.detached: dict[tuple[bytes, str], tuple[str, int]] = {}
        # user key -> when the timer may send it reader commands again (one round at a time).
        self.readers_resend: dict[bytes, int] = {}
        self._scan_needed = True

    # --- what the processor tells it ----------------------------------------------------------

    def decided(self, user_key: bytes, deadline_ms: int | None, readers: frozenset[str]) -> None:
        """A decision here changed a user's aggregate: its next deadline and attached readers now."""
        if deadline_ms is None:
            self.deadlines.pop(user_key, None)
        else:
            self.deadlines[user_key] = deadline_ms
        self._watch_readers(user_key, readers)

    def rescan_needed(self) -> None:
        """Partitions were assigned: rebuild the index from the table at the next tick."""
        self._scan_needed = True

    def forget(self, lost: set[int]) -> None:
        """Partitions were revoked: drop their users' deadlines and readers."""
        partitions = self.partitions
        self.deadlines = {k: t for k, t in self.deadlines.items() if user_partition(k, partitions) not in lost}
        self.readers = {k: r for k, r in self.readers.items() if user_partition(k, partitions) not in lost}

    # --- the tick -----------------------------------------------------------------------------

    async def tick(self) -> None:
        """Append ReconcileDue for every user here whose next deadline passed; then the reader commands."""
        if self._scan_needed:
            self._rescan()
        now_ms = int(time.time() * 1000)
        limits = self.limits
        due = [key for key, deadline in self.deadlines.items() if deadline <= now_ms]
        due.sort(key=self.deadlines.__getitem__)
        for key in due[: limits.reconcile_commands_per_tick_max]:
            user_id = key.decode()
            command = ReconcileDue(
                command_id=f"reconcile:{user_id}:{now_ms}:{limits.instance_id}",
                user_id=user_id,
                issued_at_ms=now_ms,
                as_of_ms=now_ms,
            )
            await self._send(key, encode(command))
            self.deadlines[key] = now_ms + limits.reconcile_resend_ms
            self.stats.reconciles_appended += 1
        await self._readers_tick(now_ms)

    def _rescan(self) -> None:
        assigned = self._assigned()
        if not assigned:
            return
        partitions = self.partitions
        deadlines: dict[bytes, int] = {}
        self.readers = {}
        for key, value in self._table_entries():
            if value is not None and not is_settled_key(key) and user_partition(key, partitions) in assigned:
                deadline = unpack_deadline(value)
                if deadline is not None:
                    deadlines[key] = deadline
                self._watch_readers(key, unpack_readers(value)[0])
        for key, aggregate in self._unwritten():  # decided here, ahead of the table
            if user_partition(key, partitions) in assigned:
                deadline = next_deadline_ms(aggregate.ledger, self.policy)
                if deadline is None:
                    deadlines.pop(key, None)
                else:
                    deadlines[key] = deadline
                self._watch_readers(key, attached_readers(aggregate.ledger))
        self.deadlines = deadlines
        self._scan_needed = False

    def _watch_readers(self, user_key: bytes, readers: frozenset[str]) -> None:
        if not readers:
            self.readers.pop(user_key, None)
        elif user_key in self.readers or len(self.readers) < self.limits.readers_tracked_max:
            self.readers[user_key] = readers
        else:
            self.stats.readers_unwatched += 1

    async def _readers_tick(self, now_ms: int) -> None:
        """Detach the generations of users here whose reader's edge is lost; reattach those whose
        edge was heard again before their detach lapsed. At most ``reconcile_commands_per_tick_max``
        commands a tick; a user gets one round of them per ``reconcile_resend_ms``."""
        limits = self.limits
        mono = monotonic_ms()
        budget = limits.reconcile_commands_per_tick_max
        for (user_key, generation_id), (edge_id, until_ms) in list(self.detached.items()):
            if until_ms <= now_ms:
                del self.detached[(user_key, generation_id)]
            elif not self.presence.lost(edge_id, mono) and budget > 0:
                del self.detached[(user_key, generation_id)]
                await self._send_reader_command(
                    user_key,
                    AttachReader(
                        command_id=f"attach:{generation_id}:{edge_id}:{now_ms}",
                        user_id=user_key.decode(),
                        issued_at_ms=now_ms,
                        generation_id=generation_id,
                        reader_id=edge_id,
                    ),
                )
                self.stats.readers_reattached += 1
                budget -= 1
        for user_key, readers in list(self.readers.items()):
            if budget <= 0:
                break
            lost = {r for r in readers if self.presence.lost(r, mono)}
            if not lost or self.readers_resend.get(user_key, 0) > now_ms:
                continue
            self.readers_resend[user_key] = now_ms + limits.reconcile_resend_ms
            user_id = user_key.decode()
            aggregate = self._aggregate_of(user_key, user_id)
            for record in aggregate.ledger.requests.values():
                if attached_reader(record) not in lost:
                    continue
                if len(self.detached) < limits.readers_tracked_max:
                    self.detached[(user_key, record.generation_id)] = (
                        record.reader_id,
                        now_ms + limits.edge_lost_grace_ms,
                    )
                await self._send_reader_command(
                    user_key,
                    DetachReader(
                        command_id=f"detach:{record.generation_id}:{record.reader_id}",
                        user_id=user_id,
                        issued_at_ms=now_ms,
                        generation_id=record.generation_id,
                        reader_id=record.reader_id,
                        grace_ms=limits.edge_lost_grace_ms,
                        reason=CancelReason.EDGE_LOST,
                    ),
                )
                self.stats.readers_detached += 1
                budget -= 1
        if len(self.readers_resend) > len(self.readers) * 2 + 1_000:
            self.readers_resend = {k: t for k, t in self.readers_resend.items() if t > now_ms}

    async def _send_reader_command(self, user_key: bytes, command: DetachReader | AttachReader) -> None:
        await self._send(user_key, encode(command))
