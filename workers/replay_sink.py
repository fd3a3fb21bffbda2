"""The worker's replay sink: every text delta is stored (``infra.stores.replay``) before it is
sent to the edge, so any edge can replay a generation from durable state (docs/edge.md,
"Resumable streams").

    Worker._send_delta --put(generation, epoch, seq, text)--> generation_events   (write-ahead)
                       --TextDelta--> edge inbox                                   (then)

Failure behaviour (bounded, never hangs a stream): the store is built lazily on the first ``put``,
on the worker's one Cassandra session (``infra.stores.session.CassandraSession``, shared with the
result sink): one open at a time, a failed open retried no more often than
``CHATPLANE_CASSANDRA_REOPEN_INTERVAL_S``, a ``put`` waiting at most ``OPEN_WAIT_S`` for an open in
flight; one ``put`` waits at most ``REPLAY_WRITE_TIMEOUT_S``. A failed ``put`` returns False and the
attempt stops storing its deltas (``Attempt.replay_stored``): its client still gets every delta
live, and a replay of it ends at the last delta stored, followed by the terminal event (documented as
the one case where a replay has a gap: the history store was down while the answer streamed).
"""

from __future__ import annotations

import logging
from typing import Protocol

from infra.stores.replay import ReplayStore
from infra.stores.schema import ReadModelSettings
from infra.stores.session import CassandraSession

log = logging.getLogger("chatplane.workers.replay")


class ReplaySink(Protocol):
    async def put(self, generation_id: str, epoch: int, seq: int, text: str) -> bool: ...


class NullReplaySink:
    """Stores nothing (a worker built in-process without a store, and ``CHATPLANE_WORKER_RESULT_STORE=none``)."""

    async def put(self, generation_id: str, epoch: int, seq: int, text: str) -> bool:
        return False


class CassandraReplaySink:
    """Deltas into ``ReplayStore`` on the worker's shared session (``cassandra``), or on a session of
    its own (``settings``; released by ``close``)."""

    def __init__(self, settings: ReadModelSettings | None = None, *, cassandra: CassandraSession | None = None) -> None:
        self._own_session = CassandraSession(settings) if cassandra is None else None
        self._cassandra = cassandra or self._own_session
        self.stored = 0
        self.failed = 0

    async def _open(self) -> ReplayStore | None:
        try:
            return await self._cassandra.store(ReplayStore)
        except Exception:  # noqa: BLE001 - unavailable (logged by the session); the next open waits the interval
            return None

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
        if self._own_session is not None:
            await self._own_session.close()
