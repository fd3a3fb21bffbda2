"""The result store: a completed generation's final text in Cassandra, kept for a TTL (default 1 h).

Data flow::

    worker (after its last delta, BEFORE ReportAttemptFinished) --put--> results_by_generation USING TTL
    edge GET / same-key retry of a completed request --infra.stores.queries--> get

The worker writes first and reports completion only after ``put`` returned, so every
``GenerationCompleted`` in the ledger has its text stored (until the TTL). Cassandra never returns
an expired cell, so expiry needs no reaper: past the TTL the row is gone and the reader answers
``result_unavailable`` (410), while ``generations_by_id`` (the metadata, a far longer TTL) still
serves status and usage. Inference is never rerun for an expired result.

Rows are keyed ``((generation_id), epoch)``: a fenced attempt that wrote before learning it was
fenced cannot shadow the text of the epoch that completed. This is the only Cassandra table that
holds generated text; nothing here logs it.

``CassandraResultStore`` satisfies the workers' ``ResultSink`` protocol (``async put(generation_id,
epoch, text, usage) -> None``; ``usage`` is an ``(input_tokens, output_tokens)`` pair or anything with
those attributes or keys). ``python -m workers`` wraps it in ``workers.result_sink.CassandraResultSink``
(lazy open, bounded retries, then completion is reported anyway and a retry answers
``result_unavailable``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infra.stores.cassandra import execute
from infra.stores.schema import ReadModelSettings, close_cluster, ensure_schema, open_session, prepare
from schemas.topics import RESULTS_TABLE

RESULT_WRITE_TIMEOUT_S = 5.0  # one put, client side; the worker reports failure if it runs out
RESULT_READ_TIMEOUT_S = 1.0  # one get, client side (the reader bounds the whole GET separately)
RESULT_TEXT_BYTES_MAX = 1 << 20  # 1 MiB of UTF-8: far above 4096 output tokens, far below Cassandra's limits


class ResultTooLarge(ValueError):
    """The text exceeds ``RESULT_TEXT_BYTES_MAX``; nothing was written."""


@dataclass(frozen=True, slots=True)
class StoredResult:
    generation_id: str
    epoch: int
    text: str
    input_tokens: int
    output_tokens: int
    stored_at_ms: int
    expires_at_ms: int


_USAGE_ORDER = ("input_tokens", "output_tokens")


def _usage_field(usage: Any, name: str) -> int:
    if isinstance(usage, Mapping):
        value = usage.get(name)
    elif isinstance(usage, tuple | list):  # the worker's (input_tokens, output_tokens)
        value = usage[_USAGE_ORDER.index(name)]
    else:
        value = getattr(usage, name)
    return int(value or 0)


class CassandraResultStore:
    """``put`` with TTL and ``get`` by generation (optionally by epoch), on an open session."""

    def __init__(self, session: Any, settings: ReadModelSettings, *, ttl_s: int | None = None) -> None:
        self.session = session
        self.settings = settings
        self.ttl_s = int(ttl_s if ttl_s is not None else settings.result_ttl_s)
        if self.ttl_s <= 0:
            raise ValueError("result TTL must be positive")
        self._insert: Any = None
        self._select_latest: Any = None
        self._select_epoch: Any = None
        self._cluster: Any = None

    @classmethod
    async def open(
        cls, settings: ReadModelSettings | None = None, *, session: Any = None, ttl_s: int | None = None
    ) -> CassandraResultStore:
        """Create the schema if missing and prepare, on ``session`` (a process's shared one, which stays
        its owner's) or, without one, on a connection of its own that ``close()`` releases."""
        settings = settings or ReadModelSettings()
        cluster = None
        if session is None:
            cluster, session = await open_session(settings)
        try:
            await ensure_schema(session, settings)
            store = cls(session, settings, ttl_s=ttl_s)
            await store.prepare()
        except BaseException:
            if cluster is not None:
                await close_cluster(cluster)
            raise
        store._cluster = cluster
        return store

    async def close(self) -> None:
        if self._cluster is not None:
            await close_cluster(self._cluster)
            self._cluster = None

    async def prepare(self) -> None:
        ks = self.settings.keyspace
        cols = "generation_id, epoch, text, input_tokens, output_tokens, stored_at_ms, expires_at_ms"
        self._insert = await prepare(
            self.session, f"INSERT INTO {ks}.{RESULTS_TABLE} ({cols}) VALUES (?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        self._select_latest = await prepare(
            self.session, f"SELECT {cols} FROM {ks}.{RESULTS_TABLE} WHERE generation_id = ? LIMIT 1"
        )
        self._select_epoch = await prepare(
            self.session, f"SELECT {cols} FROM {ks}.{RESULTS_TABLE} WHERE generation_id = ? AND epoch = ?"
        )

    async def put(
        self, generation_id: str, epoch: int, text: str, usage: Any, *, timeout_s: float = RESULT_WRITE_TIMEOUT_S
    ) -> None:
        """Store the final text of ``(generation_id, epoch)`` for ``ttl_s``; idempotent (same key, same row).

        Raises the driver's error or ``TimeoutError`` if Cassandra did not confirm within ``timeout_s``
        (the caller decides what then: ``CassandraResultSink`` retries, bounded).
        """
        if self._insert is None:
            await self.prepare()
        if len(text.encode("utf-8")) > RESULT_TEXT_BYTES_MAX:
            raise ResultTooLarge(f"result text over {RESULT_TEXT_BYTES_MAX} bytes")
        now_ms = int(time.time() * 1000)
        params = (
            generation_id,
            int(epoch),
            text,
            _usage_field(usage, "input_tokens"),
            _usage_field(usage, "output_tokens"),
            now_ms,
            now_ms + self.ttl_s * 1000,
            self.ttl_s,
        )
        await execute(self.session, self._insert, params, timeout_s=timeout_s)

    async def get(
        self, generation_id: str, epoch: int | None = None, *, timeout_s: float = RESULT_READ_TIMEOUT_S
    ) -> StoredResult | None:
        """The retained result (of ``epoch``, or the highest epoch stored), or None once expired or never stored."""
        if self._select_latest is None:
            await self.prepare()
        if epoch is None:
            rows = await execute(self.session, self._select_latest, (generation_id,), timeout_s=timeout_s)
        else:
            rows = await execute(self.session, self._select_epoch, (generation_id, int(epoch)), timeout_s=timeout_s)
        if not rows:
            return None
        r = rows[0]
        return StoredResult(
            generation_id=r.generation_id,
            epoch=r.epoch,
            text=r.text or "",
            input_tokens=r.input_tokens or 0,
            output_tokens=r.output_tokens or 0,
            stored_at_ms=r.stored_at_ms or 0,
            expires_at_ms=r.expires_at_ms or 0,
        )
