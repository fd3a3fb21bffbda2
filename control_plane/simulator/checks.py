"""The end of a run: the checks on the state it drained to, and the summary of what it did.

Data flow: ``simulation.Simulation.drain`` calls ``check_end_state`` with the world (its ledger as
observed, the usage topic, the invariant monitor, which worker's acceptance committed, which attempts
were started) and the processor's aggregates; ``summarize`` reads the de-duplicated ledger for the
command line. The checks that run after every step are elsewhere: the ``InvariantMonitor`` over each
ledger entry as it lands (``world.commit_ledger``) and ``check_state`` on each new state
(``processor.Processor.consume``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from control_plane.aggregate import Aggregate
from control_plane.evolve import evolve_all
from control_plane.invariants import check_state
from control_plane.simulator.world import World
from control_plane.state import UserLedger
from schemas import events as ev


def check_end_state(world: World, aggregates: Mapping[str, Aggregate]) -> None:
    """After draining: every deadline passed and reconciled, so nothing is held or active, the
    processor's state is the fold of the ledger, usage was recorded once, and no worker computed
    without a committed acceptance. Raises ``SimulationFailed`` (``world.fail``) on the first breach."""
    for user in world.users:
        state = aggregates.get(user, Aggregate.empty(user)).ledger
        violations = check_state(state, world.config.concurrency_limit)
        if violations:
            world.fail(violations)
        for r in state.reservations.values():  # the state holds only RESERVED ones
            world.fail(f"reservation {r.reservation_id} still RESERVED after every deadline passed")
        if state.slots:
            world.fail(f"{user} still holds slots {state.slots} after draining")
        for record in state.requests.values():
            if record.status.active:
                world.fail(f"{record.generation_id} still {record.status} after every deadline passed")
        for cid, conversation in state.conversations.items():
            if conversation.in_flight and not world.commits_outstanding[conversation.in_flight]:
                world.fail(f"{cid} still waits for the answer of {conversation.in_flight} after draining")
        events = [e for e in world.ledger.values() if e.user_id == user]
        if evolve_all(UserLedger(user), events) != state:
            world.fail(f"{user}: the processor's state is not the fold of the ledger")
    violations = world.monitor.check_all_states()
    if violations:
        world.fail(violations)
    unsettled = world.monitor.unsettled_token_reservations()
    if unsettled:
        world.fail(f"token reservations never settled after draining: {sorted(unsettled)[:3]}")
    usage = Counter((e.generation_id, e.epoch) for e in world.ledger.values() if isinstance(e, ev.UsageRecorded))
    twice = [k for k, n in usage.items() if n > 1]
    if twice:
        world.fail(f"usage recorded twice for {twice[:3]}")
    topic_usage = Counter((e.generation_id, e.epoch) for e in world.usage_topic.values())
    if topic_usage != usage:
        world.fail("the usage topic and the ledger's usage records disagree")
    for generation_id, epoch, worker_id in world.started:
        if world.accepted_by.get((generation_id, epoch)) != worker_id:
            world.fail(f"{worker_id} computed {generation_id} epoch {epoch} without a committed acceptance")


def summarize(ledger: Mapping[str, ev.Event]) -> dict[str, Any]:
    """What a run did, counted from the ledger it left (de-duplicated by event id)."""
    terminal: Counter[str] = Counter()
    for e in ledger.values():
        if isinstance(e, ev.TERMINAL_EVENT_TYPES):
            terminal[type(e).__name__.removeprefix("Generation").lower()] += 1
    settled: Counter[str] = Counter(
        type(e).__name__ for e in ledger.values() if isinstance(e, (ev.ReservationConsumed, ev.ReservationReleased))
    )
    conversation_events: Counter[str] = Counter(
        type(e).__name__.removeprefix("Conversation") for e in ledger.values() if type(e).__name__.startswith("Conversation")
    )
    return {
        "conversations": dict(conversation_events),
        "events": len(ledger),
        "admitted": sum(isinstance(e, ev.GenerationAdmitted) for e in ledger.values()),
        "terminal": dict(terminal),
        "messages_consumed": settled["ReservationConsumed"],
        "messages_released": settled["ReservationReleased"],
    }
