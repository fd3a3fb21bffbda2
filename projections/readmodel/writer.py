"""The ledger -> Cassandra projection: one row per generation in ``generations_by_id``.

    python -m projections.readmodel        (env: CHATPLANE_KAFKA_BOOTSTRAP, CHATPLANE_NAMESPACE,
                                            CHATPLANE_CASSANDRA_HOSTS/PORT/KEYSPACE; see docs/readmodels.md)

Data flow::

    LEDGER (key user_id, N partitions) --aiokafka consumer group "<ns>.chatplane-readmodel"-->
        fold each LedgerEntry into column updates per generation --> UPDATE ... USING TIMESTAMP <offset>
        --> commit the batch's offsets (only after every write of the batch succeeded)

At-least-once and idempotent. Every generation's events live on one ledger partition (the key is
the user), so the ledger offset orders them totally; it is the row's ``revision``. Each UPDATE is
written ``USING TIMESTAMP <revision>``, so Cassandra's per-cell last-write-wins *is* "the higher
revision wins": replaying the ledger writes the same cells with the same timestamps (same rows), and
a redelivered older entry can never overwrite a cell a newer entry wrote, without the Paxos round
trips an LWT (``IF revision < ?``) costs on every write. An update only names the columns its
events set, so a replayed entry also leaves the other columns alone. The cost of the choice: no
other writer may touch this table with wall-clock timestamps (they would always win), and
recreating the ledger topic (offsets restart at 0) needs a new keyspace or table.

Within one poll, the updates of one generation are merged into one statement at the highest offset
of the batch: every cell it writes holds that column's value as of that offset, which is what a
one-statement-per-entry replay would leave. A bounded memory of recently applied command ids
(``seen_commands_max``, ``CHATPLANE_READMODEL_SEEN_COMMANDS_MAX``) skips the identical entries a redelivering processor re-sends, so a
status does not flicker back during the re-send.

While Cassandra is unreachable the batch is retried with bounded backoff for ``WRITE_RETRY_WINDOW_S``
(below the consumer's max poll interval), with the offsets uncommitted; after that the process
exits non-zero, and the restarted process resumes from the last committed offset. Undecodable
entries go to DEAD_LETTER with their offset and the partition keeps moving.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from infra.stores.cassandra import execute
from infra.runtime.kafka_settings import producer_kwargs
from infra.runtime import memtrace, tracing
from infra.runtime.malloc_tuning import tune_malloc
from infra.runtime.log_limits import install_log_limits
from infra.runtime.metrics_http import metrics_port
from infra.runtime.event_loop import use_event_loop
from infra.runtime.settings import SettingsError, env_value, exit_on_settings_error, kafka_bootstrap
from projections.follower import POLL_TIMEOUT_MS, commit_offsets, follower_consumer, follower_group, run_follower
from projections.readmodel.metrics import readmodel_metrics
from infra.stores.schema import (
    ReadModelSettings,
    close_cluster,
    ensure_schema,
    open_session,
    prepare,
)
from schemas import events as ev
from schemas.tables import GENERATION_COLUMNS
from schemas.codes import RequestStatus
from schemas.topics import GENERATIONS_TABLE, Topology
from schemas.wire import WireError, decode_ledger_entry, encode

log = logging.getLogger("chatplane.readmodel")

READMODEL_GROUP = "chatplane-readmodel"
BATCH_RECORDS_MAX = 2_000  # ledger entries per poll (all partitions together)
WRITES_IN_FLIGHT_MAX = 64  # concurrent UPDATEs against Cassandra
WRITE_TIMEOUT_S = 5.0  # one UPDATE, client side
WRITE_RETRY_BACKOFF_S_MIN = 0.2
WRITE_RETRY_BACKOFF_S_MAX = 2.0
WRITE_RETRY_WINDOW_S = 240.0  # then exit; must stay below follower.MAX_POLL_INTERVAL_MS
DEAD_LETTER_VALUE_BYTES_MAX = 4_096
STATS_LOG_INTERVAL_S = 10.0
READMODEL_METRICS_PORT_ENV = "CHATPLANE_READMODEL_METRICS_PORT"  # Prometheus /metrics; 0: not served

Columns = dict[str, Any]


class ProjectionStalled(RuntimeError):
    """Cassandra stayed unreachable for ``WRITE_RETRY_WINDOW_S``; the process exits to resume from its commit."""


# ------------------------------------------------------------------------------------------------
# the pure fold: one ledger entry -> column updates per generation


def _apply(cols: Columns, e: ev.Event) -> bool:
    """Set the columns event ``e`` determines; False when the event does not concern the read model."""
    if isinstance(e, ev.GenerationAdmitted):
        cols.update(
            user_id=e.user_id,
            status=RequestStatus.QUEUED.value,
            model_alias=e.model_alias,
            model_version=e.model_version,
            pool=e.pool,
            tier=e.tier.value,
            stream=e.stream,
            epoch=e.epoch,
            max_output_tokens=e.max_output_tokens,
            input_tokens=e.input_tokens,
            output_tokens=0,
            window_start_ms=e.window_start_ms,
            window_end_ms=e.window_end_ms,
            created_at_ms=e.occurred_at_ms,
            cancel_requested=False,
        )
    elif isinstance(e, ev.AdmissionRejected):
        cols.update(
            user_id=e.user_id,
            status=e.status.value,
            model_alias=e.model_alias,
            model_version=e.model_version,
            tier=e.tier.value,
            code=e.code.value,
            window_start_ms=e.window_start_ms,
            created_at_ms=e.occurred_at_ms,
        )
    elif isinstance(e, ev.AttemptAccepted):
        cols.update(status=RequestStatus.RUNNING.value, epoch=e.epoch, accepted_at_ms=e.occurred_at_ms)
    elif isinstance(e, ev.CancelRequested):
        cols.update(cancel_requested=True, cancel_reason=e.reason.value)
    elif isinstance(e, ev.GenerationCompleted):
        cols.update(
            status=RequestStatus.COMPLETED.value,
            epoch=e.epoch,
            finish_reason=e.finish_reason,
            result_expires_at_ms=e.result_expires_at_ms,
            finished_at_ms=e.occurred_at_ms,
            partial=False,
            terminal_sequence=e.sequence,
            result_stored=e.result_stored,
        )
    elif isinstance(e, ev.GenerationCancelled):
        cols.update(
            status=RequestStatus.CANCELLED.value,
            cancel_reason=e.reason.value,
            partial=e.partial,
            finished_at_ms=e.occurred_at_ms,
            terminal_sequence=e.sequence,
        )
    elif isinstance(e, ev.GenerationFailed):
        cols.update(
            status=RequestStatus.FAILED.value, code=e.code.value, partial=e.partial, finished_at_ms=e.occurred_at_ms,
            terminal_sequence=e.sequence,
        )
    elif isinstance(e, ev.GenerationReturnedToAdmission):
        cols.update(status=RequestStatus.ADMISSION_RETRYABLE.value, code=e.code.value)
    elif isinstance(e, ev.ConversationTurnCommitted):
        # Committed with the admission (re-admission included): the turn a GET and a replay name.
        cols.update(conversation_id=e.conversation_id, turn_revision=e.revision)
    elif isinstance(e, ev.UsageRecorded):
        cols.update(
            input_tokens=e.input_tokens,
            output_tokens=e.output_tokens,
            usage_epoch=e.epoch,
            terminal_reason=e.terminal_reason,
        )
    else:
        # Reservation, slot, lease, fence and bookkeeping events change nothing a GET shows.
        return False
    cols["updated_at_ms"] = e.occurred_at_ms
    return True


def fold_entry(entry: ev.LedgerEntry) -> dict[str, Columns]:
    """The column updates one ledger entry implies, per generation id, in event order."""
    out: dict[str, Columns] = {}
    for e in entry.events:
        cols = out.get(e.generation_id)
        fresh = cols is None
        if fresh:
            cols = {}
        if _apply(cols, e) and fresh:
            out[e.generation_id] = cols
    return out


@dataclass(slots=True)
class RowUpdate:
    """The merged update of one generation within one batch, to be written at ``revision``."""

    generation_id: str
    partition: int
    revision: int
    columns: Columns


def merge_batch(batch: list[tuple[int, int, ev.LedgerEntry]]) -> list[RowUpdate]:
    """Fold ``(partition, offset, entry)`` records (in offset order per partition) into one update per generation."""
    rows: dict[str, RowUpdate] = {}
    for partition, offset, entry in batch:
        for gid, cols in fold_entry(entry).items():
            row = rows.get(gid)
            if row is None:
                rows[gid] = RowUpdate(gid, partition, offset, dict(cols))
            else:
                assert row.partition == partition, "a generation's events span two ledger partitions"
                row.columns.update(cols)
                row.revision = max(row.revision, offset)
    return list(rows.values())


def update_cql(keyspace: str, columns: tuple[str, ...]) -> str:
    sets = ", ".join(f"{c} = ?" for c in columns)
    return (
        f"UPDATE {keyspace}.{GENERATIONS_TABLE} USING TTL ? AND TIMESTAMP ? "
        f"SET {sets}, ledger_partition = ?, revision = ? WHERE generation_id = ?"
    )


# ------------------------------------------------------------------------------------------------
# the writer (Cassandra side)


class GenerationWriter:
    """Writes ``RowUpdate``s with ``USING TIMESTAMP revision``; one prepared statement per column set."""

    def __init__(self, session: Any, settings: ReadModelSettings) -> None:
        self.session = session
        self.settings = settings
        self._prepared: dict[tuple[str, ...], Any] = {}
        self._limit = asyncio.Semaphore(WRITES_IN_FLIGHT_MAX)

    async def _statement(self, columns: tuple[str, ...]) -> Any:
        stmt = self._prepared.get(columns)
        if stmt is None:
            unknown = set(columns) - set(GENERATION_COLUMNS)
            assert not unknown, f"columns outside the schema: {unknown}"
            stmt = await prepare(self.session, update_cql(self.settings.keyspace, columns))
            self._prepared[columns] = stmt
        return stmt

    async def write(self, row: RowUpdate) -> None:
        columns = tuple(sorted(row.columns))
        stmt = await self._statement(columns)
        params = (
            self.settings.metadata_ttl_s,
            row.revision,
            *(row.columns[c] for c in columns),
            row.partition,
            row.revision,
            row.generation_id,
        )
        async with self._limit:
            await execute(self.session, stmt, params, timeout_s=WRITE_TIMEOUT_S)

    async def write_all(self, rows: list[RowUpdate]) -> None:
        """Every row, concurrently (bounded); raises the first failure after all have settled."""
        results = await asyncio.gather(*(self.write(r) for r in rows), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r


# ------------------------------------------------------------------------------------------------
# the agent (Kafka side)


@dataclass
class ProjectionStats:
    entries: int = 0
    events: int = 0
    rows_written: int = 0
    duplicates_skipped: int = 0
    dead_lettered: int = 0
    write_retries: int = 0
    batches: int = 0
    # ms from a record's Kafka timestamp to the commit of the batch that holds it (last batch).
    last_lag_ms: float = 0.0
    lag_samples_ms: list[float] = field(default_factory=list, repr=False)
    # partition -> the next offset to project (its batch written); the metrics' lag (metrics.py).
    positions: dict[TopicPartition, int] = field(default_factory=dict, repr=False)


class ReadModelProjection:
    """Consume LEDGER, write ``generations_by_id``, commit after the writes. ``run()`` until ``stop()``."""

    def __init__(
        self,
        bootstrap: str,
        topology: Topology,
        settings: ReadModelSettings,
        *,
        group_id: str | None = None,
        keep_lag_samples: bool = False,
    ) -> None:
        self.bootstrap = bootstrap
        self.topology = topology
        self.settings = settings
        self.group_id = group_id or follower_group(topology.namespace, READMODEL_GROUP)
        self.stats = ProjectionStats()
        self.keep_lag_samples = keep_lag_samples
        self._stopping = asyncio.Event()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._cluster: Any = None
        self.writer: GenerationWriter | None = None
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None

    def stop(self) -> None:
        self._stopping.set()

    async def start(self) -> None:
        self._cluster, session = await open_session(self.settings)
        await ensure_schema(session, self.settings)
        self.writer = GenerationWriter(session, self.settings)
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5, **producer_kwargs())
        await self.producer.start()
        self.consumer = follower_consumer(self.bootstrap, (self.topology.ledger.name,), self.group_id, BATCH_RECORDS_MAX)
        await self.consumer.start()

    async def close(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
        if self.producer is not None:
            await self.producer.stop()
        if self._cluster is not None:
            await close_cluster(self._cluster)

    async def run(self) -> None:
        assert self.consumer is not None
        last_log = time.monotonic()
        while not self._stopping.is_set():
            polled = await self.consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=BATCH_RECORDS_MAX)
            polled = await self._linger(polled)
            if polled:
                await self.process(polled)
            if time.monotonic() - last_log > STATS_LOG_INTERVAL_S:
                last_log = time.monotonic()
                log.info("readmodel stats %s", self.stats)

    async def _linger(self, polled: dict[TopicPartition, list[Any]]) -> dict[TopicPartition, list[Any]]:
        """``polled`` plus what arrived within ``batch_linger_ms`` after it (bounded by BATCH_RECORDS_MAX)."""
        assert self.consumer is not None
        found = sum(len(records) for records in polled.values())
        if not found or found >= BATCH_RECORDS_MAX or self.settings.batch_linger_ms <= 0:
            return polled
        merged = {tp: list(records) for tp, records in polled.items()}
        deadline = time.monotonic() + self.settings.batch_linger_ms / 1000
        # Poll until the deadline: one fetch answers at its first new record (fetch_min_bytes=1).
        while found < BATCH_RECORDS_MAX and (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            more = await self.consumer.getmany(timeout_ms=left_ms, max_records=BATCH_RECORDS_MAX - found)
            for tp, records in more.items():
                merged.setdefault(tp, []).extend(records)
                found += len(records)
        return merged

    def _remember(self, command_id: str) -> bool:
        """True the first time a command id is seen (within the bounded memory)."""
        if command_id in self._seen:
            self._seen.move_to_end(command_id)
            return False
        self._seen[command_id] = None
        if len(self._seen) > self.settings.seen_commands_max:
            self._seen.popitem(last=False)
        return True

    async def process(self, polled: dict[TopicPartition, list[Any]]) -> None:
        """Decode, fold, write with bounded retries, then commit: the at-least-once step."""
        assert self.writer is not None and self.consumer is not None
        batch: list[tuple[int, int, ev.LedgerEntry]] = []
        offsets: dict[TopicPartition, int] = {}
        oldest_ts_ms = None
        fresh_ids: list[str] = []
        batch_ids: set[str] = set()
        for tp, records in polled.items():
            for rec in records:
                offsets[tp] = rec.offset + 1
                if oldest_ts_ms is None or rec.timestamp < oldest_ts_ms:
                    oldest_ts_ms = rec.timestamp
                try:
                    if rec.value is None:
                        raise WireError("empty ledger record")
                    entry = decode_ledger_entry(rec.value)
                except WireError as exc:
                    await self._dead_letter(tp.partition, rec.offset, rec.key, rec.value or b"", exc.reason)
                    continue
                self.stats.entries += 1
                self.stats.events += len(entry.events)
                if entry.command_id in self._seen or entry.command_id in batch_ids:
                    self.stats.duplicates_skipped += 1
                    continue
                batch_ids.add(entry.command_id)
                fresh_ids.append(entry.command_id)
                batch.append((tp.partition, rec.offset, entry))
        rows = merge_batch(batch)
        traced, write_from_ns = tracing.parents(polled.values()), tracing.now_ns()
        await self._write_with_retries(rows)
        for parent, partition, offset in traced:  # one span per traced ledger record (tracing.py)
            tracing.record("readmodel.write", parent, write_from_ns, partition=partition, offset=offset, rows=len(rows))
        for cid in fresh_ids:
            self._remember(cid)
        self.stats.rows_written += len(rows)
        self.stats.batches += 1
        # After a rebalance took the partitions, the new owner replays from the last commit (idempotent).
        await commit_offsets(self.consumer, offsets, self.stats.positions, log)
        if oldest_ts_ms is not None:
            self.stats.last_lag_ms = time.time() * 1000 - oldest_ts_ms
            if self.keep_lag_samples:
                self.stats.lag_samples_ms.append(self.stats.last_lag_ms)

    async def _write_with_retries(self, rows: list[RowUpdate]) -> None:
        assert self.writer is not None
        started = time.monotonic()
        backoff_s = WRITE_RETRY_BACKOFF_S_MIN
        while True:
            try:
                await self.writer.write_all(rows)
                return
            except Exception as exc:  # noqa: BLE001 - any driver error: Cassandra is down or overloaded
                self.stats.write_retries += 1
                waited = time.monotonic() - started
                if waited > WRITE_RETRY_WINDOW_S:
                    raise ProjectionStalled(f"Cassandra writes failing for {waited:.0f}s: {exc!r}") from exc
                log.warning("read-model write failed (%s: %s); retrying in %.1fs", type(exc).__name__, exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(WRITE_RETRY_BACKOFF_S_MAX, backoff_s * 2)

    async def _dead_letter(self, partition: int, offset: int, key: bytes | None, value: bytes, reason: str) -> None:
        assert self.producer is not None
        self.stats.dead_lettered += 1
        log.warning("dead-lettered %s[%d]@%d: %s", self.topology.ledger.name, partition, offset, reason)
        record = {
            "type": "DeadLetter",
            "schema_version": 1,
            "source_topic": self.topology.ledger.name,
            "consumer": self.group_id,
            "partition": partition,
            "offset": offset,
            "reason": reason,
            "key_b64": base64.b64encode(key or b"").decode(),
            "value_b64": base64.b64encode(value[:DEAD_LETTER_VALUE_BYTES_MAX]).decode(),
            "value_bytes": len(value),
        }
        await self.producer.send_and_wait(self.topology.dead_letter.name, encode(record), key=key)


async def _main(args: argparse.Namespace, settings: ReadModelSettings) -> int:
    topology = Topology(args.namespace)
    projection = ReadModelProjection(args.bootstrap, topology, settings, group_id=args.group or None)
    return await run_follower(
        projection,
        name="readmodel",
        label="readmodel",
        metrics=readmodel_metrics(topology),  # served on CHATPLANE_READMODEL_METRICS_PORT (docs/metrics.md)
        metrics_port=args.metrics_port,
        stalled=ProjectionStalled,
        started=f"readmodel projecting {topology.ledger.name} into {settings.keyspace}.{GENERATIONS_TABLE} "
        f"(group {projection.group_id})",
        log=log,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m projections.readmodel", description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", default=kafka_bootstrap())
    parser.add_argument("--namespace", default=env_value("CHATPLANE_NAMESPACE", ""))
    parser.add_argument(
        "--group",
        default=env_value("CHATPLANE_READMODEL_GROUP", ""),
        help="consumer group (default <namespace>.chatplane-readmodel); a new group replays the ledger",
    )
    args = parser.parse_args(argv)
    try:
        settings = ReadModelSettings()
        args.metrics_port = metrics_port(READMODEL_METRICS_PORT_ENV)
        tracing.configure("chatplane-readmodel")
        use_event_loop()
    except SettingsError as exc:
        exit_on_settings_error(exc)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    install_log_limits()
    tune_malloc()
    memtrace.maybe_start("readmodel")
    return asyncio.run(_main(args, settings))


if __name__ == "__main__":
    sys.exit(main())
