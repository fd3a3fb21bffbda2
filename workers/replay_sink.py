"""The worker's replay sink: every text delta is stored (``infra.stores.replay``) before it is
sent to the edge, so any edge can replay a generation from durable state (issue 16; docs/edge.md,
"Resumable streams").

    Worker._send_delta --put(generation, epoch, seq, text)--> generation_events   (write-ahead)
                       --TextDelta--> edge inbox                                   (then)

Failure behaviour (bounded, never hangs a stream): the connection opens lazily on the first ``put``,
one open at a time, a failed open retried no more often than ``REPLAY_REOPEN_INTERVAL_S``; one
``put`` waits at most ``REPLAY_WRITE_TIMEOUT_S``. A failed ``put`` returns False and the attempt
stops storing its deltas (``_Attempt.replay_stored``): its client still gets every delta live, and a
replay of it ends at the last delta stored, followed by the terminal event (documented as the one
case where a replay has a gap: the history store was down while the answer streamed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

log = logging.getLogger("chatplane.workers.replay")

REPLAY_REOPEN_INTERVAL_S = 5.0


class ReplaySink(Protocol):
    async def put(self, generation_id: str, epoch: int, seq: int, text: str) -> bool: ...


class NullReplaySink:
    """Stores nothing (a worker built in-process without a store, and ``CHATPLANE_WORKER_RESULT_STORE=none``)."""

    async def put(self, generation_id: str, epoch: int, seq: int, text: str) -> bool:
        return False


class CassandraReplaySink:
    def __init__(self, settings: Any = None, *, reopen_interval_s: float = REPLAY_REOPEN_INTERVAL_S) -> None:
        self.settings = settings
        self.reopen_interval_s = reopen_interval_s
        self.store: Any = None
        self._opened_at = -reopen_interval_s
        self._lock = asyncio.Lock()
        self.stored = 0
        self.failed = 0

    async def _open(self) -> Any:
        if self.store is not None:
            return self.store
        async with self._lock:
            if self.store is None and time.monotonic() - self._opened_at >= self.reopen_interval_s:
                self._opened_at = time.monotonic()
                try:
                    from infra.stores.replay import ReplayStore

                    async with asyncio.timeout(10.0):
                        self.store = await ReplayStore.open(self.settings)
                except Exception as exc:  # noqa: BLE001 - unavailable; the next open waits the interval
                    log.warning("replay store unavailable: %s", type(exc).__name__)
        return self.store

    async def put(self, generation_id: str, epoch: int, seq: int, text: str) -> bool:
        store = await self._open()
        if store is None:
            self.failed += 1
            return False
        try:
            await store.put(generation_id, epoch, seq, text)
        except Exception as exc:  # noqa: BLE001 - any driver error or the timeout: not stored
            self.failed += 1
            log.warning("replay write of %s seq %d failed: %s", generation_id, seq, type(exc).__name__)
            return False
        self.stored += 1
        return True

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
            self.store = None
