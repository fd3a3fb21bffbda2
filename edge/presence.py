"""The edge's liveness lease: ``EdgePresence`` on the ``edge-presence`` topic every
``presence_interval_s``, for as long as the process serves.

Every generation this edge admits names it as its reader (``SubmitGeneration.reader_id`` = the
edge id, new at each start). Admission processors read the presence topic; when an edge falls
silent for its lease (it was killed, or lost the network), they detach the generations it was
reading, and the core cancels those no reader reattaches to within the grace
(projections/ledger/presence.py). Nobody runs a dead edge's disconnect grace, so the fleet does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiokafka import AIOKafkaProducer

from edge.metrics import EdgeMetrics
from schemas.messages import EdgePresence
from schemas.topics import Topology
from schemas.wire import encode

log = logging.getLogger("chatplane.edge.presence")


class PresenceBeacon:
    """Sends this edge's presence every ``interval_s`` on ``producer`` (background task)."""

    def __init__(self, edge_id: str, topology: Topology, interval_s: float, metrics: EdgeMetrics) -> None:
        self.edge_id = edge_id
        self.topology = topology
        self.interval_s = interval_s
        self.metrics = metrics
        self._task: asyncio.Task[None] | None = None

    def start(self, producer: AIOKafkaProducer) -> None:
        self._task = asyncio.create_task(self._beat(producer), name="edge-presence")

    async def _beat(self, producer: AIOKafkaProducer) -> None:
        topic = self.topology.edge_presence.name
        key = self.edge_id.encode()
        interval_ms = int(self.interval_s * 1000)
        while True:
            message = EdgePresence(edge_id=self.edge_id, sent_at_ms=int(time.time() * 1000), interval_ms=interval_ms)
            try:
                # Not awaited to delivery: a slow broker must not stretch the interval; the producer
                # bounds what it buffers, and a beat that fails is counted and the next one follows.
                future = await producer.send(topic, encode(message), key=key)
                future.add_done_callback(self._delivered)
            except Exception as exc:  # noqa: BLE001 - keep beating through a broker outage
                self.metrics.presence_failures.inc()
                log.debug("presence send failed: %s", type(exc).__name__)
            await asyncio.sleep(self.interval_s)

    def _delivered(self, future: asyncio.Future[object]) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.metrics.presence_failures.inc()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
