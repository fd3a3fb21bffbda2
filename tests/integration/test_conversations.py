"""Conversations end to end, on real Kafka and Cassandra with chatplane's own processes.

The stack of each test: the admission processor (``python -m projections``), a worker process with
the simulator engine (``python -m workers --engine sim``: the one fake, for the GPU), the history
writer (``python -m projections.history``), all on a fresh topology and a fresh keyspace, and an
in-process edge serving HTTP. Nothing of ours is mocked.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest

from projections.ledger.audit import audit
from infra.stores.cassandra import execute
from schemas import events as ev
from schemas.messages import PromptPublished
from schemas.topics import RESULTS_TABLE
from schemas.wire import decode_message
from infra.harness.processes import ProjectionProcess, WorkerProcess
from infra.runtime.topic_reader import read_topic
from tests.integration.test_edge_harness import edge_settings, serve_edge
from tests.integration.workers_harness import ledger_events

pytestmark = pytest.mark.integration

MODEL = "simulated-text-model"
WAIT_S = 60.0
POLL_S = 0.05


@pytest.fixture
async def stack(kafka_bootstrap, topology, running_processor, cassandra_hosts, cassandra_port, fresh_keyspace, tmp_path, monkeypatch):
    cass_env = {
        "CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts),
        "CHATPLANE_CASSANDRA_PORT": str(cassandra_port),
        "CHATPLANE_CASSANDRA_KEYSPACE": fresh_keyspace,
    }
    for k, v in cass_env.items():  # the in-process edge's history store reads ReadModelSettings() from the env
        monkeypatch.setenv(k, v)
    writer = ProjectionProcess(kafka_bootstrap, topology.namespace, tmp_path, module="projections.history", **cass_env)
    worker = WorkerProcess(
        kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_WORKER_RESULT_STORE="cassandra",
        CHATPLANE_SIM_TTFT_MS=10, CHATPLANE_SIM_INTER_TOKEN_MS=5, **cass_env,
    )
    writer.start()
    worker.start()
    deadline = time.monotonic() + WAIT_S
    while "history: started" not in writer.log_text():  # its schema is in place
        assert writer.alive() and time.monotonic() < deadline, writer.log_text()
        await asyncio.sleep(POLL_S)
    try:
        settings = edge_settings(kafka_bootstrap, topology, read_model=True, bucket_capacity_tokens=100)
        async with serve_edge(settings) as edge, edge.http() as http:
            yield Stack(edge, http, writer, worker, fresh_keyspace)
    finally:
        worker.stop()
        writer.stop()


class Stack:
    def __init__(self, edge: Any, http: Any, writer: ProjectionProcess, worker: WorkerProcess, keyspace: str) -> None:
        self.edge, self.http, self.writer, self.worker, self.keyspace = edge, http, writer, worker, keyspace

    async def create(self, user: str, title: str | None = "t") -> dict[str, Any]:
        r = await self.http.post("/v1/conversations", json={"title": title}, headers=self.edge.headers(user, uuid.uuid4().hex))
        assert r.status_code == 201, r.text
        return r.json()

    async def turn(self, user: str, cid: str, revision: int, text: str | None = "Name three colors.", *,
                   key: str | None = None, regenerate: bool = False, stream: bool = False, max_output_tokens: int = 16) -> Any:
        body: dict[str, Any] = {"model": MODEL, "stream": stream, "max_output_tokens": max_output_tokens,
                                "conversation_id": cid, "expected_revision": revision}
        if regenerate:
            body["regenerate"] = True
        else:
            body["messages"] = [{"role": "user", "content": text}]
        return await self.http.post("/v1/generations", json=body, headers=self.edge.headers(user, key or uuid.uuid4().hex))

    async def messages(self, user: str, cid: str, **params: Any) -> Any:
        return await self.http.get(f"/v1/conversations/{cid}/messages", params=params, headers=self.edge.headers(user))

    async def wait_revision(self, user: str, cid: str, revision: int) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while True:
            r = await self.http.get(f"/v1/conversations/{cid}", headers=self.edge.headers(user))
            if r.status_code == 200 and r.json()["revision"] >= revision:
                return r.json()
            assert time.monotonic() < deadline, f"{cid} never reached revision {revision}: {r.text}\n{self.writer.log_text()}"
            await asyncio.sleep(POLL_S)


def _sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_two_devices_racing_twenty_turns_admit_one_store_one_turn_and_charge_once(stack, kafka_bootstrap, topology):
    user = f"u-{uuid.uuid4().hex[:8]}"
    conv = await stack.create(user)
    assert conv["revision"] == 0 and conv["id"].startswith("conv_")
    answers = await asyncio.gather(*(stack.turn(user, conv["id"], 0, f"device {i % 2} says {i}") for i in range(20)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] + [409] * 19, [r.text for r in answers if r.status_code not in (200, 409)] or [r.text for r in answers]
    losers = [r.json()["error"] for r in answers if r.status_code == 409]
    assert {e["code"] for e in losers} == {"conversation_conflict"}
    assert all(e["details"]["revision"] >= 1 and e["retryable"] is False for e in losers)
    won = next(r.json() for r in answers if r.status_code == 200)
    assert won["status"] == "completed" and won["conversation_id"] == conv["id"] and won["revision"] == 1
    await stack.wait_revision(user, conv["id"], 2)
    page = (await stack.messages(user, conv["id"])).json()
    assert [(m["seq"], m["role"], m["status"]) for m in page["data"]] == [(1, "user", "completed"), (2, "assistant", "completed")]
    assert page["data"][1]["content"] == won["output"][0]["text"] and page["revision"] == 2
    events = await ledger_events(kafka_bootstrap, topology)
    mine = [e for e in events if e.user_id == user]
    assert sum(isinstance(e, ev.ConversationTurnCommitted) for e in mine) == 1
    assert sum(isinstance(e, ev.ReservationConsumed) for e in mine) == 1  # quota charged once
    assert not [e for e in mine if isinstance(e, ev.AdmissionRejected)]  # the losers held and stored nothing


async def test_a_turn_s_context_is_the_history_the_engine_sees_and_its_token_count(stack, kafka_bootstrap, topology):
    user = f"u-{uuid.uuid4().hex[:8]}"
    cid = (await stack.create(user))["id"]
    revision = 0
    for i in range(3):
        r = await stack.turn(user, cid, revision, f"question {i}")
        assert r.status_code == 200, r.text
        revision = r.json()["revision"] + 1
        await stack.wait_revision(user, cid, revision)
    r = await stack.turn(user, cid, revision, "the last question")
    assert r.status_code == 200, r.text
    gid = r.json()["id"]
    # What the worker ran: the prompt the edge published beside the submit.
    published = [decode_message(v) for _, _, _, v in await read_topic(kafka_bootstrap, topology.prompts("simulated"))]
    prompt = next(p for p in published if isinstance(p, PromptPublished) and p.generation_id == gid)
    page = (await stack.messages(user, cid, limit=200)).json()["data"]
    history = [(m["role"], m["content"]) for m in page if m["seq"] <= revision]
    assert [(m.role, m.content) for m in prompt.messages] == [*history, ("user", "the last question")]
    from infra.models.catalog import load_catalog
    from infra.models.tokens import count_input_tokens

    expected_tokens = count_input_tokens(load_catalog().get(MODEL), [(m.role, m.content) for m in prompt.messages])
    assert r.json()["usage"]["input_tokens"] == expected_tokens
    admitted = [e for e in await ledger_events(kafka_bootstrap, topology, gid) if isinstance(e, ev.GenerationAdmitted)]
    assert admitted[0].input_tokens == expected_tokens


async def test_the_answer_is_not_announced_until_stored_and_the_spool_survives_a_killed_writer(stack, kafka_bootstrap, topology):
    user = f"u-{uuid.uuid4().hex[:8]}"
    cid = (await stack.create(user))["id"]
    first = await stack.turn(user, cid, 0, "first")
    assert first.status_code == 200, first.text
    await stack.wait_revision(user, cid, 2)
    stack.writer.kill()  # kill -9 of the process that persists answers
    frames: list[tuple[str, dict[str, Any]]] = []
    async with stack.http.stream(
        "POST", "/v1/generations", headers=stack.edge.headers(user, uuid.uuid4().hex),
        json={"model": MODEL, "stream": True, "max_output_tokens": 16, "conversation_id": cid, "expected_revision": 2,
              "messages": [{"role": "user", "content": "second"}]},
    ) as response:
        assert response.status_code == 200
        # One task reads the stream into a queue (cancelling a pending read of the stream would close it).
        chunks: asyncio.Queue[str | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for chunk in response.aiter_text():
                    await chunks.put(chunk)
            finally:
                await chunks.put(None)

        pumping = asyncio.create_task(pump())
        buffered = ""

        async def read_until(event: str, timeout_s: float) -> bool:
            nonlocal buffered
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    chunk = await asyncio.wait_for(chunks.get(), timeout=max(0.01, deadline - time.monotonic()))
                except TimeoutError:
                    break
                if chunk is None:
                    break
                buffered += chunk
                frames[:] = _sse(buffered)
                if any(name == event for name, _ in frames):
                    return True
            return False

        assert await read_until("generation.created", WAIT_S)
        gid = frames[0][1]["generation_id"]
        assert frames[0][1]["conversation_id"] == cid and frames[0][1]["revision"] == 3
        # The engine ends and the worker reports: the ledger has the generation completed...
        deadline = time.monotonic() + WAIT_S
        while not any(isinstance(e, ev.GenerationCompleted) for e in await ledger_events(kafka_bootstrap, topology, gid)):
            assert time.monotonic() < deadline, stack.worker.log()
            await asyncio.sleep(0.2)
        # ...and still no generation.completed reaches the client, nor the answer the messages read.
        assert not await read_until("generation.completed", 3.0), frames
        assert any(name == "generation.text.delta" for name, _ in frames)  # provisional text was delivered
        page = (await stack.messages(user, cid)).json()
        # (The store shows revision 2: the writer that stores the user turn is the one killed; its text
        # waits in turn_inputs, written by the edge before the submit.)
        assert [m["seq"] for m in page["data"]] == [1, 2] and page["revision"] == 2
        answers = [e for e in await ledger_events(kafka_bootstrap, topology, gid) if isinstance(e, ev.ConversationAnswerCommitted)]
        assert answers == []
        stack.writer.start()  # the restarted writer persists from the spool, then the answer commits
        assert await read_until("generation.completed", WAIT_S), (frames, stack.writer.log_text())
        pumping.cancel()
    text = "".join(data["delta"] for name, data in frames if name == "generation.text.delta")
    await stack.wait_revision(user, cid, 4)
    page = (await stack.messages(user, cid)).json()["data"]
    assert [(m["seq"], m["role"], m["status"]) for m in page] == [
        (1, "user", "completed"), (2, "assistant", "completed"), (3, "user", "completed"), (4, "assistant", "completed"),
    ]
    assert page[2]["content"] == "second" and page[3]["content"] == text and page[3]["generation_id"] == gid


async def test_regenerate_keeps_the_old_answer_as_a_sibling_and_takes_a_new_quota_decision(stack, kafka_bootstrap, topology):
    user = f"u-{uuid.uuid4().hex[:8]}"
    cid = (await stack.create(user))["id"]
    first = await stack.turn(user, cid, 0, "tell me a story")
    assert first.status_code == 200, first.text
    await stack.wait_revision(user, cid, 2)
    again = await stack.turn(user, cid, 2, None, regenerate=True)
    assert again.status_code == 200, again.text
    assert again.json()["id"] != first.json()["id"] and again.json()["revision"] == 2
    await stack.wait_revision(user, cid, 3)
    active = (await stack.messages(user, cid)).json()["data"]
    assert [(m["seq"], m["role"]) for m in active] == [(1, "user"), (3, "assistant")]
    assert active[1]["parent_seq"] == 1 and active[1]["generation_id"] == again.json()["id"]
    everything = (await stack.messages(user, cid, branch="all")).json()["data"]
    old = next(m for m in everything if m["seq"] == 2)
    assert old["superseded_by"] == 3 and old["parent_seq"] == 1 and old["content"] == first.json()["output"][0]["text"]
    consumed = [e for e in await ledger_events(kafka_bootstrap, topology) if e.user_id == user and isinstance(e, ev.ReservationConsumed)]
    assert len(consumed) == 2  # two quota decisions, one per answer
    # A regeneration against a stale revision is a conflict like any turn.
    stale = await stack.turn(user, cid, 2, None, regenerate=True)
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "conversation_conflict"


async def test_delete_removes_every_row_and_answers_as_the_contract_says(stack, kafka_bootstrap, topology, cassandra_session):
    user = f"u-{uuid.uuid4().hex[:8]}"
    cid = (await stack.create(user))["id"]
    generations = []
    revision = 0
    for i in range(2):
        r = await stack.turn(user, cid, revision, f"turn {i}")
        assert r.status_code == 200, r.text
        generations.append(r.json()["id"])
        revision += 2
        await stack.wait_revision(user, cid, revision)
    ks = stack.keyspace

    async def rows_of(table: str) -> list[Any]:
        found = []
        for g in generations:
            found += await execute(cassandra_session, f"SELECT generation_id FROM {ks}.{table} WHERE generation_id = %s", (g,))
        return found

    assert len(await rows_of(RESULTS_TABLE)) == 2 and len(await rows_of("turn_inputs")) == 2
    gone = await stack.http.delete(f"/v1/conversations/{cid}", headers=stack.edge.headers(user))
    assert gone.status_code == 204, gone.text
    assert (await stack.http.get(f"/v1/conversations/{cid}", headers=stack.edge.headers(user))).status_code == 404
    assert (await stack.messages(user, cid)).status_code == 404
    late = await stack.turn(user, cid, revision, "are you there?")
    assert late.status_code == 404 and late.json()["error"]["code"] == "not_found"
    again = await stack.http.delete(f"/v1/conversations/{cid}", headers=stack.edge.headers(user))
    assert again.status_code == 204, again.text
    deadline = time.monotonic() + WAIT_S
    while True:
        rows = {
            "messages": await execute(cassandra_session, f"SELECT seq FROM {ks}.messages WHERE conversation_id = %s AND bucket = 0", (cid,)),
            "conversation": await execute(cassandra_session, f"SELECT conversation_id FROM {ks}.conversations WHERE conversation_id = %s", (cid,)),
            "index": [r for r in await execute(cassandra_session, f"SELECT conversation_id FROM {ks}.conversations_by_user WHERE user_id = %s", (user,)) if r.conversation_id == cid],
            "results": await rows_of(RESULTS_TABLE),
            "turn_inputs": await rows_of("turn_inputs"),
        }
        if not any(rows.values()):
            break
        assert time.monotonic() < deadline, f"rows left: {rows}\n{stack.writer.log_text()}"
        await asyncio.sleep(0.2)
    listed = (await stack.http.get("/v1/conversations", headers=stack.edge.headers(user))).json()["data"]
    assert cid not in [c["id"] for c in listed]
    report = await audit(kafka_bootstrap, topology, compare_table=False)
    assert report.violations == [], report.violations
    assert any(isinstance(e, ev.ConversationDeleted) for e in await ledger_events(kafka_bootstrap, topology) if e.user_id == user)


async def test_two_users_never_cross(stack):
    alice, bob = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    conv = await stack.create(alice, "alice's")
    r = await stack.turn(alice, conv["id"], 0, "alice's secret")
    assert r.status_code == 200, r.text
    await stack.wait_revision(alice, conv["id"], 2)
    h = stack.edge.headers(bob)
    for answer in (
        await stack.http.get(f"/v1/conversations/{conv['id']}", headers=h),
        await stack.messages(bob, conv["id"]),
        await stack.turn(bob, conv["id"], 2, "let me in"),
        await stack.http.delete(f"/v1/conversations/{conv['id']}", headers=h),
    ):
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", answer.text
    assert (await stack.http.get("/v1/conversations", headers=h)).json()["data"] == []
    mine = (await stack.http.get("/v1/conversations", headers=stack.edge.headers(alice))).json()["data"]
    assert [c["id"] for c in mine] == [conv["id"]] and mine[0]["title"] == "alice's"
    # Alice's conversation is untouched by bob's attempts.
    assert [m["content"] for m in (await stack.messages(alice, conv["id"])).json()["data"]][0] == "alice's secret"


async def test_with_the_history_store_down_conversations_answer_503_and_stateless_requests_go_on(
    kafka_bootstrap, topology, running_processor, tmp_path, monkeypatch,
):
    # The edge's Cassandra is a port where nothing listens: the store is down for it.
    monkeypatch.setenv("CHATPLANE_CASSANDRA_PORT", "1")
    worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_SIM_TTFT_MS=10, CHATPLANE_SIM_INTER_TOKEN_MS=5)
    worker.start()
    try:
        async with serve_edge(edge_settings(kafka_bootstrap, topology)) as edge, edge.http() as http:
            user = f"u-{uuid.uuid4().hex[:8]}"
            answers = [
                await http.post("/v1/conversations", json={}, headers=edge.headers(user, uuid.uuid4().hex)),
                await http.get("/v1/conversations", headers=edge.headers(user)),
                await http.get("/v1/conversations/conv_x/messages", headers=edge.headers(user)),
                await http.post("/v1/generations", headers=edge.headers(user, uuid.uuid4().hex), json={
                    "model": MODEL, "max_output_tokens": 8, "conversation_id": "conv_x", "expected_revision": 0,
                    "messages": [{"role": "user", "content": "hello"}]}),
            ]
            for a in answers:
                assert a.status_code == 503 and a.json()["error"]["code"] == "history_unavailable", a.text
                assert a.json()["error"]["retryable"] is True and int(a.headers["Retry-After"]) >= 1
            stateless = await http.post("/v1/generations", headers=edge.headers(user, uuid.uuid4().hex), json={
                "model": MODEL, "max_output_tokens": 8, "messages": [{"role": "user", "content": "hello"}]})
            assert stateless.status_code == 200 and stateless.json()["status"] == "completed", stateless.text
    finally:
        worker.stop()


async def _stream_turn(stack: Stack, user: str, cid: str, revision: int, text: str) -> list[tuple[str, dict[str, Any]]]:
    r = await stack.turn(user, cid, revision, text, stream=True)
    assert r.status_code == 200, r.text
    return _sse(r.text)


async def test_twenty_turns_each_sent_with_the_revision_the_last_answer_gave_and_read_back_at_once(stack):
    """A client never adds to a revision nor sleeps: each turn sends exactly the revision the previous
    answer named (JSON or the stream's terminal event), and a read right after the answer shows it."""
    user = f"u-{uuid.uuid4().hex[:8]}"
    conv = await stack.create(user)
    cid, revision, updated_at = conv["id"], conv["revision"], conv["updated_at"]
    for i in range(20):
        if i % 2:
            frames = await _stream_turn(stack, user, cid, revision, f"question {i}")
            name, end = frames[-1]
            assert name == "generation.completed", frames
            gid = frames[0][1]["generation_id"]
        else:
            r = await stack.turn(user, cid, revision, f"question {i}")
            assert r.status_code == 200, r.text  # never a 409 for the revision the last answer gave
            end, gid = r.json(), r.json()["id"]
            assert end["status"] == "completed" and end["revision"] == revision + 1  # the user turn's, as before
        assert end["conversation_id"] == cid and end["next_expected_revision"] == revision + 2, end
        revision = end["next_expected_revision"]
        # Immediately, without polling: the conversation, its newest messages and the generation.
        got = await stack.http.get(f"/v1/conversations/{cid}", headers=stack.edge.headers(user))
        assert got.status_code == 200 and got.json()["revision"] == revision, (i, got.text)
        assert got.json()["updated_at"] > updated_at, (i, got.json(), updated_at)  # moves with each turn
        updated_at = got.json()["updated_at"]
        newest = (await stack.messages(user, cid, order="desc", limit=2)).json()
        assert [(m["seq"], m["role"], m["status"]) for m in newest["data"]] == [
            (revision, "assistant", "completed"), (revision - 1, "user", "completed"),
        ], (i, newest)
        generation = (await stack.http.get(f"/v1/generations/{gid}", headers=stack.edge.headers(user))).json()
        assert generation["next_expected_revision"] == revision, generation
    assert revision == 40


def _extreme_values(schema: dict[str, Any]) -> list[Any]:
    """The edges of a query parameter's schema and the values past them, plus values that are no
    number or no member at all: every one must get a typed answer."""
    schema = next((s for s in schema.get("anyOf", []) if s.get("type") != "null"), schema)
    values: list[Any] = ["", "-1", "1e400", "NaN", "x" * 4096]
    if schema.get("type") == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        values += [0, -1, 1, 2**31, 9_999_999_999, 2**63 - 1, 2**63, 10**30, -(10**30)]
        values += [low, low - 1] if low is not None else []
        values += [high, high + 1] if high is not None else []
    if schema.get("type") == "string":
        values += schema.get("enum", []) + ["asc", "desc", "active", "all", "DESC"]
        if "maxLength" in schema:
            values += ["y" * schema["maxLength"], "y" * (schema["maxLength"] + 1)]
        from infra.stores.history import encode_cursor

        values += [encode_cursor(2**63, "conv_x"), encode_cursor(10**30, "conv_x"), encode_cursor(0, "conv_x")]
    return values


async def test_extreme_query_values_of_every_route_get_a_typed_answer_and_a_bounded_read(stack):
    """Every query parameter of every route in the served OpenAPI document, at the edges of its range
    and past them: a typed answer, never a 5xx nor a retryable 503, and no messages read touching more
    than ``MESSAGES_BUCKETS_PER_READ_MAX`` buckets (counted by the store, not timed)."""
    from edge.routes.conversations import MESSAGES_BUCKETS_PER_READ_MAX
    from infra.stores.history import MESSAGES_PER_BUCKET

    user = f"u-{uuid.uuid4().hex[:8]}"
    cid = (await stack.create(user))["id"]
    revision = 0
    for i in range(3):
        r = await stack.turn(user, cid, revision, f"question {i}")
        assert r.status_code == 200, r.text
        revision, gid = r.json()["next_expected_revision"], r.json()["id"]
    paths = {"conversation_id": cid, "generation_id": gid}
    store = stack.edge.app.state.edge.history._store
    spec = (await stack.http.get("/openapi.json")).json()
    cases: list[tuple[str, str, dict[str, Any]]] = []
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            query = [p for p in op.get("parameters", []) if p["in"] == "query"]
            for p in query:
                cases += [(method, path, {p["name"]: v}) for v in _extreme_values(p["schema"])]
    # The reported one, and cursors combined with an order.
    messages = "/v1/conversations/{conversation_id}/messages"
    cases += [("get", messages, {"before": 9_999_999_999, "order": "desc"}), ("get", messages, {"after": 9_999_999_999, "order": "asc"}),
              ("get", messages, {"before": 10**30, "order": "desc", "limit": 200, "branch": "all"}),
              ("get", messages, {"before": 2**63, "after": 1})]
    assert {path for _, path, _ in cases} >= {messages, "/v1/conversations", "/v1/generations/{generation_id}/events"}
    touched_most = 0
    for method, path, params in cases:
        before = store.bucket_reads_total
        r = await stack.http.request(method.upper(), path.format(**paths), params=params, headers=stack.edge.headers(user))
        touched = store.bucket_reads_total - before
        assert touched <= MESSAGES_BUCKETS_PER_READ_MAX, (path, params, touched)
        touched_most = max(touched_most, touched)
        assert r.status_code < 500, (path, params, r.status_code, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["code"] == "invalid_request" and err["retryable"] is False, (path, params, r.text)
            assert err["details"].get("field"), (path, params, r.text)
    assert touched_most >= 1  # the reads were counted (the messages route read its buckets)
    # Past the end, a cursor reads what exists: the newest page, from the one bucket that holds it.
    before = store.bucket_reads_total
    page = (await stack.messages(user, cid, before=9_999_999_999, order="desc")).json()
    assert [m["seq"] for m in page["data"]] == list(range(revision, 0, -1)) and page["next_after"] is None, page
    assert store.bucket_reads_total - before <= 1 + revision // MESSAGES_PER_BUCKET
    page = (await stack.messages(user, cid, after=9_999_999_999)).json()
    assert page["data"] == [] and page["next_after"] is None


@pytest.fixture
async def other_edge(stack, kafka_bootstrap, topology, cassandra_hosts, cassandra_port, fresh_keyspace, tmp_path):
    """A second in-process edge replica on its own inbox partition, and the read-model projection it
    reads generations from (it admitted none of them: nothing of them is in its memory)."""
    cass_env = {"CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts), "CHATPLANE_CASSANDRA_PORT": str(cassandra_port),
                "CHATPLANE_CASSANDRA_KEYSPACE": fresh_keyspace}
    projection = ProjectionProcess(kafka_bootstrap, topology.namespace, tmp_path, **cass_env)
    projection.start()
    deadline = time.monotonic() + WAIT_S
    while "readmodel: started" not in projection.log_text():
        assert projection.alive() and time.monotonic() < deadline, projection.log_text()
        await asyncio.sleep(POLL_S)
    try:
        settings = edge_settings(kafka_bootstrap, topology, read_model=True, bucket_capacity_tokens=100, inbox_partition=2)
        async with serve_edge(settings) as edge, edge.http() as http:
            yield edge, http
    finally:
        projection.stop()


async def test_another_edge_names_the_next_revision_in_a_same_key_retry_a_get_and_a_replay(stack, other_edge):
    """The phone's retry lands on another edge replica: its answer (JSON, or the replayed stream's
    terminal event), that edge's GET and its replay name the turn's conversation and the revision the
    next turn sends, exactly as the first answer did; the next turn sent with it is admitted there."""
    edge_b, http_b = other_edge
    user = f"u-{uuid.uuid4().hex[:8]}"
    cid = (await stack.create(user))["id"]

    async def settled_on_b(gid: str) -> dict[str, Any]:
        # Polled: edge B knows the generation only once the read model projected its end.
        deadline = time.monotonic() + WAIT_S
        while True:
            r = await http_b.get(f"/v1/generations/{gid}", headers=edge_b.headers(user))
            if r.status_code == 200 and r.json()["status"] == "completed":
                return r.json()
            assert time.monotonic() < deadline, r.text
            await asyncio.sleep(POLL_S)

    # A JSON turn on edge A, retried with its key on edge B.
    key = uuid.uuid4().hex
    first = await stack.turn(user, cid, 0, "question 0", key=key)
    assert first.status_code == 200, first.text
    first_doc = first.json()
    assert (first_doc["conversation_id"], first_doc["revision"], first_doc["next_expected_revision"]) == (cid, 1, 2)
    got = await settled_on_b(first_doc["id"])
    assert (got["conversation_id"], got["revision"], got["next_expected_revision"]) == (cid, 1, 2), got
    body = {"model": MODEL, "stream": False, "max_output_tokens": 16, "conversation_id": cid, "expected_revision": 0,
            "messages": [{"role": "user", "content": "question 0"}]}
    retry = await http_b.post("/v1/generations", json=body, headers=edge_b.headers(user, key))
    assert retry.status_code == 200, retry.text
    again = retry.json()
    assert again["id"] == first_doc["id"] and again["output"] == first_doc["output"]
    assert {k: again[k] for k in ("conversation_id", "revision", "next_expected_revision")} == {
        k: first_doc[k] for k in ("conversation_id", "revision", "next_expected_revision")
    }, again

    # A streamed turn on edge A, sent with what the retry gave, retried as a stream on edge B.
    key = uuid.uuid4().hex
    r = await stack.turn(user, cid, again["next_expected_revision"], "question 1", key=key, stream=True)
    assert r.status_code == 200, r.text
    original = _sse(r.text)
    gid = original[0][1]["generation_id"]
    assert original[-1][0] == "generation.completed" and original[-1][1]["next_expected_revision"] == 4, original[-1]
    await settled_on_b(gid)
    stream_body = {**body, "stream": True, "expected_revision": 2, "messages": [{"role": "user", "content": "question 1"}]}
    replayed = await http_b.post("/v1/generations", json=stream_body, headers=edge_b.headers(user, key))
    assert replayed.status_code == 200 and replayed.headers["content-type"].startswith("text/event-stream"), replayed.text
    replayed_events = _sse(replayed.text)
    followed = await http_b.get(f"/v1/generations/{gid}/events", headers=edge_b.headers(user))
    assert followed.status_code == 200, followed.text
    for events in (replayed_events, _sse(followed.text)):
        assert [name for name, _ in events] == [name for name, _ in original]
        (name, end), (_, created) = events[-1], events[0]
        assert (end["conversation_id"], end["next_expected_revision"]) == (cid, 4), end
        assert (created["conversation_id"], created["revision"]) == (cid, 3), created

    # The next turn, on edge B, sent with exactly that revision: admitted, no 409.
    r = await http_b.post("/v1/generations", json={**body, "expected_revision": end["next_expected_revision"]},
                          headers=edge_b.headers(user, uuid.uuid4().hex))
    assert r.status_code == 200 and r.json()["next_expected_revision"] == 6, r.text
