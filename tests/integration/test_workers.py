"""Workers on the real broker and the real processor (``python -m projections``), with the ``sim`` engine.

Must-show of issue 6: acceptance racing cancel, cancel while running (tokens after the stop, slot
freed after the acknowledgement), kill -9 mid-stream (model_backend_error, partial, no second
attempt, lease fencing), and a late report from a fenced epoch dropped and recorded.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from projections.audit import read_topic
from schemas import events as ev
from schemas.codes import FinishOutcome, RejectionCode, RequestStatus
from schemas import commands as cmd
from schemas.messages import OutcomeKind, WorkerHeartbeat
from schemas.wire import decode_message
from tests.integration.ledger_harness import wait_until_deciding
from tests.integration.workers_harness import (
    TestEdge,
    WorkerProcess,
    ledger_events,
    now_ms,
    served,
    worker_settings,
)
from workers.engines.sim import SimConfig, SimulatedEngine
from workers.worker import MemoryResultSink, Worker

pytestmark = pytest.mark.integration

LEASE_MS = 3000


@pytest.fixture
async def processor(processor_factory, client):
    p = processor_factory(CHATPLANE_LEASE_MS=LEASE_MS, CHATPLANE_RECONCILE_TICK_S=0.2)
    p.start()
    await wait_until_deciding(client)
    return p


@pytest.fixture
async def edge(kafka_bootstrap, topology, processor):
    async with TestEdge(kafka_bootstrap, topology, partition=1) as e:
        yield e


def sim_worker(kafka_bootstrap, topology, sink=None, **sim) -> Worker:
    cfg = SimConfig(**{"ttft_ms": 20, "inter_token_ms": 10, "jitter_ms": 1, "output_tokens": 12, **sim})
    return Worker(worker_settings(kafka_bootstrap, topology), SimulatedEngine(cfg), served("sim"), result_sink=sink)


def user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


async def test_a_generation_streams_from_the_sim_worker_with_usage_heartbeats_and_result(kafka_bootstrap, topology, edge):
    sink = MemoryResultSink()
    async with sim_worker(kafka_bootstrap, topology, sink) as worker:
        u = user()
        gid = await edge.submit(u)
        final = await edge.wait_finalized(gid)
        assert final.status is RequestStatus.COMPLETED and final.code is None
        deltas = edge.deltas[gid]
        assert [d.sequence for d in deltas] == list(range(1, 13)) and {d.epoch for d in deltas} == {1}
        assert edge.text(gid).startswith("sim-token-1 sim-token-2")
        assert final.output_tokens == 12
        assert sink.items[(gid, 1)] == (edge.text(gid), (final.input_tokens, 12))
        trace = worker.traces[(gid, 1)]
        assert trace.accepted and trace.outcome is FinishOutcome.COMPLETED and trace.slot_freed_at is not None
        await asyncio.sleep(0.6)
        beats = [decode_message(r[3]) for r in await read_topic(kafka_bootstrap, topology.capacity)]
        mine = [b for b in beats if isinstance(b, WorkerHeartbeat) and b.worker_id == worker.settings.worker_id]
        assert mine and mine[-1].free_slots == worker.slots and mine[-1].pool == "default"
        assert max(b.tokens_per_s for b in mine) > 0
    accepted = [e for e in await ledger_events(kafka_bootstrap, topology, gid) if isinstance(e, ev.AttemptAccepted)]
    assert len(accepted) == 1
