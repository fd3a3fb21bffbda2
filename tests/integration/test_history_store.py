"""The conversation history store (``infra.stores.history``) on the real Cassandra: messages across
bucket boundaries and bounded reads, the sidebar index (ordering, cursor paging, moves), deletion of
every row a conversation left, the user-turn spool's TTL, and ``HistoryUnavailable`` for an
unreachable or failing Cassandra.

One keyspace for the module (``hist_<hex8>``), dropped at the end; every test uses its own
conversation and user ids, so the tests share it without seeing each other's rows.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import pytest

from infra.stores.history import (
    CONVERSATIONS_BY_USER_TABLE,
    CONVERSATIONS_PAGE_MAX,
    CONVERSATIONS_TABLE,
    MESSAGE_CONTENT_CHARS_MAX,
    MESSAGES_PER_BUCKET,
    MESSAGES_READ_MAX,
    MESSAGES_TABLE,
    TURN_INPUT_TTL_S,
    TURN_INPUTS_TABLE,
    ConversationRow,
    HistoryStore,
    HistoryUnavailable,
    MessageTooLarge,
    StoredMessage,
    bucket_of,
    decode_cursor,
    encode_cursor,
)
from infra.stores.results import CassandraResultStore
from infra.stores.schema import ReadModelSettings
from infra.stores.cassandra import execute
from schemas.topics import RESULTS_TABLE

pytestmark = pytest.mark.integration

DDL_TIMEOUT_S = 60.0
UNREACHABLE_BOUND_S = 20.0  # connecting to a closed port must fail well within this
WRITE_CONCURRENCY = 16  # messages written at once by the tests' setup
TTL_SLACK_S = 60  # a freshly written TTL reads back within this of the configured one
B = MESSAGES_PER_BUCKET


class CountingSession:
    """The real session, counting the statements sent through it (to check that reads are bounded)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.executed = 0

    def execute_async(self, *args: Any, **kwargs: Any) -> Any:
        self.executed += 1
        return self.inner.execute_async(*args, **kwargs)

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.prepare(*args, **kwargs)


@pytest.fixture(scope="module")
def settings(cassandra_hosts, cassandra_port) -> ReadModelSettings:
    return ReadModelSettings(
        hosts=tuple(cassandra_hosts), port=cassandra_port, keyspace=f"hist_{uuid.uuid4().hex[:8]}"
    )


@pytest.fixture(scope="module")
async def store(settings, cassandra_session):
    s = await HistoryStore.open(settings)
    try:
        yield s
    finally:
        await s.close()
        await execute(cassandra_session, f"DROP KEYSPACE IF EXISTS {settings.keyspace}", timeout_s=DDL_TIMEOUT_S)


def new_id(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:12]}"


def content_of(seq: int) -> str:
    return f"message {seq} é" + "x" * (seq % 7)


def message(cid: str, seq: int, **overrides: Any) -> StoredMessage:
    """Odd seqs are user turns, even seqs their answers; a turn and its answer share a generation id."""
    user = seq % 2 == 1
    fields: dict[str, Any] = dict(
        conversation_id=cid,
        seq=seq,
        role="user" if user else "assistant",
        content=content_of(seq),
        status="completed",
        generation_id=f"{cid}-g{(seq + 1) // 2}",
        created_at_ms=1_700_000_000_000 + seq,
        parent_seq=0 if user else seq - 1,
    )
    fields.update(overrides)
    return StoredMessage(**fields)


async def write_all(store: HistoryStore, messages: list[StoredMessage]) -> None:
    gate = asyncio.Semaphore(WRITE_CONCURRENCY)

    async def one(m: StoredMessage) -> None:
        async with gate:
            await store.write_message(m)

    await asyncio.gather(*(one(m) for m in messages))


async def raw(session: Any, cql: str, params: Any = None) -> list:
    return await execute(session, cql, params)


# ------------------------------------------------------------------------------------------------
# messages


async def test_messages_span_buckets_and_reads_are_bounded(store, settings, cassandra_session):
    ks, cid = settings.keyspace, new_id("c")
    n = 3 * B + 5
    await write_all(store, [message(cid, s) for s in range(1, n + 1)])

    # The rows really are spread over four partitions, by seq // MESSAGES_PER_BUCKET.
    for bucket in range(bucket_of(n) + 1):
        rows = await raw(
            cassandra_session, f"SELECT seq FROM {ks}.{MESSAGES_TABLE} WHERE conversation_id = %s AND bucket = %s",
            (cid, bucket),
        )
        assert sorted(r.seq for r in rows) == [s for s in range(1, n + 1) if s // B == bucket]
    assert bucket_of(n) == 3

    # read_after: everything, ascending, identical to what was written.
    everything = await store.read_after(cid, 0, MESSAGES_READ_MAX, n)
    assert everything == [message(cid, s) for s in range(1, n + 1)]

    # read_after across a bucket boundary, limited by `limit` ...
    got = await store.read_after(cid, B - 3, 10, n)
    assert [m.seq for m in got] == list(range(B - 2, B + 8))
    # ... and by up_to_seq (inclusive), across two boundaries.
    got = await store.read_after(cid, 0, MESSAGES_READ_MAX, 2 * B + 1)
    assert [m.seq for m in got] == list(range(1, 2 * B + 2))
    assert await store.read_after(cid, n, 10, n) == []
    assert await store.read_after(cid, 5, 10, 5) == []

    # read_before from the end: newest first, exactly `limit` rows, crossing buckets, and no more
    # statements than the buckets it had to touch.
    counting = CountingSession(store.session)
    bounded = HistoryStore(counting, settings)
    limit = B + 10
    got = await bounded.read_before(cid, n + 1, limit)
    assert [m.seq for m in got] == list(range(n, n - limit, -1))
    assert got[0] == message(cid, n)
    assert len({bucket_of(m.seq) for m in got}) == 3
    assert counting.executed == 3  # buckets 3, 2 and 1; never the rest of the conversation
    counting.executed = 0
    got = await bounded.read_before(cid, n + 1, 5)
    assert [m.seq for m in got] == [n, n - 1, n - 2, n - 3, n - 4]
    assert counting.executed == 1

    # Paging down with read_before visits every message once, newest first.
    paged: list[int] = []
    before = n + 1
    while page := await store.read_before(cid, before, 50):
        paged.extend(m.seq for m in page)
        before = page[-1].seq
    assert paged == list(range(n, 0, -1))

    assert [m.seq for m in await store.read_before(cid, 5, 10)] == [4, 3, 2, 1]
    assert await store.read_before(cid, 1, 10) == []

    with pytest.raises(ValueError):
        await store.read_after(cid, 0, 0, n)
    with pytest.raises(ValueError):
        await store.read_before(cid, n + 1, MESSAGES_READ_MAX + 1)


async def test_a_bucket_budget_bounds_a_read_whatever_its_cursor(store):
    from infra.stores.history import BucketBudget

    cid = new_id("c")
    n = 2 * B + 5
    await write_all(store, [message(cid, s) for s in range(1, n + 1)])
    # A cursor far past the end: one bucket query, nothing found, and the budget says it ran out
    # (without one, every empty bucket down to the messages would be queried).
    before = store.bucket_reads_total
    budget = BucketBudget(1)
    assert await store.read_before(cid, 10**12, 10, budget=budget) == [] and budget.ran_out
    assert store.bucket_reads_total - before == 1
    # Within the messages: the read stops short at the budget, and the caller pages on from it.
    budget = BucketBudget(2)
    got = await store.read_before(cid, n + 1, MESSAGES_READ_MAX, budget=budget)
    assert [m.seq for m in got] == list(range(n, B - 1, -1)) and budget.ran_out  # buckets 2 and 1
    budget = BucketBudget(1)
    got = await store.read_after(cid, 0, MESSAGES_READ_MAX, n, budget=budget)
    assert [m.seq for m in got] == list(range(1, B)) and budget.ran_out  # bucket 0 only
    budget = BucketBudget(5)
    got = await store.read_after(cid, 0, MESSAGES_READ_MAX, n, budget=budget)
    assert len(got) == n and not budget.ran_out and budget.buckets_left == 2


async def test_message_status_supersede_and_partial_rows(store):
    cid = new_id("c")
    await store.write_message(message(cid, 1))
    # An answer cancelled before any text: empty content, status not yet set.
    await store.write_message(message(cid, 2, content="", status=None))
    [m2] = await store.read_after(cid, 1, 10, 2)
    assert (m2.content, m2.status, m2.parent_seq, m2.superseded_by) == ("", None, 1, None)

    await store.set_message_status(cid, 2, "incomplete")
    await store.write_message(message(cid, 2, content="", status=None))  # a repeated write keeps the status
    await store.write_message(message(cid, 3, role="assistant", parent_seq=1))  # a regenerated answer
    await store.mark_superseded(cid, 2, 3)
    await store.write_message(message(cid, 2, content="", status=None))  # ... and keeps the supersede
    got = await store.read_after(cid, 0, 10, 3)
    assert [(m.seq, m.status, m.superseded_by) for m in got] == [
        (1, "completed", None), (2, "incomplete", 3), (3, "completed", None),
    ]

    # A status that lands before its message is not a message: reads skip it and still fill `limit`.
    await store.set_message_status(cid, 5, "completed")
    await store.write_message(message(cid, 6))
    await store.write_message(message(cid, 7))
    assert [m.seq for m in await store.read_after(cid, 3, 2, 10)] == [6, 7]
    assert [m.seq for m in await store.read_before(cid, 8, 3)] == [7, 6, 3]

    with pytest.raises(ValueError):
        await store.write_message(message(cid, 8, role="system"))
    with pytest.raises(ValueError):
        await store.write_message(message(cid, 0))
    with pytest.raises(MessageTooLarge):
        await store.write_message(message(cid, 8, content="y" * (MESSAGE_CONTENT_CHARS_MAX + 1)))
    assert await store.read_after(cid, 7, 10, 100) == []


# ------------------------------------------------------------------------------------------------
# conversations and the sidebar


async def test_list_ordering_paging_and_set_revision(store, settings, cassandra_session):
    ks, user = settings.keyspace, new_id("u")
    ids = {t: new_id(f"c{t}") for t in (1000, 2000, 3000, 4000, 5000)}
    for created, cid in ids.items():
        await store.put_conversation(cid, user, f"title {created}", created)
        assert (await store.get_conversation(cid)).status is None
        await store.confirm_conversation(cid, user, created)
    unconfirmed, deleted = new_id("unconfirmed"), new_id("deleted")
    await store.put_conversation(unconfirmed, user, None, 4500)
    await store.put_conversation(deleted, user, "gone", 3500)
    await store.confirm_conversation(deleted, user, 3500)
    await store.mark_deleted(deleted)

    row = await store.get_conversation(ids[1000])
    assert row == ConversationRow(ids[1000], user, "title 1000", 1000, 1000, 0, "active", None)
    assert (await store.get_conversation(unconfirmed)).title is None
    assert (await store.get_conversation(deleted)).status == "deleted"
    assert await store.get_conversation(new_id("missing")) is None

    async def all_pages(limit: int) -> list[list[str]]:
        pages, cursor = [], None
        while True:
            page, cursor = await store.list_conversations(user, limit, cursor)
            pages.append([c.conversation_id for c in page])
            if cursor is None:
                return pages

    newest_first = [ids[t] for t in (5000, 4000, 3000, 2000, 1000)]
    first, cursor = await store.list_conversations(user, 2, None)
    assert [c.conversation_id for c in first] == newest_first[:2]
    assert decode_cursor(cursor) == (4000, ids[4000])
    # The deleted conversation's index row (3500) is read but skipped; the unconfirmed one has none.
    assert await all_pages(2) == [newest_first[:2], [ids[3000]], [ids[2000], ids[1000]], []]
    assert await all_pages(CONVERSATIONS_PAGE_MAX) == [newest_first]

    # A new revision moves the conversation to the top; its old index row is gone.
    await store.set_revision(ids[1000], user, 2, 9000, 1000)
    row = await store.get_conversation(ids[1000])
    assert (row.revision, row.updated_at_ms, row.created_at_ms) == (2, 9000, 1000)
    assert await all_pages(10) == [[ids[1000], *newest_first[:4]]]
    index = await raw(
        cassandra_session,
        f"SELECT updated_at_ms FROM {ks}.{CONVERSATIONS_BY_USER_TABLE} WHERE user_id = %s AND updated_at_ms = 1000",
        (user,),
    )
    assert index == []

    # Same time again (a revision within the same millisecond): the row must survive the move.
    await store.set_revision(ids[1000], user, 3, 9000, 9000)
    assert [c.conversation_id for c in (await store.list_conversations(user, 1, None))[0]] == [ids[1000]]
    # A replayed confirm re-inserts the creation-time index row; the listing shows no duplicate.
    await store.confirm_conversation(ids[1000], user, 1000)
    assert await all_pages(10) == [[ids[1000], *newest_first[:4]]]
    assert (await store.get_conversation(ids[1000])).revision == 3

    await store.set_parked(ids[2000], 7)
    assert (await store.get_conversation(ids[2000])).parked_revision == 7
    await store.set_parked(ids[2000], None)
    assert (await store.get_conversation(ids[2000])).parked_revision is None

    # A repeated put (the edge retrying) does not roll the revision back.
    await store.put_conversation(ids[1000], user, "title 1000", 1000)
    assert (await store.get_conversation(ids[1000])).revision == 3

    assert await store.list_conversations(new_id("other"), 10, None) == ([], None)
    for bad in ("not a cursor!", base64.urlsafe_b64encode(b'{"a": 1}').decode(), encode_cursor(1, "x")[:-2], "x" * 600):
        with pytest.raises(ValueError):
            await store.list_conversations(user, 10, bad)
    for bad_limit in (0, CONVERSATIONS_PAGE_MAX + 1):
        with pytest.raises(ValueError):
            await store.list_conversations(user, bad_limit, None)


# ------------------------------------------------------------------------------------------------
# deletion


async def test_delete_removes_every_row(store, settings, cassandra_session):
    ks, user = settings.keyspace, new_id("u")
    cid, other = new_id("c"), new_id("keep")
    revision = 3 * B - 1  # so that revision + 1 (an answer in flight) falls into the next bucket
    await store.put_conversation(cid, user, "t", 100)
    await store.confirm_conversation(cid, user, 100)
    await store.put_conversation(other, user, "t", 50)
    await store.confirm_conversation(other, user, 50)
    await write_all(store, [message(cid, s) for s in range(1, revision + 2)])
    await write_all(store, [message(other, s) for s in range(1, 5)])
    await store.set_revision(cid, user, revision, 200, 100)

    generations = sorted({message(cid, s).generation_id for s in range(1, revision + 2)})
    kept_generations = sorted({message(other, s).generation_id for s in range(1, 5)})
    results = CassandraResultStore(store.session, settings)
    for g in generations + kept_generations:
        await results.put(g, 1, "answer", (1, 2))
        await store.put_turn_input(g, cid if g in generations else other, "question", 100)
    assert bucket_of(revision + 1) == 3

    await store.mark_deleted(cid)
    assert (await store.get_conversation(cid)).status == "deleted"
    assert [c.conversation_id for c in (await store.list_conversations(user, 10, None))[0]] == [other]

    assert sorted(await store.delete_conversation(cid, user, revision, 200)) == generations

    for bucket in range(bucket_of(revision + 1) + 2):
        assert await raw(
            cassandra_session, f"SELECT seq FROM {ks}.{MESSAGES_TABLE} WHERE conversation_id = %s AND bucket = %s",
            (cid, bucket),
        ) == []
    for g in generations:
        for table in (RESULTS_TABLE, TURN_INPUTS_TABLE):
            assert await raw(cassandra_session, f"SELECT * FROM {ks}.{table} WHERE generation_id = %s", (g,)) == []
        assert await store.get_turn_input(g) is None
    index = await raw(
        cassandra_session, f"SELECT conversation_id FROM {ks}.{CONVERSATIONS_BY_USER_TABLE} WHERE user_id = %s", (user,)
    )
    assert [r.conversation_id for r in index] == [other]
    assert await raw(
        cassandra_session, f"SELECT conversation_id FROM {ks}.{CONVERSATIONS_TABLE} WHERE conversation_id = %s", (cid,)
    ) == []
    assert await store.get_conversation(cid) is None

    # The other conversation is untouched.
    assert [m.seq for m in await store.read_after(other, 0, 10, 4)] == [1, 2, 3, 4]
    for g in kept_generations:
        assert await results.get(g) is not None
        assert await store.get_turn_input(g) == (other, "question")

    # Idempotent: a second delete finds nothing and fails nothing.
    assert await store.delete_conversation(cid, user, revision, 200) == []


# ------------------------------------------------------------------------------------------------
# the user-turn spool


async def test_turn_input_round_trip_with_ttl(store, settings, cassandra_session):
    g, cid = new_id("g"), new_id("c")
    assert await store.get_turn_input(g) is None
    await store.put_turn_input(g, cid, "what is 2+2? ü", 123)
    assert await store.get_turn_input(g) == (cid, "what is 2+2? ü")
    [row] = await raw(
        cassandra_session,
        f"SELECT TTL(content) AS ttl FROM {settings.keyspace}.{TURN_INPUTS_TABLE} WHERE generation_id = %s",
        (g,),
    )
    assert TURN_INPUT_TTL_S - TTL_SLACK_S < row.ttl <= TURN_INPUT_TTL_S
    with pytest.raises(MessageTooLarge):
        await store.put_turn_input(new_id("g"), cid, "z" * (MESSAGE_CONTENT_CHARS_MAX + 1), 123)


# ------------------------------------------------------------------------------------------------
# unavailability


async def test_closed_port_raises_history_unavailable_promptly(settings):
    unreachable = ReadModelSettings(hosts=("127.0.0.1",), port=1, keyspace=settings.keyspace)
    started = time.monotonic()
    async with asyncio.timeout(UNREACHABLE_BOUND_S):  # a hang fails the test instead of blocking it
        with pytest.raises(HistoryUnavailable) as caught:
            await HistoryStore.open(unreachable)
    assert time.monotonic() - started < UNREACHABLE_BOUND_S
    assert caught.value.__cause__ is not None


async def test_failures_and_timeouts_raise_history_unavailable(store, settings, cassandra_hosts, cassandra_port):
    secret = "the secret text of a message"
    # A timeout (the client-side bound, far below any real answer time) ...
    hurried = HistoryStore(store.session, settings, timeout_s=1e-6)
    hurried._statements = await store._prepared()  # the same prepared statements, so only execution is timed
    with pytest.raises(HistoryUnavailable) as caught:
        await hurried.write_message(message(new_id("c"), 1, content=secret))
    assert isinstance(caught.value.__cause__, TimeoutError)
    assert secret not in str(caught.value)
    with pytest.raises(HistoryUnavailable):
        await hurried.read_before(new_id("c"), 100, 10)
    with pytest.raises(HistoryUnavailable):
        await hurried.list_conversations(new_id("u"), 10, None)

    # ... a driver error (the tables are missing in this keyspace) ...
    missing = ReadModelSettings(
        hosts=tuple(cassandra_hosts), port=cassandra_port, keyspace=f"hist_missing_{uuid.uuid4().hex[:8]}"
    )
    with pytest.raises(HistoryUnavailable):
        await HistoryStore(store.session, missing).get_conversation("c")

    # ... and a session whose cluster has been shut down.
    closed = await HistoryStore.open(settings)
    await closed.close()
    async with asyncio.timeout(UNREACHABLE_BOUND_S):
        with pytest.raises(HistoryUnavailable) as caught:
            await closed.put_turn_input(new_id("g"), new_id("c"), secret, 1)
    assert secret not in str(caught.value)
