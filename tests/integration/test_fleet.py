"""More than one of everything, on one machine: the fleet's shape in miniature.

Two admission processors (``python -m projections``, instances ``pa`` and ``pb`` of one consumer
group, splitting the user partitions), two ``python -m workers --engine sim`` workers (the one fake:
no GPU), the read-model projection, two ``python -m edge`` processes on their own inbox partitions,
and Debian's nginx in front of the edges with the production proxy settings
(``infra/nginx/chatplane-proxy.conf``), all on a fresh topology and keyspace. docs/fleet.md.

``test_one_users_requests_spread_over_two_edges_stay_exact_and_sse_is_incremental_through_nginx``:
    1. one user's requests sent straight to both edges at once (bypassing nginx's stickiness, to
       force the spread): exactly ``QUOTA`` admitted and the rest ``quota_exhausted``; exactly the
       concurrency limit admitted and the rest ``concurrency_limited``; one ``Idempotency-Key`` sent to
       both edges names one generation and spends one message;
    2. a stream through nginx arrives incrementally: a heartbeat comment before the first token, the
       deltas read at many distinct times spread over the generation.

``test_one_user_holding_two_tokens_reaches_one_edge_through_nginx``:
    2b. nginx hashes the user's route key (an edge's answer to its look-up, cached per token), not the
       token: each user's two tokens reach one edge, the users together both.

``test_a_processor_leaving_and_an_edge_killed_lose_nothing_but_their_own_streams``:
    4. a processor leaves (SIGTERM) while users on both processors' partitions stream: every stream
       completes, new requests of its users complete once the other processor took its partitions;
    3. ``kill -9`` of one edge while each edge holds a stream: only that edge's streams break (the
       processor cancels their generations, ``edge_lost``); the other edge's stream completes; requests
       through nginx still succeed (nginx passes over the dead edge);
    then, from the log: every command appended got exactly one decision (no two different outcomes,
    none without one), and the audit over the ledger and the table is clean.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import murmur2
from aiokafka.protocol.group import MemberAssignment

from edge.auth import mint
from projections.ledger.audit import audit
from infra.runtime.command_client import CommandClient
from infra.runtime.kafka_admin import delete_topics, deployment_topics, ensure_topics
from infra.runtime.topic_reader import read_topic
from schemas import events as ev
from schemas.codes import Tier
from schemas.messages import Outcome
from schemas.topics import USER_PARTITIONS, Topology
from schemas.wire import decode_command, decode_message, encode
from infra.harness.processes import (
    EdgeProcess,
    ProcessorProcess,
    ProjectionProcess,
    WorkerProcess,
    wait_until_committed,
    wait_until_deciding,
)
from tests.integration.nginx_harness import NginxProcess, nginx_binary
from tests.integration.test_edge_harness import sse_events
from tests.integration.workers_harness import ledger_events

pytestmark = pytest.mark.integration

MODEL = "simulated-text-model"
QUOTA = 5  # messages per window of a free user, for every process of the fleet
CONCURRENCY_LIMIT = 2  # the policy's default
HEARTBEAT_S = 0.5  # the edges' SSE heartbeat interval
TTFT_MS = 1200  # the simulator's time to first token: long enough for heartbeats before it
INTER_TOKEN_MS = 50
# The broker's smallest session timeout (group.min.session.timeout.ms): a static member that leaves
# hands its partitions over after this (it sends no LeaveGroup).
SESSION_TIMEOUT_S = 6
LEASE_MS = 20_000  # above the handover, so a running attempt's lease outlives it
# The grace after an edge's liveness lease lapsed (the lease is the default 3 s: 3 of the edges' 1 s
# beats; a shorter one with 1 s beats was seen never to judge an edge lost on this loaded machine,
# the presence reader's fetch responses being too far apart for its "the log flows" check).
EDGE_LOST_GRACE_MS = 2_000
WAIT_S = 90.0  # bound on any one wait (a loaded 2-core machine)
CQL_DDL_TIMEOUT_S = 60.0
RETRY_PAUSE_S = 0.25
TERMINAL = ("generation.completed", "generation.cancelled", "generation.error")
# Users, each with two tokens, sent through nginx. Were the token the hash key, all of the first 8
# users' two tokens would land together only once in 256 runs; more users are tried (up to the
# maximum) until both edges served one, so the spread over edges is shown too.
TWO_TOKEN_USERS_MIN = 8
TWO_TOKEN_USERS_MAX = 24
TWO_TOKEN_TTLS_S = (600, 900)  # two lifetimes: two different tokens of one user
# One line of the fleet test's nginx access log (infra/nginx/chatplane.conf.template's format).
ACCESS_LINE = re.compile(r"^\S+ (?P<method>\S+) (?P<uri>\S+) (?P<status>\d+) upstream=(?P<upstream>.*?) "
                         r"upstream_status=(?P<upstream_status>.*?) cache=(?P<cache>\S+) time=")
ROUTE_KEY_URI = "/_chatplane_route_key"  # nginx's internal location for the look-up (chatplane-route-key.conf)


def user_partition(user: str) -> int:
    """The user partition of ``user`` (the default partitioner's murmur2, as every producer uses)."""
    return (murmur2(user.encode()) & 0x7FFFFFFF) % USER_PARTITIONS


def user_on(partitions: set[int], tag: str) -> str:
    """A fresh user id whose partition is one of ``partitions``."""
    while True:
        user = f"{tag}-{uuid.uuid4().hex[:8]}"
        if user_partition(user) in partitions:
            return user


def body(tokens: int, stream: bool = False, text: str = "Tell me a story.") -> dict[str, Any]:
    return {"model": MODEL, "stream": stream, "max_output_tokens": tokens, "messages": [{"role": "user", "content": text}]}


def error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def decide_final(http: httpx.AsyncClient, headers: dict[str, str], doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """POST a non-streaming request until it has a final answer, as a well-behaved client does: a 503
    (shed, no decision in time) or a 429 ``concurrency_limited`` is sent again with the same key; a 409
    ``generation_in_progress`` for this key is followed to its end. Returns ("completed", document)
    or (the refusal's code, error)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        assert time.monotonic() < deadline, "no final answer in time"
        r = await http.post("/v1/generations", headers=headers, json=doc)
        code = error_code(r)
        if r.status_code == 200:
            assert r.json()["status"] == "completed", r.text
            return "completed", r.json()
        if r.status_code == 409 and code == "generation_in_progress" and r.json()["error"].get("same_request"):
            return "completed", await follow_to_end(http, headers, r.json()["error"]["generation_id"])
        if r.status_code == 503 or code == "concurrency_limited":
            await asyncio.sleep(RETRY_PAUSE_S)
            continue
        return str(code), r.json()["error"]


async def follow_to_end(http: httpx.AsyncClient, headers: dict[str, str], gid: str) -> dict[str, Any]:
    """GET a generation until it is completed (a read-model lag answers 404 for a moment)."""
    auth = {"Authorization": headers["Authorization"]}
    deadline = time.monotonic() + WAIT_S
    while True:
        r = await http.get(f"/v1/generations/{gid}", headers=auth)
        if r.status_code == 200 and r.json()["status"] == "completed":
            return r.json()
        assert r.status_code in (200, 404) and (r.status_code == 404 or r.json()["status"] in ("queued", "running")), r.text
        assert time.monotonic() < deadline, f"{gid} did not complete: {r.text}"
        await asyncio.sleep(RETRY_PAUSE_S)


@dataclass
class Stream:
    """One SSE stream read to its end in the background: each read with its arrival time."""

    user: str
    headers: dict[str, str]
    reads: list[tuple[float, bytes]] = field(default_factory=list)
    status: int | None = None
    opened_at: float = 0.0
    broken: str | None = None  # the exception that ended the read, if the stream broke
    retried_503: int = 0

    @property
    def text(self) -> str:
        return b"".join(b for _, b in self.reads).decode()

    @property
    def events(self) -> list[tuple[int | None, str, dict[str, Any]]]:
        return sse_events(self.text)

    @property
    def generation_id(self) -> str | None:
        ev0 = self.events
        return ev0[0][2]["generation_id"] if ev0 else None

    def deltas(self) -> int:
        return sum(1 for _, name, _ in self.events if name == "generation.text.delta")

    def terminal(self) -> list[str]:
        return [name for _, name, _ in self.events if name in TERMINAL]


def timed_frames(reads: list[tuple[float, bytes]]) -> list[tuple[float, str]]:
    """(time of the read that completed it, event name or "heartbeat") for each SSE frame, in order."""
    out, buffer = [], b""
    for t, chunk in reads:
        buffer += chunk
        *frames, buffer = buffer.split(b"\n\n")
        for frame in frames:
            if frame.startswith(b": keep-alive"):
                out.append((t, "heartbeat"))
            elif b"event: " in frame:
                out.append((t, frame.split(b"event: ", 1)[1].split(b"\n", 1)[0].decode()))
    return out


async def read_stream(http: httpx.AsyncClient, s: Stream, doc: dict[str, Any]) -> Stream:
    """Open the stream and read it to its end. A 503 before the stream (shed, or no decision in time:
    nothing charged) is sent again with the same key after a pause, as a client does."""
    deadline = time.monotonic() + WAIT_S
    try:
        while True:
            s.opened_at = time.monotonic()
            async with http.stream("POST", "/v1/generations", headers=s.headers, json=doc) as r:
                if r.status_code == 503 and time.monotonic() < deadline:
                    await r.aread()
                    s.retried_503 += 1
                    await asyncio.sleep(RETRY_PAUSE_S)
                    continue
                if r.status_code != 200:
                    s.reads.append((time.monotonic(), await r.aread()))
                    s.status = r.status_code  # after the body: a waiter may read it at once
                    return s
                s.status = r.status_code
                async for chunk in r.aiter_raw():
                    s.reads.append((time.monotonic(), chunk))
                return s
    except httpx.HTTPError as exc:  # the connection broke (e.g. the edge behind it was killed)
        s.broken = type(exc).__name__
    return s


async def wait_until(predicate: Any, what: str, timeout_s: float = WAIT_S, pause_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(pause_s)


async def active_streams(edge: EdgeProcess) -> float:
    async with edge.http() as h:
        text = (await h.get("/metrics")).text
    m = re.search(r"^chatplane_edge_active_streams (\S+)$", text, re.MULTILINE)
    assert m, "no chatplane_edge_active_streams in /metrics"
    return float(m.group(1))


async def admissions(edge: EdgeProcess, code: str) -> float:
    async with edge.http() as h:
        text = (await h.get("/metrics")).text
    m = re.search(rf'^chatplane_edge_admissions_total{{code="{code}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def new_access_lines(nginx: NginxProcess, seen: int, count: int) -> list[dict[str, str]]:
    """The next ``count`` lines of nginx's access log after the first ``seen``, parsed (nginx writes a
    line when the request ends, which may be just after the client read the answer)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        lines = nginx.access_log().splitlines()[seen:]
        if len(lines) >= count:
            break
        assert time.monotonic() < deadline, f"nginx logged {lines}, expected {count} lines"
        await asyncio.sleep(0.02)
    parsed = [ACCESS_LINE.match(line) for line in lines[:count]]
    assert all(parsed), lines
    return [m.groupdict() for m in parsed if m]


async def processor_assignment(bootstrap: str, topology: Any) -> dict[str, set[int]]:
    """Which commands partitions each processor instance holds, from the consumer group's description
    (a static member's id starts with its instance id); empty while the group rebalances."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.describe_consumer_groups([topology.processor_app_id])
    finally:
        await admin.close()
    group = response[0].groups[0]
    if group[2] != "Stable":
        return {}
    out: dict[str, set[int]] = {}
    for member_id, _client_id, _host, _metadata, raw in group[-1]:
        if not raw:
            return {}
        instance = member_id.split("-", 1)[0]
        for topic, partitions in MemberAssignment.decode(raw).assignment:
            if topic == topology.commands.name:
                out[instance] = set(partitions)
    return out


async def wait_for_assignment(bootstrap: str, topology: Any, instances: set[str]) -> dict[str, set[int]]:
    deadline = time.monotonic() + WAIT_S
    while True:
        got = await processor_assignment(bootstrap, topology)
        if set(got) == instances and all(got.values()) and set().union(*got.values()) == set(range(USER_PARTITIONS)):
            return got
        assert time.monotonic() < deadline, f"processors {instances} did not share the partitions: {got}"
        await asyncio.sleep(0.5)


@dataclass
class Fleet:
    topology: Topology
    processors: dict[str, ProcessorProcess]
    workers: list[WorkerProcess]
    projection: ProjectionProcess
    edges: list[EdgeProcess]
    nginx: NginxProcess
    damaged: bool = False  # set by the test that kills and stops parts of it


# One fleet for the module (its start is most of the file's time on 2 cores): the first test leaves
# it whole, the second breaks it (a processor leaves, an edge is killed) and then reads the log of both.
@pytest.fixture(scope="module")
async def fleet(kafka_bootstrap, cassandra_hosts, cassandra_port, cassandra_session, tmp_path_factory):
    from infra.stores.cassandra import execute

    assert nginx_binary(), "nginx is not installed: run infra/nginx-install (make test does)"
    log_dir = tmp_path_factory.mktemp("fleet")
    topology = Topology(f"t{uuid.uuid4().hex[:10]}")
    await ensure_topics(kafka_bootstrap, deployment_topics(topology))
    keyspace = f"fleet_{uuid.uuid4().hex[:12]}"
    await execute(cassandra_session, f"CREATE KEYSPACE {keyspace} WITH replication = "
                  "{'class': 'SimpleStrategy', 'replication_factor': 1}", timeout_s=CQL_DDL_TIMEOUT_S)
    cass = {"CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts), "CHATPLANE_CASSANDRA_PORT": str(cassandra_port),
            "CHATPLANE_CASSANDRA_KEYSPACE": keyspace}
    common = {"CHATPLANE_QUOTA_FREE_PER_WINDOW": QUOTA, "CHATPLANE_LEASE_MS": LEASE_MS}
    processors = {instance: ProcessorProcess(kafka_bootstrap, topology.namespace, log_dir,
                                             CHATPLANE_PROCESSOR_SESSION_TIMEOUT_S=SESSION_TIMEOUT_S,
                                             CHATPLANE_EDGE_LOST_GRACE_MS=EDGE_LOST_GRACE_MS, **common)
                  for instance in ("pa", "pb")}
    projection = ProjectionProcess(kafka_bootstrap, topology.namespace, log_dir, **cass)
    workers = [WorkerProcess(kafka_bootstrap, topology, log_dir, engine="sim", CHATPLANE_WORKER_RESULT_STORE="cassandra",
                             CHATPLANE_SIM_TTFT_MS=TTFT_MS, CHATPLANE_SIM_INTER_TOKEN_MS=INTER_TOKEN_MS,
                             CHATPLANE_SIM_OUTPUT_TOKENS=5000, **cass, **common) for _ in range(2)]
    edges = [EdgeProcess(kafka_bootstrap, topology, log_dir, CHATPLANE_EDGE_INBOX_PARTITION=str(i),
                         CHATPLANE_EDGE_READ_MODEL="1", CHATPLANE_EDGE_HEARTBEAT_INTERVAL_S=HEARTBEAT_S,
                         # Each edge's burst bucket is not what this test measures (the retries below
                         # would drain it); quota and concurrency are the core's.
                         CHATPLANE_EDGE_BUCKET_CAPACITY=1000, CHATPLANE_EDGE_IP_RATE_PER_S=0,
                         # nginx is the edges' peer: its X-Forwarded-For names the client.
                         CHATPLANE_EDGE_TRUSTED_PROXIES="127.0.0.1/32", **cass, **common)
             for i in (1, 2)]
    nginx = None
    try:
        for instance, p in processors.items():
            p.start(instance)
        projection.start()
        for w in workers:
            w.start()
        await asyncio.gather(*(e.start() for e in edges))
        nginx = NginxProcess([e.url for e in edges])
        nginx.start()
        # Both processors decide: a probe for a user on every partition is answered.
        await wait_for_assignment(kafka_bootstrap, topology, {"pa", "pb"})
        async with CommandClient(kafka_bootstrap, topology, inbox_partition=0, decision_timeout_s=15) as client:
            for partition in range(USER_PARTITIONS):
                await wait_until_deciding(client, user_on({partition}, "probe"))
        yield Fleet(topology, processors, workers, projection, edges, nginx)
    finally:
        if nginx is not None:
            nginx.stop()
        for e in edges:
            e.stop()
        for w in workers:
            w.stop()
        projection.stop()
        for p in processors.values():
            p.stop()
        if nginx is not None:
            nginx.cleanup()
        await delete_topics(kafka_bootstrap, [spec.name for spec in deployment_topics(topology)])
        await execute(cassandra_session, f"DROP KEYSPACE IF EXISTS {keyspace}", timeout_s=CQL_DDL_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------------
# 1 and 2


async def test_one_users_requests_spread_over_two_edges_stay_exact_and_sse_is_incremental_through_nginx(fleet, kafka_bootstrap):
    assert not fleet.damaged, "this test needs the whole fleet: run it before the one that breaks it"
    topology = fleet.topology
    first, second = fleet.edges

    # 1a. Quota: 2 x QUOTA short requests of one user, half to each edge, all at once.
    user = f"quota-{uuid.uuid4().hex[:8]}"
    async with first.http() as h1, second.http() as h2:
        results = await asyncio.gather(*(
            decide_final(h, e.headers(user, f"q{i}"), body(3))
            for i, (e, h) in enumerate([(first, h1), (second, h2)] * QUOTA)
        ))
        usage = (await h2.get("/v1/usage", headers=second.headers(user))).json()
    completed = [doc["id"] for code, doc in results if code == "completed"]
    refused = [doc for code, doc in results if code != "completed"]
    assert len(completed) == QUOTA and len(set(completed)) == QUOTA, results
    assert len(refused) == QUOTA and all(d["code"] == "quota_exhausted" and d["details"]["limit"] == QUOTA for d in refused), refused
    assert usage["quota"]["limit"] == QUOTA and usage["quota"]["used"] == QUOTA and usage["quota"]["remaining"] == 0, usage
    # Both edges took requests of this user; together they admitted exactly QUOTA.
    admitted = [await admissions(e, "admitted") for e in (first, second)]
    assert sum(admitted) == QUOTA, admitted
    assert sum([await admissions(e, "quota_exhausted") for e in (first, second)]) == QUOTA

    # 1b. Concurrency: 8 long streams of one user, half to each edge, all at once: exactly the limit run.
    user = f"conc-{uuid.uuid4().hex[:8]}"
    async with first.http() as h1, second.http() as h2:
        streams = [Stream(user, e.headers(user, f"c{i}")) for i, e in enumerate([first, second] * 4)]
        tasks = [asyncio.create_task(read_stream(h, s, body(400, stream=True)))
                 for s, h in zip(streams, [h1, h2] * 4, strict=True)]
        await wait_until(lambda: all(s.status is not None for s in streams), "every stream's answer")
        await wait_until(lambda: all(s.status != 200 or s.generation_id for s in streams), "created events")
        running = [s for s in streams if s.status == 200]
        limited = [s for s in streams if s.status == 429]
        assert len(running) == CONCURRENCY_LIMIT, [(s.status, s.text[:200]) for s in streams]
        assert len(limited) == len(streams) - CONCURRENCY_LIMIT
        assert all(json.loads(s.text)["error"]["code"] == "concurrency_limited" for s in limited)
        for s in running:  # free the slots
            h = h1 if streams.index(s) % 2 == 0 else h2
            c = await h.post(f"/v1/generations/{s.generation_id}/cancel", headers={"Authorization": s.headers["Authorization"]})
            assert c.status_code in (200, 202), c.text
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        assert all(s.terminal() == ["generation.cancelled"] for s in running)

    # 1c. Idempotency: one key sent to both edges at once names one generation and spends one message.
    user = f"idem-{uuid.uuid4().hex[:8]}"
    async with first.http() as h1, second.http() as h2:
        both = await asyncio.gather(decide_final(h1, first.headers(user, "same-key"), body(8)),
                                    decide_final(h2, second.headers(user, "same-key"), body(8)))
        assert [code for code, _ in both] == ["completed", "completed"], both
        gid = both[0][1]["id"]
        assert both[1][1]["id"] == gid, both
        # Retries with the key on either edge after the end: the same generation and text.
        for e, h in ((first, h1), (second, h2)):
            again = await h.post("/v1/generations", headers=e.headers(user, "same-key"), json=body(8))
            assert again.status_code == 200 and again.json()["id"] == gid, again.text
            assert again.json()["output"] == both[0][1]["output"]
        usage = (await h1.get("/v1/usage", headers=first.headers(user))).json()
    assert usage["quota"]["used"] == 1, usage
    admitted_events = [e for e in await ledger_events(kafka_bootstrap, topology)
                       if isinstance(e, ev.GenerationAdmitted) and e.user_id == user]
    assert [e.generation_id for e in admitted_events] == [gid]

    # 2. SSE through nginx: a heartbeat before the first token, then deltas spread over time.
    user = f"sse-{uuid.uuid4().hex[:8]}"
    async with fleet.nginx.http() as hn:
        s = await asyncio.wait_for(read_stream(hn, Stream(user, first.headers(user, "sse-1")), body(40, stream=True)), WAIT_S)
    assert s.status == 200 and s.broken is None, s.text[:500]
    assert s.terminal() == ["generation.completed"], s.text[-500:]
    arrivals = timed_frames(s.reads)
    names = [n for _, n in arrivals]
    first_delta = names.index("generation.text.delta")
    assert names[0] == "generation.created"
    assert "heartbeat" in names[:first_delta], names[:first_delta + 1]  # liveness while the model is slow
    delta_times = sorted({t for t, n in arrivals if n == "generation.text.delta"})
    end_time = next(t for t, n in arrivals if n == "generation.completed")
    # 40 tokens at 50 ms each: a buffering proxy would deliver them in one read at the end.
    assert len(delta_times) >= 5, len(delta_times)
    assert delta_times[-1] - delta_times[0] >= 0.8, delta_times
    assert end_time - delta_times[0] >= 0.8
    text = "".join(d["delta"] for _, n, d in s.events if n == "generation.text.delta")
    async with first.http() as h1:  # the same text on the other side of the proxy
        doc = await follow_to_end(h1, s.headers, s.generation_id)
    assert doc["output"][0]["text"] == text
    print(f"\n[fleet] SSE through nginx: heartbeats before the first token: {names[:first_delta].count('heartbeat')}; "
          f"first delta {delta_times[0] - s.opened_at:.2f} s after the POST, {len(delta_times)} distinct delta reads "
          f"over {delta_times[-1] - delta_times[0]:.2f} s")


async def test_one_user_holding_two_tokens_reaches_one_edge_through_nginx(fleet):
    # Sticky by user, not by token: nginx asks an edge for each token's route key (one look-up per
    # token, then from its cache) and hashes that, so a user's burst bucket is one edge's.
    assert not fleet.damaged, "this test needs the whole fleet: run it before the one that breaks it"
    first = fleet.edges[0]
    edge_addresses = {e.url.removeprefix("http://") for e in fleet.edges}
    served: dict[str, set[str]] = {}
    async with fleet.nginx.http() as hn:
        for n in range(TWO_TOKEN_USERS_MAX):
            if n >= TWO_TOKEN_USERS_MIN and set().union(*served.values()) == edge_addresses:
                break
            user = f"two-tokens-{uuid.uuid4().hex[:8]}"
            tokens = [mint(first.settings, user, Tier.FREE, ttl_s=ttl) for ttl in TWO_TOKEN_TTLS_S]
            assert tokens[0] != tokens[1]
            served[user] = set()
            for token in tokens:
                auth = {"Authorization": f"Bearer {token}"}
                seen = len(fleet.nginx.access_log().splitlines())
                # A POST with a body the edge refuses (typed, before any command): the look-up before
                # it must reach the edge without the body and be answered at once, not time out
                # waiting for one. Then a GET with the same token, whose key comes from the cache.
                refused = await hn.post("/v1/generations", headers=auth, json={})
                assert refused.status_code == 400 and error_code(refused) == "invalid_request", refused.text
                models = await hn.get("/v1/models", headers=auth)
                assert models.status_code == 200, models.text
                look_up, post, cached, get = await new_access_lines(fleet.nginx, seen, 4)
                assert (look_up["uri"], look_up["status"], look_up["upstream_status"], look_up["cache"]) == \
                    (ROUTE_KEY_URI, "204", "204", "MISS"), look_up  # answered by an edge, not the fallback
                assert (cached["uri"], cached["cache"], cached["upstream"]) == (ROUTE_KEY_URI, "HIT", "-"), cached
                assert (post["uri"], post["status"], get["uri"], get["status"]) == ("/v1/generations", "400", "/v1/models", "200")
                served[user] |= {post["upstream"], get["upstream"]}
    # Each user's two tokens reached one edge; the users together reached both.
    assert all(len(edges) == 1 for edges in served.values()), served
    assert set().union(*served.values()) == edge_addresses, served
    print(f"\n[fleet] {len(served)} users with two tokens each: every user on one edge "
          f"({sum(1 for e in served.values() if e == {first.url.removeprefix('http://')})} on the first)")


# ---------------------------------------------------------------------------------------------------
# 4, then 3, then the ledger


async def test_a_processor_leaving_and_an_edge_killed_lose_nothing_but_their_own_streams(fleet, kafka_bootstrap):
    assert not fleet.damaged
    fleet.damaged = True
    topology = fleet.topology
    first, second = fleet.edges
    nginx = fleet.nginx

    # 4. Users on both processors' partitions stream through nginx; one processor leaves mid-stream.
    assignment = await wait_for_assignment(kafka_bootstrap, topology, {"pa", "pb"})
    leaving, staying = "pa", "pb"
    users = {name: [user_on(parts, name) for _ in range(3)] for name, parts in assignment.items()}
    async with nginx.http() as hn:
        streams = {u: Stream(u, first.headers(u, f"{u}-s")) for us in users.values() for u in us}
        tasks = [asyncio.create_task(read_stream(hn, s, body(160, stream=True))) for s in streams.values()]
        await wait_until(lambda: all(s.deltas() >= 2 or s.status not in (None, 200) for s in streams.values()),
                         "every stream's first deltas")
        assert all(s.status == 200 for s in streams.values()), [(s.user, s.status, s.text[:200]) for s in streams.values()]
        leaving_proc = fleet.processors[leaving]
        assert leaving_proc.proc is not None
        t_leave = time.monotonic()
        leaving_proc.proc.send_signal(signal.SIGTERM)
        # New requests of the leaving processor's users (the client retries 503 until they are decided).
        later = await asyncio.gather(*(decide_final(hn, streams[u].headers | {"Idempotency-Key": f"{u}-n"}, body(5))
                                       for u in users[leaving]))
        handover_s = time.monotonic() - t_leave
        assert [code for code, _ in later] == ["completed"] * len(users[leaving]), later
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    await wait_until(lambda: not leaving_proc.alive(), "the leaving processor's exit", 30)
    assert leaving_proc.proc.returncode == 0, leaving_proc.log_text()[-2000:]
    for s in streams.values():
        assert s.broken is None and s.terminal() == ["generation.completed"], (s.user, s.broken, s.text[-300:])
    after = await wait_for_assignment(kafka_bootstrap, topology, {staying})
    assert after == {staying: set(range(USER_PARTITIONS))}
    print(f"\n[fleet] processor {leaving} left (SIGTERM): its users' new requests completed {handover_s:.1f} s later; "
          f"{len(streams)} streams on both processors' partitions completed")

    # 3. Each edge holds a stream (through nginx: which edge a user lands on is nginx's hash, read
    # from the edges' gauges); kill -9 one edge.
    held: dict[int, list[Stream]] = {0: [], 1: []}
    tasks = []
    async with nginx.http() as hn:
        for _ in range(24):
            if held[0] and held[1]:
                break
            before = [await active_streams(e) for e in fleet.edges]
            u = f"kill-{uuid.uuid4().hex[:8]}"
            s = Stream(u, first.headers(u, f"{u}-s"))
            tasks.append(asyncio.create_task(read_stream(hn, s, body(200, stream=True))))
            await wait_until(lambda s=s: s.generation_id is not None or s.status not in (None, 200), "created")
            assert s.status == 200, s.text[:300]
            now = [await active_streams(e) for e in fleet.edges]
            grew = [i for i in (0, 1) if now[i] > before[i]]
            assert len(grew) == 1, (before, now)
            held[grew[0]].append(s)
        assert held[0] and held[1], "nginx sent 24 users to one edge"
        await wait_until(lambda: all(s.deltas() >= 2 for ss in held.values() for s in ss), "deltas on both edges")
        victim, survivor = fleet.edges[0], fleet.edges[1]
        victim.signal(signal.SIGKILL)
        await victim.wait(10)
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        for s in held[0]:  # broken: no terminal event, the connection ended early
            assert s.terminal() == [] and s.broken is not None, (s.broken, s.text[-300:])
        for s in held[1]:
            assert s.broken is None and s.terminal() == ["generation.completed"], (s.broken, s.text[-300:])
        # The processors cancel the dead edge's generations once its liveness lease and grace ran out.
        for s in held[0]:
            await wait_until_cancelled(kafka_bootstrap, topology, s.generation_id, "edge_lost")
        # Requests through nginx still succeed, those of the dead edge's users (same tokens) included.
        again = await asyncio.gather(*(decide_final(hn, s.headers | {"Idempotency-Key": f"{s.user}-again"}, body(5))
                                       for ss in held.values() for s in ss))
        assert [code for code, _ in again] == ["completed"] * len(again), again
        s = await asyncio.wait_for(read_stream(hn, Stream(held[0][0].user, held[0][0].headers | {"Idempotency-Key": "after"}),
                                               body(10, stream=True)), WAIT_S)
        assert s.status == 200 and s.terminal() == ["generation.completed"], s.text[-300:]
    # nginx's log: the victim's users were answered by the survivor, some after a refused connection
    # to the victim (until fail_timeout passes, nginx skips a failed edge without trying it).
    victim_addr = victim.url.removeprefix("http://")
    passed_over = [line for line in nginx.access_log().splitlines()
                   if f"upstream={victim_addr}, {survivor.url.removeprefix('http://')}" in line]
    print(f"[fleet] edge killed: {len(held[0])} stream(s) broke, {len(held[1])} completed; "
          f"nginx passed {len(passed_over)} request(s) over the dead edge")

    # The ledger: settle (no edge left to probe, no worker renewing), let the processor commit, stop it.
    survivor.stop()
    for w in fleet.workers:
        w.stop()
    await wait_until_committed(kafka_bootstrap, topology)
    fleet.processors[staying].stop()
    commands = [decode_command(v) for _, _, _, v in await read_topic(kafka_bootstrap, topology.commands) if v]
    outcomes: dict[str, set[bytes]] = defaultdict(set)
    for spec in (topology.edge_inbox, topology.worker_control):
        for _, _, _, value in await read_topic(kafka_bootstrap, spec):
            message = decode_message(value) if value else None
            if isinstance(message, Outcome):
                outcomes[message.command_id].add(encode(message))
    answered = [c for c in commands if c.reply_to is not None]
    assert len(answered) > 100, len(answered)
    undecided = [(type(c).__name__, c.command_id) for c in answered if c.command_id not in outcomes]
    doubled = [(type(c).__name__, c.command_id) for c in answered if len(outcomes.get(c.command_id, ())) > 1]
    assert not undecided, undecided[:10]
    assert not doubled, doubled[:10]
    report = await audit(kafka_bootstrap, topology, concurrency_limit=CONCURRENCY_LIMIT)
    assert report.ok, report.render()
    assert report.consumed > 0 and report.terminal["cancelled"] >= len(held[0])
    print(f"[fleet] {len(commands)} commands, {len(answered)} answered once each; audit: "
          + ", ".join(f"{k}={v}" for k, v in sorted(report.terminal.items())))


async def wait_until_cancelled(bootstrap: str, topology: Any, gid: str | None, reason: str) -> None:
    assert gid is not None
    deadline = time.monotonic() + WAIT_S
    while True:
        events = await ledger_events(bootstrap, topology, gid)
        cancelled = [e for e in events if isinstance(e, ev.GenerationCancelled)]
        if cancelled:
            assert cancelled[0].reason.value == reason, cancelled
            return
        assert time.monotonic() < deadline, f"{gid} was not cancelled: {[type(e).__name__ for e in events]}"
        await asyncio.sleep(0.5)
