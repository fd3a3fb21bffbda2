"""The capacity model (docs/capacity.md): the fleet the seed's load needs, recomputed
from one whole-stack benchmark's figures.

    .venv/bin/python bench/bench_stack.py --rates 20,50 --seconds 20 --idle-s 20 --hold-streams 300 --json /tmp/stack.json
    .venv/bin/python bench/capacity.py /tmp/stack.json [--generations-per-s 6000] [--streams 180000] [--json]

Every input is a figure of that one run (its JSON): the marginal CPU milliseconds per generation of
each process at a steady rate (the run's CPU per completed generation minus its idle CPU spread over
the rate's generations), Kafka records and bytes per generation by topic, Cassandra's disk bytes per
generation, and, from the held-streams phase, memory and CPU per open stream. Every assumption that is
not a measurement (how busy a core may run, the machines' sizes, replication) is a named option with
its default printed beside the result, so a reader can change one and rerun.

The formulas (per component; ``G`` generations/s, ``S`` open streams, ``U`` target utilisation):

* edges:            max(ceil((G x edge_ms / 1000 + S x edge_cpu_per_stream) / U),
                        ceil(S x edge_kib_per_stream / (edge_memory - edge_base)),
                        ceil(S / CHATPLANE_EDGE_STREAMS_MAX))
                    and the edge inbox needs one partition per edge (EDGE_INBOX_PARTITIONS);
* processors:       ceil((G x processor_ms / 1000 + S x processor_cpu_per_stream) / U); commands/s per partition = G x commands_per_gen / P,
                    which must stay under one core's worth (1000 / ms_per_command x U): a partition is
                    decided in order by one instance, so P >= instances and P >= that quotient;
* read models, history writers, workers' control-plane side: ceil((G x ms / 1000 + S x cpu_per_stream) / U);
* Kafka:            cores = (G x kafka_ms / 1000 + S x kafka_cpu_per_stream) x replication / U; disk = G x bytes_per_gen x replication;
                    brokers = max(ceil(cores / broker_cores), ceil(disk / broker_disk_write), replication);
* Cassandra:        the same with cassandra_ms, its per-stream CPU and its disk bytes, times its replication factor.

A generation's own cost (admission, dispatch, acceptance, finalization, projections, 8 output tokens)
is per generation; the cost of a stream's tokens while it is open (deltas to the edge, replay rows,
renewals) is per held stream at the seed's 20 tokens/s, from the held-streams phase.

The per-process CPU is measured on one machine with everything on loopback and a single replica of
everything; what that leaves out is said in docs/capacity.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schemas.topics import COMMANDS, EDGE_INBOX, USER_PARTITIONS  # noqa: E402

# The seed's section 10 load.
SEED_GENERATIONS_PER_S = 6_000
SEED_STREAMS = 180_000
# Steady state: a rate whose run held the admission contract (typed decisions within 500 ms) and
# completed nearly everything; the highest such rate is the default input.
STEADY_TYPED_WITHIN_MIN = 0.999
STEADY_COMPLETED_MIN = 0.99
EDGE_STREAMS_MAX = 20_000  # CHATPLANE_EDGE_STREAMS_MAX's default (edge/settings.py)


@dataclass
class Assumptions:
    """What the model assumes (not measured here); every one an option."""

    utilisation: float = 0.6  # how busy a core may run at the planned load (headroom for bursts, failover)
    edge_memory_mib: float = 2048.0  # memory an edge process may use
    broker_cores: int = 16
    broker_disk_write_mib_s: float = 300.0  # sustained log writes a broker's disks take
    kafka_replication: int = 3
    cassandra_node_cores: int = 16
    cassandra_replication: int = 3
    partition_growth: int = 4  # partitions per processor instance planned, so instances can grow without repartitioning


@dataclass
class Inputs:
    """The measured figures the model uses (all from one bench_stack run)."""

    source: str
    commit: str
    rate: float
    marginal_cpu_ms: dict[str, float]  # per generation, by process kind (idle removed)
    kafka_records_per_gen: float
    kafka_bytes_per_gen: float
    commands_per_gen: float
    cassandra_bytes_per_gen: float
    edge_kib_per_stream: float | None
    edge_base_mib: float | None
    cpu_cores_per_stream: dict[str, float] = field(default_factory=dict)


def kind(name: str) -> str:
    """``edge-1`` -> ``edge``; ``kafka`` stays."""
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name


def steady_phase(record: dict, rate: float | None) -> dict:
    # the native API's phases; a --tracing run's traced phases are tracing's cost, not the budget
    phases = [p for p in record["phases"] if p.get("api", "generations") == "generations" and not p.get("tracing")]
    if rate is not None:
        for p in phases:
            if p["rate"] == rate:
                return p
        raise SystemExit(f"no phase at rate {rate:g} in the run (rates: {[p['rate'] for p in phases]})")
    steady = [p for p in phases if p["typed_within_500ms"] >= STEADY_TYPED_WITHIN_MIN
              and p["completed"] >= STEADY_COMPLETED_MIN * p["requests"]]
    if not steady:
        raise SystemExit("no phase of the run held the admission contract: pass --rate to use one anyway")
    return max(steady, key=lambda p: p["rate"])


def inputs_from(record: dict, source: str, rate: float | None) -> Inputs:
    phase = steady_phase(record, rate)
    idle = record.get("idle_cpu_pct", {})
    marginal: dict[str, float] = {}
    for name, ms in phase["cpu_ms_per_generation"].items():
        # idle % of a core = 10 x ms per second; spread over this rate's generations per second
        idle_ms = idle.get(name, 0.0) * 10.0 / phase["rate"]
        marginal[kind(name)] = marginal.get(kind(name), 0.0) + max(0.0, ms - idle_ms)
    records = phase["kafka_records_per_generation"]
    hold = record.get("hold") or {}
    per_stream = hold.get("rss_kib_per_stream", {})
    edge_kib = sum(v for k, v in per_stream.items() if kind(k) == "edge") if per_stream else None
    base = hold.get("rss_mib_before", {})
    edge_base = sum(v for k, v in base.items() if kind(k) == "edge") if base else None
    cpu_per_stream = {kind(k): v / 100.0 for k, v in hold.get("cpu_pct_per_stream", {}).items()}
    # bench_stack names topics without the run's namespace prefix: "chatplane.commands"
    commands = next((n for t, n in records.items() if t in (COMMANDS.name, COMMANDS.name.removeprefix("chatplane."))), 0.0)
    return Inputs(
        source=source, commit=record.get("commit", "unknown"), rate=phase["rate"], marginal_cpu_ms=marginal,
        kafka_records_per_gen=sum(records.values()), kafka_bytes_per_gen=float(phase["kafka_bytes_per_generation"]),
        commands_per_gen=float(commands),
        cassandra_bytes_per_gen=float(phase["cassandra_disk_bytes_per_generation"]),
        edge_kib_per_stream=edge_kib, edge_base_mib=edge_base, cpu_cores_per_stream=cpu_per_stream,
    )


def ceil(x: float) -> int:
    return max(1, math.ceil(x - 1e-9))


def model(i: Inputs, a: Assumptions, g: float, s: int) -> dict:
    u = a.utilisation
    ms = i.marginal_cpu_ms
    out: dict = {"generations_per_s": g, "streams": s, "rows": []}

    def row(component: str, count: int, why: str, limit: str, **figures: float) -> None:
        out["rows"].append({"component": component, "count": count, "formula": why, "limiting": limit, **figures})

    # Edges: CPU for generations plus the streams they hold, memory for the streams, the per-edge cap.
    edge_cores = g * ms.get("edge", 0.0) / 1000 + s * i.cpu_cores_per_stream.get("edge", 0.0)
    by_cpu = ceil(edge_cores / u)
    by_mem = (ceil(s * i.edge_kib_per_stream / 1024 / max(1.0, a.edge_memory_mib - (i.edge_base_mib or 0.0)))
              if i.edge_kib_per_stream is not None else 0)
    by_cap = ceil(s / EDGE_STREAMS_MAX)
    edges = max(by_cpu, by_mem, by_cap)
    limit = {by_cpu: "cpu", by_mem: "memory per stream", by_cap: "CHATPLANE_EDGE_STREAMS_MAX"}[edges]
    row("edge", edges, "max(cpu, memory, streams cap)", limit, cores=edge_cores, by_cpu=by_cpu, by_memory=by_mem,
        by_streams_cap=by_cap, inbox_partitions_needed=edges, inbox_partitions_now=EDGE_INBOX.partitions)

    # Processors: one event loop (one core) each; partitions must cover instances and per-partition load.
    proc_cores = g * ms.get("processor", 0.0) / 1000 + s * i.cpu_cores_per_stream.get("processor", 0.0)
    procs = ceil(proc_cores / u)
    commands_s = g * i.commands_per_gen
    ms_per_command = ms.get("processor", 0.0) / max(i.commands_per_gen, 1e-9)
    per_partition_max = 1000.0 / max(ms_per_command, 1e-9) * u
    partitions = max(procs * a.partition_growth, ceil(commands_s / per_partition_max))
    row("processor", procs, "(G x ms / 1000 + S x per stream) / U", "cpu", cores=proc_cores, commands_per_s=commands_s,
        ms_per_command=ms_per_command, commands_per_s_per_partition_max=per_partition_max,
        user_partitions_needed=partitions, user_partitions_now=USER_PARTITIONS)
    for comp in ("readmodel", "history", "worker"):
        if comp in ms:
            cores = g * ms[comp] / 1000 + s * i.cpu_cores_per_stream.get(comp, 0.0)
            row(comp, ceil(cores / u), "(G x ms / 1000 + S x per stream) / U", "cpu", cores=cores)

    # Kafka: every record is written once per replica; CPU measured with one replica, scaled by it.
    kafka_cores = (g * ms.get("kafka", 0.0) / 1000 + s * i.cpu_cores_per_stream.get("kafka", 0.0)) * a.kafka_replication
    kafka_mib_s = g * i.kafka_bytes_per_gen * a.kafka_replication / (1024 * 1024)
    brokers = max(ceil(kafka_cores / (a.broker_cores * u)), ceil(kafka_mib_s / (a.broker_disk_write_mib_s * u)),
                  a.kafka_replication)
    row("kafka broker", brokers, "max(cpu x RF, disk x RF, RF)", "cpu" if kafka_cores / a.broker_cores >= kafka_mib_s / a.broker_disk_write_mib_s else "disk",
        cores=kafka_cores, records_per_s=g * i.kafka_records_per_gen, disk_mib_s=kafka_mib_s)
    cass_cores = (g * ms.get("cassandra", 0.0) / 1000 + s * i.cpu_cores_per_stream.get("cassandra", 0.0)) * a.cassandra_replication
    nodes = max(ceil(cass_cores / (a.cassandra_node_cores * u)), a.cassandra_replication)
    row("cassandra node", nodes, "max(cpu x RF, RF)", "cpu", cores=cass_cores,
        disk_mib_s=g * i.cassandra_bytes_per_gen * a.cassandra_replication / (1024 * 1024))

    total_cores = sum(r["cores"] for r in out["rows"])
    out["total_cores"] = total_cores
    # What limits first: the largest share of the fleet's cores.
    out["largest"] = max(out["rows"], key=lambda r: r["cores"])["component"]
    return out


def render(i: Inputs, a: Assumptions, m: dict) -> str:
    lines = [
        f"inputs: {i.source} (commit {i.commit}), steady rate {i.rate:g}/s",
        "  marginal CPU ms per generation: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(i.marginal_cpu_ms.items())),
        f"  Kafka per generation: {i.kafka_records_per_gen:.1f} records, {i.kafka_bytes_per_gen / 1024:.1f} KiB"
        f" ({i.commands_per_gen:.1f} commands); Cassandra disk {i.cassandra_bytes_per_gen / 1024:.2f} KiB",
        "  per held stream: " + (f"edge {i.edge_kib_per_stream:.1f} KiB (edge base {i.edge_base_mib:.0f} MiB); CPU "
                                 + ", ".join(f"{k} {v * 100:.4f} %" for k, v in sorted(i.cpu_cores_per_stream.items()))
                                 if i.edge_kib_per_stream is not None else "not measured (run bench_stack with --hold-streams)"),
        "assumptions: " + ", ".join(f"{k}={v}" for k, v in asdict(a).items()),
        f"fleet for {m['generations_per_s']:g} generations/s and {m['streams']:,} open streams:",
        f"  {'component':<15} {'count':>6} {'cores':>8}  limiting",
    ]
    for r in m["rows"]:
        lines.append(f"  {r['component']:<15} {r['count']:>6} {r['cores']:>8.1f}  {r['limiting']} ({r['formula']})")
    p = next(r for r in m["rows"] if r["component"] == "processor")
    e = next(r for r in m["rows"] if r["component"] == "edge")
    lines += [
        f"  total cores busy at {a.utilisation:.0%}: {m['total_cores'] / a.utilisation:.0f} ({m['total_cores']:.0f} at 100 %);"
        f" largest share: {m['largest']}",
        f"  processor: {p['commands_per_s']:,.0f} commands/s, {p['ms_per_command']:.3f} ms each, at most"
        f" {p['commands_per_s_per_partition_max']:,.0f}/s per partition; user partitions needed {p['user_partitions_needed']}"
        f" (now {p['user_partitions_now']})",
        f"  edge: by cpu {e['by_cpu']}, by memory {e['by_memory']}, by streams cap {e['by_streams_cap']};"
        f" edge inbox partitions needed {e['inbox_partitions_needed']} (now {e['inbox_partitions_now']})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/capacity.py", description=__doc__.split("\n\n")[0])
    p.add_argument("figures", type=Path, help="bench_stack.py --json output")
    p.add_argument("--generations-per-s", type=float, default=SEED_GENERATIONS_PER_S)
    p.add_argument("--streams", type=int, default=SEED_STREAMS)
    p.add_argument("--rate", type=float, help="the run's phase to use (default: the highest steady one)")
    p.add_argument("--json", action="store_true", help="print the model as JSON")
    for name, value in asdict(Assumptions()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = p.parse_args(argv)
    record = json.loads(args.figures.read_text())
    a = Assumptions(**{k: getattr(args, k) for k in asdict(Assumptions())})
    i = inputs_from(record, str(args.figures), args.rate)
    m = model(i, a, args.generations_per_s, args.streams)
    if args.json:
        print(json.dumps({"inputs": asdict(i), "assumptions": asdict(a), "model": m}, indent=1))
    else:
        print(render(i, a, m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
