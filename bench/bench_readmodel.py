"""Benchmark the Cassandra read models on the real broker and Cassandra (a script that prints figures).

    .venv/bin/python bench/bench_readmodel.py [--bootstrap HOST:PORT] [--cassandra-hosts 127.0.0.1]
        [--generations 5000] [--rate 1000] [--rate-seconds 20] [--get-rates 100,250,500] [--get-seconds 10]
        [--only throughput,lag,get]

Each run uses a fresh topic namespace and keyspace (``bench-rm-<hex>`` / ``bench_rm_<hex>``) and
deletes both afterwards. Ledger entries are synthetic but shaped like the processor's (per
generation: submit -> GenerationAdmitted; accept -> AttemptAccepted + ReservationConsumed; renew ->
LeaseRenewed; report -> GenerationCompleted + UsageRecorded + ConcurrencySlotReleased: 4 entries,
7 events), keyed by user like the real ledger. The projection is the real ``python -m
projections.readmodel`` process.

1. throughput: --generations generations produced to the ledger first; then the projection starts
   and ledger entries (and events) per second are measured from its first commit to its last
   (consumer-group offsets polled every POLL_S). Baseline in the same run: raw single-row
   ``INSERT`` of the same column count with the same driver settings and the projection's
   concurrency (WRITES_IN_FLIGHT_MAX).
2. lag: entries produced paced at --rate *events*/s for --rate-seconds while the projection runs;
   the lag of each entry is commit time - produce-ack time, read from the group's committed offsets
   every POLL_S (so the resolution is POLL_S).
3. get: over the projected generations (random ids, results stored): (a) ``GenerationReader.get``
   in this process (metadata + result read concurrently); (b) ``GET /v1/generations/{id}`` through
   one ``python -m edge`` process over HTTP_CONNECTIONS keep-alive HTTP/1.1 connections. Baseline in
   the same run: a raw prepared single-row ``SELECT`` with the same driver. First the capacity of each
   (closed loop, CAPACITY_IN_FLIGHT at once), then p50/p99 at each of --get-rates, paced open-loop
   (latency counts from the scheduled send, so queueing shows; a call past REQUEST_TIMEOUT_S is an
   error).

The machine is small and shared: read every figure beside its baseline from the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aiokafka import AIOKafkaProducer, TopicPartition  # noqa: E402
from aiokafka.admin import AIOKafkaAdminClient  # noqa: E402

from infra.runtime.settings import kafka_bootstrap  # noqa: E402
from infra.stores.cassandra import execute  # noqa: E402
from infra.runtime.kafka_admin import delete_topics, deployment_topics, ensure_topics  # noqa: E402
from infra.stores.queries import GenerationReader  # noqa: E402
from projections.readmodel.writer import WRITES_IN_FLIGHT_MAX  # noqa: E402
from infra.stores.schema import ReadModelSettings, close_cluster, ensure_schema, open_session, prepare  # noqa: E402
from infra.stores.results import CassandraResultStore  # noqa: E402
from schemas import events as ev  # noqa: E402
from schemas.codes import FinishOutcome, SlotReleaseReason, Tier  # noqa: E402
from schemas.topics import Topology  # noqa: E402
from schemas.wire import encode  # noqa: E402
from infra.harness.processes import ProjectionProcess  # noqa: E402

POLL_S = 0.1  # committed-offset polling (the lag figures' resolution)
CATCH_UP_S_MAX = 600.0
PRODUCE_IN_FLIGHT_MAX = 2_000
HTTP_CONNECTIONS = 32
CAPACITY_CALLS = 3_000
CAPACITY_IN_FLIGHT = 32
REQUEST_TIMEOUT_S = 5.0
RESULT_TEXT = "A short stored answer. " * 8  # ~180 bytes
EVENTS_PER_GENERATION = 7


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def fmt_ms(values: list[float]) -> str:
    if not values:
        return "no samples"
    return f"p50 {pct(values, 50):.2f} ms  p99 {pct(values, 99):.2f} ms  max {max(values):.2f} ms  (n={len(values)})"


def now_ms() -> int:
    return int(time.time() * 1000)


def generation_entries(i: int, users: int, t_ms: int) -> tuple[str, str, list[ev.LedgerEntry]]:
    """The four ledger entries of one completed generation (shaped like the processor's)."""
    user = f"bench-user-{i % users}"
    gid = f"bench-gen-{i}-{uuid.uuid4().hex[:6]}"
    common = {"user_id": user, "generation_id": gid, "occurred_at_ms": t_ms}
    win = t_ms - t_ms % 3_600_000

    def eid() -> str:
        return uuid.uuid4().hex

    sub, acc, ren, fin = (f"{k}-{uuid.uuid4().hex}" for k in ("sub", "acc", "ren", "fin"))
    entries = [
        ev.LedgerEntry(command_id=sub, command_type="SubmitGeneration", user_id=user, events=(
            ev.GenerationAdmitted(event_id=eid(), command_id=sub, **common, idempotency_key=f"k{i}", fingerprint="ab" * 16,
                                  model_alias="fast-text-model", model_version="smollm2-135m-instruct-q4_1", pool="default",
                                  tier=Tier.PAID, stream=True, max_output_tokens=64, input_tokens=7, epoch=1,
                                  reservation_id=f"r-{gid}", window_start_ms=win, window_end_ms=win + 3_600_000,
                                  window_limit=100, slot_index=0, queue_deadline_ms=t_ms + 30_000,
                                  reconcile_deadline_ms=t_ms + 600_000),
        )),
        ev.LedgerEntry(command_id=acc, command_type="AcceptAttempt", user_id=user, events=(
            ev.AttemptAccepted(event_id=eid(), command_id=acc, **common, epoch=1, worker_id="bench-w",
                               lease_deadline_ms=t_ms + 10_000, run_deadline_ms=t_ms + 120_000),
            ev.ReservationConsumed(event_id=eid(), command_id=acc, **common, reservation_id=f"r-{gid}", window_start_ms=win, epoch=1),
        )),
        ev.LedgerEntry(command_id=ren, command_type="RenewLease", user_id=user, events=(
            ev.LeaseRenewed(event_id=eid(), command_id=ren, **common, epoch=1, lease_deadline_ms=t_ms + 13_000, output_tokens=10),
        )),
        ev.LedgerEntry(command_id=fin, command_type="ReportAttemptFinished", user_id=user, events=(
            ev.GenerationCompleted(event_id=eid(), command_id=fin, **common, epoch=1, finish_reason="stop",
                                   result_expires_at_ms=t_ms + 3_600_000),
            ev.UsageRecorded(event_id=eid(), command_id=fin, **common, epoch=1, input_tokens=7, output_tokens=21,
                             terminal_reason="stop", outcome=FinishOutcome.COMPLETED,
                             model_version="smollm2-135m-instruct-q4_1", tier=Tier.PAID, window_start_ms=win),
            ev.ConcurrencySlotReleased(event_id=eid(), command_id=fin, **common, slot_index=0, epoch=1,
                                       reason=SlotReleaseReason.STOP_ACKNOWLEDGED),
        )),
    ]
    return user, gid, entries


class Ledger:
    """Produces entries to the ledger and remembers each record's produce-ack time per (partition, offset)."""

    def __init__(self, bootstrap: str, topology: Topology) -> None:
        self.topic = topology.ledger.name
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
        self.acked: dict[int, list[tuple[int, float]]] = {}
        self.in_flight = asyncio.Semaphore(PRODUCE_IN_FLIGHT_MAX)
        self.events = 0
        self.entries = 0

    async def __aenter__(self) -> Ledger:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def send(self, user: str, entry: ev.LedgerEntry) -> asyncio.Future:
        await self.in_flight.acquire()
        fut = await self.producer.send(self.topic, encode(entry), key=user.encode())
        self.entries += 1
        self.events += len(entry.events)

        def done(f: asyncio.Future) -> None:
            self.in_flight.release()
            if not f.cancelled() and f.exception() is None:
                md = f.result()
                self.acked.setdefault(md.partition, []).append((md.offset, time.monotonic()))

        fut.add_done_callback(done)
        return fut


async def committed(admin: AIOKafkaAdminClient, group: str, topic: str) -> dict[int, int]:
    offsets = await admin.list_consumer_group_offsets(group)
    return {tp.partition: om.offset for tp, om in offsets.items() if tp.topic == topic and om.offset >= 0}


async def wait_projection_started(proj: ProjectionProcess) -> None:
    deadline = time.monotonic() + 120
    while "readmodel: started" not in proj.log_text():
        assert proj.alive(), proj.log_text()[-2000:]
        assert time.monotonic() < deadline, "projection did not start"
        await asyncio.sleep(0.1)


# --- 1. throughput ------------------------------------------------------------------------------------

async def baseline_inserts(session, keyspace: str, n: int) -> float:
    """Raw single-row INSERTs (27 value columns, like a full generation row), WRITES_IN_FLIGHT_MAX at once."""
    cols = [f"c{i}" for i in range(26)]
    await execute(session, f"CREATE TABLE IF NOT EXISTS {keyspace}.baseline (id text PRIMARY KEY, {', '.join(c + ' bigint' for c in cols)})",
                  timeout_s=60)
    stmt = await prepare(session, f"INSERT INTO {keyspace}.baseline (id, {', '.join(cols)}) VALUES (?{', ?' * len(cols)})")
    sem = asyncio.Semaphore(WRITES_IN_FLIGHT_MAX)

    async def one(i: int) -> None:
        async with sem:
            await execute(session, stmt, (f"row-{i}", *range(len(cols))), timeout_s=REQUEST_TIMEOUT_S)

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.monotonic() - started)


async def bench_throughput(bootstrap: str, topology: Topology, settings: ReadModelSettings, session, n_gen: int,
                           log_dir: Path, users: int) -> tuple[ProjectionProcess, list[tuple[str, str]]]:
    gens: list[tuple[str, str]] = []
    async with Ledger(bootstrap, topology) as ledger:
        futs = []
        t = now_ms()
        for i in range(n_gen):
            user, gid, entries = generation_entries(i, users, t)
            gens.append((user, gid))
            for e in entries:
                futs.append(await ledger.send(user, e))
        await asyncio.gather(*futs)
        total_entries, total_events = ledger.entries, ledger.events
        ends = {p: max(o for o, _ in v) + 1 for p, v in ledger.acked.items()}
    print(f"throughput: {total_entries} ledger entries ({total_events} events, {n_gen} generations) produced first")
    group = f"{topology.namespace}.chatplane-readmodel"
    proj = ProjectionProcess(bootstrap, topology.namespace, log_dir,
                             CHATPLANE_CASSANDRA_HOSTS=",".join(settings.hosts), CHATPLANE_CASSANDRA_PORT=settings.port,
                             CHATPLANE_CASSANDRA_KEYSPACE=settings.keyspace)
    proj.start()
    await wait_projection_started(proj)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        first: tuple[float, int] | None = None
        deadline = time.monotonic() + CATCH_UP_S_MAX
        while True:
            c = await committed(admin, group, topology.ledger.name)
            done = sum(min(c.get(p, 0), end) for p, end in ends.items())
            t_now = time.monotonic()
            if first is None and done > 0:
                first = (t_now, done)
            if done >= total_entries:
                break
            assert proj.alive(), proj.log_text()[-2000:]
            assert t_now < deadline, f"projection not caught up: {done}/{total_entries}"
            await asyncio.sleep(POLL_S)
    finally:
        await admin.close()
    assert first is not None
    elapsed = t_now - first[0]
    counted = total_entries - first[1]
    if counted <= 0 or elapsed <= 0:
        print(f"  all entries were committed in one batch: raise --generations (now {n_gen}) to measure throughput")
        eps = float("nan")
    else:
        eps = counted / elapsed
    print(f"  projection: {eps:,.0f} ledger entries/s = {eps * EVENTS_PER_GENERATION / 4:,.0f} events/s "
          f"= {eps / 4:,.0f} generations/s ({counted} entries in {elapsed:.2f} s, first to last commit)")
    base = await baseline_inserts(session, settings.keyspace, 5_000)
    print(f"  baseline: raw single-row INSERT (27 columns, {WRITES_IN_FLIGHT_MAX} in flight): {base:,.0f} rows/s")
    print(f"  (the projection merges a generation's entries within one poll, so rows/s < entries/s; "
          f"ratio projection generations/s : raw rows/s = {eps / 4 / base:.2f})")
    return proj, gens


# --- 2. lag at a paced rate ---------------------------------------------------------------------------

async def bench_lag(bootstrap: str, topology: Topology, proj: ProjectionProcess, rate_events: float, seconds: float,
                    users: int) -> None:
    group = f"{topology.namespace}.chatplane-readmodel"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    lags_ms: list[float] = []
    try:
        async with Ledger(bootstrap, topology) as ledger:
            stop = asyncio.Event()

            async def watch() -> None:
                pending: dict[int, int] = {}  # partition -> index into ledger.acked[p] already resolved
                while True:
                    c = await committed(admin, group, topology.ledger.name)
                    t_now = time.monotonic()
                    for p, off in c.items():
                        acked = ledger.acked.get(p, [])
                        i = pending.get(p, 0)
                        while i < len(acked) and acked[i][0] < off:
                            lags_ms.append((t_now - acked[i][1]) * 1000)
                            i += 1
                        pending[p] = i
                    if stop.is_set() and all(pending.get(p, 0) >= len(v) for p, v in ledger.acked.items()):
                        return
                    await asyncio.sleep(POLL_S)

            watcher = asyncio.create_task(watch())
            started = time.monotonic()
            i = 10_000_000
            sent_events = 0
            futs = []
            while time.monotonic() - started < seconds:
                user, _gid, entries = generation_entries(i, users, now_ms())
                i += 1
                for e in entries:
                    # open-loop pacing by events: entry k goes out when its events are due
                    due = started + sent_events / rate_events
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    futs.append(await ledger.send(user, e))
                    sent_events += len(e.events)
            await asyncio.gather(*futs)
            offered_s = time.monotonic() - started
            stop.set()
            await asyncio.wait_for(watcher, CATCH_UP_S_MAX)
            drained_s = time.monotonic() - started - offered_s
    finally:
        await admin.close()
    assert proj.alive(), proj.log_text()[-2000:]
    print(f"lag: {sent_events} events ({ledger.entries} entries) offered at {sent_events / offered_s:,.0f} events/s "
          f"for {offered_s:.1f} s (target {rate_events:,.0f})")
    print(f"  produce-ack -> committed by the projection (after its Cassandra writes), {POLL_S * 1000:.0f} ms resolution: "
          f"{fmt_ms(lags_ms)}")
    print(f"  drained {drained_s:.2f} s after the last produce")


# --- 3. GET latency -----------------------------------------------------------------------------------

async def paced(rate: float, seconds: float, fn) -> tuple[list[float], int, float]:
    """Call ``fn(i)`` open-loop at ``rate``/s; latency from each call's scheduled time. Returns (ms, errors, s)."""
    lat: list[float] = []
    errors = 0
    tasks = []
    started = time.monotonic()
    n = int(rate * seconds)

    async def one(i: int, due: float) -> None:
        nonlocal errors
        try:
            await asyncio.wait_for(fn(i), REQUEST_TIMEOUT_S)
            lat.append((time.monotonic() - due) * 1000)
        except Exception:  # noqa: BLE001 - counted, the figure says how many
            errors += 1

    for i in range(n):
        due = started + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    return lat, errors, time.monotonic() - started


class HttpPool:
    """Keep-alive HTTP/1.1 connections to the edge, reused; a request waits for a free one (bounded)."""

    def __init__(self, port: int, size: int) -> None:
        self.port, self.size = port, size
        self.free: asyncio.Queue = asyncio.Queue(maxsize=size)

    async def open(self) -> None:
        for _ in range(self.size):
            self.free.put_nowait(await asyncio.open_connection("127.0.0.1", self.port))

    async def close(self) -> None:
        while not self.free.empty():
            _, w = self.free.get_nowait()
            w.close()

    async def get(self, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        reader, writer = await self.free.get()
        ok = False
        try:
            head = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
            writer.write(head.encode())
            try:
                raw = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                # The server closed this kept-alive connection while it sat idle (uvicorn's
                # timeout_keep_alive): as HTTP clients do for an idempotent GET, retry once on a new one.
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(head.encode())
                raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            length = next(int(v) for k, _, v in (ln.partition(":") for ln in lines[1:]) if k.lower() == "content-length")
            body = await reader.readexactly(length)
            ok = True
            return status, body
        finally:
            if ok:
                self.free.put_nowait((reader, writer))
            else:  # a broken connection is replaced
                writer.close()
                self.free.put_nowait(await asyncio.open_connection("127.0.0.1", self.port))


async def closed_loop(fn, n: int, in_flight: int) -> tuple[float, int]:
    """Capacity: ``n`` calls with ``in_flight`` at once; returns (calls/s, errors)."""
    sem = asyncio.Semaphore(in_flight)
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        async with sem:
            try:
                await asyncio.wait_for(fn(i), REQUEST_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - counted
                errors += 1

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.monotonic() - started), errors


async def bench_get(bootstrap: str, topology: Topology, settings: ReadModelSettings, session, gens: list[tuple[str, str]],
                    rates: list[float], seconds: float, log_dir: Path) -> None:
    # Results for the generations (as the worker would have stored them).
    store = CassandraResultStore(session, settings)
    await store.prepare()
    sem = asyncio.Semaphore(WRITES_IN_FLIGHT_MAX)

    async def put(g: str) -> None:
        async with sem:
            await store.put(g, 1, RESULT_TEXT, (7, 21))

    await asyncio.gather(*(put(g) for _, g in gens))
    rnd = random.Random(7)
    picks = [gens[rnd.randrange(len(gens))] for _ in range(int(max(rates) * seconds) + CAPACITY_CALLS + 1)]

    select = await prepare(session, f"SELECT user_id, status FROM {settings.keyspace}.generations_by_id WHERE generation_id = ?")

    async def raw(i: int) -> None:
        rows = await execute(session, select, (picks[i][1],), timeout_s=REQUEST_TIMEOUT_S)
        assert rows

    reader = await GenerationReader.open(settings)

    async def via_reader(i: int) -> None:
        user, gid = picks[i]
        view = await reader.get(gid, owner=user)
        assert view is not None and view.result_text == RESULT_TEXT

    from infra.harness.processes import EdgeProcess

    edge = EdgeProcess(bootstrap, topology, log_dir, CHATPLANE_EDGE_READ_MODEL="1",
                       CHATPLANE_CASSANDRA_HOSTS=",".join(settings.hosts), CHATPLANE_CASSANDRA_PORT=settings.port,
                       CHATPLANE_CASSANDRA_KEYSPACE=settings.keyspace, CHATPLANE_LOG_LEVEL="WARNING")
    await edge.start()
    pool = HttpPool(edge.port, HTTP_CONNECTIONS)
    bad: list[int] = []
    try:
        await pool.open()
        tokens = {u: edge.headers(u) for u in {u for u, _ in picks}}

        async def via_http(i: int) -> None:
            user, gid = picks[i]
            status, body = await pool.get(f"/v1/generations/{gid}", tokens[user])
            if status != 200 or RESULT_TEXT.encode() not in body:
                bad.append(status)
                raise RuntimeError(f"status {status}")

        variants = [
            ("baseline raw single-row SELECT (same driver, this process)", raw),
            ("GenerationReader.get (metadata + result, owner-checked, this process)", via_reader),
            (f"HTTP GET /v1/generations/{{id}} via python -m edge ({HTTP_CONNECTIONS} keep-alive conns)", via_http),
        ]
        async def http_healthz(i: int) -> None:  # HTTP + FastAPI only: no token, no Cassandra
            status, _ = await pool.get("/healthz", {})
            assert status == 200

        async def http_unknown(i: int) -> None:  # + token check + one metadata read (404)
            user, _gid = picks[i]
            status, _ = await pool.get(f"/v1/generations/no-such-{i}", tokens[user])
            assert status == 404

        await closed_loop(via_http, 200, HTTP_CONNECTIONS)  # warm-up: the edge opens its Cassandra session lazily
        print(f"get: capacity, closed loop ({CAPACITY_CALLS} calls, {CAPACITY_IN_FLIGHT} in flight)")
        breakdown = [("  (edge breakdown) HTTP GET /healthz: no token, no Cassandra", http_healthz),
                     ("  (edge breakdown) HTTP GET unknown id: token + 1 read -> 404", http_unknown)]
        for name, fn in [*variants, *breakdown]:
            bad.clear()
            cps, err = await closed_loop(fn, CAPACITY_CALLS, CAPACITY_IN_FLIGHT)
            print(f"  {name}: {cps:,.0f}/s  errors {err}")
        for rate in rates:
            print(f"get: {rate:.0f}/s open-loop for {seconds:.0f} s over {len(gens)} projected generations (random ids)")
            for name, fn in variants:
                bad.clear()
                lat, err, took = await paced(rate, seconds, fn)
                extra = f" (non-200: {len(bad)})" if fn is via_http else ""
                print(f"  {name}: {fmt_ms(lat)}  errors {err}{extra}  achieved {len(lat) / took:,.0f}/s")
    finally:
        await pool.close()
        edge.stop()
        await reader.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bootstrap", default=kafka_bootstrap())
    ap.add_argument("--cassandra-hosts", default=os.environ.get("CHATPLANE_CASSANDRA_HOSTS", "127.0.0.1"))
    ap.add_argument("--cassandra-port", type=int, default=int(os.environ.get("CHATPLANE_CASSANDRA_PORT", "9042")))
    ap.add_argument("--generations", type=int, default=5_000)
    ap.add_argument("--users", type=int, default=500)
    ap.add_argument("--rate", type=float, default=1_000.0, help="ledger events/s offered for the lag part")
    ap.add_argument("--rate-seconds", type=float, default=20.0)
    ap.add_argument("--get-rates", default="100,250,500", help="comma-separated GET rates (per second)")
    ap.add_argument("--get-seconds", type=float, default=10.0)
    ap.add_argument("--only", default="throughput,lag,get")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("aiokafka").setLevel(logging.ERROR)  # NotLeader retries right after topic creation
    parts = set(args.only.split(","))

    tag = uuid.uuid4().hex[:8]
    topology = Topology(f"bench-rm-{tag}")
    settings = ReadModelSettings(hosts=tuple(args.cassandra_hosts.split(",")), port=args.cassandra_port,
                                 keyspace=f"bench_rm_{tag}")
    print(f"namespace {topology.namespace}, keyspace {settings.keyspace}; machine shared, figures noisy")
    await ensure_topics(args.bootstrap, deployment_topics(topology))
    cluster, session = await open_session(settings)
    proj: ProjectionProcess | None = None
    try:
        await ensure_schema(session, settings)
        with tempfile.TemporaryDirectory(prefix="bench-rm-") as tmp:
            log_dir = Path(tmp)
            proj, gens = await bench_throughput(args.bootstrap, topology, settings, session, args.generations, log_dir, args.users)
            if "lag" in parts:
                await bench_lag(args.bootstrap, topology, proj, args.rate, args.rate_seconds, args.users)
            proj.stop()
            if "get" in parts:
                await bench_get(args.bootstrap, topology, settings, session, gens,
                                [float(r) for r in args.get_rates.split(",")], args.get_seconds, log_dir)
    finally:
        if proj is not None:
            proj.stop()
        with contextlib.suppress(Exception):
            await execute(session, f"DROP KEYSPACE IF EXISTS {settings.keyspace}", timeout_s=120)
        await close_cluster(cluster)
        await delete_topics(args.bootstrap, [s.name for s in deployment_topics(topology)])
        print(f"cleaned up: dropped keyspace {settings.keyspace}, deleted the {topology.namespace}.* topics")


if __name__ == "__main__":
    asyncio.run(main())
