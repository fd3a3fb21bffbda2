"""The benchmark of server-kept conversations (docs/conversations.md): what a turn costs against a
stateless request, over HTTP, on one whole stack.

    .venv/bin/python bench/bench_conversations.py                 # the default run (a few minutes)
    .venv/bin/python bench/bench_conversations.py --quick         # a short smoke run

The stack is bench/stackrun.py's, shaped as bench/bench_stack.py runs it (and with the same ``sim``
engine timing: 50 ms to the first token, 10 ms a token, 8 output tokens a request): its own broker
and Cassandra on free ports, one admission processor, one read model, one history writer, one worker,
one edge. The client is this process, on the same machine.

Sessions. ``--users`` conversation users (paid tier: 200 messages per 3 h), each with one conversation,
and as many stateless users, each keeping its own context client-side (its ``messages`` hold every
earlier turn and answer, as a client without server-kept conversations must send them). A session
has at most one request in flight: an open-loop tick takes the longest-idle session of its kind and
sends its next turn; a tick that finds none idle is counted (``no_idle_session``), never queued. A
turn is sent with ``expected_revision`` = the revision its previous answer committed at (the
``generation.created`` revision + 1). With the default 200 users at 50/s a session sends about one
turn every 4 s, below the burst bucket's refill (one token per 3 s), so neither quota nor bucket is
what is measured; any refusal is printed by its code.

Phases, one stack, in this order:

1. mixed: stateless requests and conversation turns interleaved at ``--rate`` combined (half each)
   for ``--duration``: POST -> ``generation.created``, -> first text token, -> ``generation.completed``
   p50/p95/p99 for each kind (a turn's completed event comes once its answer is committed);
2. A, stateless only, at ``--rate``/2 for ``--duration``; B, turns only, the same: CPU ms per completed
   generation per process (bench_stack's /proc reading, Kafka and Cassandra included), Kafka bytes
   (log segments) and records per generation by topic, Cassandra disk writes per generation;
3. state: users with N conversations (one turn each) beside users with N stateless requests;
4. reads at ``--read-rate`` (open loop) for ``--read-s`` each: ``GET .../messages`` of the phase-1
   conversations (alternately ``?limit=50`` ascending and ``?before=<revision+1>&order=desc&limit=20``),
   then ``GET /v1/conversations?limit=20`` of ``--sidebar-users`` users holding
   ``--sidebar-conversations`` conversations each;
5. bytes: the ledger replayed (``projections.ledger.audit.Auditor``, invariants checked), the
   processor's changelog read back: per user, the hot value as the processor last wrote it, its
   settled entries, the whole aggregate (``dump_aggregate``) and the hot value ``table_store.plan``
   derives from the replayed state; per generation, the bytes of the user's commands, ledger entries
   and changelog writes (values as produced, before the broker's compression).

Each phase also prints what the client really offered (its ticks go out late when this process or
the machine falls behind: an open-loop rate the machine cannot serve shows as a schedule lag and a
lower offered rate, not as a slower stack), this process's own CPU, the cores the stack, the client
and every other process of the machine kept busy, and the edge's sheds (edge/shedding.py) with its
adaptive in-flight limit before and after: a limit cut during an earlier phase sheds the next one.
On a 2-core machine shared by the stack and the client, the defaults (100/s mixed, 500 reads/s) are
beyond what it serves (the client itself then takes most of a core); with ``--rate 40 --read-rate 100``
the one-kind phases and the reads stay within it, while the mixed phase (40/s in all) can still meet
the edge's in-flight limit.

``usage in`` (the tables' mean ``usage.input_tokens`` of ``generation.completed``) is printed as the
stack reports it: a turn's is the edge's count of the context it built (``count_input_tokens``, the
byte estimate for the simulated model, which has no vocabulary), a stateless request's is the sim
engine's own count (words + 4 a message), so the two columns are not the same counter.

Nothing here asserts on a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_stack import (  # noqa: E402
    ENGINE_TTFT_MS,
    HTTP_TIMEOUT_S,
    MIB,
    MODEL,
    OUTPUT_TOKENS,
    SIM_ENV,
    kafka_records,
    pct,
    snapshot,
    stack_pids,
)
from bench.stackrun import Stack, rss_bytes  # noqa: E402
from control_plane.aggregate import Aggregate  # noqa: E402
from control_plane.codec import dump_aggregate  # noqa: E402
from control_plane.policy import Policy  # noqa: E402
from projections.ledger.audit import Auditor  # noqa: E402
from projections.ledger.table_store import EMPTY_LAYOUT, is_settled_key, plan, user_of_settled_key  # noqa: E402
from infra.runtime.topic_reader import read_topic  # noqa: E402
from schemas.codes import RequestStatus, Tier  # noqa: E402

WARMUP_RATE = 10.0  # stateless requests/s during --warmup-s (fresh users; not reported)
WARMUP_CONVERSATIONS = 20  # conversations the warm-up's turns go to (not the measured ones)
SETUP_CONCURRENCY = 16
IN_FLIGHT_LIMIT_GAUGE = "in-flight limit"  # conversation creates in flight during the setup
STATELESS_HISTORY_MAX = 200  # messages a stateless session sends at most (the edge allows 256)
SIZE_NS = (1, 4, 16)  # conversations (one turn each) of the state users; 16 fits the burst bucket (20)
QUICK_SIZE_NS = (1, 4)
PROMPT = "Say eight words."
RAN = frozenset({RequestStatus.COMPLETED, RequestStatus.CANCELLED, RequestStatus.FAILED})  # generations that ran


# -- samples and sessions ------------------------------------------------------------------------


@dataclass
class Sample:
    kind: str  # "stateless" | "turn" | "messages_asc" | "messages_desc" | "list"
    sent: float
    lag: float = 0.0  # how late the open-loop schedule sent it (the client's own backlog)
    created: float | None = None  # generation.created
    first_token: float | None = None
    done: float | None = None  # generation.completed, or a read's whole answer
    code: str = ""
    input_tokens: int | None = None


@dataclass
class Session:
    user: str
    token: str
    conversation_id: str | None = None  # None: stateless, the context kept here
    revision: int = 0
    history: list[dict[str, str]] = field(default_factory=list)
    completed: int = 0


class Pool:
    """Idle sessions of one kind, longest idle first; a session in flight is not in it."""

    def __init__(self, sessions: list[Session]) -> None:
        self.all = sessions
        self.idle: deque[Session] = deque(sessions)

    def take(self) -> Session | None:
        return self.idle.popleft() if self.idle else None

    def put(self, session: Session) -> None:
        self.idle.append(session)


def headers(token: str, key: bool = False) -> dict[str, str]:
    h = {"Authorization": f"Bearer {token}"}
    if key:
        h["Idempotency-Key"] = uuid.uuid4().hex
    return h


def error_code(resp_status: int, raw: bytes) -> str:
    try:
        err = orjson.loads(raw)["error"]
        return str(err.get("code") or err.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"http_{resp_status}"


async def generate(http: httpx.AsyncClient, token: str, body: dict[str, Any], s: Sample) -> tuple[dict[str, Any] | None, str]:
    """One streamed ``POST /v1/generations``: the times of its events on ``s``; returns the created
    event's data and the answer's text."""
    created: dict[str, Any] | None = None
    text: list[str] = []
    try:
        async with http.stream("POST", "/v1/generations", json=body, headers=headers(token, key=True)) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                s.done = time.monotonic()
                s.code = error_code(resp.status_code, raw)
                return None, ""
            buf = b""
            async for chunk in resp.aiter_raw():
                buf += chunk
                while (end := buf.find(b"\n\n")) >= 0:
                    block, buf = buf[:end], buf[end + 2 :]
                    event = data = None
                    for line in block.split(b"\n"):
                        if line.startswith(b"event: "):
                            event = line[7:].decode()
                        elif line.startswith(b"data: "):
                            data = line[6:]
                    if event is None or data is None:
                        continue  # a heartbeat
                    now = time.monotonic()
                    doc = orjson.loads(data)
                    if event == "generation.created":
                        s.created, created = now, doc
                    elif event == "generation.text.delta":
                        if s.first_token is None:
                            s.first_token = now
                        text.append(doc.get("delta", ""))
                    elif event == "generation.completed":
                        s.done, s.code = now, "completed"
                        s.input_tokens = (doc.get("usage") or {}).get("input_tokens")
                    elif event == "generation.error":
                        s.done, s.code = now, f"stream:{doc.get('code')}"
                    elif event == "generation.cancelled":
                        s.done, s.code = now, "stream:cancelled"
            s.code = s.code or "eof"
    except httpx.HTTPError as exc:
        s.code = type(exc).__name__
    return created, "".join(text)


Anomalies = Counter  # things that should not happen, counted (a created revision other than expected, ...)


async def send_stateless(http: httpx.AsyncClient, pool: Pool, s: Sample, anomalies: Anomalies) -> None:
    session = pool.take()
    if session is None:
        s.code = "no_idle_session"
        return
    try:
        user_message = {"role": "user", "content": f"{PROMPT} (turn {session.completed + 1})"}
        messages = [*session.history, user_message][-STATELESS_HISTORY_MAX:]
        while messages[0]["role"] != "user":
            messages = messages[1:]
        body = {"model": MODEL, "stream": True, "max_output_tokens": OUTPUT_TOKENS, "messages": messages}
        _, text = await generate(http, session.token, body, s)
        if s.code == "completed":
            session.completed += 1
            if text:
                session.history += [user_message, {"role": "assistant", "content": text}]
            else:
                anomalies["stateless answer without text"] += 1
    finally:
        pool.put(session)


async def send_turn(http: httpx.AsyncClient, pool: Pool, s: Sample, anomalies: Anomalies) -> None:
    session = pool.take()
    if session is None:
        s.code = "no_idle_session"
        return
    try:
        await turn(http, session, s, anomalies)
    finally:
        pool.put(session)


async def turn(http: httpx.AsyncClient, session: Session, s: Sample, anomalies: Anomalies) -> None:
    """One conversation turn of ``session``; its revision follows (re-read from the edge after a failure)."""
    body = {"model": MODEL, "stream": True, "max_output_tokens": OUTPUT_TOKENS,
            "conversation_id": session.conversation_id, "expected_revision": session.revision,
            "messages": [{"role": "user", "content": f"{PROMPT} (turn {session.completed + 1})"}]}
    created, _ = await generate(http, session.token, body, s)
    if s.code == "completed" and created is not None:
        if created.get("revision") != session.revision + 1 or created.get("conversation_id") != session.conversation_id:
            anomalies["created revision other than expected_revision + 1"] += 1
        session.revision = int(created.get("revision") or session.revision + 1) + 1
        session.completed += 1
        return
    if s.code == "completed":
        anomalies["turn completed without a created event"] += 1
    # Whatever went wrong, the next turn is sent against what the edge says now.
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        r = await http.get(f"/v1/conversations/{session.conversation_id}", headers=headers(session.token))
        if r.status_code == 200:
            session.revision = int(r.json()["revision"])


async def create_conversation(http: httpx.AsyncClient, token: str, title: str) -> tuple[str | None, float, str]:
    t = time.monotonic()
    try:
        r = await http.post("/v1/conversations", json={"title": title}, headers=headers(token, key=True))
    except httpx.HTTPError as exc:
        return None, time.monotonic() - t, type(exc).__name__
    ms = time.monotonic() - t
    if r.status_code != 201:
        return None, ms, error_code(r.status_code, r.content)
    return r.json()["id"], ms, "created"


async def read(http: httpx.AsyncClient, path: str, params: dict[str, Any], token: str, s: Sample,
               check: Callable[[Any], str | None] | None = None, anomalies: Anomalies | None = None) -> None:
    try:
        r = await http.get(path, params=params, headers=headers(token))
        s.done = time.monotonic()
        s.code = "ok" if r.status_code == 200 else error_code(r.status_code, r.content)
        if r.status_code == 200 and check is not None and anomalies is not None:
            problem = check(r.json())
            if problem:
                anomalies[problem] += 1
    except httpx.HTTPError as exc:
        s.code = type(exc).__name__


# -- phases --------------------------------------------------------------------------------------


async def edge_shed(http: httpx.AsyncClient) -> Counter[str]:
    """The edge's ``chatplane_edge_shed`` counters by reason (edge/shedding.py), from /metrics."""
    counts: Counter[str] = Counter()
    with contextlib.suppress(httpx.HTTPError):
        for line in (await http.get("/metrics")).text.splitlines():
            if line.startswith("chatplane_edge_shed_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                counts[reason] = int(float(line.rsplit(" ", 1)[1]))
            elif line.startswith("chatplane_edge_shed_in_flight_limit "):
                counts[IN_FLIGHT_LIMIT_GAUGE] = int(float(line.rsplit(" ", 1)[1]))
    return counts


@dataclass
class Phase:
    name: str
    rate: float
    shed: dict[str, int] = field(default_factory=dict)  # the edge's sheds during the phase, by reason
    send_s: float = 0.0  # from the first tick to the last answer
    shed_limit: tuple[int | None, int | None] = (None, None)  # the edge's adaptive in-flight limit, before and after
    last_tick_s: float = 0.0  # when the last tick was sent, from the first
    client_cpu_s: float = 0.0  # this process's CPU from the first tick to the last answer
    # Cores busy over the phase (first tick to the end of the tail): the stack's processes, this
    # client, and every other process of the machine (/proc/stat less the two).
    machine: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def offered_per_s(self) -> float:
        """The rate the ticks really went out at (below ``rate`` when the client fell behind)."""
        return (len(self.samples) - 1) / self.last_tick_s if self.last_tick_s > 0 else float("nan")
    samples: list[Sample] = field(default_factory=list)
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per unit (completed generation, or ok read)
    rss_mib: dict[str, float] = field(default_factory=dict)
    kafka_topics: dict[str, int] = field(default_factory=dict)  # bytes per unit by topic
    kafka_records: dict[str, float] = field(default_factory=dict)
    cassandra_bytes: int = 0
    units: int = 0
    wall_s: float = 0.0

    def of(self, kind: str) -> list[Sample]:
        return [s for s in self.samples if s.kind == kind]


Sender = tuple[str, Callable[[httpx.AsyncClient, Sample], Awaitable[None]]]


async def run_phase(name: str, stack: Stack, rate: float, seconds: float, tail_s: float, senders: list[Sender],
                    unit: Callable[[Sample], bool]) -> Phase:
    """Open-loop ticks at ``rate`` for ``seconds``, tick i sent by ``senders[i % len(senders)]``; the
    CPU, Kafka and Cassandra counters from the first tick until every request ended plus ``tail_s``,
    divided by the samples ``unit`` counts."""
    phase = Phase(name, rate)
    limits = httpx.Limits(max_connections=10_000, max_keepalive_connections=500)
    async with httpx.AsyncClient(base_url=stack.edge_urls[0], timeout=HTTP_TIMEOUT_S, limits=limits) as http:
        r0 = await kafka_records(stack)
        shed0 = await edge_shed(http)
        cpu0, k0, c0 = snapshot(stack_pids(stack), stack)
        m0, own0 = machine_busy_s(), client_cpu_s()
        t0 = time.monotonic()
        client0 = client_cpu_s()
        tasks = []
        for i in range(int(rate * seconds)):
            due = t0 + i / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            kind, send = senders[i % len(senders)]
            now = time.monotonic()
            s = Sample(kind, now, lag=now - due)
            phase.samples.append(s)
            tasks.append(asyncio.create_task(send(http, s)))
        phase.last_tick_s = time.monotonic() - t0
        await asyncio.gather(*tasks)
        phase.send_s = time.monotonic() - t0
        phase.client_cpu_s = client_cpu_s() - client0
        await asyncio.sleep(tail_s)
        cpu1, k1, c1 = snapshot(stack_pids(stack), stack)
        m1, own1 = machine_busy_s(), client_cpu_s()
        phase.wall_s = time.monotonic() - t0
        r1 = await kafka_records(stack)
        shed1 = await edge_shed(http)
    phase.shed_limit = (shed0.pop(IN_FLIGHT_LIMIT_GAUGE, None), shed1.pop(IN_FLIGHT_LIMIT_GAUGE, None))
    phase.shed = {k: v - shed0.get(k, 0) for k, v in shed1.items() if v != shed0.get(k, 0)}
    stack_s = sum(cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1)
    phase.machine = (stack_s / phase.wall_s, (own1 - own0) / phase.wall_s, (m1 - m0 - stack_s - (own1 - own0)) / phase.wall_s)
    n = phase.units = sum(1 for s in phase.samples if unit(s))
    n = max(1, n)
    phase.cpu_ms = {k: (cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) * 1000 / n for k in cpu1}
    phase.rss_mib = {k: sum(rss_bytes(p) or 0 for p in g) / MIB for k, g in stack_pids(stack).items()}
    phase.kafka_topics = {t: (k1[t] - k0.get(t, 0)) // n for t in k1 if k1[t] != k0.get(t, 0)}
    phase.kafka_records = {t: (r1[t] - r0.get(t, 0)) / n for t in r1 if r1[t] != r0.get(t, 0)}
    phase.cassandra_bytes = (c1 - c0) // n
    return phase


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has been busy so far (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def client_cpu_s() -> float:
    """This process's own CPU time (user + system, every thread; not its children, the stack)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def is_completed(s: Sample) -> bool:
    return s.code == "completed"


def is_ok(s: Sample) -> bool:
    return s.code == "ok"


def ms(values: list[float]) -> list[float]:
    return [v * 1000 for v in values]


def triple(values: list[float]) -> str:
    return f"{pct(values, .5):,.0f} / {pct(values, .95):,.0f} / {pct(values, .99):,.0f}"


def generation_rows(phase: Phase, kinds: tuple[str, ...]) -> list[str]:
    lines = [f"  {'kind':<10} {'sent':>5} {'done':>5}  {'created p50/p95/p99 ms':>24}  {'first token':>20}  "
             f"{'completed':>20}  {'usage in':>8}  outcomes (refusals by code)"]
    for kind in kinds:
        ss = phase.of(kind)
        created = ms([s.created - s.sent for s in ss if s.created is not None])
        first = ms([s.first_token - s.sent for s in ss if s.first_token is not None and s.code == "completed"])
        done = ms([s.done - s.sent for s in ss if s.done is not None and s.code == "completed"])
        tokens = [s.input_tokens for s in ss if s.input_tokens is not None]
        outcomes = dict(Counter(s.code for s in ss).most_common())
        lines.append(f"  {kind:<10} {len(ss):>5} {sum(map(is_completed, ss)):>5}  {triple(created):>24}  "
                     f"{triple(first):>20}  {triple(done):>20}  {statistics.mean(tokens) if tokens else 0:>8.0f}  {outcomes}")
    lines.append("  (usage in: mean usage.input_tokens of generation.completed, as the stack reports it; the sim engine's "
                 "and the edge's counts differ, see --help)")
    return lines


def cost_rows(phase: Phase, unit: str, submits: bool = True) -> list[str]:
    lags = ms([s.lag for s in phase.samples])
    lines = [
        f"  the edge's sheds during the phase (edge/shedding.py), by reason: {phase.shed or 'none'}; its adaptive "
        f"in-flight limit {phase.shed_limit[0]} before, {phase.shed_limit[1]} after",
    ] if submits else []
    lines += [
        f"  client: offered {phase.offered_per_s():.1f}/s of the {phase.rate:g}/s asked (ticks sent over {phase.last_tick_s:.1f} s); "
        f"schedule lag p50 {pct(lags, .5):.0f} ms, p99 {pct(lags, .99):.0f} ms, max {max(lags, default=0):.0f} ms; "
        f"its own CPU {phase.client_cpu_s / max(phase.send_s, 1e-9):.0%} of a core, "
        f"{phase.client_cpu_s * 1000 / max(1, len(phase.samples)):.1f} ms per request",
        f"  machine ({os.cpu_count()} cores) busy over the phase, in cores: the stack {phase.machine[0]:.2f}, this client "
        f"{phase.machine[1]:.2f}, other processes {phase.machine[2]:.2f}",
        f"  CPU ms per {unit}: total {sum(phase.cpu_ms.values()):.1f} = "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(phase.cpu_ms.items(), key=lambda kv: -kv[1])),
    ]
    if phase.kafka_topics:
        lines += [
            f"  bytes per {unit}: Kafka log segments {sum(phase.kafka_topics.values()) / 1024:.1f} KiB, "
            f"Cassandra disk writes {phase.cassandra_bytes / 1024:.1f} KiB",
            f"  Kafka bytes per {unit} by topic: "
            + ", ".join(f"{t} {b}" for t, b in sorted(phase.kafka_topics.items(), key=lambda kv: -kv[1])),
            f"  Kafka records per {unit}: {sum(phase.kafka_records.values()):.1f} = "
            + ", ".join(f"{t} {n:.1f}" for t, n in sorted(phase.kafka_records.items(), key=lambda kv: -kv[1])),
        ]
    lines.append("  RSS MiB at the end: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(phase.rss_mib.items())))
    return lines


def answered_per_s(phase: Phase) -> float:
    return sum(map(is_ok, phase.samples)) / max(phase.send_s, 1e-9)


def read_rows(phase: Phase, kinds: tuple[str, ...]) -> list[str]:
    lines = [f"  {'read':<14} {'sent':>5} {'ok':>5}  {'p50 / p95 / p99 ms':>20}  {'max ms':>7}  outcomes"]
    for kind in kinds:
        ss = phase.of(kind)
        lat = ms([s.done - s.sent for s in ss if s.done is not None and s.code == "ok"])
        lines.append(f"  {kind:<14} {len(ss):>5} {sum(map(is_ok, ss)):>5}  {triple(lat):>20}  {max(lat, default=0):>7.0f}  "
                     f"{dict(Counter(s.code for s in ss).most_common())}")
    lines.append(f"  answered {answered_per_s(phase):.0f} ok reads/s: from the first request to the last answer "
                 f"{phase.send_s:.1f} s (asked {phase.rate:g}/s for {len(phase.samples) / phase.rate:g} s)")
    return lines


# -- bytes and state ------------------------------------------------------------------------------


@dataclass
class UserBytes:
    hot: int = 0  # the processor's hot value as last written (changelog)
    settled: int = 0  # its live settled entries and index chunks (changelog, latest values)
    settled_entries: int = 0
    whole: int = 0  # dump_aggregate of the replayed state (no remembered decisions)
    planned_hot: int = 0  # table_store.plan's hot value of the replayed state (no remembered decisions)
    conversations: int = 0  # in the replayed hot state
    commands: int = 0  # bytes of every command value of the user
    ledger: int = 0
    changelog: int = 0  # bytes of every changelog value written for the user (superseded ones included)
    generations: int = 0  # terminal generations in the replayed state


async def measure_bytes(stack: Stack, users: set[str]) -> tuple[dict[str, UserBytes], Auditor, float]:
    t = time.monotonic()
    out = {u: UserBytes() for u in users}
    auditor = Auditor()
    for partition, offset, key, value in sorted(await read_topic(stack.bootstrap, stack.topology.ledger), key=lambda r: r[:2]):
        auditor.feed_raw(f"ledger[{partition}]@{offset}", value)
        u = key.decode() if key else None
        if u in out and value:
            out[u].ledger += len(value)
    auditor.finish()
    for _, _, key, value in await read_topic(stack.bootstrap, stack.topology.commands):
        u = key.decode() if key else None
        if u in out and value:
            out[u].commands += len(value)
    latest: dict[bytes, bytes | None] = {}
    for _, _, key, value in sorted(await read_topic(stack.bootstrap, stack.topology.changelog), key=lambda r: r[:2]):
        if key is None:
            continue
        latest[key] = value
        u = user_of_settled_key(key) if is_settled_key(key) else key.decode(errors="replace")
        if u in out and value:
            out[u].changelog += len(value)
    for key, value in latest.items():
        if value is None:
            continue
        if is_settled_key(key):
            u = user_of_settled_key(key)
            if u in out:
                out[u].settled += len(value)
                out[u].settled_entries += 1
        elif (u := key.decode(errors="replace")) in out:
            out[u].hot = len(value)
    policy = Policy()
    for u, b in out.items():
        ledger = auditor.report.states.get(u)
        if ledger is None:
            continue
        aggregate = Aggregate(ledger, (), -1)
        b.whole = len(dump_aggregate(aggregate))
        b.planned_hot = len(plan(aggregate, EMPTY_LAYOUT, policy).puts[-1][1])
        b.conversations = len(ledger.conversations)
        b.generations = sum(1 for r in ledger.requests.values() if r.status in RAN)
    return out, auditor, time.monotonic() - t


def mean_of(rows: list[UserBytes], f: Callable[[UserBytes], float]) -> float:
    return statistics.mean(f(r) for r in rows) if rows else float("nan")


def bytes_rows(groups: list[tuple[str, list[UserBytes]]]) -> list[str]:
    lines = [f"  {'users':<36} {'n':>4} {'conv':>5} {'gens':>5} {'hot B':>7} {'plan hot':>8} {'whole B':>8} "
             f"{'settled B':>9} {'cmd B/gen':>9} {'ledger B/gen':>12} {'chlog B/gen':>11}"]
    for label, rows in groups:
        def per_gen(f: Callable[[UserBytes], int]) -> float:
            return mean_of(rows, lambda r: f(r) / max(1, r.generations))

        lines.append(
            f"  {label:<36} {len(rows):>4} {mean_of(rows, lambda r: r.conversations):>5.1f} {mean_of(rows, lambda r: r.generations):>5.1f} "
            f"{mean_of(rows, lambda r: r.hot):>7,.0f} {mean_of(rows, lambda r: r.planned_hot):>8,.0f} {mean_of(rows, lambda r: r.whole):>8,.0f} "
            f"{mean_of(rows, lambda r: r.settled):>9,.0f} {per_gen(lambda r: r.commands):>9,.0f} {per_gen(lambda r: r.ledger):>12,.0f} "
            f"{per_gen(lambda r: r.changelog):>11,.0f}"
        )
    return lines


# -- the run --------------------------------------------------------------------------------------


async def setup_sessions(stack: Stack, n: int, prefix: str, conversations: bool, title: str = "bench") -> tuple[list[Session], list[float], Counter[str]]:
    sessions = [Session(f"{prefix}{i:05d}-{uuid.uuid4().hex[:6]}", "") for i in range(n)]
    for s in sessions:
        s.token = stack.token(s.user, Tier.PAID)
    times: list[float] = []
    codes: Counter[str] = Counter()
    if not conversations:
        return sessions, times, codes
    sem = asyncio.Semaphore(SETUP_CONCURRENCY)
    async with httpx.AsyncClient(base_url=stack.edge_urls[0], timeout=HTTP_TIMEOUT_S) as http:
        async def one(s: Session) -> None:
            async with sem:
                cid, t, code = await create_conversation(http, s.token, title)
            s.conversation_id = cid
            times.append(t)
            codes[code] += 1

        await asyncio.gather(*(one(s) for s in sessions))
    return [s for s in sessions if s.conversation_id], times, codes


async def setup_sidebars(stack: Stack, users: int, per_user: int) -> tuple[list[Session], list[float], Counter[str]]:
    """``users`` users with ``per_user`` conversations each (no turns): what the list reads read."""
    sessions = [Session(f"sb{i:04d}-{uuid.uuid4().hex[:6]}", "") for i in range(users)]
    for s in sessions:
        s.token = stack.token(s.user, Tier.PAID)
    times: list[float] = []
    codes: Counter[str] = Counter()
    sem = asyncio.Semaphore(SETUP_CONCURRENCY)
    async with httpx.AsyncClient(base_url=stack.edge_urls[0], timeout=HTTP_TIMEOUT_S) as http:
        async def one(s: Session, k: int) -> None:
            async with sem:
                _, t, code = await create_conversation(http, s.token, f"chat {k}")
            times.append(t)
            codes[code] += 1

        await asyncio.gather(*(one(s, k) for s in sessions for k in range(per_user)))
    return sessions, times, codes


async def state_users(stack: Stack, ns: tuple[int, ...], anomalies: Anomalies) -> tuple[dict[int, str], dict[int, str], Counter[str]]:
    """Per N: a user with N conversations and one turn in each, and a user with N stateless requests
    (one after the other: the concurrency limit is 2, the burst bucket 20)."""
    conv_users: dict[int, str] = {}
    stateless_users: dict[int, str] = {}
    codes: Counter[str] = Counter()
    async with httpx.AsyncClient(base_url=stack.edge_urls[0], timeout=HTTP_TIMEOUT_S) as http:
        async def conv_user(n: int) -> None:
            user = f"state-conv-{n}-{uuid.uuid4().hex[:6]}"
            token = stack.token(user, Tier.PAID)
            conv_users[n] = user
            for k in range(n):
                cid, _, code = await create_conversation(http, token, f"chat {k}")
                if cid is None:
                    codes[f"create:{code}"] += 1
                    continue
                s = Sample("turn", time.monotonic())
                await turn(http, Session(user, token, cid), s, anomalies)
                codes[s.code] += 1

        async def stateless_user(n: int) -> None:
            user = f"state-stateless-{n}-{uuid.uuid4().hex[:6]}"
            session = Session(user, stack.token(user, Tier.PAID))
            stateless_users[n] = user
            pool = Pool([session])
            for _ in range(n):
                s = Sample("stateless", time.monotonic())
                await send_stateless(http, pool, s, anomalies)
                codes[s.code] += 1

        await asyncio.gather(*(conv_user(n) for n in ns), *(stateless_user(n) for n in ns))
    return conv_users, stateless_users, codes


async def bench(args: argparse.Namespace, work: Path) -> None:
    stack = Stack(work, namespace=f"bconv{uuid.uuid4().hex[:6]}", processors=1, workers=1, edges=1, readmodels=1, histories=1,
                  env={**SIM_ENV, **dict(item.split("=", 1) for item in args.env)})
    anomalies = Anomalies()
    out: list[str] = []

    def say(*lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            out.append(line)

    t_start = time.monotonic()
    await stack.start()
    say(f"stack up in {time.monotonic() - t_start:.0f} s ({work}); sim engine {ENGINE_TTFT_MS:.0f} ms to the first token, "
        f"{SIM_ENV['CHATPLANE_SIM_INTER_TOKEN_MS']} ms a token, {OUTPUT_TOKENS} output tokens a request")
    try:
        # -- setup: sessions, conversations, sidebars; a warm-up -------------------------------------
        conv_sessions, create_s, create_codes = await setup_sessions(stack, args.users, "cu", conversations=True)
        stateless_sessions, _, _ = await setup_sessions(stack, args.users, "su", conversations=False)
        sidebar_sessions, sidebar_s, sidebar_codes = await setup_sidebars(stack, args.sidebar_users, args.sidebar_conversations)
        create_ms = ms(create_s + sidebar_s)
        say(f"setup: {len(conv_sessions)}/{args.users} conversation users, {args.users} stateless users, "
            f"{args.sidebar_users} sidebar users x {args.sidebar_conversations} conversations; "
            f"POST /v1/conversations p50/p95/p99 {triple(create_ms)} ms ({SETUP_CONCURRENCY} in flight, before any generation load), "
            f"outcomes {dict((create_codes + sidebar_codes).most_common())}")
        conv_pool, stateless_pool = Pool(conv_sessions), Pool(stateless_sessions)
        if args.warmup_s > 0:  # JIT-warm the JVMs and both paths, fill the connection pools; not reported
            warm_user = iter(range(10**9))
            warm_convs, _, _ = await setup_sessions(stack, WARMUP_CONVERSATIONS, "wu", conversations=True)
            warm_pool = Pool(warm_convs)

            async def warm(http: httpx.AsyncClient, s: Sample) -> None:
                user = f"warm{next(warm_user)}-{uuid.uuid4().hex[:6]}"
                pool = Pool([Session(user, stack.token(user, Tier.PAID))])
                await send_stateless(http, pool, s, anomalies)

            w = await run_phase("warm-up", stack, WARMUP_RATE, args.warmup_s, 1.0,
                                [("stateless", warm), ("turn", lambda http, s: send_turn(http, warm_pool, s, anomalies))], is_completed)
            say(f"warm-up: {args.warmup_s:g} s at {WARMUP_RATE:g}/s, stateless (fresh users) and turns ({len(warm_convs)} other "
                f"conversations), outcomes {dict(Counter(s.code for s in w.samples).most_common())} (not reported)")

        stateless: Sender = ("stateless", lambda http, s: send_stateless(http, stateless_pool, s, anomalies))
        turns: Sender = ("turn", lambda http, s: send_turn(http, conv_pool, s, anomalies))

        # -- 1. mixed -----------------------------------------------------------------------------------
        mixed = await run_phase("mixed", stack, args.rate, args.duration, args.tail_s, [stateless, turns], is_completed)
        say("", f"1. mixed: stateless requests and conversation turns interleaved, {args.rate:g}/s combined "
            f"({args.rate / 2:g}/s each) for {args.duration:g} s; {len(conv_sessions)} conversation users, "
            f"{len(stateless_sessions)} stateless users, paid tier, one request in flight per session; "
            f"latency from the POST being sent", *generation_rows(mixed, ("stateless", "turn")), *cost_rows(mixed, "completed generation"))
        await asyncio.sleep(args.pause_s)

        # -- 2. CPU and bytes per generation, one kind at a time -----------------------------------------
        phase_a = await run_phase("A", stack, args.rate / 2, args.duration, args.tail_s, [stateless], is_completed)
        say("", f"2A. stateless only, {args.rate / 2:g}/s for {args.duration:g} s",
            *generation_rows(phase_a, ("stateless",)), *cost_rows(phase_a, "completed generation"))
        await asyncio.sleep(args.pause_s)
        phase_b = await run_phase("B", stack, args.rate / 2, args.duration, args.tail_s, [turns], is_completed)
        say("", f"2B. conversation turns only, {args.rate / 2:g}/s for {args.duration:g} s",
            *generation_rows(phase_b, ("turn",)), *cost_rows(phase_b, "completed generation"))
        await asyncio.sleep(args.pause_s)

        # -- 3. users with N conversations beside users with N stateless requests -----------------------
        conv_users, stateless_users, state_codes = await state_users(stack, args.size_ns, anomalies)
        say("", f"3. state users: N in {list(args.size_ns)}: N conversations with one turn each vs N stateless requests; "
            f"outcomes {dict(state_codes.most_common())}")
        await asyncio.sleep(args.pause_s)

        # -- 4. reads ---------------------------------------------------------------------------------------
        readable = [s for s in conv_sessions if s.revision > 0]
        rng = random.Random(1)

        def check_page(expected_at_least: int) -> Callable[[Any], str | None]:
            def check(doc: Any) -> str | None:
                return None if len(doc.get("data", ())) >= expected_at_least else "short messages page"
            return check

        async def read_asc(http: httpx.AsyncClient, s: Sample) -> None:
            c = rng.choice(readable)
            await read(http, f"/v1/conversations/{c.conversation_id}/messages", {"limit": 50}, c.token, s,
                       check_page(min(50, c.revision)), anomalies)

        async def read_desc(http: httpx.AsyncClient, s: Sample) -> None:
            c = rng.choice(readable)
            await read(http, f"/v1/conversations/{c.conversation_id}/messages",
                       {"before": c.revision + 1, "order": "desc", "limit": 20}, c.token, s,
                       check_page(min(20, c.revision)), anomalies)

        async def read_list(http: httpx.AsyncClient, s: Sample) -> None:
            u = rng.choice(sidebar_sessions)
            want = min(20, args.sidebar_conversations)
            await read(http, "/v1/conversations", {"limit": 20}, u.token, s,
                       lambda doc: None if len(doc.get("data", ())) >= want else "short conversation list", anomalies)

        history = [s.revision for s in readable]
        reads_m = await run_phase("messages", stack, args.read_rate, args.read_s, 1.0,
                                  [("messages_asc", read_asc), ("messages_desc", read_desc)], is_ok)
        say("", f"4a. messages reads at {args.read_rate:g}/s for {args.read_s:g} s (open loop) over {len(readable)} conversations "
            f"of {statistics.mean(history) if history else 0:.1f} messages on average (min {min(history, default=0)}, max {max(history, default=0)}): "
            "asc = ?limit=50, desc = ?before=<revision+1>&order=desc&limit=20",
            *read_rows(reads_m, ("messages_asc", "messages_desc")), *cost_rows(reads_m, "ok read", submits=False)[:3])
        await asyncio.sleep(args.pause_s)
        reads_l = await run_phase("list", stack, args.read_rate, args.read_s, 1.0, [("list", read_list)], is_ok)
        say("", f"4b. conversation list reads (GET /v1/conversations?limit=20) at {args.read_rate:g}/s for {args.read_s:g} s "
            f"over {len(sidebar_sessions)} users of {args.sidebar_conversations} conversations",
            *read_rows(reads_l, ("list",)), *cost_rows(reads_l, "ok read", submits=False)[:3])

        # -- 5. bytes and the processor's hot value -------------------------------------------------------
        await asyncio.sleep(args.tail_s)
        wanted = {s.user for s in conv_sessions} | {s.user for s in stateless_sessions} | set(conv_users.values()) | set(stateless_users.values())
        per_user, auditor, read_s = await measure_bytes(stack, wanted)
        groups: list[tuple[str, list[UserBytes]]] = [
            (f"stateless pool (client-kept context)", [per_user[s.user] for s in stateless_sessions]),
            (f"conversation pool (1 conv each)", [per_user[s.user] for s in conv_sessions]),
        ]
        for n in args.size_ns:
            groups.append((f"N={n}: {n} stateless requests", [per_user[stateless_users[n]]]))
            groups.append((f"N={n}: {n} conversations x 1 turn", [per_user[conv_users[n]]]))
        rep = auditor.report
        say("", f"5. bytes per user after the run (ledger replayed and changelog read back in {read_s:.1f} s; "
            f"ledger: {rep.entries_read} entries, {rep.users} users, invariant violations {len(rep.violations)}, undecodable {len(rep.undecodable)})",
            "  hot B: the processor's hot value as last written; plan hot: table_store.plan's hot value of the replayed state",
            "  (no remembered decisions); whole B: dump_aggregate of the replayed state; settled B: live settled entries + index",
            "  chunks; B/gen: every value of the user produced to commands / ledger / changelog, per terminal generation",
            *bytes_rows(groups))
        for v in rep.violations[:5]:
            say(f"  violation: {v}")

        # -- figures ------------------------------------------------------------------------------------
        def p(phase: Phase, kind: str, attr: str, q: float) -> float:
            return pct(ms([getattr(s, attr) - s.sent for s in phase.of(kind) if getattr(s, attr) is not None
                           and (attr == "created" or s.code == "completed")]), q)

        def pp(phase: Phase, kind: str, attr: str) -> str:
            return f"{p(phase, kind, attr, .5):,.0f} / {p(phase, kind, attr, .99):,.0f}"

        def read_p(phase: Phase, kind: str, q: float) -> float:
            return pct(ms([s.done - s.sent for s in phase.of(kind) if s.done is not None and s.code == "ok"]), q)

        def refusals(phase: Phase, kind: str) -> str:
            c = Counter(s.code for s in phase.of(kind) if s.code != "completed")
            return ", ".join(f"{k} {v}" for k, v in c.most_common()) or "none"

        st_rows, cv_rows = groups[0][1], groups[1][1]
        n_max = max(args.size_ns)
        per_conversation = (per_user[conv_users[n_max]].planned_hot - per_user[stateless_users[n_max]].planned_hot) / n_max
        hot_line = "; ".join(
            f"N={n}: {per_user[stateless_users[n]].hot:,} B stateless vs {per_user[conv_users[n]].hot:,} B with conversations"
            for n in args.size_ns)
        say("", "figures (paste into docs; one run, this machine, client on the same machine)", "",
            "| figure | stateless | conversation turn |", "|---|---|---|",
            f"| mixed {args.rate:g}/s: POST -> generation.created p50 / p99 ms | {pp(mixed, 'stateless', 'created')} | {pp(mixed, 'turn', 'created')} |",
            f"| mixed {args.rate:g}/s: POST -> first text token p50 / p99 ms | {pp(mixed, 'stateless', 'first_token')} | {pp(mixed, 'turn', 'first_token')} |",
            f"| mixed {args.rate:g}/s: POST -> generation.completed p50 / p99 ms | {pp(mixed, 'stateless', 'done')} | {pp(mixed, 'turn', 'done')} |",
            f"| mixed {args.rate:g}/s: not completed, by code | {refusals(mixed, 'stateless')} | {refusals(mixed, 'turn')} |",
            f"| {args.rate / 2:g}/s one kind: CPU ms per completed generation, whole stack | {sum(phase_a.cpu_ms.values()):.1f} | {sum(phase_b.cpu_ms.values()):.1f} |",
            f"| ... of it processor / edge / worker / history writer | "
            + " / ".join(f"{phase_a.cpu_ms.get(k, 0):.1f}" for k in ("processor-1", "edge-1", "worker-1", "history-1")) + " | "
            + " / ".join(f"{phase_b.cpu_ms.get(k, 0):.1f}" for k in ("processor-1", "edge-1", "worker-1", "history-1")) + " |",
            f"| ... of it Kafka / Cassandra | {phase_a.cpu_ms.get('kafka', 0):.1f} / {phase_a.cpu_ms.get('cassandra', 0):.1f} | "
            f"{phase_b.cpu_ms.get('kafka', 0):.1f} / {phase_b.cpu_ms.get('cassandra', 0):.1f} |",
            f"| Kafka log bytes / records per completed generation | {sum(phase_a.kafka_topics.values()) / 1024:.1f} KiB / {sum(phase_a.kafka_records.values()):.1f} | "
            f"{sum(phase_b.kafka_topics.values()) / 1024:.1f} KiB / {sum(phase_b.kafka_records.values()):.1f} |",
            f"| Cassandra disk writes per completed generation | {phase_a.cassandra_bytes / 1024:.1f} KiB | {phase_b.cassandra_bytes / 1024:.1f} KiB |",
            f"| command + ledger + changelog value bytes per generation (pool users) | "
            f"{mean_of(st_rows, lambda r: (r.commands + r.ledger + r.changelog) / max(1, r.generations)):,.0f} B | "
            f"{mean_of(cv_rows, lambda r: (r.commands + r.ledger + r.changelog) / max(1, r.generations)):,.0f} B |",
            f"| processor hot value, pool user after ~{mean_of(cv_rows, lambda r: r.generations):.0f} generations | "
            f"{mean_of(st_rows, lambda r: r.hot):,.0f} B | {mean_of(cv_rows, lambda r: r.hot):,.0f} B (1 conversation) |",
            "",
            f"Processor hot value by conversations held: {hot_line}; without its remembered decisions (table_store.plan "
            f"of the replayed state) about {per_conversation:,.0f} B per conversation held.",
            f"Reads at {args.read_rate:g}/s (open loop): messages p50 / p99 {read_p(reads_m, 'messages_asc', .5):,.0f} / "
            f"{read_p(reads_m, 'messages_asc', .99):,.0f} ms (?limit=50 asc), {read_p(reads_m, 'messages_desc', .5):,.0f} / "
            f"{read_p(reads_m, 'messages_desc', .99):,.0f} ms (?before&order=desc&limit=20); conversation list (20 a page) "
            f"{read_p(reads_l, 'list', .5):,.0f} / {read_p(reads_l, 'list', .99):,.0f} ms; answered "
            f"{answered_per_s(reads_m):.0f} and {answered_per_s(reads_l):.0f} ok reads/s.",
            f"Offered (asked): mixed {mixed.offered_per_s():.0f}/s ({args.rate:g}), A {phase_a.offered_per_s():.0f}/s ({args.rate / 2:g}), "
            f"B {phase_b.offered_per_s():.0f}/s ({args.rate / 2:g}), messages {reads_m.offered_per_s():.0f}/s, list "
            f"{reads_l.offered_per_s():.0f}/s ({args.read_rate:g}); the client's own CPU: mixed "
            f"{mixed.client_cpu_s / max(mixed.send_s, 1e-9):.0%}, reads {reads_m.client_cpu_s / max(reads_m.send_s, 1e-9):.0%} / "
            f"{reads_l.client_cpu_s / max(reads_l.send_s, 1e-9):.0%} of a core; other processes of the machine, in cores: "
            + ", ".join(f"{ph.name} {ph.machine[2]:.2f}" for ph in (mixed, phase_a, phase_b, reads_m, reads_l)) + ".",
            f"Anomalies: {dict(anomalies) or 'none'}.")
    finally:
        stack.stop()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_conversations.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, help="seconds of each generation phase (default 30; --quick 6)")
    p.add_argument("--rate", type=float, help="combined requests/s of the mixed phase; each one-kind phase runs at half (default 100; --quick 20)")
    p.add_argument("--users", type=int, help="conversation users, and as many stateless users (default 200; --quick 20)")
    p.add_argument("--read-rate", type=float, help="reads/s of each read phase (default 500; --quick 100)")
    p.add_argument("--read-s", type=float, help="seconds of each read phase (default 10; --quick 3)")
    p.add_argument("--sidebar-users", type=int, help="users whose conversation list is read (default 20; --quick 4)")
    p.add_argument("--sidebar-conversations", type=int, default=20, help="conversations each sidebar user holds")
    p.add_argument("--warmup-s", type=float, help=f"stateless load at {WARMUP_RATE:g}/s after the setup, not reported (default 10; --quick 2)")
    p.add_argument("--tail-s", type=float, default=3.0, help="after the last stream of a phase ended, still counted")
    p.add_argument("--pause-s", type=float, default=3.0, help="between phases")
    p.add_argument("--quick", action="store_true", help="a short run (smoke check): small rates, users and durations")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="a setting for every chatplane component")
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, broker and Cassandra data)")
    args = p.parse_args(argv)
    defaults = {"duration": (30.0, 6.0), "rate": (100.0, 20.0), "users": (200, 20), "read_rate": (500.0, 100.0),
                "read_s": (10.0, 3.0), "sidebar_users": (20, 4), "warmup_s": (10.0, 2.0)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.size_ns = QUICK_SIZE_NS if args.quick else SIZE_NS
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="chatplane-bench-conv-"))
    asyncio.run(bench(args, work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
