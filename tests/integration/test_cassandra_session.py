"""One edge process opens exactly one Cassandra session, whatever routes it serves (infra/stores/session.py).

The stack: the admission processor (``python -m projections``), an in-process fake worker (the
simulator's deltas, no engine), and an in-process edge served by uvicorn (the harness the other stack
tests use) with the read model on, against the real Cassandra on a fresh keyspace. The driver's
``Cluster.connect`` is counted for the whole process while the edge serves; the edge's provider
counts the sessions it opened. After each route family (a generation GET answered from the read
model, a conversation created, listed and read, its messages read from the history store, a stream
replayed from the replay store) both say one.
"""

from __future__ import annotations

import uuid

import pytest
from cassandra.cluster import Cluster

from infra.stores.replay import ReplayStore
from infra.stores.schema import ReadModelSettings, ensure_schema
from infra.stores.session import CassandraSession
from tests.integration.test_edge_harness import FakeSimWorker, edge_settings, serve_edge, sse_events

pytestmark = pytest.mark.integration

MODEL = "simulated-text-model"


async def test_one_edge_opens_one_cassandra_session_whatever_routes_it_serves(
    kafka_bootstrap, topology, running_processor, cassandra_session, cassandra_hosts, cassandra_port, fresh_keyspace,
    monkeypatch,
):
    for k, v in {"CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts), "CHATPLANE_CASSANDRA_PORT": str(cassandra_port),
                 "CHATPLANE_CASSANDRA_KEYSPACE": fresh_keyspace}.items():
        monkeypatch.setenv(k, v)  # the in-process edge reads ReadModelSettings() from the env at its first open
    # The read model's tables (the projection would create them; it does not run here).
    await ensure_schema(cassandra_session, ReadModelSettings(keyspace=fresh_keyspace))

    connects: list[Cluster] = []
    real_connect = Cluster.connect

    def counted_connect(self: Cluster, *args, **kwargs):
        connects.append(self)
        return real_connect(self, *args, **kwargs)

    monkeypatch.setattr(Cluster, "connect", counted_connect)

    settings = edge_settings(kafka_bootstrap, topology, read_model=True, bucket_capacity_tokens=100)
    async with FakeSimWorker(kafka_bootstrap, topology), serve_edge(settings) as edge, edge.http() as http:
        cassandra: CassandraSession = edge.app.state.edge.cassandra
        user = f"u-{uuid.uuid4().hex[:8]}"

        def sessions() -> tuple[int, int]:
            return cassandra.sessions_opened, len(connects)

        assert sessions() == (0, 0)  # opened on first use, not at start

        # A stateless generation (streamed, so this edge keeps its events for the replay below).
        r = await http.post("/v1/generations", headers=edge.headers(user, uuid.uuid4().hex),
                            json={"model": MODEL, "stream": True, "max_output_tokens": 8,
                                  "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
        streamed = sse_events(r.text)
        gid = streamed[0][2]["generation_id"]
        assert streamed[-1][1] == "generation.completed", streamed[-1]
        assert sessions() == (0, 0)  # a stateless request never opens it

        # A generation GET answered by the read model (an id this edge never admitted: 404 after the read).
        r = await http.get(f"/v1/generations/gen_{uuid.uuid4().hex}", headers=edge.headers(user))
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        assert sessions() == (1, 1)

        # Conversations: create, list, read, and its messages (the history store).
        r = await http.post("/v1/conversations", json={"title": "t"}, headers=edge.headers(user, uuid.uuid4().hex))
        assert r.status_code == 201, r.text
        cid = r.json()["id"]
        r = await http.get("/v1/conversations", headers=edge.headers(user))
        assert r.status_code == 200 and cid in [c["id"] for c in r.json()["data"]], r.text
        r = await http.get(f"/v1/conversations/{cid}", headers=edge.headers(user))
        assert r.status_code == 200 and r.json()["id"] == cid, r.text
        r = await http.get(f"/v1/conversations/{cid}/messages", headers=edge.headers(user))
        assert r.status_code == 200 and r.json()["data"] == [], r.text
        assert sessions() == (1, 1)

        # A stream replay (the replay store), from the start: the same ids and end as the first stream.
        r = await http.get(f"/v1/generations/{gid}/events", headers=edge.headers(user))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        replayed = sse_events(r.text)
        assert replayed[0][2]["generation_id"] == gid and replayed[-1][1] == "generation.completed", replayed
        assert sessions() == (1, 1)

        # Every store the edge uses is on that one session.
        store_sessions = {
            id(edge.app.state.edge.reader._reader.session),
            id((await edge.app.state.edge.history.store()).session),
            id((await edge.app.state.edge.replay.store()).session),
        }
        assert store_sessions == {id(await cassandra.session())}
        assert sessions() == (1, 1)
    assert not cassandra.is_open  # released when the edge stopped


async def test_a_worker_s_result_and_replay_sinks_share_one_session(cassandra_hosts, cassandra_port, fresh_keyspace):
    from workers.__main__ import build_replay_sink, build_result_sink
    from workers.settings import WorkerSettings

    cassandra = CassandraSession(ReadModelSettings(hosts=tuple(cassandra_hosts), port=cassandra_port, keyspace=fresh_keyspace))
    settings = WorkerSettings()
    results, replay = build_result_sink(settings, cassandra), build_replay_sink(settings, cassandra)
    gid = f"gen_{uuid.uuid4().hex}"
    try:
        # The result store creates the keyspace's tables (the replay store only prepares, as before).
        assert await results.put(gid, 1, "Hello", (3, 2)) is True
        assert await replay.put(gid, 1, 1, "Hel") is True
        assert cassandra.sessions_opened == 1
        stored = await (await cassandra.store(ReplayStore)).read_after(gid, 0)
        assert [d.text for d in stored] == ["Hel"]
    finally:
        await results.close()
        await replay.close()
        assert cassandra.is_open  # the sinks do not close the worker's shared session
        await cassandra.close()
    assert not cassandra.is_open
