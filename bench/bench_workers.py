"""Worker benchmarks on the real broker and the real processor (``python -m projections``).

    .venv/bin/python bench/bench_workers.py [--concurrency 100] [--cancels 30] [--cpu-runs 5]
                                            [--sim-only] [--parts burst,steady,cancel,cpu]

Prints, per part:
- burst: sim, ``--concurrency`` generations submitted at once: client TTFT (submit sent -> first delta on the inbox),
  engine TTFT (engine started -> first token) and their difference, the control plane's overhead
  (processor decision, dispatch, prompt fetch, acceptance, delta transport): p50/p95.
- steady: sim, ``--concurrency`` generations in flight at steady state (3x that many arrivals, paced
  so that each arrives while about ``--concurrency`` others run): client TTFT and overhead, measured
  over the arrivals that found at least 80% of that number running; outcomes of all arrivals.
- cancel: sim, cancel -> engine stopped: CancelGeneration sent -> the engine's stop acknowledgement, p50/p95,
  and the tokens generated after the worker learned of the stop.
- cpu: (SmolLM2-135M-Instruct on llama.cpp, skipped when not installed): engine TTFT, tokens/s,
  client TTFT, and cancel -> engine stopped.
Everything runs on this machine (broker, processor, worker, client), so the figures include their
competition for its cores; a floor is printed next to each (the simulator's own configured TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.runtime.settings import kafka_bootstrap  # noqa: E402
from infra.runtime.command_client import CommandClient  # noqa: E402
from infra.runtime.kafka_admin import delete_topics, deployment_topics, ensure_topics  # noqa: E402
from schemas.codes import RequestStatus  # noqa: E402
from schemas.topics import Topology  # noqa: E402
from infra.harness.models import CPU_ALIAS, TEST_CATALOG_PATH  # noqa: E402
from infra.harness.processes import ProcessorProcess, wait_until_deciding  # noqa: E402

# The processor subprocess and the workers read the tests' catalog (the simulator's alias is not in the default).
os.environ.setdefault("CHATPLANE_MODEL_CATALOG", str(TEST_CATALOG_PATH))
from infra.harness.worker_edge import TestEdge, served, worker_settings  # noqa: E402
from workers.engines.cpu import CPU_THREADS, cpu_runtime_missing_reason  # noqa: E402
from workers.engines.sim import SimConfig, SimulatedEngine  # noqa: E402
from workers.worker import Worker  # noqa: E402

WAIT_S = 120.0


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def line(name: str, values_s: list[float]) -> str:
    ms = [v * 1000 for v in values_s]
    return f"{name:<44} n={len(ms):<4} p50={pct(ms, 50):8.1f} ms  p95={pct(ms, 95):8.1f} ms  max={max(ms) if ms else float('nan'):8.1f} ms"


async def ttft_under_load(bootstrap: str, topo: Topology, edge: TestEdge, concurrency: int, inter_token_ms: float) -> None:
    cfg = SimConfig(ttft_ms=50, inter_token_ms=inter_token_ms, jitter_ms=2, output_tokens=32, max_concurrent=max(128, concurrency))
    async with Worker(worker_settings(bootstrap, topo, slots=concurrency), SimulatedEngine(cfg), served()) as worker:
        await asyncio.sleep(3)  # the worker joins its consumer group
        users = [f"bench-{uuid.uuid4().hex[:8]}" for _ in range(concurrency)]
        sent: dict[str, float] = {}

        async def one(u: str) -> str:
            t0 = time.monotonic()
            gid = await edge.submit(u, "hello")
            sent[gid] = t0
            return gid

        gids = await asyncio.gather(*(one(u) for u in users))
        await wait_all_finalized(edge, worker, gids)
        print(f"\n== sim: burst of {concurrency} simultaneous submits (engine TTFT configured {cfg.ttft_ms:.0f} ms, "
              f"{cfg.inter_token_ms:.0f} ms/token) ==")
        print(f"{'outcomes':<44} {outcomes(edge, gids)}")
        gids = [g for g in gids if g in edge.finalized and edge.finalized[g].status is RequestStatus.COMPLETED
                and g in edge.first_delta_at]
        ttft_breakdown(worker, edge, gids, sent)


def outcomes(edge: TestEdge, gids: list[str]) -> dict[str, int]:
    def one(g: str) -> str:
        f = edge.finalized.get(g)
        if f is None:
            return f"not finalized in {WAIT_S:.0f} s"
        return f.status.value + (f":{f.code.value}" if f.code else "")

    return dict(collections.Counter(one(g) for g in gids))


async def wait_all_finalized(edge: TestEdge, worker: Worker, gids: list[str]) -> None:
    """Wait (bounded by WAIT_S) for every generation's finalization; say where the missing ones are."""
    try:
        await edge.wait_for(lambda: all(g in edge.finalized for g in gids), WAIT_S, "all finalized")
    except AssertionError:
        missing = [g for g in gids if g not in edge.finalized]
        where = collections.Counter(
            "never dispatched here" if (g, 1) not in worker.traces else
            f"declined:{worker.traces[(g, 1)].declined}" if worker.traces[(g, 1)].declined else
            f"outcome:{worker.traces[(g, 1)].outcome} report_appended:{worker.traces[(g, 1)].report_appended}"
            for g in missing
        )
        print(f"!! {len(missing)} of {len(gids)} not finalized within {WAIT_S:.0f} s: {dict(where)}")
        for g in missing[:3]:
            tr = worker.traces.get((g, 1))
            print(f"!!   {g}: {tr} active={(g, 1) in worker.active} deltas={len(edge.deltas[g])}")
        for task in asyncio.all_tasks():
            if task.get_coro().__qualname__.endswith("_handle"):
                task.print_stack(limit=8)


def ttft_breakdown(worker: Worker, edge: TestEdge, gids: list[str], sent: dict[str, float]) -> None:
    """Client TTFT, engine TTFT, their difference (the control plane's overhead) and its hops."""
    client, engine, overhead = [], [], []
    to_dispatch, to_prompt, to_accept, to_engine, to_client = [], [], [], [], []
    for g in gids:
        tr = worker.traces[(g, 1)]
        to_dispatch.append(tr.taken_at - sent[g])
        to_prompt.append(tr.prompt_at - tr.taken_at)
        to_accept.append(tr.accepted_at - tr.prompt_at)
        to_engine.append(tr.engine_started_at - tr.accepted_at)
        to_client.append(edge.first_delta_at[g] - tr.engine_first_token_at)
        c = edge.first_delta_at[g] - sent[g]
        e = tr.engine_first_token_at - tr.engine_started_at
        client.append(c), engine.append(e), overhead.append(c - e)
    print(line("client TTFT", client))
    print(line("engine TTFT", engine))
    print(line("control-plane overhead (client - engine)", overhead))
    print(line("  submit sent -> dispatch taken by worker", to_dispatch))
    print(line("  dispatch taken -> prompt from edge", to_prompt))
    print(line("  prompt -> acceptance decided", to_accept))
    print(line("  acceptance -> engine started", to_engine))
    print(line("  engine first token -> client has it", to_client))


async def ttft_steady(
    bootstrap: str, topo: Topology, edge: TestEdge, in_flight: int, total: int, inter_token_ms: float,
    delta_interval_ms: float | None = 50.0,
) -> None:
    """``in_flight`` generations running at once at steady state: arrivals paced so that each of ~2 s
    lasts while ``in_flight`` others run (not a burst of simultaneous submits)."""
    cfg = SimConfig(ttft_ms=50, inter_token_ms=inter_token_ms, jitter_ms=2, output_tokens=200, max_concurrent=max(128, in_flight * 2))
    # None: one delta per engine chunk (the baseline); else gather text for at least this many ms.
    deltas_kw = (
        {"delta_coalesce_chars_max": 0} if delta_interval_ms is None else {"delta_interval_ms": delta_interval_ms}
    )
    settings = worker_settings(bootstrap, topo, slots=in_flight * 2, renew_interval_s=3.0, **deltas_kw)
    async with Worker(settings, SimulatedEngine(cfg), served()) as worker:
        await asyncio.sleep(3)
        duration_s = (cfg.ttft_ms + cfg.output_tokens * cfg.inter_token_ms) / 1000
        interval_s = duration_s / in_flight
        sent: dict[str, float] = {}
        running_at_start: dict[str, int] = {}

        async def one(u: str) -> None:
            t0 = time.monotonic()
            running = len(worker.active)
            gid = await edge.submit(u, "hello", max_output_tokens=cfg.output_tokens)
            sent[gid], running_at_start[gid] = t0, running

        tasks = []
        for _ in range(total):
            tasks.append(asyncio.create_task(one(f"bench-{uuid.uuid4().hex[:8]}")))
            await asyncio.sleep(interval_s)
        await asyncio.gather(*tasks)
        await wait_all_finalized(edge, worker, list(sent))
        completed = [g for g in sent if g in edge.finalized and edge.finalized[g].status is RequestStatus.COMPLETED
                     and g in edge.first_delta_at]
        steady = [g for g in completed if running_at_start[g] >= in_flight * 0.8]
        print(f"\n== sim: steady state, ~{in_flight} generations in flight ({total} paced arrivals, one per "
              f"{interval_s * 1000:.0f} ms; {len(steady)} completed that arrived with >= {int(in_flight * 0.8)} running; "
              f"{cfg.inter_token_ms:.0f} ms/token; delta coalescing "
              f"{'off: one delta per chunk' if delta_interval_ms is None else f'interval {delta_interval_ms:.0f} ms'}) ==")
        print(f"{'outcomes':<44} {outcomes(edge, list(sent))}")
        chunks = sum(worker.traces[k].output_tokens or 0 for k in worker.traces if k[0] in sent)
        deltas = sum(len(edge.deltas[g]) for g in sent)
        print(f"{'deltas sent / engine chunks':<44} {deltas} / {chunks} ({deltas / max(chunks, 1):.2f} per chunk)")
        ttft_breakdown(worker, edge, steady, sent)


async def cancel_latency(bootstrap: str, topo: Topology, edge: TestEdge, engine_name: str, runs: int, worker_kw: dict) -> None:
    if engine_name == "sim":
        engine = SimulatedEngine(SimConfig(ttft_ms=20, inter_token_ms=20, jitter_ms=2, output_tokens=5000))
        model, prompt = served(), "hello"
    else:
        from workers.engines.cpu import CpuEngine

        model, prompt = served(CPU_ALIAS), "Write a very long story about a dragon and a knight."
        engine = CpuEngine(model.verify_weights(), context_tokens=model.context_tokens)
    settings = worker_settings(bootstrap, topo, model_alias=model.alias, **worker_kw)
    async with Worker(settings, engine, model) as worker:
        await asyncio.sleep(3)
        lat, after = [], []
        for _ in range(runs):
            u = f"bench-{uuid.uuid4().hex[:8]}"
            gid = await edge.submit(u, prompt, max_output_tokens=2000, model_alias=model.alias)
            await edge.wait_for(lambda: len(edge.deltas[gid]) >= 5, WAIT_S, "5 deltas")
            t0 = time.monotonic()
            await edge.cancel(u, gid)
            final = await edge.wait_finalized(gid, WAIT_S)
            assert final.status is RequestStatus.CANCELLED, final
            tr = worker.traces[(gid, 1)]
            lat.append(tr.stopped_at - t0)
            after.append(tr.tokens_after_stop or 0)
        print(f"\n== {engine_name}: cancel -> engine stopped, {runs} sequential cancels ==")
        print(line("CancelGeneration sent -> stop acknowledged", lat))
        print(f"{'tokens generated after the worker saw the stop':<44} max={max(after)} mean={statistics.mean(after):.2f}")


async def cpu_speed(bootstrap: str, topo: Topology, edge: TestEdge, runs: int) -> None:
    from workers.engines.cpu import CpuEngine

    model = served(CPU_ALIAS)
    engine = CpuEngine(model.verify_weights(), context_tokens=model.context_tokens)
    async with Worker(worker_settings(bootstrap, topo, slots=1, model_alias=model.alias), engine, model) as worker:
        await asyncio.sleep(3)
        ttft, tps, client = [], [], []
        sample = ""
        for i in range(runs):
            u = f"bench-{uuid.uuid4().hex[:8]}"
            t0 = time.monotonic()
            # A different prompt each run: llama.cpp reuses the KV of a repeated prompt's common prefix,
            # which would make every run after the first skip most of its prompt evaluation.
            prompt = "Name three colors." if i == 0 else f"Name three colors. This is question {i + 1}."
            gid = await edge.submit(u, prompt, max_output_tokens=128, model_alias=model.alias)
            final = await edge.wait_finalized(gid, WAIT_S)
            tr = worker.traces[(gid, 1)]
            ttft.append(tr.engine_first_token_at - tr.engine_started_at)
            client.append(edge.first_delta_at[gid] - t0)
            if final.output_tokens > 1:
                tps.append((final.output_tokens - 1) / (tr.stopped_at - tr.engine_first_token_at))
            sample = sample or edge.text(gid)
        print(f"\n== cpu: SmolLM2-135M-Instruct Q4_1 on llama.cpp ({CPU_THREADS} threads), {runs} runs of "
              f"'Name three colors.' (+ a varying suffix after the first) ==")
        print(line("engine TTFT (prompt eval + first token)", ttft))
        print(line("client TTFT", client))
        print(f"{'decode tokens/s':<44} n={len(tps):<4} mean={statistics.mean(tps):.1f} min={min(tps):.1f}")
        print(f"{'sample answer (first run)':<44} {sample!r}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", default=kafka_bootstrap())
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--cancels", type=int, default=30)
    ap.add_argument("--cpu-runs", type=int, default=5)
    ap.add_argument("--inter-token-ms", type=float, default=10.0,
                    help="the simulator's decode step in the burst and steady parts (10 ms = 100 tokens/s per stream)")
    ap.add_argument("--deltas", default="off,50",
                    help="steady part once per entry, in this order: off (one delta per engine chunk, the "
                         "baseline) or a CHATPLANE_WORKER_DELTA_INTERVAL_MS value")
    ap.add_argument("--sim-only", action="store_true", help="skip the cpu parts")
    ap.add_argument("--parts", default="burst,steady,cancel,cpu",
                    help="comma-separated subset of burst,steady,cancel,cpu (default: all)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    topo = Topology(f"bw{uuid.uuid4().hex[:8]}")
    await ensure_topics(args.bootstrap, deployment_topics(topo))
    proc = ProcessorProcess(args.bootstrap, topo.namespace, Path(tempfile.mkdtemp(prefix="bench-workers-")),
                            CHATPLANE_QUOTA_FREE_PER_WINDOW=10_000)
    proc.start()
    try:
        async with CommandClient(args.bootstrap, topo, inbox_partition=0, decision_timeout_s=15) as probe:
            await wait_until_deciding(probe)
        async with TestEdge(args.bootstrap, topo, partition=1) as edge:
            if "burst" in parts:
                await ttft_under_load(args.bootstrap, topo, edge, args.concurrency, args.inter_token_ms)
            if "steady" in parts:
                for spec in args.deltas.split(","):
                    interval = None if spec == "off" else float(spec)
                    await ttft_steady(
                        args.bootstrap, topo, edge, args.concurrency, args.concurrency * 3, args.inter_token_ms, interval
                    )
            if "cancel" in parts:
                await cancel_latency(args.bootstrap, topo, edge, "sim", args.cancels, {})
            if args.sim_only or "cpu" not in parts:
                return
            missing = cpu_runtime_missing_reason()
            if missing:
                print(f"\n== cpu: skipped ({missing}) ==")
            else:
                await cpu_speed(args.bootstrap, topo, edge, args.cpu_runs)
                await cancel_latency(args.bootstrap, topo, edge, "cpu", args.cpu_runs, {"slots": 1})
    finally:
        proc.stop()
        await delete_topics(args.bootstrap, [s.name for s in deployment_topics(topo)])


if __name__ == "__main__":
    asyncio.run(main())
