"""The processor's split table layout (projections/ledger/table_store.py) against the core's own states.

The seeded simulator drives the real ``handle``; every aggregate it produces is planned into a
table the way the processor writes it, read back with ``join`` and compared with the aggregate
itself, and every crash point inside one command's writes reads back as the state before or after.
"""

from __future__ import annotations

import orjson
import pytest

import control_plane.simulator.processor as simulator
from control_plane.aggregate import Aggregate
from control_plane.codec import dump_aggregate
from control_plane.decide import next_deadline_ms
from control_plane.simulator import SimConfig, Simulation
from projections.ledger.table_store import (
    CHUNK_MS,
    EMPTY_LAYOUT,
    TableWrites,
    bucket_of,
    chunk_key,
    is_chunk_key,
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
        # No entry is left behind: the table holds the hot values and exactly the chunks and entries
        # they name, each entry in the chunk of its purge time.
        named = {
            settled_key(u, k, s.revision) for u, lay in self.layouts.items() for k, s in lay.settled.items()
        }
        named |= {chunk_key(u, b, c.revision) for u, lay in self.layouts.items() for b, c in lay.chunks.items()}
        assert {k for k in self.table if is_settled_key(k)} == named
        for lay in self.layouts.values():
            assert {k: (bucket_of(s.purge_at_ms), s.revision) for k, s in lay.settled.items()} == {
                k: (b, r) for b, c in lay.chunks.items() for k, r in c.members.items()
            }


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
    chunks = {k for k, _ in writes.puts if is_chunk_key(k)}
    assert len(writes.puts) == len(settled) + len(chunks) + 1 and chunks and not writes.deletes
    table = dict(writes.puts)
    assert same(join(table[user.encode()], table.get, sim.policy)[0], aggregate)
    hot = orjson.loads(table[user.encode()][8:])
    assert hot["layout"] == 3 and "settled" not in hot and len(hot["chunks"]) == len(chunks)
    assert set().union(*(orjson.loads(table[k]) for k in chunks)) == set(settled)
    assert not set(hot["ledger"]["requests"]) & set(settled)


def _as_layout_2(table: dict[bytes, bytes], user: str) -> dict[bytes, bytes]:
    """The same state as the previous layout wrote it: the hot value names every settled entry."""
    value = table[user.encode()]
    hot = orjson.loads(value[8:])
    names: dict[str, int] = {}
    for b, revision in hot.pop("chunks").items():
        names.update(orjson.loads(table[chunk_key(user, int(b), revision)]))
    hot["layout"], hot["settled"] = 2, names
    old = {k: v for k, v in table.items() if not is_chunk_key(k)}
    old[user.encode()] = value[:8] + orjson.dumps(hot)
    return old


def test_a_layout_2_value_still_loads_and_its_first_command_writes_the_index_chunks(monkeypatch):
    sim = Simulation(22, SimConfig())
    recorder = Recorder(sim.policy, False)
    monkeypatch.setattr(simulator, "handle", recorder(simulator.handle))
    sim.run(5_000)
    aggregate = recorder.best
    assert aggregate is not None and recorder.max_settled > 3
    user = aggregate.ledger.user_id
    table = _as_layout_2(write_all([aggregate], sim.policy), user)
    loaded, layout = join(table[user.encode()], table.get, sim.policy)
    assert same(loaded, aggregate) and layout.chunks is None
    writes = plan(loaded, layout, sim.policy)
    # The settled entries stay as they are; only the chunks naming them and the hot value are new.
    assert all(is_chunk_key(k) for k, _ in writes.puts[:-1]) and not writes.deletes
    table.update(writes.puts)
    again, layout = join(table[user.encode()], table.get, sim.policy)
    assert same(again, aggregate) and layout.chunks
    assert orjson.loads(table[user.encode()][8:])["layout"] == 3


def test_the_hot_value_names_chunks_not_entries_so_it_stays_small_with_many_records():
    # A user at the burst bucket's pace (a new key every 3 s) for a day holds ~28,800 records; the
    # hot value names one chunk per CHUNK_MS of purge times, not one entry per record.
    from tests.unit.ledger_dsl import Ledger
    from control_plane.policy import Policy
    from schemas.codes import Tier

    L = Ledger(policy=Policy(quota_limit_by_tier={Tier.FREE: 0, Tier.PAID: 0}))  # every submit refused: quick
    for i in range(2_000):
        L.submit(f"key-{i:08d}-aaaaaaaaaaaaaaaaaaaaaaaaaaaa")  # 36 characters, a UUID's length
        L.advance(3_000 * 14)  # 2,000 records over a day: 1 per 42 s, so ~14 per 10-minute chunk
    aggregate = Aggregate(L.state, L.aggregate.recent, 7)
    writes = plan(aggregate, EMPTY_LAYOUT, L.policy)
    hot = orjson.loads(writes.puts[-1][1][8:])
    chunks = [v for k, v in writes.puts if is_chunk_key(k)]
    assert len(chunks) == len(hot["chunks"]) <= L.policy.dedup_retention_ms // CHUNK_MS + 2
    # ~145 chunk references (~1.7 KB), where naming every entry took ~100 KB (49 bytes per key).
    assert len(orjson.dumps(hot["chunks"])) < 4_000
    table = dict(writes.puts)
    assert join(table[L.user_id.encode()], table.get, L.policy)[0].ledger == L.state


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
    chunks = {chunk_key("ab", 1, 1), chunk_key("a", 11, 1), chunk_key("a", 1, 11), chunk_key("é", 1, 1)}
    assert len(chunks) == 4 and not chunks & keys
    assert all(is_settled_key(k) and is_chunk_key(k) for k in chunks) and not any(is_chunk_key(k) for k in keys)
    # No idempotency key can make a settled entry's key a chunk's: its length field is never FF FF.
    assert settled_key("a", "\x00\xff\xff", 1) not in chunks
    assert user_of_settled_key(chunk_key("é-user", 5, 7)) == "é-user"
