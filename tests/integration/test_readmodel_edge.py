"""A retry and a GET answered from the result store through the HTTP edge, the real worker writing it.

``python -m workers --engine sim`` (its default Cassandra result sink, on a fresh keyspace) completes a
non-streaming request; ``python -m projections.readmodel`` projects the ledger. A *second* edge (no
memory of the first's results) answers a same-key retry and ``GET /v1/generations/{id}`` from
Cassandra with the stored text; past the TTL the retry is 410 ``result_unavailable`` while status and
usage are still served. Also: the worker's sink against a Cassandra port where nothing listens gives
up within its budget without raising (real driver, no mock).
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import pytest

from infra.stores.cassandra import execute
from infra.stores.schema import ReadModelSettings
from schemas import events as ev
from schemas.topics import GENERATIONS_TABLE, RESULTS_TABLE
from infra.harness.processes import ProjectionProcess, WorkerProcess
from tests.integration.test_edge_harness import edge_settings, serve_edge
from tests.integration.workers_harness import ledger_events
from workers.result_sink import CassandraResultSink

pytestmark = pytest.mark.integration

RESULT_TTL_S = 8  # long enough for two edges and the projection on a shared 2-core machine
PROJECTED_WAIT_S = 60.0
POLL_S = 0.1
HANG_GUARD_S = 60.0
BODY = {"model": "simulated-text-model", "messages": [{"role": "user", "content": "Name three colors."}],
        "stream": False, "max_output_tokens": 16}


async def _wait_projected(session, keyspace: str, gid: str) -> object:
    deadline = time.monotonic() + PROJECTED_WAIT_S
    while True:
        rows = await execute(session, f"SELECT status, output_tokens FROM {keyspace}.{GENERATIONS_TABLE} WHERE generation_id = %s", (gid,))
        if rows and rows[0].status == "completed":
            return rows[0]
        assert time.monotonic() < deadline, f"{gid} not projected as completed"
        await asyncio.sleep(POLL_S)


async def test_same_key_retry_through_a_fresh_edge_returns_text_stored_by_the_worker_then_410(
    kafka_bootstrap, topology, running_processor, cassandra_session, cassandra_hosts, cassandra_port,
    fresh_keyspace, tmp_path, monkeypatch,
):
    cass_env = {"CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts), "CHATPLANE_CASSANDRA_PORT": str(cassandra_port),
                "CHATPLANE_CASSANDRA_KEYSPACE": fresh_keyspace}
    for k, v in cass_env.items():  # the in-process edges' ReadModel reads ReadModelSettings() from the env
        monkeypatch.setenv(k, v)
    projection = ProjectionProcess(kafka_bootstrap, topology.namespace, tmp_path, **cass_env)
    worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_WORKER_RESULT_STORE="cassandra",
                           CHATPLANE_RESULT_TTL_S=RESULT_TTL_S, CHATPLANE_SIM_TTFT_MS=10, CHATPLANE_SIM_INTER_TOKEN_MS=5,
                           **cass_env)
    projection.start()
    worker.start()
    user, key = f"u-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    try:
        async with serve_edge(edge_settings(kafka_bootstrap, topology, read_model=True)) as first, first.http() as http:
            r = await http.post("/v1/generations", json=BODY, headers=first.headers(user, key))
            assert r.status_code == 200, f"{r.text}\nworker log: {worker.log()}"
            doc = r.json()
            assert doc["status"] == "completed"
            gid, text = doc["id"], doc["output"][0]["text"]
            assert text
        # The worker stored the text before it reported completion.
        stored = await execute(cassandra_session, f"SELECT epoch, text, output_tokens FROM {fresh_keyspace}.{RESULTS_TABLE} WHERE generation_id = %s", (gid,))
        assert [(s.text, s.output_tokens) for s in stored] == [(text, doc["usage"]["output_tokens"])]
        stored_at = time.monotonic()
        projected = await _wait_projected(cassandra_session, fresh_keyspace, gid)
        assert projected.output_tokens == doc["usage"]["output_tokens"]

        async with serve_edge(edge_settings(kafka_bootstrap, topology, read_model=True)) as second, second.http() as http:
            assert second.app.state.edge.retention.result_of(gid) is None  # nothing in this edge's memory
            retry = await http.post("/v1/generations", json=BODY, headers=second.headers(user, key))
            assert retry.status_code == 200, retry.text
            assert retry.json()["id"] == gid and retry.json()["output"] == [{"type": "text", "text": text}]
            got = await http.get(f"/v1/generations/{gid}", headers=second.headers(user))
            assert got.status_code == 200 and got.json()["output"] == [{"type": "text", "text": text}]
            other = await http.get(f"/v1/generations/{gid}", headers=second.headers("mallory"))
            assert other.status_code == 404

            await asyncio.sleep(max(0.0, RESULT_TTL_S + 1.0 - (time.monotonic() - stored_at)))
            expired = await http.post("/v1/generations", json=BODY, headers=second.headers(user, key))
            assert expired.status_code == 410, expired.text
            assert expired.json()["error"]["code"] == "result_unavailable"
            meta = await http.get(f"/v1/generations/{gid}", headers=second.headers(user))
            # GET is 410 too, and status and usage outlive the content: they come with the error
            assert meta.status_code == 410, meta.text
            body = meta.json()
            assert body["error"]["code"] == "result_unavailable" and body["error"]["retryable"] is False
            assert body["error"]["status"] == "completed" and body["error"]["usage"] == doc["usage"]
        # inference never reran: one attempt accepted for this generation in the whole ledger
        events = await ledger_events(kafka_bootstrap, topology, gid)
        assert sum(isinstance(e, ev.AttemptAccepted) for e in events) == 1
    finally:
        worker.stop()
        projection.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_sink_against_an_unreachable_cassandra_gives_up_within_its_budget():
    settings = ReadModelSettings(hosts=("127.0.0.1",), port=_free_port(), keyspace="unreachable")
    sink = CassandraResultSink(settings, attempts_max=3, backoff_s=0.1, deadline_s=2.0)
    # Neither put raises; the guard only turns a hang into a failure instead of a stuck run.
    await asyncio.wait_for(sink.put("g-1", 1, "some text", (3, 4)), HANG_GUARD_S)
    await asyncio.wait_for(sink.put("g-2", 1, "more text", (3, 4)), HANG_GUARD_S)  # the failed open is throttled
    assert (sink.stats.stored, sink.stats.held, sink.stats.not_stored) == (0, 2, 0)  # held for a later write
    assert sink.stats.last_error is not None
    await sink.close()
    assert (sink.stats.held, sink.stats.not_stored) == (0, 2)  # given up when the worker stops


class GatedTcpProxy:
    """A TCP proxy to Cassandra for the worker alone: while closed, it accepts and drops every
    connection (the worker's result store is unreachable); once opened, it forwards."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.open = False
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> GatedTcpProxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        if not self.open:
            cwriter.transport.abort()
            return
        ureader, uwriter = await asyncio.open_connection(*self.upstream)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()

        try:
            await asyncio.gather(pipe(creader, uwriter), pipe(ureader, cwriter))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (cwriter, uwriter):
                w.transport.abort()


async def test_a_result_the_worker_could_not_store_yet_is_pending_not_expired_then_served_once_written(
    kafka_bootstrap, topology, running_processor, cassandra_session, cassandra_hosts, cassandra_port,
    fresh_keyspace, tmp_path, monkeypatch,
):
    # The read model and the edges use Cassandra directly; the worker reaches it through a proxy that
    # is closed while the generation completes: its result sink holds the text for the later write and
    # the report says result_stored=False. Until that write lands, GET and a same-key retry answer 503
    # result_pending (retryable), not 410 result_unavailable; once the proxy opens, the text is served.
    cass_env = {"CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts), "CHATPLANE_CASSANDRA_PORT": str(cassandra_port),
                "CHATPLANE_CASSANDRA_KEYSPACE": fresh_keyspace}
    for k, v in cass_env.items():
        monkeypatch.setenv(k, v)
    async with GatedTcpProxy((cassandra_hosts[0], cassandra_port)) as proxy:
        projection = ProjectionProcess(kafka_bootstrap, topology.namespace, tmp_path, **cass_env)
        worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_WORKER_RESULT_STORE="cassandra",
                               CHATPLANE_WORKER_REPLAY_STORE="none", CHATPLANE_WORKER_RESULT_PUT_DEADLINE_S=1.0,
                               CHATPLANE_WORKER_RESULT_RETRY_INTERVAL_S=0.5, CHATPLANE_SIM_TTFT_MS=10,
                               CHATPLANE_SIM_INTER_TOKEN_MS=5,
                               **{**cass_env, "CHATPLANE_CASSANDRA_HOSTS": "127.0.0.1", "CHATPLANE_CASSANDRA_PORT": str(proxy.port)})
        projection.start()
        worker.start()
        user, key = f"u-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        try:
            async with serve_edge(edge_settings(kafka_bootstrap, topology, read_model=True)) as first, first.http() as http:
                r = await http.post("/v1/generations", json=BODY, headers=first.headers(user, key))
                assert r.status_code == 200, f"{r.text}\nworker log: {worker.log()}"
                gid, text = r.json()["id"], r.json()["output"][0]["text"]
            await _wait_projected(cassandra_session, fresh_keyspace, gid)
            rows = await execute(cassandra_session, f"SELECT result_stored FROM {fresh_keyspace}.{GENERATIONS_TABLE} WHERE generation_id = %s", (gid,))
            assert rows[0].result_stored is False, worker.log()

            async with serve_edge(edge_settings(kafka_bootstrap, topology, read_model=True)) as second, second.http() as http:
                got = await http.get(f"/v1/generations/{gid}", headers=second.headers(user))
                assert got.status_code == 503, got.text
                error = got.json()["error"]
                assert (error["code"], error["retryable"], error["status"]) == ("result_pending", True, "completed"), error
                assert got.headers["Retry-After"] == "2"
                retry = await http.post("/v1/generations", json=BODY, headers=second.headers(user, key))
                assert retry.status_code == 503 and retry.json()["error"]["code"] == "result_pending", retry.text

                proxy.open = True  # the store is back: the worker's later write lands
                deadline = time.monotonic() + PROJECTED_WAIT_S
                while (got := await http.get(f"/v1/generations/{gid}", headers=second.headers(user))).status_code == 503:
                    assert time.monotonic() < deadline, f"the later write never landed\n{worker.log()}"
                    await asyncio.sleep(0.5)
                assert got.status_code == 200 and got.json()["output"] == [{"type": "text", "text": text}], got.text
                retry = await http.post("/v1/generations", json=BODY, headers=second.headers(user, key))
                assert retry.status_code == 200 and retry.json()["output"] == [{"type": "text", "text": text}], retry.text
            events = await ledger_events(kafka_bootstrap, topology, gid)
            assert sum(isinstance(e, ev.AttemptAccepted) for e in events) == 1  # inference never reran
            assert [e.result_stored for e in events if isinstance(e, ev.GenerationCompleted)] == [False]
        finally:
            worker.stop()
            projection.stop()
