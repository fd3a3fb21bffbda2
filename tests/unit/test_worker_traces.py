"""The worker's per-attempt memory is bounded: ``Worker.traces`` keeps at most
``attempt_traces_max`` AttemptTraces (none by default, as in ``python -m workers``), while ``on_trace``
still sees every attempt. No broker: each dispatch is one the control partition already stopped, so
the real ``Worker._handle`` gives it up without any I/O."""

from __future__ import annotations

import time
import uuid

from aiokafka import TopicPartition

from schemas.codes import Tier
from schemas.messages import DispatchAuthorized
from schemas.topics import Topology
from infra.harness.worker_edge import served
from workers.attempt import AttemptTrace, StopReason
from workers.engines.sim import SimConfig, SimulatedEngine
from workers.settings import WorkerSettings
from workers.worker import Worker

ATTEMPTS = 50


def dispatch(generation_id: str) -> DispatchAuthorized:
    now_ms = int(time.time() * 1000)
    return DispatchAuthorized(
        event_id=uuid.uuid4().hex, user_id="u", generation_id=generation_id, epoch=1, model_version=served().version,
        tier=Tier.FREE, max_output_tokens=8, input_tokens=3, authorized_at_ms=now_ms,
        queue_deadline_ms=now_ms + 60_000, stream_to=None,
    )


async def run_attempts(worker: Worker, n: int) -> list[str]:
    """Hand ``n`` dispatches to the worker's attempt handler, each stopped before it was taken."""
    from schemas.wire import encode

    tp = TopicPartition("dispatch", 0)
    gids = []
    for offset in range(n):
        gid = f"gen_{offset}"
        worker._fenced[(gid, 1)] = StopReason.CANCEL
        worker._offsets.begin(tp, offset)
        worker.free_slots -= 1
        worker.preparing += 1
        await worker._handle(tp, offset, encode(dispatch(gid)))
        gids.append(gid)
    return gids


def make_worker(seen: list[AttemptTrace], **over) -> Worker:
    settings = WorkerSettings(kafka_bootstrap="127.0.0.1:1", topology=Topology("unit"), worker_id="w-unit", **over)
    return Worker(settings, SimulatedEngine(SimConfig()), served(), on_trace=seen.append)


async def test_a_production_worker_keeps_no_attempt_trace():
    seen: list[AttemptTrace] = []
    worker = make_worker(seen)  # the default of python -m workers
    await run_attempts(worker, ATTEMPTS)
    assert len(seen) == ATTEMPTS and all(t.declined == "stopped_before_accept" for t in seen)
    assert len(worker.traces) == 0
    assert worker.free_slots == worker.slots and worker.preparing == 0


async def test_a_bounded_worker_keeps_only_the_newest_traces():
    seen: list[AttemptTrace] = []
    worker = make_worker(seen, attempt_traces_max=5)
    gids = await run_attempts(worker, ATTEMPTS)
    assert len(seen) == ATTEMPTS
    assert list(worker.traces) == [(g, 1) for g in gids[-5:]]
    assert worker.traces[(gids[-1], 1)] is seen[-1]
