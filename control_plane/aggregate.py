"""The table value the processor keeps per user, and ``handle``: one command in, one atomic change out.

``Aggregate`` = the ledger state (a pure projection of the ledger's events) plus a bounded memory of
recent command decisions. ``handle`` answers a redelivered command from that memory, re-emitting the
very same events and outcome, so at-least-once delivery never applies a command twice and never
loses its events: if the processor crashed after its changelog write but before the ledger events
were acknowledged, the redelivery re-sends them (readers de-duplicate by event id).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from control_plane.decide import Decision, decide
from control_plane.evolve import evolve_all
from control_plane.policy import Policy
from control_plane.state import UserLedger
from schemas.commands import Command, QueryUsage
from schemas.wire import encode, event_from_dict, message_from_dict

# Decisions remembered per user. Redelivery only replays commands after the partition's last
# committed offset, so this must exceed the commands one user issues within one commit interval
# (1 s by default): 16 is far above what one user issues in a second (the burst limit is 20
# requests a minute, each a handful of commands).
RECENT_DECISIONS_MAX = 16


@dataclass(frozen=True, slots=True)
class Remembered:
    """One remembered decision, kept encoded: it is written to the changelog with every command but
    read back only on a redelivery, so it is encoded once, when it is made."""

    command_id: str
    encoded: bytes

    @classmethod
    def of(cls, command_id: str, decision: Decision) -> Remembered:
        return cls(command_id, encode({"events": decision.events, "outcome": decision.outcome}))

    def decision(self) -> Decision:
        doc = orjson.loads(self.encoded)
        return Decision(tuple(event_from_dict(e) for e in doc["events"]), message_from_dict(doc["outcome"]))


@dataclass(frozen=True, slots=True)
class Aggregate:
    ledger: UserLedger
    recent: tuple[Remembered, ...] = field(default=())
    # Offset (in the user's COMMANDS partition) of the last command applied. A redelivered command
    # at or below it was applied already: it is answered from ``recent`` if still remembered and
    # never decided again (a catch-up after a crash can replay more than RECENT_DECISIONS_MAX
    # commands of one user, and re-deciding those against the newer state would reuse event ids
    # with other content).
    source_offset: int = -1

    @classmethod
    def empty(cls, user_id: str) -> Aggregate:
        return cls(UserLedger(user_id))

    def remembered(self, command_id: str) -> Decision | None:
        for seen in reversed(self.recent):
            if seen.command_id == command_id:
                return seen.decision()
        return None


def handle(
    aggregate: Aggregate, command: Command, policy: Policy, source_offset: int | None = None
) -> tuple[Aggregate, Decision | None, bool]:
    """Apply one command. Returns the new aggregate, the decision, and whether it was a redelivery.

    The decision is ``None`` only for a redelivery (``source_offset`` at or below the last applied
    one) whose decision is no longer remembered: it was applied and its outputs sent long ago.
    """
    if command.user_id != aggregate.ledger.user_id:
        raise ValueError("command routed to another user's aggregate")
    seen = aggregate.remembered(command.command_id)
    if seen is not None:
        return aggregate, seen, True
    if source_offset is not None and source_offset <= aggregate.source_offset:
        return aggregate, None, True
    decision = decide(aggregate.ledger, command, policy)
    if isinstance(command, QueryUsage):
        # A read: nothing to remember (a redelivery is simply answered again) and nothing changes,
        # so the processor writes nothing for it (the same aggregate object comes back).
        return aggregate, decision, False
    ledger = evolve_all(aggregate.ledger, decision.events)
    recent = (*aggregate.recent[-(RECENT_DECISIONS_MAX - 1) :], Remembered.of(command.command_id, decision))
    offset = aggregate.source_offset if source_offset is None else source_offset
    return Aggregate(ledger, recent, offset), decision, False
