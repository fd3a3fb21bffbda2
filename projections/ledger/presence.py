"""Edge liveness as the processor sees it: which readers (edge processes) are gone.

Every edge sends ``EdgePresence`` on the ``edge-presence`` topic every ``interval_ms`` (edge/presence.py).
Each processor reads that topic from its end (``PresenceReader``, run by ``PresenceWatch``) into a ``PresenceView``. An edge
is *lost* when nothing was heard from it for its lease: ``max(lease_ms, 3 * its interval)``. The
processor's timer (timer.py) then detaches every generation of its partitions that the lost edge was reading
(``DetachReader``, reason ``edge_lost``); a generation nobody reattaches to within the grace is
cancelled by the core at its deadline, and its worker stops: no work is orphaned when an edge dies.

Judging silence needs a log that flows: while this reader gets no fetch responses (a broker
restart, a stalled event loop) nobody is judged, and once responses come again every edge gets a
whole lease to be heard before it can be judged lost. So an outage of Kafka itself never looks like
the death of every edge. A processor that has just started judges nobody for one lease either.

Times here are this process's monotonic clock at receipt, never the edge's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

from aiokafka import AIOKafkaConsumer, TopicPartition

from infra.runtime.kafka_settings import kafka_client_kwargs
from schemas.messages import EdgePresence
from schemas.topics import Topology
from schemas.wire import WireError, decode_message

log = logging.getLogger("chatplane.processor.presence")

# A lease is at least this many of the edge's own intervals: two presence records may be late.
LEASE_INTERVALS_MIN = 3
# How long the reader waits for records in one poll.
POLL_TIMEOUT_MS = 500
# The log counts as flowing while fetch responses come at most half a lease apart, but never judged on
# a gap tighter than this: an empty long poll alone takes POLL_TIMEOUT_MS, and on a loaded machine the
# next one comes a few hundred ms later. Without the floor a short lease (1.5 s: 750 ms) saw the log
# "stop" at almost every poll, every edge got a fresh lease each time, and a dead edge was never
# judged lost (found by tests/integration/test_fleet.py with CHATPLANE_EDGE_PRESENCE_LEASE_MS=1500).
FLOWING_GAP_MIN_MS = 3 * POLL_TIMEOUT_MS


def monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


class PresenceView:
    """The edges heard from recently (at most ``edges_max``, least recently heard forgotten first)."""

    def __init__(self, lease_ms: int, edges_max: int) -> None:
        self.lease_ms = lease_ms
        self.edges_max = edges_max
        self._heard: OrderedDict[str, tuple[int, int]] = OrderedDict()  # edge_id -> (heard at, lease)
        self._flowing_since: int | None = None
        self._last_response: int | None = None

    def observe(self, presence: EdgePresence, now_ms: int) -> None:
        lease = max(self.lease_ms, LEASE_INTERVALS_MIN * presence.interval_ms)
        self._heard[presence.edge_id] = (now_ms, lease)
        self._heard.move_to_end(presence.edge_id)
        while len(self._heard) > self.edges_max:
            self._heard.popitem(last=False)

    def responded(self, now_ms: int) -> None:
        """The broker answered a fetch of the presence topic (with records or without)."""
        if not self._flowing(now_ms):
            self._flowing_since = now_ms
        self._last_response = now_ms

    def _flowing(self, now_ms: int) -> bool:
        gap_ms = max(self.lease_ms // 2, FLOWING_GAP_MIN_MS)
        return self._last_response is not None and now_ms - self._last_response <= gap_ms

    def lost(self, edge_id: str, now_ms: int) -> bool:
        """Whether ``edge_id`` is gone: unheard for its lease while the log was flowing all along."""
        if not edge_id or not self._flowing(now_ms):
            return False
        assert self._flowing_since is not None
        heard = self._heard.get(edge_id)
        lease = heard[1] if heard is not None else self.lease_ms
        if now_ms - self._flowing_since < lease:
            return False
        return heard is None or now_ms - heard[0] > lease

    def __len__(self) -> int:
        return len(self._heard)


class PresenceReader:
    """Reads the ``edge-presence`` topic from its end into a ``PresenceView`` (no consumer group)."""

    def __init__(self, bootstrap: str, topology: Topology, view: PresenceView) -> None:
        self.bootstrap = bootstrap
        self.topology = topology
        self.view = view

    async def run(self) -> None:
        spec = self.topology.edge_presence
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="latest",
            group_id=None,
            **kafka_client_kwargs(),
        )
        await consumer.start()
        try:
            consumer.assign(tps)
            for tp in tps:
                await consumer.seek_to_end(tp)
            answered: dict[TopicPartition, int | None] = dict.fromkeys(tps)
            while True:
                batches = await consumer.getmany(*tps, timeout_ms=POLL_TIMEOUT_MS)
                now = monotonic_ms()
                for records in batches.values():
                    for record in records:
                        try:
                            message = decode_message(record.value or b"")
                        except WireError as exc:
                            log.warning("undecodable presence record: %s", exc.reason)
                            continue
                        if isinstance(message, EdgePresence):
                            self.view.observe(message, now)
                for tp in tps:
                    # The time of the partition's last fetch response: it moves while the broker
                    # answers, records or not, and stops while it cannot be reached.
                    with contextlib.suppress(AssertionError, KeyError):
                        stamp = consumer.last_poll_timestamp(tp)
                        if stamp is not None and stamp != answered[tp]:
                            answered[tp] = stamp
                            self.view.responded(now)
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()

    async def run_forever(self, restart_pause_s: float) -> None:
        """``run``, started again after an error (the view keeps what it heard; judging waits for the
        log to flow again)."""
        while True:
            try:
                await self.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the watch must outlive a broker outage
                log.warning("edge presence reader failed (%s); restarting in %.1f s", type(exc).__name__, restart_pause_s)
                await asyncio.sleep(restart_pause_s)


# Before the edge presence reader starts again after an error.
PRESENCE_RESTART_PAUSE_S = 1.0


class PresenceWatch:
    """The processor's watch on edge liveness: a ``PresenceView`` and the task that keeps it current.

    The processor runs ``run`` as an app task for its whole life and hands ``view`` to its timer
    (timer.py), which asks it which readers are lost; nothing else of the processor is needed here.
    """

    def __init__(
        self, bootstrap: str, topology: Topology, lease_ms: int, edges_max: int,
        restart_pause_s: float = PRESENCE_RESTART_PAUSE_S,
    ) -> None:
        self.view = PresenceView(lease_ms, edges_max)
        self.bootstrap = bootstrap
        self.topology = topology
        self.restart_pause_s = restart_pause_s

    async def run(self) -> None:
        """The edge presence reader, for the life of the caller (restarted after an error)."""
        reader = PresenceReader(self.bootstrap, self.topology, self.view)
        await reader.run_forever(self.restart_pause_s)
