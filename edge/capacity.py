"""The edge's view of model capacity, from ``WorkerHeartbeat``s on the ``capacity`` topic.

The estimate goes into ``SubmitGeneration.estimated_queue_wait_ms``; the core refuses with
``capacity_exhausted`` above ``Policy.queue_budget_ms``, so the decision stays a pure function of the
command. Estimate for a pool, over the workers whose last heartbeat is fresher than
``heartbeat_stale_ms``:

- a free slot anywhere -> 0 ms;
- otherwise ``(queued + 1) / running_sequences * generation_service_ms_estimate``: the new request
  waits for its turn behind the queue, served at the pool's rate of one sequence per mean service
  time per running sequence;
- no live worker heartbeat for the pool -> ``NO_CAPACITY_WAIT_MS`` (far above any budget), so
  admission refuses with ``capacity_exhausted`` instead of queueing work nobody will accept (the
  worker would decline it at the 15 s queue deadline; refusing up front is the honest answer and is
  retryable with the same key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from projections.shared.kafka_settings import kafka_client_kwargs
from schemas.messages import WorkerHeartbeat
from schemas.topics import Topology
from schemas.wire import WireError, decode_message

log = logging.getLogger("chatplane.edge.capacity")

NO_CAPACITY_WAIT_MS = 3_600_000
WORKERS_TRACKED_MAX = 10_000


@dataclass(slots=True)
class _Seen:
    heartbeat: WorkerHeartbeat
    received_ms: int


class CapacityView:
    def __init__(self, heartbeat_stale_ms: int, generation_service_ms_estimate: int) -> None:
        self.heartbeat_stale_ms = heartbeat_stale_ms
        self.generation_service_ms_estimate = generation_service_ms_estimate
        self._workers: dict[str, _Seen] = {}

    def observe(self, hb: WorkerHeartbeat, received_ms: int | None = None) -> None:
        if hb.worker_id not in self._workers and len(self._workers) >= WORKERS_TRACKED_MAX:
            oldest = min(self._workers, key=lambda w: self._workers[w].received_ms)
            del self._workers[oldest]
        self._workers[hb.worker_id] = _Seen(hb, received_ms if received_ms is not None else _now_ms())

    def estimate_wait_ms(self, pool: str, now_ms: int | None = None) -> int:
        now = now_ms if now_ms is not None else _now_ms()
        live = [
            s.heartbeat
            for s in self._workers.values()
            if s.heartbeat.pool == pool and now - s.received_ms <= self.heartbeat_stale_ms
        ]
        if not live:
            return NO_CAPACITY_WAIT_MS
        if any(h.free_slots > 0 for h in live):
            return 0
        running = sum(h.active_sequences for h in live)
        queued = sum(h.queued for h in live)
        return int((queued + 1) / max(1, running) * self.generation_service_ms_estimate)


class CapacityReader:
    """Reads the capacity topic from one staleness window back (older heartbeats are stale by definition)."""

    def __init__(self, bootstrap: str, topology: Topology, view: CapacityView) -> None:
        self.bootstrap = bootstrap
        self.topology = topology
        self.view = view
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False, auto_offset_reset="latest", group_id=None,
            **kafka_client_kwargs(),
        )
        await self._consumer.start()
        spec = self.topology.capacity
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        self._consumer.assign(tps)
        # Start from the heartbeats of the last staleness window, so a restarted edge knows the pool
        # at once instead of refusing everything until the next heartbeat arrives.
        since = await self._consumer.offsets_for_times({tp: _now_ms() - self.view.heartbeat_stale_ms for tp in tps})
        for tp in tps:
            found = since.get(tp)
            if found is not None:
                self._consumer.seek(tp, found.offset)
            else:
                await self._consumer.seek_to_end(tp)
        self._task = asyncio.create_task(self._read(), name="capacity-reader")

    async def _read(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    try:
                        msg = decode_message(record.value or b"")
                    except WireError as exc:
                        log.warning("undecodable capacity message: %s", exc.reason)
                        continue
                    if isinstance(msg, WorkerHeartbeat):
                        # Age a heartbeat by when it was sent (clamped to now against a fast worker
                        # clock): a replayed old one must not look fresh.
                        self.view.observe(msg, received_ms=min(_now_ms(), msg.sent_at_ms))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()


def _now_ms() -> int:
    return int(time.time() * 1000)
