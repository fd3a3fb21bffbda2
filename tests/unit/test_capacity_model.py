"""bench/capacity.py's formulas on a hand-made benchmark record (docs/capacity.md): each count below
is worked out by hand beside it, so a change to a formula shows here."""

from __future__ import annotations

import json

from bench.capacity import Assumptions, inputs_from, main, model

RECORD = {
    "commit": "abc1234",
    "idle_cpu_pct": {"edge-1": 1.0, "processor-1": 1.0, "readmodel-1": 0.0, "worker-1": 2.0, "kafka": 5.0, "cassandra": 2.0},
    "phases": [
        {"api": "generations", "rate": 20.0, "requests": 400, "completed": 400, "typed_within_500ms": 1.0,
         "cpu_ms_per_generation": {"edge-1": 6.0, "processor-1": 10.5, "readmodel-1": 4.0, "worker-1": 9.0,
                                   "kafka": 17.5, "cassandra": 14.0},
         "kafka_records_per_generation": {"chatplane.commands": 4.0, "chatplane.ledger": 4.0, "chatplane.edge-inbox": 5.0},
         "kafka_bytes_per_generation": 16384, "cassandra_disk_bytes_per_generation": 1024},
        # overloaded: not steady (decisions late), so never the default input
        {"api": "generations", "rate": 100.0, "requests": 2000, "completed": 1500, "typed_within_500ms": 0.4,
         "cpu_ms_per_generation": {"edge-1": 1.0, "processor-1": 1.0}, "kafka_records_per_generation": {},
         "kafka_bytes_per_generation": 0, "cassandra_disk_bytes_per_generation": 0},
    ],
    "hold": {"rss_kib_per_stream": {"edge-1": 40.0, "worker-1": 5.0}, "rss_mib_before": {"edge-1": 100.0},
             "cpu_pct_per_stream": {"edge-1": 0.01, "cassandra": 0.001}},
}


def test_inputs_take_the_steady_phase_and_remove_idle_cpu():
    i = inputs_from(RECORD, "r.json", None)
    assert i.rate == 20.0
    # idle % of a core x 10 = ms per second; / 20 generations a second = ms per generation
    assert i.marginal_cpu_ms == {"edge": 6.0 - 0.5, "processor": 10.5 - 0.5, "readmodel": 4.0, "worker": 9.0 - 1.0,
                                 "kafka": 17.5 - 2.5, "cassandra": 14.0 - 1.0}
    assert i.commands_per_gen == 4.0 and i.kafka_records_per_gen == 13.0
    assert i.edge_kib_per_stream == 40.0 and i.edge_base_mib == 100.0
    assert i.cpu_cores_per_stream == {"edge": 0.0001, "cassandra": 0.00001}


def test_fleet_counts_by_hand():
    i = inputs_from(RECORD, "r.json", None)
    m = model(i, Assumptions(), 6000, 180_000)
    rows = {r["component"]: r for r in m["rows"]}
    # edge cores: 6000 x 5.5 / 1000 = 33, + 180000 x 0.0001 = 18 -> 51; / 0.6 = 85
    assert rows["edge"]["by_cpu"] == 85
    # memory: 180000 x 40 KiB = 7031.25 MiB over (2048 - 100) per edge -> 3.6 -> 4
    assert rows["edge"]["by_memory"] == 4
    # streams cap 20000 -> 9
    assert rows["edge"]["by_streams_cap"] == 9
    assert rows["edge"]["count"] == 85 and rows["edge"]["limiting"] == "cpu"
    # processor: 6000 x 10 / 1000 = 60 cores / 0.6 = 100 instances; 24000 commands/s at 2.5 ms each:
    # 400/s per core, x 0.6 = 240/s per partition -> 100 partitions; instances x 4 = 400 -> 400
    assert rows["processor"]["count"] == 100
    assert rows["processor"]["commands_per_s"] == 24_000
    assert abs(rows["processor"]["commands_per_s_per_partition_max"] - 240.0) < 1e-9
    assert rows["processor"]["user_partitions_needed"] == 400
    # Kafka: 6000 x 15 / 1000 x 3 = 270 cores / (16 x 0.6) = 28.1 -> 29; disk 6000 x 16 KiB x 3 = 281 MiB/s -> 2
    assert rows["kafka broker"]["count"] == 29 and rows["kafka broker"]["limiting"] == "cpu"
    # Cassandra: (6000 x 13 / 1000 + 180000 x 0.00001) x 3 = (78 + 1.8) x 3 = 239.4 cores / 9.6 = 24.9 -> 25;
    # without the held streams' share it would be 234 (24.4 -> 25 as well): check the cores
    assert rows["cassandra node"]["count"] == 25
    assert abs(rows["cassandra node"]["cores"] - 239.4) < 1e-9
    assert m["largest"] == "kafka broker"


def test_cli_prints_and_writes_json(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(RECORD))
    assert main([str(path), "--json", "--utilisation", "1.0"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["component"]: r for r in out["model"]["rows"]}
    assert rows["processor"]["count"] == 60  # 60 cores at 100 %
    assert main([str(path)]) == 0
    assert "fleet for 6000 generations/s" in capsys.readouterr().out
