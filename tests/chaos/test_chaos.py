"""The chaos run's CI variant: every fault kind once, about two and a half minutes of load.

The whole run is ``python -m tests.chaos.chaos`` (tests/chaos/chaos.py says what it starts, injects
and checks); here it runs one round of faults on its own private Kafka broker and Cassandra node, so
restarting them touches nothing else of the session. Its seed comes from the checkout's commit, so
that CI explores another schedule with each commit; the seed is printed, and
``CHATPLANE_CHAOS_SEED=<seed>`` replays it (outside a git checkout the seed is ``FALLBACK_SEED``).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from tests.chaos.chaos import (
    Fault, chaos, chaos_stack, fault_kinds, head_commit, log_outage_ms, plan_faults, render, round_duration_s,
    run_duration_s, seed_from_commit,
)

CI_SLOT_S = 12.0
FALLBACK_SEED = 2
# Every seed in this range, at each of these slot sizes and run lengths (one round, a round and a
# bit, the 10-minute local run), plans every fault kind at least once.
PLAN_SEEDS = range(1_000)
PLAN_SLOTS_S = (5.0, 12.0, 20.0)


def ci_seed() -> tuple[int, str]:
    """The seed CI runs, and where it came from."""
    if os.environ.get("CHATPLANE_CHAOS_SEED"):
        return int(os.environ["CHATPLANE_CHAOS_SEED"]), "CHATPLANE_CHAOS_SEED"
    commit = head_commit()
    if commit is None:
        return FALLBACK_SEED, "no git checkout: the fallback seed"
    return seed_from_commit(commit), f"commit {commit[:12]}"


@pytest.fixture
def components(tmp_path) -> list[str]:
    """The chaos stack's components, as a run builds it (nothing starts)."""
    return sorted(chaos_stack(0, tmp_path).components)


def test_the_same_seed_gives_the_same_schedule_and_a_round_holds_every_fault_once(components):
    one_round_s = round_duration_s(components, CI_SLOT_S)
    a = plan_faults(5, one_round_s, components, CI_SLOT_S)
    assert a == plan_faults(5, one_round_s, components, CI_SLOT_S)
    assert [(f.kind, f.target) for f in a] != [(f.kind, f.target) for f in plan_faults(6, one_round_s, components, CI_SLOT_S)]
    assert sorted((f.kind, f.target) for f in a) == sorted(fault_kinds(components))
    assert {(f.kind, f.target) for f in a} == {("kill9", c) for c in components} | {
        ("restart_kafka", "kafka"), ("restart_cassandra", "cassandra"), ("stall", "worker-1")}
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)
    assert all(f.at_s < one_round_s for f in a)


def test_every_seeds_plan_holds_every_fault_kind(components):
    kinds = set(fault_kinds(components))
    for slot_s in PLAN_SLOTS_S:
        one_round_s = round_duration_s(components, slot_s)
        for duration_s in (one_round_s, one_round_s + slot_s / 3, 600.0):
            for seed in PLAN_SEEDS:
                planned = {(f.kind, f.target) for f in plan_faults(seed, duration_s, components, slot_s)}
                assert planned == kinds, f"seed {seed}, {duration_s} s, slots of {slot_s} s: missing {kinds - planned}"


def test_a_run_shorter_than_a_round_is_lengthened_to_one_and_never_planned_short(components):
    one_round_s = round_duration_s(components, CI_SLOT_S)
    # The CI run's length before the history writer joined the stack: one slot short of a round.
    assert run_duration_s(one_round_s - CI_SLOT_S, components, CI_SLOT_S) == one_round_s
    assert run_duration_s(None, components, CI_SLOT_S) == one_round_s
    assert run_duration_s(600.0, components, CI_SLOT_S) == 600.0
    with pytest.raises(ValueError, match="fault kinds"):
        plan_faults(17, one_round_s - CI_SLOT_S, components, CI_SLOT_S)


def test_the_seed_follows_the_commit_and_replays_with_it():
    a, b = "7bb858d" + "0" * 33, "8999eec" + "0" * 33
    assert seed_from_commit(a) == seed_from_commit(a) != seed_from_commit(b)
    assert seed_from_commit("ffffff" + "f" * 34) == 16**6 - 1


def test_only_the_part_of_a_broker_outage_after_the_reader_left_extends_an_orphans_allowance():
    faults = [Fault(0, "restart_kafka", "kafka", 4, started_ms=10_000, ended_ms=30_000),
              Fault(0, "kill9", "worker-1", 2, started_ms=30_000, ended_ms=33_000),
              Fault(0, "restart_cassandra", "cassandra", 4, started_ms=40_000, ended_ms=60_000)]
    assert log_outage_ms(faults, 5_000, 35_000) == 20_000  # the whole outage, nothing for the worker kill
    assert log_outage_ms(faults, 25_000, 50_000) == 5_000  # left in the outage's last 5 s; Cassandra counts nothing
    assert log_outage_ms(faults, 5_000, 12_000) == 2_000  # ended 2 s into the outage
    assert log_outage_ms(faults, 31_000, 70_000) == 0
    running = [Fault(0, "restart_kafka", "kafka", 4, started_ms=10_000)]  # still down when it ended
    assert log_outage_ms(running, 12_000, 20_000) == 8_000


@pytest.mark.integration
async def test_a_seeded_chaos_run_ends_in_a_clean_audit(tmp_path, components):
    seed, source = ci_seed()
    replay = f"CHATPLANE_CHAOS_SEED={seed} .venv/bin/python -m pytest -s tests/chaos/test_chaos.py -k seeded"
    print(f"chaos seed {seed} ({source}); replay: {replay}", flush=True)
    result = await chaos(seed, None, tmp_path / "run", slot_s=CI_SLOT_S)  # None: exactly one round
    print(render(result))
    assert result.ok, f"seed {seed} ({source}), replay: {replay}\n" + "\n".join(result.problems[:20])
    figures = result.figures
    assert figures["faults"] == dict(Counter(kind for kind, _ in fault_kinds(components))), f"seed {seed}"
    # The run did what it is for: generations admitted and settled, orphans checked, keys retried.
    assert figures["generations_seen"] > 50 and figures["orphans"] > 0 and figures["same_key_pairs"] > 0
