"""``projections.ledger.read_stamps.stamp_of``: which ledger entries give a re-read submit its first stamp."""

from __future__ import annotations

from control_plane.routing import route
from projections.ledger.read_stamps import stamp_of
from schemas.topics import Topology
from tests.unit.ledger_dsl import T0, Ledger


def entry_of(L: Ledger, command) -> bytes:
    before = L.state
    decision = L.run(command)
    return route(Topology(), before, L.state, command, decision, 0)[0].value


def test_a_stamped_submit_entry_gives_its_command_id_and_stamp():
    L = Ledger()
    command = L.submit_cmd("k1", decide_by_ms=T0 + 1_700, read_at_ms=T0 + 40)
    assert stamp_of(entry_of(L, command)) == (command.command_id, T0 + 40)


def test_entries_without_a_stamp_give_nothing():
    L = Ledger()
    unstamped = entry_of(L, L.submit_cmd("k1"))
    assert stamp_of(unstamped) is None
    g = L.state.requests["k1"].generation_id
    from schemas.commands import CancelGeneration

    cancel = CancelGeneration(**L._base(generation_id=g))
    assert stamp_of(entry_of(L, cancel)) is None
    assert stamp_of(None) is None and stamp_of(b"") is None
    assert stamp_of(b'{"command_type":"SubmitGeneration", not json') is None
    assert stamp_of(b'{"command_type":"SubmitGeneration","command_id":7,"read_at_ms":5}') is None
