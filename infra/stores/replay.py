"""The replay store: every text delta of a generation, by sequence, for resumable streams.

Data flow::

    worker: for each delta, BEFORE it is sent to the edge --put--> generation_events USING TTL
    any edge: GET /v1/generations/{id}/events (Last-Event-ID / ?after=N) --read_after--> replay,
              then the same reads, polled, follow the generation live until its terminal event

Write-ahead: a worker sends a delta to its client only after the delta is stored (or its bounded
write failed: then the attempt stops storing, and its replay ends at the last stored delta), so
every sequence a client was sent is stored, on every replica alike, and a replay plus the live
tail has neither a hole nor a repeat at the seam. The terminal event's id is fixed by the
processor when it commits the terminal state (the worker's report names the last sequence it sent;
the terminal event is the next one) and is stored in the read model (``terminal_sequence``).

Rows live the result TTL (``ReadModelSettings.result_ttl_s``): past it a replay is 410
``result_unavailable`` like the result itself. Deleting a conversation deletes its generations'
rows (infra/stores/history.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infra.stores.cassandra import execute
from infra.stores.schema import ReadModelSettings, close_cluster, ensure_schema, open_session, prepare
from schemas.topics import REPLAY_TABLE

REPLAY_WRITE_TIMEOUT_S = 0.5  # one delta's write, client side: past it the worker sends without storing
REPLAY_READ_TIMEOUT_S = 2.0
REPLAY_READ_MAX = 512  # rows per read


@dataclass(frozen=True, slots=True)
class StoredDelta:
    seq: int
    epoch: int
    text: str


class ReplayStore:
    def __init__(self, session: Any, settings: ReadModelSettings, cluster: Any = None) -> None:
        self.session = session
        self.settings = settings
        self._cluster = cluster
        self._insert: Any = None
        self._select: Any = None

    @classmethod
    async def open(
        cls, settings: ReadModelSettings | None = None, *, session: Any = None, create_schema: bool = False
    ) -> ReplayStore:
        """Prepare (and create the schema if asked), on ``session`` (a process's shared one, which stays
        its owner's) or, without one, on a connection of its own that ``close()`` releases."""
        settings = settings or ReadModelSettings()
        cluster = None
        if session is None:
            cluster, session = await open_session(settings)
        store = cls(session, settings, cluster)
        try:
            if create_schema:
                await ensure_schema(session, settings)
            await store.prepare()
        except BaseException:
            await store.close()
            raise
        return store

    async def close(self) -> None:
        if self._cluster is not None:
            await close_cluster(self._cluster)
            self._cluster = None

    async def prepare(self) -> None:
        ks = self.settings.keyspace
        self._insert = await prepare(
            self.session, f"INSERT INTO {ks}.{REPLAY_TABLE} (generation_id, seq, epoch, text) VALUES (?, ?, ?, ?) USING TTL ?"
        )
        self._select = await prepare(
            self.session, f"SELECT seq, epoch, text FROM {ks}.{REPLAY_TABLE} WHERE generation_id = ? AND seq > ? LIMIT ?"
        )

    async def put(self, generation_id: str, epoch: int, seq: int, text: str, *, timeout_s: float = REPLAY_WRITE_TIMEOUT_S) -> None:
        """Store one delta (idempotent: the same key, the same value). Raises on failure or timeout."""
        if self._insert is None:
            await self.prepare()
        params = (generation_id, int(seq), int(epoch), text, self.settings.result_ttl_s)
        await execute(self.session, self._insert, params, timeout_s=timeout_s)

    async def read_after(
        self, generation_id: str, after_seq: int, limit: int = REPLAY_READ_MAX, *, timeout_s: float = REPLAY_READ_TIMEOUT_S
    ) -> Sequence[StoredDelta]:
        """The stored deltas with ``seq > after_seq``, ascending, at most ``limit``."""
        if self._select is None:
            await self.prepare()
        rows = await execute(self.session, self._select, (generation_id, int(after_seq), min(limit, REPLAY_READ_MAX)), timeout_s=timeout_s)
        return [StoredDelta(r.seq, r.epoch, r.text or "") for r in rows]
