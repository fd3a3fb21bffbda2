"""The Cassandra read models on the real broker and the real Cassandra: the ledger projection, the
result store's TTL and idempotent replay, owner-checked reads, revision monotonicity under
redelivery, and the usage report against the ledger.

Generations are driven through the real processor (``python -m projections``) by ``FakeWorker``
(a stand-in for an inference worker: no model runs here) and projected by the real
``python -m projections.readmodel`` subprocess.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid

import pytest

from infra.models.catalog import load_catalog
from infra.runtime.topic_reader import read_topic
from infra.stores.cassandra import execute
from infra.stores.queries import GenerationReader, ResultState, ResultUnavailable
from projections.readmodel.writer import GenerationWriter, RowUpdate
from infra.stores.schema import ReadModelSettings, ensure_schema
from infra.stores.results import CassandraResultStore
from schemas import events as ev
from schemas.codes import RequestStatus
from schemas.messages import OutcomeKind
from schemas.wire import decode_ledger_entry
from infra.harness.processes import ProjectionProcess
from tests.integration.readmodel_load import (
    ROOT,
    FakeWorker,
    expected_from_ledger,
    group_caught_up,
    read_rows,
    wait_caught_up,
)

pytestmark = pytest.mark.integration

SHORT_RESULT_TTL_S = 3
TTL_EXPIRY_WAIT_S = SHORT_RESULT_TTL_S + 1.5
REPORT_TIMEOUT_S = 120.0
REPLAY_POLL_S = 0.05


@pytest.fixture
def rm_settings(cassandra_hosts, cassandra_port, fresh_keyspace) -> ReadModelSettings:
    return ReadModelSettings(hosts=tuple(cassandra_hosts), port=cassandra_port, keyspace=fresh_keyspace)


@pytest.fixture
async def schema(cassandra_session, rm_settings):
    await ensure_schema(cassandra_session, rm_settings, create_keyspace=False)
    return rm_settings


@pytest.fixture
def projection_factory(kafka_bootstrap, topology, tmp_path, rm_settings):
    started: list[ProjectionProcess] = []

    def make(**env) -> ProjectionProcess:
        env.setdefault("CHATPLANE_CASSANDRA_HOSTS", ",".join(rm_settings.hosts))
        env.setdefault("CHATPLANE_CASSANDRA_PORT", rm_settings.port)
        env.setdefault("CHATPLANE_CASSANDRA_KEYSPACE", rm_settings.keyspace)
        p = ProjectionProcess(kafka_bootstrap, topology.namespace, tmp_path, **env)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


@pytest.fixture
async def reader(schema):
    r = await GenerationReader.open(schema)
    yield r
    await r.close()


async def test_completed_result_served_then_expired_410_while_status_and_usage_served(
    running_processor, client, cassandra_session, schema, projection_factory, reader
):
    store = CassandraResultStore(cassandra_session, schema, ttl_s=SHORT_RESULT_TTL_S)
    worker = FakeWorker(client, store=store)
    user, key = f"u-{uuid.uuid4().hex[:8]}", "k-ttl"
    driven = await worker.run_one(user, key, output_tokens=21, text="the final answer")
    proj = projection_factory()
    proj.start()
    await wait_caught_up(cassandra_session, schema.keyspace, await expected_from_ledger(client.bootstrap, client.topology))

    view = await reader.get(driven.generation_id, owner=user)
    assert view is not None
    assert view.status is RequestStatus.COMPLETED
    assert view.result is ResultState.AVAILABLE and view.result_text == "the final answer"
    assert (view.input_tokens, view.output_tokens) == (7, 21)
    assert view.model_version == load_catalog().get("fast-text-model").version
    # owner-checked: someone else's id reads exactly like an unknown one
    assert await reader.get(driven.generation_id, owner="mallory") is None
    assert await reader.get("no-such-generation", owner=user) is None

    # a same-key retry of the completed request is answered from the store, without a new dispatch
    retry = await worker.submit(user, key)
    assert retry.kind is OutcomeKind.EXISTING and retry.status is RequestStatus.COMPLETED
    assert retry.generation_id == driven.generation_id
    stored = await reader.result_for_outcome(retry)
    assert (stored.text, stored.output_tokens) == ("the final answer", 21)

    await asyncio.sleep(TTL_EXPIRY_WAIT_S)

    expired = await reader.get(driven.generation_id, owner=user)
    assert expired is not None
    assert expired.result is ResultState.EXPIRED and expired.result_text is None
    with pytest.raises(ResultUnavailable):
        expired.require_result()
    # status and usage outlive the content
    assert expired.status is RequestStatus.COMPLETED
    assert (expired.input_tokens, expired.output_tokens) == (7, 21)
    retry2 = await worker.submit(user, key)
    assert retry2.kind is OutcomeKind.EXISTING and retry2.status is RequestStatus.COMPLETED
    with pytest.raises(ResultUnavailable) as exc_info:
        await reader.result_for_outcome(retry2)
    assert exc_info.value.code.value == "result_unavailable"
    # inference never reran: the ledger has exactly one attempt accepted for this generation
    entries = [decode_ledger_entry(v or b"") for _, _, _, v in await read_topic(client.bootstrap, client.topology.ledger)]
    accepted = {e.event_id for en in entries for e in en.events if isinstance(e, ev.AttemptAccepted) and e.generation_id == driven.generation_id}
    assert len(accepted) == 1


async def test_revision_never_goes_backwards_under_redelivery(
    running_processor, client, cassandra_session, schema, projection_factory
):
    worker = FakeWorker(client)
    users = [f"u-{uuid.uuid4().hex[:8]}" for _ in range(4)]
    for i in range(12):
        await worker.run_one(users[i % len(users)], f"k-{i}", output_tokens=10 + i)
    # and some left queued (never accepted)
    for i in range(3):
        out = await worker.submit(users[i], f"q-{i}")
        assert out.kind is OutcomeKind.ADMITTED
    expected = await expected_from_ledger(client.bootstrap, client.topology)
    first = projection_factory()
    first.start()
    rows = await wait_caught_up(cassandra_session, schema.keyspace, expected)
    for gid, x in expected.items():
        r = rows[gid]
        assert (r.user_id, r.status, r.epoch, r.output_tokens) == (x.user_id, x.status, x.epoch, x.output_tokens)
    first.stop()
    snapshot = await read_rows(cassandra_session, schema.keyspace)

    # Redelivery 1: a new consumer group replays the whole ledger into the same table while we watch.
    group = f"replay-{uuid.uuid4().hex[:8]}"
    replay = projection_factory(CHATPLANE_READMODEL_GROUP=group)
    replay.start()
    done = asyncio.create_task(group_caught_up(client.bootstrap, group, client.topology))
    seen_max = {g: r.revision for g, r in snapshot.items()}
    polls = 0
    while True:
        now = await read_rows(cassandra_session, schema.keyspace)
        polls += 1
        for g, r in now.items():
            assert r.revision >= seen_max.get(g, -1), f"{g}: revision went back {seen_max[g]} -> {r.revision}"
            seen_max[g] = r.revision
        if done.done():
            break
        assert replay.alive(), replay.log_text()
        await asyncio.sleep(REPLAY_POLL_S)
    await done  # re-raises a timeout
    assert polls >= 1
    replay.stop()
    after = await read_rows(cassandra_session, schema.keyspace)
    assert after == snapshot, "replaying the ledger changed the rows"

    # Redelivery 2: an old entry arriving late (written directly at its older revision).
    writer = GenerationWriter(cassandra_session, schema)
    gid, x = next((g, x) for g, x in expected.items() if x.status == RequestStatus.COMPLETED.value)
    stale = RowUpdate(gid, 0, max(0, x.revision - 2), {"status": RequestStatus.QUEUED.value, "output_tokens": 0})
    await writer.write(stale)
    row = (await read_rows(cassandra_session, schema.keyspace))[gid]
    assert (row.status, row.revision, row.output_tokens) == (x.status, x.revision, x.output_tokens)


async def test_usage_report_totals_equal_ledger_sums(running_processor, client, tmp_path):
    worker = FakeWorker(client)
    users = [f"u-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    t_from = int(time.time() * 1000) - 1
    for i in range(9):
        await worker.run_one(users[i % 3], f"k-{i}", output_tokens=5 * i + 1)
    # a cancelled (queued) generation: its usage record, if any, counts like any other
    out = await worker.submit(users[0], "k-cancel")
    assert out.kind is OutcomeKind.ADMITTED
    from schemas.commands import CancelGeneration

    cancelled = await client.decide(
        CancelGeneration(
            command_id=uuid.uuid4().hex, user_id=users[0], issued_at_ms=int(time.time() * 1000),
            generation_id=out.generation_id or "", reply_to=client.reply_to(),
        )
    )
    assert cancelled.kind in (OutcomeKind.APPLIED, OutcomeKind.CANCEL_REQUESTED)
    t_to = int(time.time() * 1000) + 1

    # the sums from the ledger (not from the usage topic), de-duplicated by (generation, epoch)
    expected_users: dict[str, list[int]] = {}
    seen: set[tuple[str, int]] = set()
    for _, _, _, value in await read_topic(client.bootstrap, client.topology.ledger):
        for e in decode_ledger_entry(value or b"").events:
            if isinstance(e, ev.UsageRecorded) and t_from <= e.occurred_at_ms < t_to and (e.generation_id, e.epoch) not in seen:
                seen.add((e.generation_id, e.epoch))
                s = expected_users.setdefault(e.user_id, [0, 0, 0])
                s[0] += 1
                s[1] += e.input_tokens
                s[2] += e.output_tokens
    assert sum(s[0] for s in expected_users.values()) >= 9

    chart = tmp_path / "usage.png"
    proc = subprocess.run(
        [sys.executable, "-m", "projections.reports.usage", "--json", "--bootstrap", client.bootstrap,
         "--namespace", client.topology.namespace, "--from", str(t_from), "--to", str(t_to), "--chart", str(chart)],
        cwd=ROOT, capture_output=True, text=True, timeout=REPORT_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    got = {u: [v["generations"], v["input_tokens"], v["output_tokens"]] for u, v in report["by_user"].items()}
    assert got == expected_users
    total = report["total"]
    assert [total["generations"], total["input_tokens"], total["output_tokens"]] == [
        sum(s[i] for s in expected_users.values()) for i in range(3)
    ]
    assert sum(v["generations"] for v in report["by_hour"].values()) == total["generations"]
    assert report["undecodable"] == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_a_table_created_before_columns_were_added_gains_them_and_its_old_rows_still_read(cassandra_session, rm_settings):
    """An existing keyspace keeps its table: ``ensure_schema`` adds the columns added since (a turn's
    conversation and revision among them), and a row written before them reads as before, without a
    turn."""
    from schemas.tables import ADDED_GENERATION_COLUMNS, GENERATION_COLUMNS
    from schemas.topics import GENERATIONS_TABLE

    ks = rm_settings.keyspace
    old_columns = {c: t for c, t in GENERATION_COLUMNS.items() if c not in ADDED_GENERATION_COLUMNS}
    cols = ", ".join(f"{c} {t}" for c, t in old_columns.items())
    await execute(cassandra_session, f"CREATE TABLE {ks}.{GENERATIONS_TABLE} (generation_id text PRIMARY KEY, {cols})", timeout_s=60)
    await execute(
        cassandra_session,
        f"INSERT INTO {ks}.{GENERATIONS_TABLE} (generation_id, user_id, status, epoch, revision) VALUES (%s, %s, %s, %s, %s)",
        ("gen_old", "u-old", "cancelled", 1, 7),
    )
    await ensure_schema(cassandra_session, rm_settings, create_keyspace=False)
    rows = await execute(
        cassandra_session,
        "SELECT column_name FROM system_schema.columns WHERE keyspace_name = %s AND table_name = %s",
        (ks, GENERATIONS_TABLE),
    )
    assert set(GENERATION_COLUMNS) <= {r.column_name for r in rows}
    await ensure_schema(cassandra_session, rm_settings, create_keyspace=False)  # again: nothing to add, no error
    reader = await GenerationReader.open(rm_settings)
    try:
        view = await reader.get("gen_old", owner="u-old", include_result=False)
    finally:
        await reader.close()
    assert view is not None and view.status is RequestStatus.CANCELLED
    assert (view.conversation_id, view.turn_revision) == (None, None)
