"""The admission processor on the real broker: round trip, concurrency, crash safety, rebalance, audit."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter, defaultdict

import pytest

from projections.audit import audit, read_topic
from projections.client import CommandClient
from projections.kafka_admin import delete_topics, ensure_topics
from schemas import commands as cmd
from schemas.codes import FinishOutcome, RejectionCode, RequestStatus, Tier
from schemas.messages import DispatchAuthorized, Outcome, OutcomeKind
from schemas.topics import Topology
from schemas.wire import decode_ledger_entry, decode_message, encode
from tests.integration.ledger_harness import ProcessorProcess, wait_until_deciding

pytestmark = pytest.mark.integration

LOAD_DECISION_TIMEOUT_S = 20.0


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
async def topology(kafka_bootstrap):
    topo = Topology(f"t{uuid.uuid4().hex[:10]}")
    await ensure_topics(kafka_bootstrap, topo.all())
    yield topo
    await delete_topics(kafka_bootstrap, [s.name for s in topo.all()])


@pytest.fixture
def processor_factory(kafka_bootstrap, topology, tmp_path):
    started: list[ProcessorProcess] = []

    def make(**env) -> ProcessorProcess:
        p = ProcessorProcess(kafka_bootstrap, topology.namespace, tmp_path, **env)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


@pytest.fixture
async def client(kafka_bootstrap, topology):
    async with CommandClient(kafka_bootstrap, topology, inbox_partition=0, decision_timeout_s=LOAD_DECISION_TIMEOUT_S) as c:
        yield c


def submit(client: CommandClient, user: str, key: str, fingerprint: str = "fp-aaaaaaaa", **over) -> cmd.SubmitGeneration:
    fields = dict(
        command_id=uuid.uuid4().hex,
        user_id=user,
        issued_at_ms=now_ms(),
        idempotency_key=key,
        fingerprint=fingerprint,
        model_alias="fast-text-model",
        tier=Tier.FREE,
        stream=True,
        max_output_tokens=100,
        input_tokens=10,
        reply_to=client.reply_to(),
    )
    fields.update(over)
    return cmd.SubmitGeneration(**fields)


def worker_cmd(client: CommandClient, cls, user: str, generation_id: str, **fields):
    return cls(
        command_id=uuid.uuid4().hex,
        user_id=user,
        issued_at_ms=now_ms(),
        generation_id=generation_id,
        reply_to=client.reply_to(),
        **fields,
    )


async def test_submit_decision_round_trip_through_kafka(kafka_bootstrap, topology, processor_factory, client):
    p = processor_factory()
    p.start()
    await wait_until_deciding(client)
    outcome = await client.decide(submit(client, "alice", "k1"))
    assert outcome.kind is OutcomeKind.ADMITTED and outcome.status is RequestStatus.QUEUED
    assert outcome.model_version == "smollm2-135m-instruct-q4_1"
    dispatch = [decode_message(r[3]) for r in await read_topic(kafka_bootstrap, topology.dispatch("default", "free"))]
    assert [d.generation_id for d in dispatch if isinstance(d, DispatchAuthorized)] == [outcome.generation_id]
    entries = [decode_ledger_entry(r[3]) for r in await read_topic(kafka_bootstrap, topology.ledger)]
    admitted = [e for entry in entries for e in entry.events if e.type == "GenerationAdmitted"]
    assert [e.generation_id for e in admitted] == [outcome.generation_id]
    # The decision is stable: the same key again identifies the same generation.
    again = await client.decide(submit(client, "alice", "k1"))
    assert again.code is RejectionCode.GENERATION_IN_PROGRESS and again.generation_id == outcome.generation_id


async def test_undecodable_commands_go_to_the_dead_letter_topic_and_the_partition_moves_on(
    kafka_bootstrap, topology, processor_factory, client
):
    p = processor_factory()
    p.start()
    await wait_until_deciding(client, user_id="bob")
    await client._producer.send_and_wait(topology.commands.name, b"{not json", key=b"bob")
    await client._producer.send_and_wait(topology.commands.name, b'{"type":"SubmitGeneration"}', key=b"bob")
    outcome = await client.decide(submit(client, "bob", "k1"))
    assert outcome.kind is OutcomeKind.ADMITTED
    import orjson

    dead = [orjson.loads(r[3]) for r in await read_topic(kafka_bootstrap, topology.dead_letter)]
    assert len(dead) == 2
    assert dead[0]["reason"].startswith("invalid JSON") and dead[1]["reason"].startswith("invalid field")
    assert all(d["source_topic"] == topology.commands.name and d["offset"] >= 0 for d in dead)


async def test_200_concurrent_submits_admit_exactly_the_limit(kafka_bootstrap, topology, processor_factory, client):
    p = processor_factory(CHATPLANE_CONCURRENCY_LIMIT=1000)
    p.start()
    await wait_until_deciding(client, user_id="carol")
    outcomes = await asyncio.gather(*(client.decide(submit(client, "carol", f"k{i}")) for i in range(200)))
    kinds = Counter(o.code.value if o.code else o.kind.value for o in outcomes)
    assert kinds == {"admitted": 40, "quota_exhausted": 160}, kinds
    limited = [o for o in outcomes if o.code is RejectionCode.QUOTA_EXHAUSTED]
    assert all(o.details.limit == 40 and o.details.remaining == 0 for o in limited)
    # 50 concurrent retries of one key: one generation.
    retries = await asyncio.gather(*(client.decide(submit(client, "dave", "same")) for _ in range(50)))
    assert len({o.generation_id for o in retries}) == 1
    assert Counter(o.kind for o in retries)[OutcomeKind.ADMITTED] == 1
    assert Counter(o.code for o in retries)[RejectionCode.GENERATION_IN_PROGRESS] == 49
    report = await audit(kafka_bootstrap, topology)
    assert report.ok, report.render()
    assert report.consumed == 0 and report.users == 3  # carol, dave and the probe user


async def test_default_concurrency_limit_refuses_as_the_state_says(kafka_bootstrap, topology, processor_factory, client):
    p = processor_factory()
    p.start()
    await wait_until_deciding(client, user_id="erin")
    outcomes = await asyncio.gather(*(client.decide(submit(client, "erin", f"k{i}")) for i in range(200)))
    kinds = Counter(o.code.value if o.code else o.kind.value for o in outcomes)
    assert kinds == {"admitted": 2, "concurrency_limited": 198}, kinds
    assert all(o.status is RequestStatus.ADMISSION_RETRYABLE for o in outcomes if o.code)


class MixedLoad:
    """Edge and workers in one: submits, same-key retries, accepts, renewals, cancels, finishes."""

    def __init__(self, client: CommandClient, users: int, seed: int) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.users = [f"user-{i}" for i in range(users)]
        self.keys: dict[str, list[str]] = defaultdict(list)
        self.running: dict[str, tuple[str, int]] = {}  # generation -> (user, epoch)
        self.queued: dict[str, tuple[str, int]] = {}
        self.outcomes: dict[str, list[Outcome]] = defaultdict(list)
        self.sent: list[cmd.Command] = []

    async def step(self) -> None:
        r = self.rng.random()
        user = self.rng.choice(self.users)
        if r < 0.35 or not (self.running or self.queued):
            if self.keys[user] and self.rng.random() < 0.3:
                key = self.rng.choice(self.keys[user])
            else:
                key = uuid.uuid4().hex[:12]
                self.keys[user].append(key)
            command = submit(self.client, user, key)
        elif r < 0.6 and self.queued:
            generation_id, (user, epoch) = self.rng.choice(list(self.queued.items()))
            command = worker_cmd(self.client, cmd.AcceptAttempt, user, generation_id, epoch=epoch, worker_id="w1")
        elif r < 0.7 and self.running:
            generation_id, (user, epoch) = self.rng.choice(list(self.running.items()))
            command = worker_cmd(self.client, cmd.CancelGeneration, user, generation_id)
        else:
            pool = self.running or self.queued
            generation_id, (user, epoch) = self.rng.choice(list(pool.items()))
            outcome = self.rng.choice([FinishOutcome.COMPLETED, FinishOutcome.STOPPED, FinishOutcome.FAILED])
            command = worker_cmd(
                self.client,
                cmd.ReportAttemptFinished,
                user,
                generation_id,
                epoch=epoch,
                worker_id="w1",
                outcome=outcome,
                input_tokens=10,
                output_tokens=self.rng.randint(0, 50),
            )
        self.sent.append(command)
        outcome = await self.client.decide(command)
        self.outcomes[command.command_id].append(outcome)
        self._learn(command, outcome)

    def _learn(self, command: cmd.Command, outcome: Outcome) -> None:
        g = outcome.generation_id
        if g is None:
            return
        if outcome.status is RequestStatus.QUEUED:
            self.queued[g] = (command.user_id, outcome.epoch)
        elif outcome.status is RequestStatus.RUNNING:
            self.queued.pop(g, None)
            self.running[g] = (command.user_id, outcome.epoch)
        elif outcome.status is not None:
            self.queued.pop(g, None)
            self.running.pop(g, None)


async def test_kill_9_under_mixed_load_loses_and_doubles_nothing(kafka_bootstrap, topology, processor_factory, client):
    p = processor_factory(CHATPLANE_PROCESSOR_COMMIT_INTERVAL_S=0.3, CHATPLANE_QUEUE_WAIT_MAX_MS=3000, CHATPLANE_RECONCILE_GRACE_MS=1000, CHATPLANE_LEASE_MS=4000)
    p.start()
    await wait_until_deciding(client)
    load = MixedLoad(client, users=6, seed=20261202)
    rng = random.Random(7)
    kills = 0
    for _round in range(4):
        tasks = [asyncio.create_task(_drive(load, rng.randint(30, 80)))]
        await asyncio.sleep(rng.uniform(0.2, 1.5))
        p.kill9()
        kills += 1
        p.start()
        await asyncio.gather(*tasks)
    await _drive(load, 50)
    assert kills == 4
    # Let every queued reservation pass its reconcile deadline and every lease expire.
    await asyncio.sleep(7.0)
    report = await audit(kafka_bootstrap, topology, concurrency_limit=2)
    assert report.ok, report.render()
    assert report.consumed > 0 and report.entries_read > 0
    # Every command has exactly one logical outcome, however often it was decided or redelivered.
    replies: dict[str, set[bytes]] = defaultdict(set)
    for _, _, _, value in await read_topic(kafka_bootstrap, topology.edge_inbox):
        message = decode_message(value)
        if isinstance(message, Outcome):
            replies[message.command_id].add(encode(message))
    sent_ids = {c.command_id for c in load.sent}
    assert sent_ids <= set(replies)
    assert all(len(replies[c]) == 1 for c in sent_ids), "a command got two different outcomes"
    # Nothing is left RESERVED past its reconcile deadline.
    cutoff = now_ms() - 2_000
    assert report.states
    for state in report.states.values():
        for reservation in state.reservations.values():
            assert not (reservation.state.value == "reserved" and reservation.reconcile_deadline_ms < cutoff)


async def _drive(load: MixedLoad, steps: int) -> None:
    for _ in range(steps):
        await load.step()
