"""Helpers for the read-model tests: drive generations through the real processor and rebuild the
expected read model from the ledger independently (the real projection process, ``ProjectionProcess``,
is in ``infra.harness.processes``, shared with the benchmarks).

``FakeWorker`` stands in for an inference worker (no model runs here): it accepts the attempt
through the processor, writes a canned result into the real result store, and reports usage, in
the order the real worker must (store first, then report completion).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from projections.ledger.audit import Auditor
from infra.runtime.topic_reader import read_topic
from infra.runtime.command_client import CommandClient
from schemas import events as ev
from schemas.codes import FinishOutcome, Tier
from schemas.commands import AcceptAttempt, ReportAttemptFinished, SubmitGeneration
from schemas.messages import Outcome, OutcomeKind
from schemas.topics import Topology
from schemas.wire import decode_ledger_entry

ROOT = Path(__file__).resolve().parents[2]
PROJECTION_READY_TIMEOUT_S = 60.0
CATCH_UP_TIMEOUT_S = 120.0
CATCH_UP_POLL_S = 0.5
FAKE_FINGERPRINT_HEX = "ab" * 16


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Driven:
    generation_id: str
    user_id: str
    idempotency_key: str
    epoch: int


class FakeWorker:
    """A scripted stand-in for a worker: accept, store the result, report completed."""

    def __init__(self, client: CommandClient, worker_id: str = "fake-worker-1", store: Any = None) -> None:
        self.client = client
        self.worker_id = worker_id
        self.store = store

    async def submit(self, user_id: str, key: str, input_tokens: int = 7, tier: Tier = Tier.PAID) -> Outcome:
        return await self.client.decide(
            SubmitGeneration(
                command_id=f"sub-{uuid.uuid4().hex}",
                user_id=user_id,
                issued_at_ms=now_ms(),
                idempotency_key=key,
                fingerprint=FAKE_FINGERPRINT_HEX,
                model_alias="fast-text-model",
                tier=tier,
                stream=False,
                max_output_tokens=64,
                input_tokens=input_tokens,
                reply_to=self.client.reply_to(),
            )
        )

    async def complete(self, outcome: Outcome, user_id: str, output_tokens: int, input_tokens: int = 7, text: str | None = None) -> None:
        gid = outcome.generation_id or ""
        accepted = await self.client.decide(
            AcceptAttempt(
                command_id=f"acc-{uuid.uuid4().hex}",
                user_id=user_id,
                issued_at_ms=now_ms(),
                generation_id=gid,
                epoch=outcome.epoch,
                worker_id=self.worker_id,
                reply_to=self.client.reply_to(),
            )
        )
        assert accepted.kind in (OutcomeKind.APPLIED, OutcomeKind.EXISTING), accepted
        if self.store is not None and text is not None:
            await self.store.put(gid, outcome.epoch, text, {"input_tokens": input_tokens, "output_tokens": output_tokens})
        finished = await self.client.decide(
            ReportAttemptFinished(
                command_id=f"fin-{uuid.uuid4().hex}",
                user_id=user_id,
                issued_at_ms=now_ms(),
                generation_id=gid,
                epoch=outcome.epoch,
                worker_id=self.worker_id,
                outcome=FinishOutcome.COMPLETED,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                finish_reason="stop",
                reply_to=self.client.reply_to(),
            )
        )
        assert finished.kind in (OutcomeKind.APPLIED, OutcomeKind.EXISTING), finished

    async def run_one(self, user_id: str, key: str, output_tokens: int, text: str | None = None) -> Driven:
        outcome = await self.submit(user_id, key)
        assert outcome.kind is OutcomeKind.ADMITTED, outcome
        await self.complete(outcome, user_id, output_tokens, text=text)
        return Driven(outcome.generation_id or "", user_id, key, outcome.epoch)


@dataclass
class Expected:
    """One generation as the ledger says it should appear in ``generations_by_id``."""

    user_id: str
    status: str
    epoch: int
    model_version: str
    input_tokens: int
    output_tokens: int
    revision: int  # the highest offset of an entry that changed a shown column


_SHOWN = (
    ev.GenerationAdmitted,
    ev.AdmissionRejected,
    ev.AttemptAccepted,
    ev.CancelRequested,
    ev.GenerationCompleted,
    ev.GenerationCancelled,
    ev.GenerationFailed,
    ev.GenerationReturnedToAdmission,
    ev.UsageRecorded,
)


async def expected_from_ledger(bootstrap: str, topology: Topology) -> dict[str, Expected]:
    """Rebuild the read model from the ledger through the core's own ``evolve`` (the auditor), not the projection's fold."""
    records = sorted(await read_topic(bootstrap, topology.ledger), key=lambda r: (r[0], r[1]))
    auditor = Auditor()
    revision: dict[str, int] = {}
    usage: dict[tuple[str, int], ev.UsageRecorded] = {}
    seen_commands: set[str] = set()
    for _partition, offset, _key, value in records:
        entry = decode_ledger_entry(value or b"")
        auditor.feed(entry)
        first = entry.command_id not in seen_commands
        seen_commands.add(entry.command_id)
        for e in entry.events:
            if isinstance(e, _SHOWN) and first:
                revision[e.generation_id] = max(revision.get(e.generation_id, -1), offset)
            if isinstance(e, ev.UsageRecorded):
                usage[(e.generation_id, e.epoch)] = e
    report = auditor.finish()
    assert report.ok, report.render()
    out: dict[str, Expected] = {}
    for user_id, ledger in report.states.items():
        for rec in ledger.requests.values() if isinstance(ledger.requests, dict) else ledger.requests:
            used = [u for (gid, _), u in usage.items() if gid == rec.generation_id]
            out[rec.generation_id] = Expected(
                user_id=user_id,
                status=rec.status.value,
                epoch=rec.epoch,
                model_version=rec.model_version,
                input_tokens=used[-1].input_tokens if used else rec.input_tokens,
                output_tokens=sum(u.output_tokens for u in used),
                revision=revision[rec.generation_id],
            )
    return out


async def read_rows(session: Any, keyspace: str) -> dict[str, Any]:
    from infra.stores.cassandra import execute

    rows = await execute(
        session,
        f"SELECT generation_id, user_id, status, epoch, model_version, input_tokens, output_tokens, revision "
        f"FROM {keyspace}.generations_by_id",
        timeout_s=30,
    )
    return {r.generation_id: r for r in rows}


async def wait_caught_up(session: Any, keyspace: str, expected: dict[str, Expected], timeout_s: float = CATCH_UP_TIMEOUT_S) -> dict[str, Any]:
    """Until every expected generation's row shows the expected revision; returns the rows."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rows = await read_rows(session, keyspace)
        except Exception:  # noqa: BLE001 - Cassandra may still be coming back
            rows = {}
        if rows and all(g in rows and rows[g].revision == x.revision for g, x in expected.items()):
            return rows
        if time.monotonic() > deadline:
            behind = [g for g, x in expected.items() if g not in rows or rows[g].revision != x.revision]
            raise TimeoutError(f"projection not caught up after {timeout_s}s: {len(behind)} rows behind")
        await asyncio.sleep(CATCH_UP_POLL_S)


async def group_caught_up(bootstrap: str, group_id: str, topology: Topology, timeout_s: float = CATCH_UP_TIMEOUT_S) -> None:
    """Until ``group_id`` has committed the ledger's end offsets (taken once, at call time) on every partition."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    spec = topology.ledger
    tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            committed = await admin.list_consumer_group_offsets(group_id)
            behind = [tp for tp in tps if ends[tp] > 0 and (tp not in committed or committed[tp].offset < ends[tp])]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {group_id} behind on {len(behind)} partitions after {timeout_s}s")
            await asyncio.sleep(CATCH_UP_POLL_S)
    finally:
        await admin.close()
