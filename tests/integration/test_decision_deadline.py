"""A 503 never charges: a submit the processor reads after its decision deadline holds nothing.

The edge gives every submit a decision deadline (``decide_by_ms``) a clock-skew margin before it stops
waiting and answers 503 ``quota_service_unavailable``; the processor stamps when it read the command
(``read_at_ms``) and refuses, holding nothing, a submit read after its deadline. Here the processor is
held back (not started) past the deadline, on the real broker:

- over HTTP through the real edge: 503; once the processor runs, the audit shows the refusal and
  nothing reserved or consumed; a same-key retry is admitted once and consumes one message;
- through the command client, as the processor tests drive it: the same, step by step;
- after a crash: a submit whose in-time admission reached the ledger before its state was durable
  is read again late, and is decided with the stamp its ledger entry recorded (read_stamps.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest
from aiokafka import AIOKafkaProducer

from control_plane.aggregate import Aggregate, handle
from control_plane.routing import route
from projections.ledger.audit import audit
from projections.ledger.processor import user_partition
from infra.runtime.command_client import DecisionTimeout
from infra.runtime.settings import policy_from_env
from infra.runtime.topic_reader import read_topic
from schemas import commands as cmd
from schemas import events as ev
from schemas.codes import RejectionCode, RequestStatus, Tier
from schemas.messages import DispatchAuthorized, OutcomeKind
from schemas.wire import decode_ledger_entry, decode_message, encode
from infra.harness.models import SIM_ALIAS, SIM_POOL
from infra.harness.processes import wait_until_committed, wait_until_deciding
from tests.integration.test_edge_errors import body, typed
from tests.integration.test_edge_harness import FakeSimWorker, edge_settings, serve_edge

pytestmark = pytest.mark.integration

EDGE_WAIT_S = 1.0
SKEW_MARGIN_MS = 300
LEDGER_POLL_S = 0.25
LEDGER_WAIT_S = 60.0


def now_ms() -> int:
    return int(time.time() * 1000)


def submit(client, user: str, key: str, decide_by_ms: int, command_id: str | None = None) -> cmd.SubmitGeneration:
    return cmd.SubmitGeneration(
        command_id=command_id or uuid.uuid4().hex,
        user_id=user,
        issued_at_ms=now_ms(),
        idempotency_key=key,
        fingerprint="fp-aaaaaaaa",
        model_alias=SIM_ALIAS,
        tier=Tier.FREE,
        stream=False,
        max_output_tokens=16,
        input_tokens=10,
        decide_by_ms=decide_by_ms,
        reply_to=client.reply_to(),
    )


async def ledger_entries(bootstrap: str, topology, user: str) -> list[ev.LedgerEntry]:
    entries = [decode_ledger_entry(r[3]) for r in sorted(await read_topic(bootstrap, topology.ledger), key=lambda r: (r[0], r[1]))]
    return [e for e in entries if e.user_id == user]


async def entries_of(bootstrap: str, topology, user: str, command_id: str | None = None, count: int = 1) -> list[ev.LedgerEntry]:
    """A user's ledger entries (of one command, if given), once there are ``count`` of them."""
    deadline = time.monotonic() + LEDGER_WAIT_S
    while True:
        found = [e for e in await ledger_entries(bootstrap, topology, user) if command_id in (None, e.command_id)]
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"{len(found)} of {count} ledger entries within {LEDGER_WAIT_S} s"
        await asyncio.sleep(LEDGER_POLL_S)


def refused_late(entry: ev.LedgerEntry) -> ev.AdmissionRejected:
    (event,) = entry.events
    assert isinstance(event, ev.AdmissionRejected), entry
    assert (event.code, event.status) == (RejectionCode.QUOTA_SERVICE_UNAVAILABLE, RequestStatus.ADMISSION_RETRYABLE)
    assert event.decide_by_ms and event.read_at_ms > event.decide_by_ms and entry.read_at_ms == event.read_at_ms
    return event


async def settled_audit(bootstrap: str, topology, processor):
    """The audit once the processor is stopped, so no timer reconcile lands between its reads of the
    ledger and of the table (test_processor.py saw that race)."""
    await wait_until_committed(bootstrap, topology)
    processor.stop()
    report = await audit(bootstrap, topology, concurrency_limit=2)
    assert report.ok, report.render()
    return report


async def assert_one_late_refusal_then_one_message_spent(bootstrap: str, topology, processor, user: str, generation_id: str) -> None:
    """The late submit held nothing; its same-key retry reserved and consumed exactly one message."""
    report = await settled_audit(bootstrap, topology, processor)
    assert (report.consumed, report.released, report.refused_late) == (1, 0, 1)
    state = report.states[user]
    # A consumed reservation leaves the state; its window counts it.
    assert state.reservations == {}
    (window,) = state.windows.values()
    assert (window.used, window.reserved, window.released) == (1, 0, 0)
    assert state.record_of(generation_id).epoch == 1


async def test_the_edge_answers_503_and_the_late_submit_charges_nothing_until_a_same_key_retry_runs(
    kafka_bootstrap, topology, processor_factory, client
):
    user = f"u-{uuid.uuid4().hex[:8]}"
    settings = edge_settings(kafka_bootstrap, topology, decision_timeout_s=EDGE_WAIT_S, decision_skew_margin_ms=SKEW_MARGIN_MS)
    async with serve_edge(settings) as e, e.http() as http:
        # No processor deciding yet (as right after `make up`): the edge fails closed.
        first = await http.post("/v1/generations", json=body("hello"), headers=e.headers(user, "k"))
        typed(first, RejectionCode.QUOTA_SERVICE_UNAVAILABLE)
        p = processor_factory()
        p.start()
        await wait_until_deciding(client)
        (entry,) = await entries_of(kafka_bootstrap, topology, user)
        late = refused_late(entry)
        await wait_until_committed(kafka_bootstrap, topology)
        report = await audit(kafka_bootstrap, topology, concurrency_limit=2)
        assert report.ok, report.render()
        assert (report.consumed, report.released, report.refused_late) == (0, 0, 1)
        state = report.states[user]
        assert state.reservations == {} and state.slots == {} and state.windows == {}
        assert state.requests["k"].status is RequestStatus.ADMISSION_RETRYABLE
        # The client retries the same key: a fresh decision, admitted once, one message spent.
        async with FakeSimWorker(kafka_bootstrap, topology, tokens=["fine"], token_interval_s=0.0):
            retry = await http.post("/v1/generations", json=body("hello"), headers=e.headers(user, "k"))
            assert retry.status_code == 200, retry.text
            assert retry.json()["id"] == late.generation_id and retry.json()["output"] == [{"type": "text", "text": "fine"}]
    await assert_one_late_refusal_then_one_message_spent(kafka_bootstrap, topology, p, user, late.generation_id)


async def test_a_submit_read_after_its_deadline_reserves_nothing_and_a_same_key_retry_is_admitted_once(
    kafka_bootstrap, topology, processor_factory, client
):
    user = f"u-{uuid.uuid4().hex[:8]}"
    command = submit(client, user, "k", decide_by_ms=now_ms() + int(EDGE_WAIT_S * 1000) - SKEW_MARGIN_MS)
    with pytest.raises(DecisionTimeout):
        await client.decide(command, timeout_s=EDGE_WAIT_S)  # no processor runs: the edge's 503
    p = processor_factory()
    p.start()
    await wait_until_deciding(client)
    (entry,) = await entries_of(kafka_bootstrap, topology, user, command.command_id)
    late = refused_late(entry)
    dispatched = [decode_message(r[3]) for r in await read_topic(kafka_bootstrap, topology.dispatch(SIM_POOL, "free"))]
    assert not [d for d in dispatched if isinstance(d, DispatchAuthorized)], "a refused submit was dispatched"
    # The retry (fresh command, fresh deadline) is decided afresh; a second one finds it in progress.
    retry = await client.decide(submit(client, user, "k", decide_by_ms=now_ms() + 10_000))
    assert retry.kind is OutcomeKind.ADMITTED and (retry.generation_id, retry.epoch) == (late.generation_id, 1)
    again = await client.decide(submit(client, user, "k", decide_by_ms=now_ms() + 10_000))
    assert again.code is RejectionCode.GENERATION_IN_PROGRESS and again.generation_id == late.generation_id
    accepted = await client.decide(
        cmd.AcceptAttempt(
            command_id=uuid.uuid4().hex, user_id=user, issued_at_ms=now_ms(), generation_id=retry.generation_id,
            epoch=1, worker_id="w1", reply_to=client.reply_to(),
        )
    )
    assert accepted.kind is OutcomeKind.APPLIED
    await assert_one_late_refusal_then_one_message_spent(kafka_bootstrap, topology, p, user, late.generation_id)


async def test_a_submit_decided_in_time_before_a_crash_is_decided_again_with_its_recorded_stamp(
    kafka_bootstrap, topology, processor_factory, client
):
    """The crash window: a processor read this submit in time, admitted it and sent the admission to
    the ledger, then died before its state was durable. Its successor reads the command again long
    after the deadline; with the stamp read back from the ledger it admits it again, identically
    (a fresh stamp would refuse it under the same event ids: invariant 0)."""
    user = f"u-{uuid.uuid4().hex[:8]}"
    decide_by = now_ms() - 60_000
    command = submit(client, user, "k", decide_by_ms=decide_by)
    # What the first processor decided and wrote, computed with the same pure core and policy.
    first_read = dataclasses.replace(command, read_at_ms=decide_by - 100)
    _, decision, _ = handle(Aggregate.empty(user), first_read, policy_from_env())
    assert decision is not None and decision.outcome.kind is OutcomeKind.ADMITTED
    partition = user_partition(user.encode(), topology.commands.partitions)
    (ledger_record, *_) = route(topology, Aggregate.empty(user).ledger, Aggregate.empty(user).ledger, first_read, decision, partition)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topology.ledger.name, ledger_record.value, key=user.encode(), partition=partition)
        await producer.send_and_wait(topology.commands.name, encode(command), key=user.encode())  # never committed
    finally:
        await producer.stop()
    p = processor_factory()
    p.start()
    await wait_until_deciding(client)
    before, after = await entries_of(kafka_bootstrap, topology, user, command.command_id, count=2)
    assert after.events == before.events and isinstance(after.events[0], ev.GenerationAdmitted)
    assert after.read_at_ms == before.read_at_ms == decide_by - 100
    report = await settled_audit(kafka_bootstrap, topology, p)
    assert report.refused_late == 0 and report.duplicate_events == 1

