"""The table value the processor keeps per user, and ``handle``: one command in, one atomic change out.

``Aggregate`` = the ledger state (a pure projection of the ledger's events) plus a bounded memory of
recent command decisions. ``handle`` answers a redelivered command from that memory, re-emitting the
very same events and outcome, so at-least-once delivery never applies a command twice and never
loses its events: if the processor crashed after its changelog write but before the ledger events
were acknowledged, the redelivery re-sends them (readers de-duplicate by event id).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.decide import Decision, decide
from control_plane.evolve import evolve_all
from control_plane.policy import Policy
from control_plane.state import UserLedger
from schemas.commands import Command

# Decisions remembered per user. Redelivery only replays commands after the partition's last
# committed offset, so this must exceed the commands one user issues within one commit interval.
RECENT_DECISIONS_MAX = 32


@dataclass(frozen=True, slots=True)
class Aggregate:
    ledger: UserLedger
    recent: tuple[tuple[str, Decision], ...] = field(default=())

    @classmethod
    def empty(cls, user_id: str) -> Aggregate:
        return cls(UserLedger(user_id))

    def remembered(self, command_id: str) -> Decision | None:
        for seen_id, decision in reversed(self.recent):
            if seen_id == command_id:
                return decision
        return None


def handle(aggregate: Aggregate, command: Command, policy: Policy) -> tuple[Aggregate, Decision, bool]:
    """Apply one command. Returns the new aggregate, the decision, and whether it was a redelivery."""
    if command.user_id != aggregate.ledger.user_id:
        raise ValueError("command routed to another user's aggregate")
    seen = aggregate.remembered(command.command_id)
    if seen is not None:
        return aggregate, seen, True
    decision = decide(aggregate.ledger, command, policy)
    ledger = evolve_all(aggregate.ledger, decision.events)
    recent = (*aggregate.recent[-(RECENT_DECISIONS_MAX - 1) :], (command.command_id, decision))
    return Aggregate(ledger, recent), decision, False
