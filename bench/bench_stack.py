"""The whole-stack benchmark over HTTP: what a user sees, and what it costs.

    .venv/bin/python bench/bench_stack.py                         # idle 30 s, then 20, 50, 100/s for 30 s each
    .venv/bin/python bench/bench_stack.py --rates 20 --seconds 20 --idle-s 10    # a quick look
    .venv/bin/python bench/bench_stack.py --rates 20 --seconds 20 --tracing      # tracing off vs on (docs/tracing.md)

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
Kafka's bytes and records (end offsets) are also printed per topic.

``--peer litellm`` then runs the same load, at the same rates, against LiteLLM's proxy
(bench/peer_litellm.py: ``litellm[proxy]==1.106.12`` in its own venv, ``--peer-workers`` processes) in
front of bench/fake_openai.py (a FAKE model server with the same 50 ms / 10 ms timing), after
chatplane's stack has stopped, and prints the two side by side: first token p50/p95/p99 and CPU ms
per completed request (LiteLLM's processes; the fake model's apart).

    .venv/bin/python bench/bench_stack.py --rates 20,50,100 --seconds 20 --peer litellm
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peer_litellm import DEFAULT_VENV, LiteLLMPeer  # noqa: E402
from bench.stackrun import Stack, cpu_seconds, rss_bytes  # noqa: E402

MODEL = "simulated-text-model"
ENGINE_TTFT_MS = 50.0
SIM_ENV = {"CHATPLANE_SIM_TTFT_MS": int(ENGINE_TTFT_MS), "CHATPLANE_SIM_INTER_TOKEN_MS": 10,
           "CHATPLANE_SIM_JITTER_MS": 0, "CHATPLANE_SIM_OUTPUT_TOKENS": 1_000}
OUTPUT_TOKENS = 8
DECISION_TARGET_S = 0.5
WARMUP_RATE = 10.0  # requests/s during --warmup-s
# --tracing: every component traces what carries a context and encodes its spans, then drops them.
TRACING_ENV = {"CHATPLANE_TRACING": "drop"}
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


def kafka_log_bytes(stack: Stack) -> Counter[str]:
    """Bytes in the broker's log segments per topic (every partition, changelogs included): what was
    appended, as stored. A compaction between two readings can make a topic's difference smaller."""
    data = stack.work_dir / "var" / "kafka" / "data"
    sizes: Counter[str] = Counter()
    for p in data.rglob("*.log"):
        if p.is_file():
            topic = p.parent.name.rsplit("-", 1)[0]  # <topic>-<partition>
            sizes[topic.removeprefix(stack.namespace + ".")] += p.stat().st_size
    return sizes


API_PATHS = {"generations": "/v1/generations", "openai": "/v1/chat/completions"}
FIRST_CONTENT = re.compile(rb'"content":\s?"[^"]')


async def kafka_records(stack: Stack) -> Counter[str]:
    """Records appended so far per topic (the sum of its partitions' end offsets; transactional
    markers count as records)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap)
    await consumer.start()
    try:
        cluster = await consumer._client.fetch_all_metadata()  # bench-only: the consumer's own cache holds no partitions
        tps = [TopicPartition(t, p) for t in cluster.topics() if t.startswith(stack.namespace + ".")
               for p in cluster.partitions_for_topic(t) or ()]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    counts: Counter[str] = Counter()
    for tp, end in ends.items():
        counts[tp.topic.removeprefix(stack.namespace + ".")] += end
    return counts


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
    kafka_topics: dict[str, int] = field(default_factory=dict)  # bytes per generation by topic
    kafka_records: dict[str, float] = field(default_factory=dict)  # records per generation by topic
    cassandra_bytes: int = 0
    wall_s: float = 0.0


async def one(http: httpx.AsyncClient, stack: Stack, s: Sample) -> None:
    """One streaming generation through chatplane's edge, as a new user."""
    user = f"b{uuid.uuid4().hex[:12]}"
    body = {"model": MODEL, "stream": True, "max_output_tokens": OUTPUT_TOKENS,
            "messages": [{"role": "user", "content": "Say eight words."}]}
    headers = {"Authorization": f"Bearer {stack.token(user)}", "Idempotency-Key": uuid.uuid4().hex}
    try:
        async with http.stream("POST", "/v1/generations", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await _error_answer(resp, s)
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


async def peer_one(http: httpx.AsyncClient, peer: LiteLLMPeer, s: Sample) -> None:
    """The same request to LiteLLM's OpenAI-compatible endpoint (decided: its 200's headers arrived)."""
    await chat_completion(http, peer.headers(), s)


async def ours_openai(http: httpx.AsyncClient, stack: Stack, s: Sample) -> None:
    """The same request to chatplane's ``/v1/chat/completions`` (``--api openai``), as a new user."""
    user = f"b{uuid.uuid4().hex[:12]}"
    await chat_completion(http, {"Authorization": f"Bearer {stack.token(user)}", "Idempotency-Key": uuid.uuid4().hex}, s)


async def chat_completion(http: httpx.AsyncClient, headers: dict[str, str], s: Sample) -> None:
    """One streamed OpenAI chat completion (decided: its 200's headers arrived; first token: the first
    chunk with content)."""
    body = {"model": MODEL, "stream": True, "max_tokens": OUTPUT_TOKENS,
            "messages": [{"role": "user", "content": "Say eight words."}]}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await _error_answer(resp, s)
                return
            s.decided, s.typed = time.monotonic(), True
            tail = b""
            async for chunk in resp.aiter_raw():
                window = tail + chunk
                # The first chunk with text: a role chunk's empty content (chatplane sends one at
                # admission, as OpenAI does) is not a token.
                if s.first_token is None and FIRST_CONTENT.search(window):
                    s.first_token = time.monotonic()
                if b"data: [DONE]" in window:
                    s.code = "completed"
                tail = window[-64:]
            s.code = s.code or "eof"
    except httpx.HTTPError as exc:
        s.code = type(exc).__name__


async def _error_answer(resp: httpx.Response, s: Sample) -> None:
    raw = await resp.aread()
    s.decided = time.monotonic()
    try:
        err = json.loads(raw)["error"]
        s.code, s.typed = str(err.get("code") or err.get("type")), True
    except (ValueError, KeyError, TypeError, AttributeError):
        s.code = f"http_{resp.status_code}"


def snapshot(pids: dict[str, list[int]], stack: Stack | None) -> tuple[dict[str, float], Counter[str], int]:
    cpu = {name: sum(cpu_seconds(pid) or 0.0 for pid in group) for name, group in pids.items()}
    if stack is None:
        return cpu, Counter(), 0
    cass = write_bytes(pids["cassandra"][0]) if "cassandra" in pids else 0
    return cpu, kafka_log_bytes(stack), cass


def stack_pids(stack: Stack) -> dict[str, list[int]]:
    return {name: [pid] for name, pid in stack.pids().items()}


async def run_rate(rate: float, seconds: float, tail_s: float, base_url: str,
                   send: Callable[[httpx.AsyncClient, Sample], Awaitable[None]],
                   pids: Callable[[], dict[str, list[int]]], stack: Stack | None) -> Phase:
    """Open-loop load at ``rate`` for ``seconds`` through ``send``; CPU of ``pids()``; Kafka and
    Cassandra bytes when ``stack`` is chatplane's."""
    phase = Phase(rate)
    limits = httpx.Limits(max_connections=10_000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base_url, timeout=HTTP_TIMEOUT_S, limits=limits) as http:
        r0 = await kafka_records(stack) if stack is not None else Counter()
        cpu0, k0, c0 = snapshot(pids(), stack)
        t0 = time.monotonic()
        tasks = []
        n = int(rate * seconds)
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            s = Sample(time.monotonic())
            phase.samples.append(s)
            tasks.append(asyncio.create_task(send(http, s)))
        await asyncio.gather(*tasks)
        await asyncio.sleep(tail_s)
        cpu1, k1, c1 = snapshot(pids(), stack)
        phase.wall_s = time.monotonic() - t0
        r1 = await kafka_records(stack) if stack is not None else Counter()
    done = max(1, sum(s.code == "completed" for s in phase.samples))
    phase.cpu_ms = {name: (cpu1.get(name, 0.0) - cpu0.get(name, 0.0)) * 1000 / done for name in cpu1}
    phase.rss_mib = {name: sum(rss_bytes(pid) or 0 for pid in group) / MIB for name, group in pids().items()}
    phase.kafka_topics = {t: (k1[t] - k0.get(t, 0)) // done for t in k1 if k1[t] != k0.get(t, 0)}
    phase.kafka_records = {t: (r1[t] - r0.get(t, 0)) / done for t in r1 if r1[t] != r0.get(t, 0)}
    phase.kafka_bytes, phase.cassandra_bytes = sum(phase.kafka_topics.values()), (c1 - c0) // done
    return phase


def report(phase: Phase, who: str = "chatplane") -> str:
    ss = phase.samples
    done = [s for s in ss if s.code == "completed"]
    created = [(s.decided - s.sent) * 1000 for s in ss if s.decided is not None and s.typed]
    first = [(s.first_token - s.sent) * 1000 for s in done if s.first_token is not None]
    within = sum(1 for s in ss if s.typed and s.decided is not None and s.decided - s.sent <= DECISION_TARGET_S)
    added = [f - ENGINE_TTFT_MS for f in first]
    lines = [
        f"{who} rate {phase.rate:g}/s: {len(ss)} requests, {len(done)} completed, {phase.wall_s:.1f} s",
        f"  outcomes: {dict(Counter(s.code for s in ss).most_common())}",
        f"  decision (created or typed error) p50/p95/p99: {pct(created, .5):.0f} / {pct(created, .95):.0f} / {pct(created, .99):.0f} ms;"
        f" typed within 500 ms: {within / max(1, len(ss)):.2%}",
        f"  first token p50/p95/p99: {pct(first, .5):.0f} / {pct(first, .95):.0f} / {pct(first, .99):.0f} ms;"
        f" control plane's addition (minus the engine's {ENGINE_TTFT_MS:.0f} ms) p50 {pct(added, .5):.0f}, p95 {pct(added, .95):.0f} ms",
        f"  CPU ms per completed generation: total {sum(phase.cpu_ms.values()):.1f} = "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(phase.cpu_ms.items())),
    ]
    if phase.kafka_topics or phase.kafka_records:
        lines += [
            f"  bytes per generation: Kafka log segments {phase.kafka_bytes / 1024:.1f} KiB, Cassandra disk writes {phase.cassandra_bytes / 1024:.1f} KiB",
            "  Kafka bytes per generation by topic: "
            + ", ".join(f"{t} {b}" for t, b in sorted(phase.kafka_topics.items(), key=lambda kv: -kv[1])),
            f"  Kafka records per generation: {sum(phase.kafka_records.values()):.1f} = "
            + ", ".join(f"{t} {n:.1f}" for t, n in sorted(phase.kafka_records.items(), key=lambda kv: -kv[1])),
        ]
    lines.append("  RSS MiB at the end: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(phase.rss_mib.items())))
    return "\n".join(lines)


def summary(phase: Phase) -> dict[str, object]:
    """One phase as data (``--json``): what ``report`` prints, for bench/capacity.py and later comparisons."""
    ss = phase.samples
    done = [s for s in ss if s.code == "completed"]
    created = [(s.decided - s.sent) * 1000 for s in ss if s.decided is not None and s.typed]
    first = [(s.first_token - s.sent) * 1000 for s in done if s.first_token is not None]
    within = sum(1 for s in ss if s.typed and s.decided is not None and s.decided - s.sent <= DECISION_TARGET_S)
    return {
        "rate": phase.rate, "requests": len(ss), "completed": len(done), "wall_s": round(phase.wall_s, 3),
        "outcomes": dict(Counter(s.code for s in ss)),
        "typed_within_500ms": within / max(1, len(ss)),
        "decision_ms": {q: pct(created, v) for q, v in (("p50", .5), ("p95", .95), ("p99", .99))},
        "first_token_ms": {q: pct(first, v) for q, v in (("p50", .5), ("p95", .95), ("p99", .99))},
        "cpu_ms_per_generation": phase.cpu_ms,
        "rss_mib": phase.rss_mib,
        "kafka_bytes_per_generation": phase.kafka_bytes,
        "kafka_bytes_per_generation_by_topic": phase.kafka_topics,
        "kafka_records_per_generation": phase.kafka_records,
        "cassandra_disk_bytes_per_generation": phase.cassandra_bytes,
    }


# The held-streams phase (--hold-streams): memory and CPU per open stream, on a second stack whose sim
# worker writes a token every --hold-inter-token-ms (default: the seed's mean of twenty output tokens a
# second per sequence, section 2), each stream read as it comes.
HOLD_INTER_TOKEN_MS = 50
HOLD_OPEN_RATE = 10.0  # new streams a second while opening
HOLD_OUTPUT_TOKENS = 4_000  # long enough to stay open for the whole phase
HOLD_FIRST_TOKEN_WAIT_S = 120.0
HOLD_MEASURE_S = 10.0


async def hold_streams(n: int, work: Path, env: dict[str, str], inter_token_ms: int = HOLD_INTER_TOKEN_MS) -> dict[str, object]:
    """Open ``n`` streams (one new user each) on a fresh stack, wait until every one has its first
    token, then read RSS of every process and CPU over ``HOLD_MEASURE_S``; per stream is the difference
    against the same stack just before the streams opened, divided by the streams that were open."""
    stack = Stack(work, namespace=f"hold{uuid.uuid4().hex[:6]}", processors=1, workers=1, edges=1, readmodels=1,
                  env={**SIM_ENV, "CHATPLANE_SIM_INTER_TOKEN_MS": inter_token_ms,
                       "CHATPLANE_SIM_OUTPUT_TOKENS": 100_000, "CHATPLANE_SIM_MAX_CONCURRENT": n + 64,
                       "CHATPLANE_GENERATION_DURATION_MAX_MS": 3_600_000, "CHATPLANE_WORKER_GENERATION_DURATION_MAX_S": 3_600,
                       # the phase measures holding streams, not admission: the edge's capacity estimate
                       # (built for 10 ms tokens) would refuse most of these slow, long ones
                       # and the edge's adaptive in-flight limit starts at CHATPLANE_EDGE_SHED_STREAMS_MIN held streams
                       # and rises only as decisions come back in time: off too (docs/cost.md's "before" settings)
                       "CHATPLANE_EDGE_CAPACITY_CHECK": 0, "CHATPLANE_EDGE_SHED_DECISION_AGE_MS": 0,
                       "CHATPLANE_EDGE_SHED_LOOP_LAG_MS": 0, "CHATPLANE_EDGE_SHED_LATENCY_TARGET_MS": 0, **env})
    await stack.start()
    opened: list[asyncio.Task[None]] = []
    first = 0
    ends: Counter[str] = Counter()  # how the streams that ended before the phase's end ended
    waiting = n  # streams neither past their first token nor ended
    measuring = False
    deltas = 0  # text delta events received while measuring
    stop = asyncio.Event()

    async def hold(http: httpx.AsyncClient) -> None:
        """One stream, read until the phase ends; ``waiting`` drops once it has its first token or ended."""
        nonlocal first, waiting, deltas
        user = f"h{uuid.uuid4().hex[:12]}"
        body = {"model": MODEL, "stream": True, "max_output_tokens": HOLD_OUTPUT_TOKENS,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}
        headers = {"Authorization": f"Bearer {stack.token(user)}", "Idempotency-Key": uuid.uuid4().hex}
        seen = False
        try:
            async with http.stream("POST", "/v1/generations", json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    s = Sample(0.0)
                    await _error_answer(resp, s)
                    ends[s.code] += 1
                    return
                tail = b""
                async for chunk in resp.aiter_raw():
                    window = tail + chunk
                    if not seen and b"generation.text.delta" in window:
                        seen, first, waiting = True, first + 1, waiting - 1
                    if measuring:
                        deltas += chunk.count(b"event: generation.text.delta")
                    if stop.is_set():
                        return
                    for name in (b"generation.completed", b"generation.error", b"generation.cancelled"):
                        if b"event: " + name in window:
                            ends[name.decode()] += 1
                            return
                    tail = window[-64:]
                ends["eof"] += 1
        except httpx.HTTPError as exc:
            ends[type(exc).__name__] += 1
        finally:
            if not seen:
                waiting -= 1

    try:
        limits = httpx.Limits(max_connections=n + 100, max_keepalive_connections=n + 100)
        async with httpx.AsyncClient(base_url=stack.edge_urls[0], timeout=HTTP_TIMEOUT_S, limits=limits) as http:
            await asyncio.sleep(5.0)  # settle after start
            before_rss = {name: (rss_bytes(pid) or 0) / MIB for name, pid in stack.pids().items()}
            before_cpu, _, _ = snapshot(stack_pids(stack), None)
            t_before = time.monotonic()
            await asyncio.sleep(HOLD_MEASURE_S)
            idle_cpu_pct = {k: (v - before_cpu[k]) / (time.monotonic() - t_before) * 100
                            for k, v in snapshot(stack_pids(stack), None)[0].items()}
            t0 = time.monotonic()
            for i in range(n):
                await asyncio.sleep(max(0.0, t0 + i / HOLD_OPEN_RATE - time.monotonic()))
                opened.append(asyncio.create_task(hold(http)))
            deadline = time.monotonic() + HOLD_FIRST_TOKEN_WAIT_S
            while waiting > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            open_now = sum(1 for t in opened if not t.done())
            cpu0, _, _ = snapshot(stack_pids(stack), None)
            t1 = time.monotonic()
            measuring = True
            await asyncio.sleep(HOLD_MEASURE_S)
            measuring = False
            cpu1, _, _ = snapshot(stack_pids(stack), None)
            held_s = time.monotonic() - t1
            held_rss = {name: (rss_bytes(pid) or 0) / MIB for name, pid in stack.pids().items()}
            still_open = sum(1 for t in opened if not t.done())
            stop.set()
            for t in opened:
                t.cancel()
            await asyncio.gather(*opened, return_exceptions=True)
    finally:
        stack.stop()
    held = max(1, min(open_now, still_open))
    return {
        "streams_requested": n, "streams_with_first_token": first, "streams_open_measured": held,
        "ended_early": dict(ends),
        "inter_token_ms": inter_token_ms,
        "deltas_per_s_per_stream": deltas / held_s / held,
        "rss_mib_before": before_rss, "rss_mib_held": held_rss,
        "rss_kib_per_stream": {k: (held_rss.get(k, 0.0) - before_rss.get(k, 0.0)) * 1024 / held for k in held_rss},
        "idle_cpu_pct": idle_cpu_pct,
        "held_cpu_pct": {k: (cpu1[k] - cpu0.get(k, 0.0)) / held_s * 100 for k in cpu1},
        "cpu_pct_per_stream": {k: ((cpu1[k] - cpu0.get(k, 0.0)) / held_s * 100 - idle_cpu_pct.get(k, 0.0)) / held
                               for k in cpu1},
    }


def hold_report(h: dict[str, object]) -> str:
    per = h["rss_kib_per_stream"]
    cpu = h["cpu_pct_per_stream"]
    assert isinstance(per, dict) and isinstance(cpu, dict)
    return "\n".join([
        f"held streams: {h['streams_open_measured']} open of {h['streams_requested']} requested "
        f"({h['streams_with_first_token']} had their first token), one token per {h['inter_token_ms']} ms"
        f" ({h['deltas_per_s_per_stream']:.1f} delta events/s per stream arrived);"
        f" ended before the measure: {h['ended_early'] or 'none'}",
        "  RSS KiB per held stream: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items())),
        "  CPU % of a core per held stream (above idle): " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(cpu.items())),
    ])


def first_token_ms(phase: Phase) -> list[float]:
    return [(s.first_token - s.sent) * 1000 for s in phase.samples if s.code == "completed" and s.first_token is not None]


def side_by_side(ours: list[Phase], peer: list[Phase], peer_cpu_names: tuple[str, ...]) -> str:
    lines = ["", "side by side (first token p50 / p95 / p99 ms; CPU ms per completed request)",
             f"{'rate':>6}  {'chatplane':>22}  {'LiteLLM':>22}  {'chatplane CPU':>14}  {'LiteLLM CPU':>12}  p95 at or below"]
    for a, b in zip(ours, peer, strict=True):
        fa, fb = first_token_ms(a), first_token_ms(b)
        cpu_b = sum(v for k, v in b.cpu_ms.items() if k in peer_cpu_names)
        lines.append(f"{a.rate:>6g}  {pct(fa, .5):>6.0f} / {pct(fa, .95):>5.0f} / {pct(fa, .99):>5.0f}  "
                     f"{pct(fb, .5):>6.0f} / {pct(fb, .95):>5.0f} / {pct(fb, .99):>5.0f}  "
                     f"{sum(a.cpu_ms.values()):>14.1f}  {cpu_b:>12.1f}  {'yes' if pct(fa, .95) <= pct(fb, .95) else 'NO'}")
    return "\n".join(lines)


async def idle_cpu(pids: Callable[[], dict[str, list[int]]], seconds: float) -> dict[str, float]:
    cpu0, _, _ = snapshot(pids(), None)
    await asyncio.sleep(seconds)
    cpu1, _, _ = snapshot(pids(), None)
    return {k: (cpu1[k] - cpu0.get(k, 0.0)) / seconds * 100 for k in cpu1}


async def bench(args: argparse.Namespace, work: Path) -> None:
    stack = Stack(work, namespace=f"bench{uuid.uuid4().hex[:6]}", processors=1, workers=1,
                  edges=2 if args.tracing else 1, readmodels=1,
                  env={**SIM_ENV, **(TRACING_ENV if args.tracing else {}), **dict(item.split("=", 1) for item in args.env)})
    if args.tracing:  # edge-1 starts no traces (the baseline), edge-2 traces every generation
        stack.components["edge-1"].env["CHATPLANE_TRACING"] = "off"
    targets = [(" (tracing off)", 0), (" (tracing on)", 1)] if args.tracing else [("", 0)]
    ours: list[Phase] = []
    record: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
                              "commit": _commit(), "phases": []}
    await stack.start()
    try:
        for url in stack.edge_urls if args.warmup_s > 0 else ():  # JIT-warm the JVMs, fill the pools; not reported
            await run_rate(WARMUP_RATE, args.warmup_s, args.tail_s, url,
                           lambda http, s: one(http, stack, s), lambda: stack_pids(stack), stack)
        idle = await idle_cpu(lambda: stack_pids(stack), args.idle_s)
        record["idle_cpu_pct"] = idle
        print(f"chatplane idle over {args.idle_s:g} s, % of one core: "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(idle.items())), flush=True)
        sends = {"generations": one, "openai": ours_openai}
        for rate in args.rates:
            for api in args.api:
                send = sends[api]
                for label, edge in targets:  # with --tracing: the same rate untraced, then traced
                    phase = await run_rate(rate, args.seconds, args.tail_s, stack.edge_urls[edge],
                                           lambda http, s, send=send: send(http, stack, s), lambda: stack_pids(stack), stack)
                    if api == args.api[0] and edge == 0:
                        ours.append(phase)
                    record["phases"].append({"api": api, "tracing": edge == 1, **summary(phase)})
                    who = "chatplane" if api == "generations" else f"chatplane {API_PATHS[api]}"
                    print(report(phase, who + label), flush=True)
                    await asyncio.sleep(args.pause_s)
    finally:
        stack.stop()
    if args.hold_streams > 0:
        record["hold"] = await hold_streams(args.hold_streams, work / "hold", dict(item.split("=", 1) for item in args.env),
                                           args.hold_inter_token_ms)
        print(hold_report(record["hold"]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1, default=str))
        print(f"figures written to {args.json}", flush=True)
    if args.peer != "litellm":
        return
    peer = LiteLLMPeer(work / "litellm", args.peer_venv, args.peer_workers, MODEL, ENGINE_TTFT_MS, 10.0)
    theirs: list[Phase] = []
    await peer.start()
    try:
        if args.warmup_s > 0:
            await run_rate(WARMUP_RATE, args.warmup_s, args.tail_s, peer.url, lambda http, s: peer_one(http, peer, s),
                           peer.pids, None)
        idle = await idle_cpu(peer.pids, args.idle_s)
        print(f"LiteLLM ({args.peer_workers} worker(s)) idle over {args.idle_s:g} s, % of one core: "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(idle.items())), flush=True)
        for rate in args.rates:
            phase = await run_rate(rate, args.seconds, args.tail_s, peer.url, lambda http, s: peer_one(http, peer, s),
                                   peer.pids, None)
            theirs.append(phase)
            print(report(phase, f"LiteLLM {args.peer_workers}w"), flush=True)
            await asyncio.sleep(args.pause_s)
    finally:
        peer.stop()
    print(side_by_side(ours, theirs, ("litellm",)), flush=True)


def _commit() -> str:
    import subprocess

    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_stack.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=[20.0, 50.0, 100.0])
    p.add_argument("--seconds", type=float, default=30.0, help="seconds of load per rate")
    p.add_argument("--idle-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=20.0,
                   help=f"load at {WARMUP_RATE:g}/s after the stack is up, before the idle measure (not reported)")
    p.add_argument("--tail-s", type=float, default=3.0, help="after the last stream ended, still counted")
    p.add_argument("--pause-s", type=float, default=5.0, help="between rates")
    p.add_argument("--peer", choices=("none", "litellm"), default="none",
                   help="litellm: the same load against LiteLLM's proxy afterwards, and the two side by side")
    p.add_argument("--peer-venv", type=Path, default=DEFAULT_VENV, help="where LiteLLM is (installed there when missing)")
    p.add_argument("--peer-workers", type=int, default=1, help="LiteLLM proxy worker processes")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="a setting for every chatplane component")
    p.add_argument("--api", type=lambda v: v.split(","), default=["generations"],
                   help="chatplane's API(s) per rate, one phase each, in this order: generations, openai "
                        "(/v1/chat/completions on the same pipeline); the first is the one compared with the peer")
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--json", type=Path, help="also write every figure as JSON here (bench/capacity.py reads it)")
    p.add_argument("--tracing", action="store_true",
                   help="two edges: each rate through edge-1 (starts no traces) and then edge-2 (traces every "
                        "generation); every component has CHATPLANE_TRACING=drop (spans encoded, then dropped: "
                        "docs/tracing.md), so the two phases compare tracing's CPU and latency in one run")
    p.add_argument("--hold-streams", type=int, default=0,
                   help="after the rates: open this many slow streams on a second stack and measure memory and CPU per "
                        "held stream (the capacity model's input)")
    p.add_argument("--hold-inter-token-ms", type=int, default=HOLD_INTER_TOKEN_MS,
                   help="the held streams' engine pace (default: the seed's 20 output tokens/s per sequence)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.api) - set(API_PATHS))
    if unknown:
        p.error(f"--api: unknown {', '.join(unknown)} (expected {', '.join(API_PATHS)})")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="chatplane-bench-"))
    asyncio.run(bench(args, work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
