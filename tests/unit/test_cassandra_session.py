"""infra.stores.session: a process's one Cassandra session, its reopen policy, and the stores on it.

Unit level: the connect is a fake (no driver) and the clock is a variable, so the policy is checked
step by step: a failed open, no reopen before the interval, a reopen after it. The edge's wiring
(one provider behind the read model, the history and the replay store, failures mapped to their
typed 503s) is checked on the app; tests/integration/test_cassandra_session.py counts the real
driver sessions of an edge serving every route family against the real Cassandra.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from edge.app import create_app
from edge.settings import EdgeSettings
from infra.stores import session as session_module
from infra.stores.schema import REOPEN_INTERVAL_S_DEFAULT, ReadModelSettings
from infra.stores.session import CassandraSession, CassandraUnavailable, Reopening
from schemas.codes import RejectionCode
from tests.unit.test_edge import FakeDecider, assert_typed, hdrs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeCluster:
    def __init__(self) -> None:
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1


class FakeConnect:
    """Stands in for ``open_session``: fails ``fail`` times, then returns a new (cluster, session)."""

    def __init__(self, fail: int = 0, gate: asyncio.Event | None = None) -> None:
        self.fail, self.gate = fail, gate
        self.calls = 0
        self.clusters: list[FakeCluster] = []

    async def __call__(self, settings: ReadModelSettings) -> tuple[FakeCluster, object]:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.calls <= self.fail:
            raise ConnectionError("no host")
        cluster = FakeCluster()
        self.clusters.append(cluster)
        return cluster, object()


class FakeStore:
    """A store kind: ``open(settings, session=...)`` like every store in infra.stores."""

    opened: list[tuple[FakeStore, object]] = []

    def __init__(self, session: object) -> None:
        self.session = session
        self.closed = False

    @classmethod
    async def open(cls, settings: ReadModelSettings | None = None, *, session: object = None) -> FakeStore:
        store = cls(session)
        cls.opened.append((store, session))
        return store

    async def close(self) -> None:
        self.closed = True


class OtherStore(FakeStore):
    opened: list[tuple[FakeStore, object]] = []


async def test_a_failed_open_is_not_retried_before_the_interval_and_is_after_it():
    clock, connect = Clock(), FakeConnect(fail=1)
    cassandra = CassandraSession(ReadModelSettings(), reopen_interval_s=5.0, connect=connect, clock=clock)
    with pytest.raises(ConnectionError, match="no host"):  # the first open fails: its own error
        await cassandra.session()
    assert connect.calls == 1 and cassandra.sessions_opened == 0
    for step in (0.0, 1.0, 4.9):  # within the interval: fails at once, no connect
        clock.now = 1000.0 + step
        with pytest.raises(CassandraUnavailable, match="retried at most every 5 s"):
            await cassandra.session()
    assert connect.calls == 1
    clock.now = 1000.0 + 5.0  # the interval has passed: reopened
    first = await cassandra.session()
    assert connect.calls == 2 and cassandra.sessions_opened == 1 and cassandra.is_open
    clock.now += 1000.0
    assert await cassandra.session() is first and connect.calls == 2  # open: never reconnected
    await cassandra.close()
    assert connect.clusters[0].shutdowns == 1
    with pytest.raises(CassandraUnavailable, match="closed"):
        await cassandra.session()


async def test_every_store_is_built_once_on_the_one_session():
    FakeStore.opened.clear()
    OtherStore.opened.clear()
    connect = FakeConnect()
    cassandra = CassandraSession(ReadModelSettings(), connect=connect)
    a = await cassandra.store(FakeStore)
    b = await cassandra.store(OtherStore)
    assert await cassandra.store(FakeStore) is a and await cassandra.store(OtherStore) is b
    assert connect.calls == 1 and cassandra.sessions_opened == 1
    assert a.session is b.session is await cassandra.session()
    assert len(FakeStore.opened) == 1 and len(OtherStore.opened) == 1
    await cassandra.close()
    assert a.closed and b.closed and connect.clusters[0].shutdowns == 1


async def test_concurrent_callers_share_one_open_and_a_caller_s_deadline_does_not_cancel_it():
    gate = asyncio.Event()
    connect = FakeConnect(gate=gate)
    cassandra = CassandraSession(ReadModelSettings(), connect=connect)
    with pytest.raises(TimeoutError):  # this caller gives up; the open goes on
        await cassandra.store(FakeStore, wait_s=0.05)
    waiting = [asyncio.create_task(cassandra.store(FakeStore, wait_s=None)) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    stores = await asyncio.gather(*waiting)
    assert all(s is stores[0] for s in stores)
    assert connect.calls == 1 and cassandra.sessions_opened == 1
    await cassandra.close()


async def test_a_store_whose_build_failed_is_retried_on_the_same_policy():
    clock, calls = Clock(), []

    async def opener() -> str:
        calls.append(clock.now)
        if len(calls) == 1:
            raise RuntimeError("prepare failed")
        return "store"

    lazy: Reopening[str] = Reopening("store", opener, 2.0, clock=clock)
    with pytest.raises(RuntimeError):
        await lazy.get()
    clock.now += 1.0
    with pytest.raises(CassandraUnavailable):
        await lazy.get()
    assert (lazy.attempts, lazy.failures, lazy.last_error) == (1, 1, "RuntimeError")
    clock.now += 1.0
    assert await lazy.get() == "store" and len(calls) == 2


def test_the_interval_is_one_named_setting(monkeypatch):
    assert ReadModelSettings().reopen_interval_s == REOPEN_INTERVAL_S_DEFAULT == 5.0
    monkeypatch.setenv("CHATPLANE_CASSANDRA_REOPEN_INTERVAL_S", "0.5")
    assert CassandraSession(ReadModelSettings()).reopen_interval_s == 0.5
    assert CassandraSession(ReadModelSettings(), reopen_interval_s=2.0).reopen_interval_s == 2.0


async def test_the_edge_builds_its_three_stores_on_one_provider_and_maps_its_failures(monkeypatch):
    connect = FakeConnect(fail=10)
    monkeypatch.setattr(session_module, "open_session", connect)
    settings = EdgeSettings(capacity_check=False, read_model=True)
    app = create_app(settings)
    edge = app.state.edge
    edge.client = FakeDecider()
    cassandra = edge.cassandra
    assert isinstance(cassandra, CassandraSession)
    assert edge.reader._cassandra is edge.history._cassandra is edge.replay._cassandra is cassandra
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
        err = assert_typed(await http.get("/v1/generations/g1", headers=hdrs(settings)), RejectionCode.STORE_UNAVAILABLE)
        assert err["retryable"] is True
        assert connect.calls == 1
        # The other stores fail at once within the interval: the same provider, no second connect.
        assert_typed(await http.get("/v1/conversations", headers=hdrs(settings)), RejectionCode.HISTORY_UNAVAILABLE)
        assert_typed(await http.get("/v1/conversations/conv_x", headers=hdrs(settings)), RejectionCode.HISTORY_UNAVAILABLE)
        with pytest.raises(Exception) as raised:
            await edge.replay.store()
        assert getattr(raised.value, "code", None) is RejectionCode.STORE_UNAVAILABLE
    assert connect.calls == 1 and cassandra.sessions_opened == 0
    await cassandra.close()
