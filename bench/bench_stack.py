"""The whole-stack benchmark over HTTP (issue 14, item 1): what a user sees, and what it costs.

    .venv/bin/python bench/bench_stack.py                         # idle 30 s, then 20, 50, 100/s for 30 s each
    .venv/bin/python bench/bench_stack.py --rates 20 --seconds 20 --idle-s 10    # a quick look

The stack is bench/stackrun.py's, shaped as ``make up`` runs it: its own broker and Cassandra, one
admission processor, one read-model projection, one ``sim`` worker (50 ms to the first token, 10 ms a
token, no jitter), one edge. The client (this process, on the same machine) sends open-loop streaming
requests at each rate, one new user per request, 8 output tokens each, and reads every stream to its
end.

Printed:

* idle: CPU of every process (percent of one core) over ``--idle-s`` with no traffic;
* per rate: ``generation.created`` and first-token latency p50/p95/p99 (from the POST being sent),
  the share of requests with a typed decision (created event or typed error) within 500 ms, the
  outcomes by code, the control plane's addition to the first token (first token minus the engine's
  50 ms), and per process: CPU milliseconds per completed generation and RSS at the end; bytes
  appended to Kafka's logs per generation (the ``.log`` segment files of every topic, changelogs
  included) and bytes Cassandra wrote to disk per generation (``/proc/<pid>/io`` write_bytes).

The CPU and bytes of a rate are counted from its first request until every stream of it ended plus
``--tail-s``, so the work a generation causes after its last token (reports, projections) is in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stackrun import Stack, cpu_seconds, rss_bytes  # noqa: E402

MODEL = "simulated-text-model"
ENGINE_TTFT_MS = 50.0
SIM_ENV = {"CHATPLANE_SIM_TTFT_MS": int(ENGINE_TTFT_MS), "CHATPLANE_SIM_INTER_TOKEN_MS": 10,
           "CHATPLANE_SIM_JITTER_MS": 0, "CHATPLANE_SIM_OUTPUT_TOKENS": 1_000}
OUTPUT_TOKENS = 8
DECISION_TARGET_S = 0.5
HTTP_TIMEOUT_S = 120.0
MIB = 1024 * 1024


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def write_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def kafka_log_bytes(stack: Stack) -> int:
    """Bytes in the broker's log segments (every topic): what was appended, compressed as stored."""
    data = stack.work_dir / "var" / "kafka" / "data"
    return sum(p.stat().st_size for p in data.rglob("*.log") if p.is_file())


@dataclass
class Sample:
    sent: float
    decided: float | None = None  # created event or an error answer
    first_token: float | None = None
    code: str = ""
    typed: bool = False


@dataclass
class Phase:
    rate: float
    samples: list[Sample] = field(default_factory=list)
    cpu_ms: dict[str, float] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)
    kafka_bytes: int = 0
    cassandra_bytes: int = 0
    wall_s: float = 0.0


async def one(http: httpx.AsyncClient, stack: Stack, s: Sample) -> None:
    user = f"b{uuid.uuid4().hex[:12]}"
    body = {"model": MODEL, "stream": True, "max_output_tokens": OUTPUT_TOKENS,
            "messages": [{"role": "user", "content": "Say eight words."}]}
    headers = {"Authorization": f"Bearer {stack.token(user)}", "Idempotency-Key": uuid.uuid4().hex}
    try:
        async with http.stream("POST", "/v1/generations", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                s.decided = time.monotonic()
                try:
                    s.code, s.typed = json.loads(raw)["error"]["code"], True
                except (ValueError, KeyError, TypeError):
                    s.code = f"http_{resp.status_code}"
                return
            tail = b""  # the end of what came before: an event name split across two chunks is still found
            async for chunk in resp.aiter_raw():
                window = tail + chunk
                if s.decided is None and b"generation.created" in window:
                    s.decided, s.typed = time.monotonic(), True
                if s.first_token is None and b"generation.text.delta" in window:
                    s.first_token = time.monotonic()
                if b"event: generation.completed" in window:
                    s.code = "completed"
                elif b"event: generation.error" in window or b"event: generation.cancelled" in window:
                    s.code = s.code or "stream_error"
                tail = window[-64:]
            s.code = s.code or "eof"
    except httpx.HTTPError as exc:
        s.code = type(exc).__name__


def snapshot(stack: Stack) -> tuple[dict[str, float], int, int]:
    pids = stack.pids()
    cpu = {name: cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
    cass = write_bytes(pids["cassandra"]) if "cassandra" in pids else 0
    return cpu, kafka_log_bytes(stack), cass


async def run_rate(stack: Stack, rate: float, seconds: float, tail_s: float) -> Phase:
    phase = Phase(rate)
    limits = httpx.Limits(max_connections=10_000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=stack.edge_urls[0], timeout=HTTP_TIMEOUT_S, limits=limits) as http:
        cpu0, k0, c0 = snapshot(stack)
        t0 = time.monotonic()
        tasks = []
        n = int(rate * seconds)
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            s = Sample(time.monotonic())
            phase.samples.append(s)
            tasks.append(asyncio.create_task(one(http, stack, s)))
        await asyncio.gather(*tasks)
        await asyncio.sleep(tail_s)
        cpu1, k1, c1 = snapshot(stack)
        phase.wall_s = time.monotonic() - t0
    done = max(1, sum(s.code == "completed" for s in phase.samples))
    phase.cpu_ms = {name: (cpu1.get(name, 0.0) - cpu0.get(name, 0.0)) * 1000 / done for name in cpu1}
    phase.rss_mib = {name: (rss_bytes(pid) or 0) / MIB for name, pid in stack.pids().items()}
    phase.kafka_bytes, phase.cassandra_bytes = (k1 - k0) // done, (c1 - c0) // done
    return phase


def report(phase: Phase) -> str:
    ss = phase.samples
    done = [s for s in ss if s.code == "completed"]
    created = [(s.decided - s.sent) * 1000 for s in ss if s.decided is not None and s.typed]
    first = [(s.first_token - s.sent) * 1000 for s in done if s.first_token is not None]
    within = sum(1 for s in ss if s.typed and s.decided is not None and s.decided - s.sent <= DECISION_TARGET_S)
    added = [f - ENGINE_TTFT_MS for f in first]
    lines = [
        f"rate {phase.rate:g}/s: {len(ss)} requests, {len(done)} completed, {phase.wall_s:.1f} s",
        f"  outcomes: {dict(Counter(s.code for s in ss).most_common())}",
        f"  decision (created or typed error) p50/p95/p99: {pct(created, .5):.0f} / {pct(created, .95):.0f} / {pct(created, .99):.0f} ms;"
        f" typed within 500 ms: {within / max(1, len(ss)):.2%}",
        f"  first token p50/p95/p99: {pct(first, .5):.0f} / {pct(first, .95):.0f} / {pct(first, .99):.0f} ms;"
        f" control plane's addition (minus the engine's {ENGINE_TTFT_MS:.0f} ms) p50 {pct(added, .5):.0f}, p95 {pct(added, .95):.0f} ms",
        f"  CPU ms per completed generation: total {sum(phase.cpu_ms.values()):.1f} = "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(phase.cpu_ms.items())),
        f"  bytes per generation: Kafka log segments {phase.kafka_bytes / 1024:.1f} KiB, Cassandra disk writes {phase.cassandra_bytes / 1024:.1f} KiB",
        "  RSS MiB at the end: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(phase.rss_mib.items())),
    ]
    return "\n".join(lines)


async def bench(args: argparse.Namespace, work: Path) -> None:
    stack = Stack(work, namespace=f"bench{uuid.uuid4().hex[:6]}", processors=1, workers=1, edges=1, readmodels=1,
                  env=SIM_ENV)
    await stack.start()
    try:
        await asyncio.sleep(args.warmup_s)
        cpu0, _, _ = snapshot(stack)
        await asyncio.sleep(args.idle_s)
        cpu1, _, _ = snapshot(stack)
        idle = {k: (cpu1[k] - cpu0.get(k, 0.0)) / args.idle_s * 100 for k in cpu1}
        print(f"idle over {args.idle_s:g} s, % of one core: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(idle.items())), flush=True)
        for rate in args.rates:
            phase = await run_rate(stack, rate, args.seconds, args.tail_s)
            print(report(phase), flush=True)
            await asyncio.sleep(args.pause_s)
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_stack.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=[20.0, 50.0, 100.0])
    p.add_argument("--seconds", type=float, default=30.0, help="seconds of load per rate")
    p.add_argument("--idle-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=10.0, help="after the stack is up, before the idle measure")
    p.add_argument("--tail-s", type=float, default=3.0, help="after the last stream ended, still counted")
    p.add_argument("--pause-s", type=float, default=5.0, help="between rates")
    p.add_argument("--work-dir", type=Path)
    args = p.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="chatplane-bench-"))
    asyncio.run(bench(args, work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
