"""The audit names what differs when the processor's table and the replayed ledger disagree."""

from __future__ import annotations

from projections.ledger.audit import state_difference
from tests.unit.ledger_dsl import Ledger


def test_a_mismatch_names_the_fields_and_keys_that_differ():
    before = Ledger()
    after = Ledger()
    after.submit("k1")
    text = state_difference(after.state, before.state)
    assert "requests (1 keys) k1: table=RequestRecord(" in text and "replay=None" in text
    assert "slots (1 keys)" in text
    assert state_difference(before.state, before.state) == ""
