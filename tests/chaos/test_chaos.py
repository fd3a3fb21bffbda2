"""The chaos run's CI variant (issue 13): every fault kind once, about two minutes of load.

The whole run is ``python -m tests.chaos.chaos`` (tests/chaos/chaos.py says what it starts, injects
and checks); here it runs with a fixed seed (``CHATPLANE_CHAOS_SEED`` picks another) on its own
private Kafka broker and Cassandra node, so restarting them touches nothing else of the session.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.chaos import Fault, chaos, log_outage_ms, plan_faults, render

CI_SEED = int(os.environ.get("CHATPLANE_CHAOS_SEED", "2"))
CI_SLOT_S = 12.0
COMPONENTS = ["edge-1", "edge-2", "processor-1", "processor-2", "readmodel-1", "worker-1", "worker-2"]
KINDS_PER_ROUND = len(COMPONENTS) + 3  # a kill -9 of each, the broker, Cassandra, a stalled worker
CI_DURATION_S = KINDS_PER_ROUND * CI_SLOT_S + CI_SLOT_S / 2


def test_the_same_seed_gives_the_same_schedule_and_a_round_holds_every_fault_once():
    a = plan_faults(5, CI_DURATION_S, COMPONENTS, CI_SLOT_S)
    assert a == plan_faults(5, CI_DURATION_S, COMPONENTS, CI_SLOT_S)
    assert [(f.kind, f.target) for f in a] != [(f.kind, f.target) for f in plan_faults(6, CI_DURATION_S, COMPONENTS, CI_SLOT_S)]
    assert len(a) == KINDS_PER_ROUND
    assert {(f.kind, f.target) for f in a} == {("kill9", c) for c in COMPONENTS} | {
        ("restart_kafka", "kafka"), ("restart_cassandra", "cassandra"), ("stall", "worker-1")}
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)


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
async def test_a_seeded_chaos_run_ends_in_a_clean_audit(tmp_path):
    result = await chaos(CI_SEED, CI_DURATION_S, tmp_path, slot_s=CI_SLOT_S)
    print(render(result))
    assert result.ok, "\n".join(result.problems[:20])
    figures = result.figures
    assert figures["faults"] == {"kill9": len(COMPONENTS), "restart_kafka": 1, "restart_cassandra": 1, "stall": 1}
    # The run did what it is for: generations admitted and settled, orphans checked, keys retried.
    assert figures["generations_seen"] > 50 and figures["orphans"] > 0 and figures["same_key_pairs"] > 0
