"""cassandra-driver from asyncio through infra.stores.cassandra: prepared statements, TTL expiry,
paging, errors and the client-side timeout."""

from __future__ import annotations

import asyncio
import time

import pytest
from cassandra import InvalidRequest

from infra.stores.cassandra import execute

pytestmark = pytest.mark.integration

TTL_S = 2
EXPIRY_MARGIN_S = 1.5


async def test_prepared_insert_with_ttl_expires(cassandra_session, fresh_keyspace):
    ks = fresh_keyspace
    await execute(cassandra_session, f"CREATE TABLE {ks}.results (id text PRIMARY KEY, body text)", timeout_s=60)
    insert = cassandra_session.prepare(f"INSERT INTO {ks}.results (id, body) VALUES (?, ?) USING TTL {TTL_S}")
    select = cassandra_session.prepare(f"SELECT id, body, TTL(body) AS ttl FROM {ks}.results WHERE id = ?")

    written_at = time.monotonic()
    await execute(cassandra_session, insert, ("gen-1", "hello"))
    rows = await execute(cassandra_session, select, ("gen-1",))
    assert [(r.id, r.body) for r in rows] == [("gen-1", "hello")]
    assert 0 < rows[0].ttl <= TTL_S

    await asyncio.sleep(max(0.0, TTL_S + EXPIRY_MARGIN_S - (time.monotonic() - written_at)))
    assert await execute(cassandra_session, select, ("gen-1",)) == []


async def test_bridge_pages_errors_and_does_not_block_the_loop(cassandra_session, fresh_keyspace):
    ks = fresh_keyspace
    await execute(cassandra_session, f"CREATE TABLE {ks}.kv (p int, c int, v text, PRIMARY KEY (p, c))", timeout_s=60)
    insert = cassandra_session.prepare(f"INSERT INTO {ks}.kv (p, c, v) VALUES (?, ?, ?)")
    # Many statements in flight at once on one loop.
    await asyncio.gather(*(execute(cassandra_session, insert, (1, i, f"v{i}")) for i in range(25)))

    select = cassandra_session.prepare(f"SELECT c FROM {ks}.kv WHERE p = ?")
    select.fetch_size = 10  # forces three pages
    rows = await execute(cassandra_session, select, (1,))
    assert [r.c for r in rows] == list(range(25))

    with pytest.raises(InvalidRequest):
        await execute(cassandra_session, f"SELECT nope FROM {ks}.kv")

    # The loop keeps running while a statement is in flight.
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    t = asyncio.create_task(ticker())
    try:
        await execute(cassandra_session, f"SELECT * FROM {ks}.kv WHERE p = 1")
    finally:
        t.cancel()
    assert ticks >= 1


async def test_bridge_times_out(cassandra_session):
    class NeverAnswers:
        """A stand-in session whose future never calls back."""

        def execute_async(self, *_a, **_k):
            class F:
                has_more_pages = False

                def add_callbacks(self, *_a):
                    pass

            return F()

    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await execute(NeverAnswers(), "SELECT 1", timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0
