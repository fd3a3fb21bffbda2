"""Benchmark the admission processor on the real broker (a script that prints figures, not a test).

    .venv/bin/python bench/bench_processor.py [--bootstrap HOST:PORT] [--commands 20000]
        [--rate 500] [--latency-seconds 20] [--recovery-users 100000]

1. Throughput: a realistic mix (submit, accept, renew, report, some cancels and same-key retries) for
   many users is produced to a fresh COMMANDS topic first; then one processor process is started and
   the time from its first to its last decision is measured (decisions counted on the inbox).
2. Latency: submits paced at --rate per second from a client that produces to COMMANDS and reads its
   inbox, p50/p99 of submit -> decision, beside the floor measured in the same run: a bare aiokafka
   produce -> consume round trip on one topic with the same producer/consumer settings. Nothing
   accepts the attempts, so by default their queue deadline is set past the run; --expiry-wave keeps
   the policy's 15 s and splits the figure at the moment the timer starts fencing them all.
3. Recovery: --recovery-users users' state in the table, kill -9, restart, time until the first
   decision for a previously seen user (includes faust start, rebalance and changelog recovery).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.runtime.settings import kafka_bootstrap  # noqa: E402
from control_plane.ids import generation_id_for  # noqa: E402
from infra.runtime.command_client import CommandClient  # noqa: E402
from infra.runtime.kafka_admin import delete_topics, deployment_topics, ensure_topics  # noqa: E402
from infra.runtime.settings import policy_from_env  # noqa: E402
from schemas import commands as cmd  # noqa: E402
from schemas.codes import FinishOutcome, Tier  # noqa: E402
from schemas.commands import ReplyTo  # noqa: E402
from schemas.topics import Topology  # noqa: E402
from schemas.wire import encode  # noqa: E402
from infra.harness.processes import ProcessorProcess, wait_until_deciding  # noqa: E402

DECISION_WAIT_S_MAX = 600.0
WARMUP_S = 2.0  # decisions in the first seconds (new connections, metadata) are not measured


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def mixed_commands(n: int, users: int, reply: ReplyTo, t0_ms: int) -> list[cmd.Command]:
    """Per user: submit, a same-key retry, accept, two renewals, report (every 7th is cancelled)."""
    out: list[cmd.Command] = []
    i = 0
    while len(out) < n:
        for u in range(users):
            if len(out) >= n:
                break
            user = f"bench-user-{u}"
            key = f"k{i}"
            now = t0_ms + i

            def base(c: str) -> dict:
                return {"command_id": c, "user_id": user, "issued_at_ms": now, "reply_to": reply}

            submit_id = f"s{i}-{u}"
            g = generation_id_for(user, submit_id)
            submit = dict(
                idempotency_key=key, fingerprint="fp-bench-000", model_alias="fast-text-model", tier=Tier.FREE,
                stream=True, max_output_tokens=200, input_tokens=30,
            )
            out.append(cmd.SubmitGeneration(**base(submit_id), **submit))
            out.append(cmd.SubmitGeneration(**base(f"r{i}-{u}"), **submit))
            out.append(cmd.AcceptAttempt(**base(f"a{i}-{u}"), generation_id=g, epoch=1, worker_id="w1"))
            out.append(cmd.RenewLease(**base(f"l{i}-{u}"), generation_id=g, epoch=1, worker_id="w1", output_tokens=10))
            if i % 7 == 0:
                out.append(cmd.CancelGeneration(**base(f"c{i}-{u}"), generation_id=g))
                outcome = FinishOutcome.STOPPED
            else:
                out.append(cmd.RenewLease(**base(f"m{i}-{u}"), generation_id=g, epoch=1, worker_id="w1", output_tokens=20))
                outcome = FinishOutcome.COMPLETED
            out.append(
                cmd.ReportAttemptFinished(
                    **base(f"f{i}-{u}"), generation_id=g, epoch=1, worker_id="w1", outcome=outcome,
                    input_tokens=30, output_tokens=25,
                )
            )
        i += 1
    return out[:n]


async def count_inbox(bootstrap: str, topology: Topology, partition: int, expected: int) -> tuple[float, float]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    tp = TopicPartition(topology.edge_inbox.name, partition)
    consumer.assign([tp])
    consumer.seek(tp, 0)
    seen, first, last = 0, None, None
    deadline = time.monotonic() + DECISION_WAIT_S_MAX
    try:
        while seen < expected and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            for records in batch.values():
                now = time.monotonic()
                first = first or now
                last = now
                seen += len(records)
    finally:
        await consumer.stop()
    if seen < expected:
        raise RuntimeError(f"only {seen}/{expected} decisions arrived")
    return first or 0.0, last or 0.0


async def throughput(bootstrap: str, n: int, tmp: Path) -> float:
    topology = Topology(f"bench{uuid.uuid4().hex[:8]}")
    await ensure_topics(bootstrap, deployment_topics(topology))
    try:
        reply = ReplyTo(topic=topology.edge_inbox.name, partition=1, request_id="bench")
        commands = mixed_commands(n, users=max(50, n // 60), reply=reply, t0_ms=int(time.time() * 1000))
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
        await producer.start()
        try:
            for c in commands:
                await producer.send(topology.commands.name, encode(c), key=c.user_id.encode())
            await producer.flush()
        finally:
            await producer.stop()
        p = ProcessorProcess(bootstrap, topology.namespace, tmp)
        started = time.monotonic()
        p.start("bench")
        try:
            first, last = await count_inbox(bootstrap, topology, 1, len(commands))
        finally:
            p.stop()
        rate = len(commands) / (last - first)
        print(f"throughput: {len(commands)} commands decided in {last - first:.2f} s "
              f"(first decision {first - started:.1f} s after start) -> {rate:,.0f} commands/s (target >= 2,000/s)")
        return rate
    finally:
        await delete_topics(bootstrap, [s.name for s in deployment_topics(topology)])


async def floor_round_trip(bootstrap: str, rate: float, seconds: float) -> list[float]:
    """Bare aiokafka produce -> consume on one topic, same settings as CommandClient, same pacing."""
    topology = Topology(f"floor{uuid.uuid4().hex[:8]}")
    spec = topology.edge_inbox
    await ensure_topics(bootstrap, [spec])
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=5)
    await producer.start()
    await consumer.start()
    tp = TopicPartition(spec.name, 0)
    consumer.assign([tp])
    await consumer.seek_to_end(tp)
    await consumer.position(tp)
    sent: dict[bytes, float] = {}
    latencies: list[float] = []

    async def read() -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=100)
            now = time.perf_counter()
            for records in batch.values():
                for r in records:
                    latencies.append(now - sent.pop(r.value))

    reader = asyncio.create_task(read())
    try:
        n = int(rate * seconds)
        start = time.perf_counter()
        for i in range(n):
            target = start + i / rate
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            value = f"m{i}".encode()
            sent[value] = time.perf_counter()
            await producer.send(spec.name, value, partition=0)
        await asyncio.sleep(2.0)
    finally:
        reader.cancel()
        await consumer.stop()
        await producer.stop()
        await delete_topics(bootstrap, [spec.name])
    return latencies


async def latency(bootstrap: str, rate: float, seconds: float, tmp: Path, expiry_wave: bool = False,
                  users: int = 1000) -> None:
    policy = policy_from_env()
    floor = await floor_round_trip(bootstrap, rate, seconds)
    topology = Topology(f"lat{uuid.uuid4().hex[:8]}")
    await ensure_topics(bootstrap, deployment_topics(topology))
    # No worker accepts here and the concurrency limit is lifted, so every admitted attempt stays
    # queued (in its user's hot value) until its queue deadline, then the timer fences them all: a
    # wave no deployment sees unless its workers stop accepting while admission goes on. By default
    # the deadline lies past the run (steady state); --expiry-wave keeps the policy's deadline.
    env = {} if expiry_wave else {"CHATPLANE_QUEUE_WAIT_MAX_MS": int((seconds + WARMUP_S + 120) * 1000)}
    p = ProcessorProcess(bootstrap, topology.namespace, tmp, CHATPLANE_CONCURRENCY_LIMIT=100000,
                         CHATPLANE_QUOTA_FREE_PER_WINDOW=1000000, **env)
    p.start("lat")
    try:
        async with CommandClient(bootstrap, topology, inbox_partition=2, decision_timeout_s=30) as client:
            await wait_until_deciding(client)
            n = int(rate * seconds)
            latencies: list[float] = []
            warmup = int(rate * WARMUP_S)

            async def one(i: int) -> None:
                c = cmd.SubmitGeneration(
                    command_id=uuid.uuid4().hex, user_id=f"lat-user-{i % users}", issued_at_ms=int(time.time() * 1000),
                    idempotency_key=f"k{i}", fingerprint="fp-bench-000", model_alias="fast-text-model",
                    tier=Tier.FREE, stream=True, max_output_tokens=100, input_tokens=10, reply_to=client.reply_to(),
                )
                t = time.perf_counter()
                await client.decide(c)
                if i >= warmup:
                    latencies.append(time.perf_counter() - t)
                    timeline.append((t - start, latencies[-1]))

            tasks = []
            timeline: list[tuple[float, float]] = []
            start = time.perf_counter()
            for i in range(n + warmup):
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
            worst = sorted(timeline, key=lambda x: -x[1])[:5]
            print("slowest decisions (sent at s, took ms):", [(round(a, 2), round(b * 1000)) for a, b in worst])
    finally:
        p.stop()
        await delete_topics(bootstrap, [s.name for s in deployment_topics(topology)])
    f50, f99 = pct(floor, 50) * 1000, pct(floor, 99) * 1000
    l50, l99 = pct(latencies, 50) * 1000, pct(latencies, 99) * 1000
    print(f"floor (bare aiokafka produce->consume) at {rate:.0f}/s: p50 {f50:.1f} ms, p99 {f99:.1f} ms ({len(floor)} messages)")
    print(f"submit->decision at {rate:.0f}/s, {users} users: p50 {l50:.1f} ms, p99 {l99:.1f} ms ({len(latencies)} commands; "
          "target p99 <= 50 ms)")
    print(f"ratio to floor: p50 x{l50 / f50:.2f}, p99 x{l99 / f99:.2f}")
    # No worker accepts here, so from queue deadline + reconcile grace after the first submit on, the
    # timer fences expiring attempts (one ReconcileDue per user and deadline) beside the submits.
    wave_s = (policy.queue_wait_max_ms + policy.reconcile_grace_ms) / 1000
    for label, part in () if not expiry_wave else (
        (f"sent before the first deadline wave (< {wave_s:.0f} s)", [b for a, b in timeline if a < wave_s]),
        ("sent during the deadline waves", [b for a, b in timeline if a >= wave_s]),
    ):
        if part:
            print(f"  {label}: p50 {pct(part, 50) * 1000:.1f} ms, p99 {pct(part, 99) * 1000:.1f} ms ({len(part)} commands)")


async def recovery(bootstrap: str, users: int, tmp: Path) -> None:
    topology = Topology(f"rec{uuid.uuid4().hex[:8]}")
    await ensure_topics(bootstrap, deployment_topics(topology))
    reply = ReplyTo(topic=topology.edge_inbox.name, partition=3, request_id="bench")
    now = int(time.time() * 1000)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    await producer.start()
    try:
        for u in range(users):
            c = cmd.SubmitGeneration(
                command_id=f"rec-{u}", user_id=f"rec-user-{u}", issued_at_ms=now, idempotency_key="k",
                fingerprint="fp-bench-000", model_alias="fast-text-model", tier=Tier.FREE, stream=True,
                max_output_tokens=100, input_tokens=10, reply_to=reply,
            )
            await producer.send(topology.commands.name, encode(c), key=c.user_id.encode())
        await producer.flush()
    finally:
        await producer.stop()
    # Deadlines an hour away: the timer stays idle, so the figure is recovery alone.
    p = ProcessorProcess(bootstrap, topology.namespace, tmp, CHATPLANE_QUEUE_WAIT_MAX_MS=3_600_000)
    p.start("rec")
    try:
        t = time.monotonic()
        await count_inbox(bootstrap, topology, 3, users)
        print(f"recovery: {users} users' state built in {time.monotonic() - t:.1f} s")
        await asyncio.sleep(3.0)  # let the last offsets commit
        p.kill9()
        t = time.monotonic()
        p.start("rec")
        async with CommandClient(bootstrap, topology, inbox_partition=4, decision_timeout_s=120) as client:
            outcome = await wait_until_deciding(client, user_id="rec-user-7", timeout_s=600)
            elapsed = time.monotonic() - t
        again = cmd.SubmitGeneration(
            command_id=uuid.uuid4().hex, user_id="rec-user-7", issued_at_ms=int(time.time() * 1000),
            idempotency_key="k", fingerprint="fp-bench-000", model_alias="fast-text-model", tier=Tier.FREE,
            stream=True, max_output_tokens=100, input_tokens=10, reply_to=None,
        )
        del again
        print(f"recovery after kill -9 with {users} users in the table: first decision {elapsed:.1f} s after restart "
              f"({outcome.kind.value})")
    finally:
        p.stop()
        await delete_topics(bootstrap, [s.name for s in deployment_topics(topology)])


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", default=kafka_bootstrap())
    parser.add_argument("--commands", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--latency-seconds", type=float, default=20.0)
    parser.add_argument("--recovery-users", type=int, default=100_000)
    parser.add_argument("--only", choices=["throughput", "latency", "recovery"])
    parser.add_argument("--latency-users", type=int, default=1000,
                        help="latency: submits go round-robin to this many users (each holds its queued attempts)")
    parser.add_argument("--expiry-wave", action="store_true",
                        help="latency: keep the policy's queue deadline, so the run includes the fencing of every queued attempt")
    args = parser.parse_args()
    tmp = ROOT / "var" / "bench"
    tmp.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "throughput"):
        await throughput(args.bootstrap, args.commands, tmp)
    if args.only in (None, "latency"):
        await latency(args.bootstrap, args.rate, args.latency_seconds, tmp, args.expiry_wave, args.latency_users)
    if args.only in (None, "recovery"):
        await recovery(args.bootstrap, args.recovery_users, tmp)


if __name__ == "__main__":
    asyncio.run(main())
