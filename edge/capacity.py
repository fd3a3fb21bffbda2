"""The edge's view of model capacity, from ``WorkerHeartbeat``s on the ``capacity`` topic.

The estimate goes into ``SubmitGeneration.estimated_queue_wait_ms``; the core refuses with
``capacity_exhausted`` above ``Policy.queue_budget_ms``, so the decision stays a pure function of the
command. It estimates how long the new request waits before a worker of its pool starts it, from the
work the pool holds, not from counts alone (the seed: "a short prompt and a hundred-thousand-token
prompt should not count as equal work"; workers/work.py says what each heartbeat reports). Over the
workers whose last heartbeat is fresher than ``heartbeat_stale_ms``:

- no live worker heartbeat for the pool -> ``NO_CAPACITY_WAIT_MS`` (far above any budget), so
  admission refuses with ``capacity_exhausted`` instead of queueing work nobody will accept (the
  worker would decline it at the 15 s queue deadline; refusing up front is the honest answer and is
  retryable with the same key);
- nothing waiting on the pool's dispatch log and a worker with a free slot whose KV room (when it
  reports one) holds this request's prompt plus its expected output -> 0 ms;
- otherwise the request waits for a slot (or KV room) behind the dispatches waiting on the log.
  The sequences holding slots (running, or taken and being prepared) end at about ``holding /
  mean_left_s`` per second, where ``mean_left_s`` is their mean expected output still to decode
  (each one's output budget scaled by the measured share generations use, minus what it produced)
  over the measured per-sequence decode rate, so ``(backlog + 1) * mean_left_s / holding``; to that
  comes the prefill of the prompts being prepared at the measured prefill rate. The last dispatch
  taken off the log had waited
  ``queue_age_ms``: while dispatches wait, the estimate is never below that (a measured queue age
  beats a modelled one);
- a heartbeat from a worker that does not report its work (an older version) -> the count-based
  estimate: ``(queued + 1) / running_sequences * generation_service_ms_estimate``;
- before a worker measured its rates, ``decode_tokens_per_s_estimate`` and
  ``prefill_tokens_per_s_estimate`` stand in (edge settings).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from infra.runtime.kafka_settings import kafka_client_kwargs
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
    def __init__(
        self,
        heartbeat_stale_ms: int,
        generation_service_ms_estimate: int,
        decode_tokens_per_s_estimate: float = 20.0,
        prefill_tokens_per_s_estimate: float = 1_000.0,
    ) -> None:
        self.heartbeat_stale_ms = heartbeat_stale_ms
        self.generation_service_ms_estimate = generation_service_ms_estimate
        self.decode_tokens_per_s_estimate = decode_tokens_per_s_estimate
        self.prefill_tokens_per_s_estimate = prefill_tokens_per_s_estimate
        self._workers: dict[str, _Seen] = {}

    def observe(self, hb: WorkerHeartbeat, received_ms: int | None = None) -> None:
        if hb.worker_id not in self._workers and len(self._workers) >= WORKERS_TRACKED_MAX:
            oldest = min(self._workers, key=lambda w: self._workers[w].received_ms)
            del self._workers[oldest]
        self._workers[hb.worker_id] = _Seen(hb, received_ms if received_ms is not None else _now_ms())

    def estimate_wait_ms(
        self, pool: str, input_tokens: int = 0, output_budget: int = 1, now_ms: int | None = None
    ) -> int:
        """How long a request of ``input_tokens`` and ``output_budget`` would wait in ``pool``."""
        now = now_ms if now_ms is not None else _now_ms()
        live = [
            s.heartbeat
            for s in self._workers.values()
            if s.heartbeat.pool == pool and now - s.received_ms <= self.heartbeat_stale_ms
        ]
        if not live:
            return NO_CAPACITY_WAIT_MS
        if not all(h.reports_work for h in live):
            return self._by_count(live)
        return self._by_work(live, input_tokens, output_budget)

    def _by_count(self, live: list[WorkerHeartbeat]) -> int:
        if any(h.free_slots > 0 for h in live):
            return 0
        running = sum(h.active_sequences for h in live)
        queued = sum(h.queued for h in live)
        return int((queued + 1) / max(1, running) * self.generation_service_ms_estimate)

    def _by_work(self, live: list[WorkerHeartbeat], input_tokens: int, output_budget: int) -> int:
        backlog = sum(h.dispatch_backlog for h in live)
        fill = sum(h.output_fill for h in live) / len(live)
        need = input_tokens + max(1, round(output_budget * fill))  # what this request may hold in KV

        def fits(h: WorkerHeartbeat) -> bool:
            return h.kv_tokens_free < 0 or h.kv_tokens_free >= need

        if backlog == 0 and any(h.free_slots > 0 and fits(h) for h in live):
            return 0
        # The sequences holding slots: running ones, and those taken and being prepared (their slot is
        # theirs already); each ends after its expected output still to decode.
        holding = sum(h.active_sequences + h.queued for h in live)
        if holding == 0 and backlog == 0:
            # Idle, yet no worker has room for it: nothing that ends will make room.
            return NO_CAPACITY_WAIT_MS
        measured_decode = [h.decode_tokens_per_s for h in live if h.decode_tokens_per_s > 0]
        decode = sum(measured_decode) / len(measured_decode) if measured_decode else self.decode_tokens_per_s_estimate
        prefill = sum(h.prefill_tokens_per_s or self.prefill_tokens_per_s_estimate for h in live)
        ahead = backlog + 1  # the dispatches waiting on the log, then this one
        slot_wait_s = 0.0
        if holding > 0:
            left = sum(h.output_tokens_left + h.queued_output_tokens for h in live)
            mean_left_s = left / holding / max(decode, 1e-3)
            slot_wait_s = ahead * mean_left_s / holding
        prefill_ahead_s = sum(h.queued_input_tokens for h in live) / max(prefill, 1e-3)
        wait_ms = (slot_wait_s + prefill_ahead_s) * 1000
        if backlog > 0:
            wait_ms = max(wait_ms, max(h.queue_age_ms for h in live))
        return int(wait_ms)


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
