"""The processor's split table layout (projections/ledger/table_store.py) against the core's own states.

The seeded simulator drives the real ``handle``; every aggregate it produces is planned into a
table the way the processor writes it, read back with ``join`` and compared with the aggregate
itself, and every crash point inside one command's writes reads back as the state before or after.
"""

from __future__ import annotations

import orjson
import pytest

import control_plane.simulator as simulator
from control_plane.aggregate import Aggregate
from control_plane.codec import dump_aggregate
from control_plane.decide import next_deadline_ms
from control_plane.simulator import SimConfig, Simulation
from projections.ledger.table_store import (
    EMPTY_LAYOUT,
    TableWrites,
    is_settled_key,
    join,
    join_table,
    plan,
    settled_key,
    unpack_deadline,
    user_of_settled_key,
    write_all,
)

STEPS = 12_000


def apply(table: dict[bytes, bytes], writes: TableWrites, upto: int | None = None) -> None:
    ops: list[tuple[bytes, bytes | None]] = [*writes.puts, *((k, None) for k in writes.deletes)]
    for key, value in ops[: len(ops) if upto is None else upto]:
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value


def same(a: Aggregate, b: Aggregate) -> bool:
    return a.ledger == b.ledger and [(r.command_id, r.encoded) for r in a.recent] == [
        (r.command_id, r.encoded) for r in b.recent
    ]


class Recorder:
    """Wraps ``handle``: plans each new aggregate into a table and checks the read-back."""

    def __init__(self, policy, check_prefixes: bool) -> None:
        self.policy = policy
        self.check_prefixes = check_prefixes
        self.table: dict[bytes, bytes] = {}
        self.changelog: list[tuple[bytes, bytes | None]] = []
        self.layouts: dict[str, object] = {}
        self.stored: dict[str, Aggregate] = {}
        self.revision = 0
        self.commands = 0
        self.settled_writes = 0
        self.max_settled = 0
        self.best: Aggregate | None = None

    def __call__(self, real):
        def handle(before, command, policy, source_offset=None):
            after, decision, redelivered = real(before, command, policy, source_offset)
            if decision is not None and not redelivered:
                self.record(after)
            return after, decision, redelivered

        return handle

    def record(self, after: Aggregate) -> None:
        user = after.ledger.user_id
        self.revision += 1
        self.commands += 1
        stamped = Aggregate(after.ledger, after.recent, self.revision)
        deadline = next_deadline_ms(after.ledger, self.policy)
        writes = plan(stamped, self.layouts.get(user, EMPTY_LAYOUT), self.policy)
        assert writes.deadline_ms == deadline
        self.settled_writes += len(writes.puts) - 1
        previous = self.stored.get(user)
        if self.check_prefixes:
            # A crash after any prefix of this command's writes reads back as before or after.
            n = len(writes.puts) + len(writes.deletes)
            for upto in range(n):
                trial = dict(self.table)
                apply(trial, writes, upto)
                if user.encode() not in trial:
                    assert previous is None
                    continue
                got, _ = join(trial[user.encode()], trial.get, self.policy)
                assert (previous is not None and same(got, previous)) or same(got, stamped), (user, upto, n)
        apply(self.table, writes)
        self.changelog.extend(writes.puts)
        self.changelog.extend((k, None) for k in writes.deletes)
        got, layout = join(self.table[user.encode()], self.table.get, self.policy)
        assert same(got, stamped)
        assert got.source_offset == self.revision
        assert unpack_deadline(self.table[user.encode()]) == deadline
        self.layouts[user] = layout
        self.stored[user] = stamped
        if len(layout.settled) > self.max_settled:
            self.max_settled, self.best = len(layout.settled), stamped
        if self.commands % 50:
            return
        # No entry is left behind: the table holds the hot values and exactly the entries they name.
        named = {
            settled_key(u, k, s.revision) for u, lay in self.layouts.items() for k, s in lay.settled.items()
        }
        assert {k for k in self.table if is_settled_key(k)} == named


@pytest.mark.parametrize("seed,check_prefixes", [(11, True), (12, False), (13, False)])
def test_every_state_of_a_simulation_reads_back_from_the_split_table(monkeypatch, seed, check_prefixes):
    config = SimConfig()
    sim = Simulation(seed, config)
    recorder = Recorder(sim.policy, check_prefixes)
    monkeypatch.setattr(simulator, "handle", recorder(simulator.handle))
    sim.run(STEPS if not check_prefixes else STEPS // 4)
    assert recorder.commands > 300
    assert recorder.settled_writes > 20 and recorder.max_settled > 3  # the split was exercised

    # A new instance rebuilt from the changelog alone (latest value per key) reads the same states.
    latest: dict[bytes, bytes | None] = {}
    for key, value in recorder.changelog:
        latest[key] = value
    rebuilt = join_table(latest.items(), sim.policy)
    assert rebuilt == {u: a.ledger for u, a in recorder.stored.items()}


def test_a_whole_aggregate_value_still_loads_and_is_rewritten_split(monkeypatch):
    sim = Simulation(21, SimConfig())
    recorder = Recorder(sim.policy, False)
    monkeypatch.setattr(simulator, "handle", recorder(simulator.handle))
    sim.run(5_000)
    aggregate = recorder.best
    assert aggregate is not None
    user = aggregate.ledger.user_id
    legacy = (12345).to_bytes(8, "big") + dump_aggregate(aggregate)
    loaded, layout = join(legacy, {}.get, sim.policy)
    assert layout is EMPTY_LAYOUT and same(loaded, aggregate) and unpack_deadline(legacy) == 12345
    settled = [k for k, r in aggregate.ledger.requests.items() if not r.status.active]
    assert settled, "the chosen user has settled records"
    writes = plan(loaded, layout, sim.policy)
    assert len(writes.puts) == len(settled) + 1 and not writes.deletes
    table = dict(writes.puts)
    assert same(join(table[user.encode()], table.get, sim.policy)[0], aggregate)
    hot = orjson.loads(table[user.encode()][8:])
    assert hot["layout"] == 2 and set(hot["settled"]) == set(settled)
    assert not set(hot["ledger"]["requests"]) & set(settled)


def test_a_missing_settled_entry_is_an_error_not_a_smaller_state(monkeypatch):
    sim = Simulation(31, SimConfig())
    recorder = Recorder(sim.policy, False)
    monkeypatch.setattr(simulator, "handle", recorder(simulator.handle))
    sim.run(5_000)
    assert recorder.best is not None and recorder.max_settled > 0
    table = write_all([recorder.best], sim.policy)
    victim = next(k for k in table if is_settled_key(k))
    user = user_of_settled_key(victim)
    del table[victim]
    with pytest.raises(ValueError, match="missing from the table"):
        join(table[user.encode()], table.get, sim.policy)


def test_settled_keys_of_different_users_never_collide():
    keys = {
        settled_key("ab", "c", 1),
        settled_key("a", "bc", 1),
        settled_key("a", "b", 11),
        settled_key("a", "b1", 1),
        settled_key("é", "x", 1),
    }
    assert len(keys) == 5
    assert all(is_settled_key(k) for k in keys)
    assert user_of_settled_key(settled_key("é-user", "k", 7)) == "é-user"
    assert not is_settled_key("user".encode())
