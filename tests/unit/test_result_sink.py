"""workers.result_sink.CassandraResultSink: lazy open, bounded retries, a typed give-up (no raise).

The store is a fake here (unit level); tests/integration/test_readmodel_edge.py runs the real one
against the real Cassandra and against a port where nothing listens.
"""

from __future__ import annotations

import asyncio

import pytest

from infra.stores.results import ResultTooLarge
from workers.result_sink import CassandraResultSink
from workers.settings import WorkerSettings


class FakeStore:
    def __init__(self, fail_first: int = 0, hang: bool = False, too_large: bool = False) -> None:
        self.fail_first, self.hang, self.too_large = fail_first, hang, too_large
        self.calls: list[tuple[str, int, str, object, float]] = []
        self.closed = False

    async def put(self, gid, epoch, text, usage, *, timeout_s):
        self.calls.append((gid, epoch, text, usage, timeout_s))
        if self.too_large:
            raise ResultTooLarge("big")
        if self.hang:
            await asyncio.sleep(timeout_s)
            raise TimeoutError
        if len(self.calls) <= self.fail_first:
            raise ConnectionError("down")

    async def close(self):
        self.closed = True


def opener_for(store: FakeStore, opens: list[int], fail_opens: int = 0):
    async def open_():
        opens.append(1)
        if len(opens) <= fail_opens:
            raise ConnectionError("no host")
        return store

    return open_


async def test_opens_lazily_and_stores():
    store, opens = FakeStore(), []
    sink = CassandraResultSink(opener=opener_for(store, opens))
    assert opens == []  # nothing is opened before the first put
    assert await sink.put("g1", 1, "hello", (3, 4)) is True  # reported as result_stored
    assert await sink.put("g2", 1, "world", (3, 5)) is True
    assert opens == [1]
    assert [c[:4] for c in store.calls] == [("g1", 1, "hello", (3, 4)), ("g2", 1, "world", (3, 5))]
    assert (sink.stats.stored, sink.stats.not_stored) == (2, 0)
    await sink.close()
    assert store.closed


async def test_transient_failure_is_retried_within_the_attempts():
    store, opens = FakeStore(fail_first=2), []
    sink = CassandraResultSink(attempts_max=3, backoff_s=0.0, opener=opener_for(store, opens))
    await sink.put("g", 2, "t", (1, 1))
    assert len(store.calls) == 3 and sink.stats.stored == 1 and sink.stats.not_stored == 0


async def test_gives_up_after_attempts_without_raising():
    store, opens = FakeStore(fail_first=10), []
    sink = CassandraResultSink(attempts_max=3, backoff_s=0.0, opener=opener_for(store, opens))
    # Does not raise: the worker reports completion anyway, with result_stored False (held).
    assert await sink.put("g", 1, "t", (1, 1)) is False
    assert len(store.calls) == 3
    assert (sink.stats.stored, sink.stats.held, sink.stats.last_error) == (0, 1, "ConnectionError")
    await sink.close()  # a result still held when the worker stops is given up
    assert (sink.stats.held, sink.stats.not_stored) == (0, 1)


async def test_a_hung_store_is_bounded_by_the_budget():
    store, opens = FakeStore(hang=True), []
    sink = CassandraResultSink(attempts_max=2, backoff_s=0.0, deadline_s=0.2, opener=opener_for(store, opens))
    await asyncio.wait_for(sink.put("g", 1, "t", (1, 1)), 30)  # the guard turns a hang into a failure
    assert sink.stats.held == 1 and sink.stats.stored == 0
    assert store.calls and all(c[4] == pytest.approx(0.1) for c in store.calls)  # each write gets deadline / attempts


async def test_a_hung_open_is_bounded_and_reused():
    gate = asyncio.Event()
    store, opens = FakeStore(), []

    async def slow_open():
        opens.append(1)
        await gate.wait()
        return store

    sink = CassandraResultSink(deadline_s=0.1, opener=slow_open)
    await sink.put("g1", 1, "t", (1, 1))
    assert sink.stats.held == 1 and store.calls == []
    gate.set()
    await sink.put("g2", 1, "t", (1, 1))  # the same open, finished meanwhile: no second connection
    assert opens == [1] and sink.stats.stored == 1


async def test_failed_open_is_throttled():
    store, opens = FakeStore(), []
    sink = CassandraResultSink(attempts_max=3, backoff_s=0.0, reopen_interval_s=60.0,
                               opener=opener_for(store, opens, fail_opens=1))
    await sink.put("g", 1, "t", (1, 1))
    assert opens == [1]  # the 2nd and 3rd attempts did not reconnect within reopen_interval_s
    assert sink.stats.held == 1
    sink.reopen_interval_s = 0.0
    await sink.put("g", 1, "t", (1, 1))
    assert opens == [1, 1] and sink.stats.stored == 1


async def test_too_large_is_not_retried():
    store, opens = FakeStore(too_large=True), []
    sink = CassandraResultSink(opener=opener_for(store, opens))
    assert await sink.put("g", 1, "x", (1, 1)) is None  # never stored: not "pending" either
    assert len(store.calls) == 1 and sink.stats.too_large == 1 and sink.stats.not_stored == 0


async def test_a_result_put_could_not_store_is_written_later_once_the_store_is_back():
    store, opens = FakeStore(fail_first=3), []
    sink = CassandraResultSink(attempts_max=3, backoff_s=0.0, retry_interval_s=0.01, opener=opener_for(store, opens))
    await sink.put("g", 1, "the text", (2, 3))
    assert sink.stats.held == 1 and sink.stats.stored == 0
    for _ in range(500):
        if sink.stats.stored:
            break
        await asyncio.sleep(0.01)
    assert (sink.stats.stored, sink.stats.stored_later, sink.stats.held, sink.stats.not_stored) == (1, 1, 0, 0)
    assert store.calls[-1][:4] == ("g", 1, "the text", (2, 3))
    await sink.close()


async def test_held_results_are_bounded_by_count_bytes_and_age():
    store, opens = FakeStore(fail_first=10**6), []
    sink = CassandraResultSink(attempts_max=1, backoff_s=0.0, retry_interval_s=60.0, pending_max=2,
                               pending_bytes_max=10, opener=opener_for(store, opens))
    for i in range(3):
        await sink.put(f"g{i}", 1, "abc", (1, 1))
    assert (sink.stats.held, sink.stats.not_stored) == (2, 1)  # the oldest gave way
    await sink.put("g3", 1, "x" * 8, (1, 1))  # 3 + 3 + 8 bytes > 10: the oldest go until it fits
    assert (sink.stats.held, sink.stats.not_stored) == (1, 3)
    aged = CassandraResultSink(attempts_max=1, backoff_s=0.0, retry_interval_s=0.01, pending_age_max_s=0.0,
                               opener=opener_for(FakeStore(fail_first=10**6), []))
    await aged.put("old", 1, "t", (1, 1))
    for _ in range(500):
        if aged.stats.not_stored:
            break
        await asyncio.sleep(0.01)
    assert (aged.stats.held, aged.stats.not_stored) == (0, 1)
    await sink.close()
    await aged.close()


def test_settings_select_the_sink(monkeypatch):
    from workers.__main__ import build_result_sink
    from workers.worker import NullResultSink

    monkeypatch.delenv("CHATPLANE_WORKER_RESULT_STORE", raising=False)
    assert isinstance(build_result_sink(WorkerSettings()), CassandraResultSink)  # the default of python -m workers
    monkeypatch.setenv("CHATPLANE_WORKER_RESULT_STORE", "none")
    assert isinstance(build_result_sink(WorkerSettings()), NullResultSink)
    monkeypatch.setenv("CHATPLANE_WORKER_RESULT_STORE", "cassandra")
    monkeypatch.setenv("CHATPLANE_WORKER_RESULT_PUT_ATTEMPTS_MAX", "5")
    sink = build_result_sink(WorkerSettings())
    assert isinstance(sink, CassandraResultSink) and sink.attempts_max == 5
    monkeypatch.setenv("CHATPLANE_WORKER_RESULT_STORE", "redis")
    with pytest.raises(ValueError):
        WorkerSettings()
