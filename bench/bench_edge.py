"""Benchmark the HTTP/SSE edge with the whole stack on this machine (a script that prints figures).

    .venv/bin/python bench/bench_edge.py [--only admission|streams|deltas] [--bootstrap HOST:PORT]
        [--rate 200] [--seconds 15] [--streams 10000] [--hold-s 35] [--delta-streams 200]
        [--delta-rate 20000] [--delta-seconds 10]

Each part starts a fresh topic namespace, the real processor (``python -m projections``) and one
edge process (``python -m edge``), all on this machine, and stops them afterwards.

1. admission: streaming POSTs paced open-loop at --rate/s (a new user each, so no limit refuses),
   p50/p99 of POST sent -> ``generation.created`` read by the client, and the share of requests that
   got a typed decision (created event or typed error) within 500 ms. Baseline in the same run: the
   processor's own submit -> decision round trip through ``CommandClient`` at the same rate, so the
   edge's added latency is the difference. Queue deadlines and disconnect cancels are moved past the
   run, so both phases cost the processor one command per request.
2. streams: --streams SSE streams admitted and held open (their generations stay queued: the queue
   deadline is raised for the run) while heartbeats flow for --hold-s; the edge's RSS before and
   after, bytes per stream, and how many streams saw a heartbeat.
3. deltas: --delta-streams streams held, then a publisher (standing in for workers) sends TextDeltas
   to the edge's inbox partition paced at --delta-rate/s, each stamped with its publish time; the
   clients count deltas and the publish -> client receipt latency. Baseline in the same run: the bare
   Kafka publish -> consume latency on the same partition at the same rate, so the edge's added
   latency is the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # noqa: E402

from infra.runtime.settings import kafka_bootstrap  # noqa: E402
from infra.runtime.command_client import CommandClient  # noqa: E402
from infra.runtime.kafka_admin import delete_topics, deployment_topics, ensure_topics  # noqa: E402
from schemas.codes import Tier  # noqa: E402
from schemas.commands import SubmitGeneration  # noqa: E402
from schemas.messages import TextDelta  # noqa: E402
from schemas.topics import Topology  # noqa: E402
from schemas.wire import encode  # noqa: E402
from infra.harness.processes import (  # noqa: E402
    EDGE_INBOX_PARTITION,
    EdgeProcess,
    ProcessorProcess,
    wait_until_deciding,
)

TYPED_DECISION_S = 0.5
WARMUP_S = 2.0
LONG_QUEUE_MS = 900_000  # streams and deltas runs: generations stay queued (no worker) while held
CONNECT_CONCURRENCY_MAX = 400
ADMISSION_DISCONNECT_GRACE_S = 600  # admission run: disconnect cancels come after the measurement


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/<pid>/stat, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} on {os.cpu_count()} CPUs"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.asynccontextmanager
async def stack(bootstrap: str, **env: str):
    topology = Topology(f"bench{uuid.uuid4().hex[:8]}")
    await ensure_topics(bootstrap, deployment_topics(topology))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-edge-"))
    processor = ProcessorProcess(bootstrap, topology.namespace, log_dir, **env)
    edge = EdgeProcess(bootstrap, topology, log_dir, **env)
    try:
        processor.start()
        async with CommandClient(bootstrap, topology, inbox_partition=0, decision_timeout_s=15) as probe:
            await wait_until_deciding(probe)
        await edge.start()
        yield topology, processor, edge
    finally:
        edge.stop()
        processor.stop()
        await delete_topics(bootstrap, [s.name for s in deployment_topics(topology)])
        print(f"  (logs in {log_dir})")


def body(i: int) -> bytes:
    return (
        b'{"model":"fast-text-model","messages":[{"role":"user","content":"bench '
        + str(i).encode()
        + b'"}],"stream":true,"max_output_tokens":4096}'
    )


def raw_request(edge: EdgeProcess, user: str, i: int) -> bytes:
    payload = body(i)
    auth = edge.headers(user, f"k{i}")
    return (
        b"POST /v1/generations HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
        + f"Authorization: {auth['Authorization']}\r\nIdempotency-Key: k{i}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )


# --- 1. admission latency ------------------------------------------------------------------------


async def baseline_decisions(bootstrap: str, topology: Topology, rate: float, seconds: float) -> list[float]:
    """Submit -> decision through CommandClient at the same rate: the processor's floor."""
    latencies: list[float] = []
    async with CommandClient(bootstrap, topology, inbox_partition=2, decision_timeout_s=10) as client:

        async def one(i: int) -> None:
            c = SubmitGeneration(
                command_id=uuid.uuid4().hex, user_id=f"base-{i}", issued_at_ms=int(time.time() * 1000),
                idempotency_key="k", fingerprint="hmac-sha256:" + "0" * 16, model_alias="fast-text-model",
                tier=Tier.FREE, stream=True, max_output_tokens=16, input_tokens=10, reply_to=client.reply_to(),
            )
            t = time.perf_counter()
            await client.decide(c)
            latencies.append(time.perf_counter() - t)

        await paced(rate, seconds, one)
    return latencies[int(rate * WARMUP_S) :]


async def paced(rate: float, seconds: float, fn) -> None:
    n = int(rate * seconds)
    t0 = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fn(i)))
    await asyncio.gather(*tasks, return_exceptions=True)


async def bench_admission(bootstrap: str, rate: float, seconds: float) -> None:
    print(f"\n== admission: streaming POST -> generation.created at {rate:.0f}/s for {seconds:.0f} s")
    # Both phases must cost the processor the same: one SubmitGeneration each. So nothing admitted
    # expires in the window (the baseline's generations would hit their queue deadline during the
    # edge phase) and the edge's disconnect cancels (the client closes after generation.created)
    # fall after it.
    env = {"CHATPLANE_QUEUE_WAIT_MAX_MS": str(LONG_QUEUE_MS), "CHATPLANE_EDGE_DISCONNECT_GRACE_S": str(ADMISSION_DISCONNECT_GRACE_S)}
    async with stack(bootstrap, **env) as (topology, _processor, edge):
        base = await baseline_decisions(bootstrap, topology, rate, seconds)
        n = int(rate * seconds)
        requests = [raw_request(edge, f"adm-{i}-{uuid.uuid4().hex[:4]}", i) for i in range(n)]
        latencies: list[float] = []
        outcomes: dict[str, int] = {}
        port = edge.port

        async def one(i: int) -> None:
            t = time.perf_counter()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(requests[i])
                buf = b""
                while b"\n\n" not in buf.split(b"\r\n\r\n", 1)[-1] or b"\r\n\r\n" not in buf:
                    chunk = await asyncio.wait_for(reader.read(4096), 30)
                    if not chunk:
                        break
                    buf += chunk
                    if buf.startswith(b"HTTP/1.1 4") or buf.startswith(b"HTTP/1.1 5"):
                        if b"\r\n\r\n" in buf and b"}" in buf.split(b"\r\n\r\n", 1)[1]:
                            break
                elapsed = time.perf_counter() - t
                if b"event: generation.created" in buf:
                    kind = "created"
                elif b'"error":{"code":"' in buf:
                    kind = buf.split(b'"error":{"code":"')[1].split(b'"')[0].decode()
                else:
                    kind = "untyped"
                outcomes[kind] = outcomes.get(kind, 0) + 1
                if i >= rate * WARMUP_S:
                    latencies.append(elapsed if kind != "untyped" else float("inf"))
            except Exception as exc:  # noqa: BLE001 - counted: a benchmark reports failures, it does not stop
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                if i >= rate * WARMUP_S:
                    latencies.append(float("inf"))
            finally:
                writer.close()

        assert edge.proc is not None
        cpu0, wall0 = cpu_s(edge.proc.pid), time.perf_counter()
        await paced(rate, seconds, one)
        edge_cpu = cpu_s(edge.proc.pid) - cpu0
        wall = time.perf_counter() - wall0
        async with httpx.AsyncClient(base_url=edge.url) as http:
            metrics = (await http.get("/metrics")).text
        # The edge's own view (request received -> decision), to tell edge time from client time.
        buckets = {
            line.split('le="')[1].split('"')[0]: float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("chatplane_edge_decision_seconds_bucket")
        }
        within = sum(1 for x in latencies if x <= TYPED_DECISION_S) / max(1, len(latencies))
        ms = lambda x: f"{x * 1000:.1f} ms"  # noqa: E731
        print(f"  baseline CommandClient submit -> decision : p50 {ms(pct(base, 50))}  p99 {ms(pct(base, 99))}  (n={len(base)})")
        print(f"  edge POST -> generation.created         : p50 {ms(pct(latencies, 50))}  p99 {ms(pct(latencies, 99))}  (n={len(latencies)}; target p99 <= 60 ms)")
        print(f"  edge added over the baseline           : p50 {ms(pct(latencies, 50) - pct(base, 50))}  p99 {ms(pct(latencies, 99) - pct(base, 99))}")
        print(f"  typed decision within 500 ms            : {within * 100:.2f} % of {len(latencies)} measured requests")
        print(f"  outcomes                                : {dict(sorted(outcomes.items()))}")
        total_decided = buckets.get("+Inf", 0.0) or 1.0
        shares = "  ".join(f"<= {le} s: {buckets[le] / total_decided * 100:.1f} %" for le in ("0.05", "0.1", "0.5") if le in buckets)
        print(f"  edge's own received -> decision         : {shares}  (n={total_decided:.0f}, /metrics histogram)")
        print(f"  edge process CPU                        : {edge_cpu:.1f} s over {wall:.1f} s ({edge_cpu / max(1, n) * 1000:.2f} ms per request)")
        print(f"  machine                                 : {load()}")


# --- 2. held streams -----------------------------------------------------------------------------


async def bench_streams(bootstrap: str, streams: int, hold_s: float) -> None:
    print(f"\n== streams: {streams} SSE streams held with heartbeats for {hold_s:.0f} s")
    env = {"CHATPLANE_QUEUE_WAIT_MAX_MS": str(LONG_QUEUE_MS), "CHATPLANE_EDGE_GENERATION_WAIT_S_MAX": "3600"}
    async with stack(bootstrap, **env) as (_topology, _processor, edge):
        assert edge.proc is not None
        pid = edge.proc.pid
        # Warm the edge's code paths (first requests import and allocate) before the idle baseline.
        warm = [raw_request(edge, f"warm-{i}", i) for i in range(20)]
        await open_streams(edge.port, warm)
        await asyncio.sleep(2)
        before = rss_bytes(pid)
        requests = [raw_request(edge, f"st-{i}-{uuid.uuid4().hex[:4]}", i) for i in range(streams)]
        t = time.perf_counter()
        conns = await open_streams(edge.port, requests)
        opened = sum(1 for c in conns if c is not None)
        print(f"  opened {opened}/{streams} streams in {time.perf_counter() - t:.1f} s")
        heartbeats = [0] * len(conns)

        async def listen(i: int) -> None:
            reader = conns[i][0]
            while True:
                chunk = await reader.read(4096)
                if not chunk:
                    return
                heartbeats[i] += chunk.count(b": keep-alive\n\n")

        listeners = [asyncio.create_task(listen(i)) for i, c in enumerate(conns) if c is not None]
        peak = 0
        end = time.monotonic() + hold_s
        while time.monotonic() < end:
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(1)
        after = rss_bytes(pid)
        with_hb = sum(1 for i, c in enumerate(conns) if c is not None and heartbeats[i] > 0)
        async with httpx.AsyncClient(base_url=edge.url) as http:
            metrics = (await http.get("/metrics")).text
        active = next((line.split()[-1] for line in metrics.splitlines() if line.startswith("chatplane_edge_active_streams ")), "?")
        for task in listeners:
            task.cancel()
        for c in conns:
            if c is not None:
                c[1].close()
        per = (peak - before) / max(1, opened)
        print(f"  edge RSS idle {before / 2**20:.0f} MiB -> held {after / 2**20:.0f} MiB (peak {peak / 2**20:.0f} MiB; target <= 1536 MiB at 10,000)")
        print(f"  bytes per held stream                   : {per / 1024:.1f} KiB")
        print(f"  streams that received a heartbeat       : {with_hb}/{opened}  (edge active_streams gauge {active})")
        print(f"  machine                                 : {load()}")


async def open_streams(port: int, requests: list[bytes]) -> list:
    sem = asyncio.Semaphore(CONNECT_CONCURRENCY_MAX)

    async def one(req: bytes):
        async with sem:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(req)
                buf = b""
                while b"generation.created" not in buf:
                    chunk = await asyncio.wait_for(reader.read(4096), 60)
                    if not chunk or buf.startswith(b"HTTP/1.1 4") or buf.startswith(b"HTTP/1.1 5"):
                        writer.close()
                        return None
                    buf += chunk
                return reader, writer, buf
            except (OSError, TimeoutError):
                return None

    return await asyncio.gather(*(one(r) for r in requests))


# --- 3. delta delivery ---------------------------------------------------------------------------


async def bench_deltas(bootstrap: str, n_streams: int, rate: float, seconds: float) -> None:
    print(f"\n== deltas: {n_streams} streams, TextDeltas published at {rate:.0f}/s for {seconds:.0f} s")
    env = {"CHATPLANE_QUEUE_WAIT_MAX_MS": str(LONG_QUEUE_MS), "CHATPLANE_EDGE_GENERATION_WAIT_S_MAX": "3600"}
    async with stack(bootstrap, **env) as (topology, _processor, edge):
        base = await kafka_floor(bootstrap, topology, rate, min(seconds, 5.0))
        requests = [raw_request(edge, f"dl-{i}-{uuid.uuid4().hex[:4]}", i) for i in range(n_streams)]
        conns = await open_streams(edge.port, requests)
        assert all(c is not None for c in conns), "a stream did not open"
        gids = [c[2].split(b'"generation_id":"')[1].split(b'"')[0].decode() for c in conns]
        received: list[list[float]] = [[] for _ in conns]
        span_ns = [0, 0]  # first and last receipt of a delta, any client

        async def listen(i: int) -> None:
            reader = conns[i][0]
            buf = b""
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                now_ns = time.time_ns()
                buf += chunk
                *frames, buf = buf.split(b"\n\n")
                for f in frames:
                    j = f.find(b'"delta":"')
                    if j >= 0:
                        received[i].append((now_ns - int(f[j + 9 : j + 28])) / 1e9)
                        span_ns[0] = span_ns[0] or now_ns
                        span_ns[1] = now_ns

        listeners = [asyncio.create_task(listen(i)) for i in range(len(conns))]
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=2, max_batch_size=256 * 1024)
        await producer.start()
        inbox = topology.edge_inbox.name
        total = int(rate * seconds)
        tick_s = 0.01
        per_tick = max(1, int(rate * tick_s))
        seq = [0] * n_streams
        assert edge.proc is not None
        cpu0 = cpu_s(edge.proc.pid)
        t0 = time.perf_counter()
        sent = 0
        pad = "x" * 12
        while sent < total:
            for _ in range(per_tick):
                k = sent % n_streams
                text = f"{time.time_ns():019d}{pad}"
                d = TextDelta(generation_id=gids[k], epoch=1, sequence=seq[k], index=0, text=text)
                seq[k] += 1
                await producer.send(inbox, encode(d), partition=EDGE_INBOX_PARTITION)
                sent += 1
            delay = t0 + (sent / rate) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        await producer.flush()
        publish_s = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while sum(len(r) for r in received) < total and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        got = sum(len(r) for r in received)
        edge_cpu = cpu_s(edge.proc.pid) - cpu0
        await producer.stop()
        async with httpx.AsyncClient(base_url=edge.url) as http:
            metrics = (await http.get("/metrics")).text
        slow = sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("chatplane_edge_slow_consumer_cancels_total"))
        for t in listeners:
            t.cancel()
        for c in conns:
            c[1].close()
        warm = [x for r in received for x in r]
        last_receipt_span = max(1e-9, (span_ns[1] - span_ns[0]) / 1e9)  # first to last receipt
        ms = lambda x: f"{x * 1000:.1f} ms"  # noqa: E731
        print(f"  published {sent} deltas in {publish_s:.2f} s ({sent / publish_s:.0f}/s offered)")
        print(f"  delivered {got}/{total} to SSE clients  : {got / last_receipt_span:.0f} deltas/s (target >= 20,000/s)")
        print(f"  baseline Kafka publish -> consume        : p50 {ms(pct(base, 50))}  p99 {ms(pct(base, 99))}")
        print(f"  publish -> SSE client receipt            : p50 {ms(pct(warm, 50))}  p99 {ms(pct(warm, 99))}")
        print(f"  edge added over the baseline             : p50 {ms(pct(warm, 50) - pct(base, 50))}  p99 {ms(pct(warm, 99) - pct(base, 99))} (target p99 <= 50 ms)")
        print(f"  slow-consumer cancels                    : {slow:.0f}")
        print(f"  edge process CPU                         : {edge_cpu:.1f} s for {got} deltas ({got / max(1e-9, edge_cpu):.0f} deltas per edge CPU-second)")
        print(f"  machine                                  : {load()}")


async def kafka_floor(bootstrap: str, topology: Topology, rate: float, seconds: float) -> list[float]:
    """Publish -> consume latency of one inbox partition, no edge: the floor of the delta path."""
    tp = TopicPartition(topology.edge_inbox.name, 5)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=5)
    await consumer.start()
    consumer.assign([tp])
    await consumer.seek_to_end(tp)
    await consumer.position(tp)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=2)
    await producer.start()
    total = int(rate * seconds)
    latencies: list[float] = []

    async def consume() -> None:
        while len(latencies) < total:
            batches = await consumer.getmany(timeout_ms=100)
            now_ns = time.time_ns()
            for records in batches.values():
                for r in records:
                    latencies.append((now_ns - int(r.value[:19])) / 1e9)

    reader = asyncio.create_task(consume())
    t0 = time.perf_counter()
    per_tick = max(1, int(rate * 0.01))
    sent = 0
    while sent < total:
        for _ in range(per_tick):
            await producer.send(tp.topic, f"{time.time_ns():019d}".encode() + b"x" * 100, partition=tp.partition)
            sent += 1
        delay = t0 + sent / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    await producer.flush()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(reader, 30)
    reader.cancel()
    await producer.stop()
    await consumer.stop()
    return latencies


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["admission", "streams", "deltas"])
    p.add_argument("--bootstrap", default=kafka_bootstrap())
    p.add_argument("--rate", type=float, default=200)
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--streams", type=int, default=10_000)
    p.add_argument("--hold-s", type=float, default=35)
    p.add_argument("--delta-streams", type=int, default=200)
    p.add_argument("--delta-rate", type=float, default=20_000)
    p.add_argument("--delta-seconds", type=float, default=10)
    a = p.parse_args()
    if a.only in (None, "admission"):
        await bench_admission(a.bootstrap, a.rate, a.seconds)
    if a.only in (None, "streams"):
        await bench_streams(a.bootstrap, a.streams, a.hold_s)
    if a.only in (None, "deltas"):
        await bench_deltas(a.bootstrap, a.delta_streams, a.delta_rate, a.delta_seconds)


if __name__ == "__main__":
    asyncio.run(main())
