"""The Cassandra read models' schema, settings and connection, shared by their writers and readers.

Data flow (DESIGN section 5)::

    LEDGER --projections.readmodel--> generations_by_id      (status and usage by id, revision = offset)
    worker --infra.stores.results----> results_by_generation  (final text, USING TTL)
    edge GET /v1/generations/{id} <--infra.stores.queries-- both tables

The CQL is created idempotently (``IF NOT EXISTS``) by ``ensure_schema``; the writers call it at
start, so a fresh keyspace needs no separate migration step. Table names come from
``schemas.topics`` (they are schema). Connecting (``open_session``) runs the driver's blocking
``Cluster.connect`` on a thread, bounded by ``CONNECT_TIMEOUT_S``, so it never blocks the loop.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from infra.stores.cassandra import execute, named_tuple_rows
from infra.runtime.settings import SettingsError, comma_list, env_var, setting
from schemas.topics import GENERATIONS_TABLE, KEYSPACE, REPLAY_TABLE, RESULTS_TABLE

CQL_PROTOCOL_VERSION = 5  # Cassandra 4.0+; skips the driver's downgrade round trips
CONNECT_TIMEOUT_S = 30.0  # one attempt to reach a contact point and open a session
DDL_TIMEOUT_S = 60.0  # schema statements wait for agreement, slower than reads
RECONNECT_DELAY_S = 1.0  # the driver retries a down node this often (constant, so a restart is seen fast)
DRIVER_CONNECT_TIMEOUT_S = 5.0  # the driver's own per-connection timeout

# Default retention of the two tables (docs/retention.md). The metadata outlives the content.
RESULT_TTL_S_DEFAULT = 3600  # 1 h, as the processor's Policy.result_ttl_ms
GENERATION_METADATA_TTL_S_DEFAULT = 30 * 24 * 3600  # 30 days: longer than the 24 h dedup retention
READ_DEADLINE_S_DEFAULT = 1.0  # one GET's whole budget against Cassandra

_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,47}$")

# Every column the projection writes. ``revision`` is the ledger offset the row reflects; cells are
# written USING TIMESTAMP <revision> so last-write-wins resolves by ledger position (readmodel.py).
GENERATION_COLUMNS: dict[str, str] = {
    "user_id": "text",
    "status": "text",
    "model_alias": "text",
    "model_version": "text",
    "pool": "text",
    "tier": "text",
    "stream": "boolean",
    "epoch": "int",
    "max_output_tokens": "int",
    "input_tokens": "int",
    "output_tokens": "int",
    "usage_epoch": "int",
    "terminal_reason": "text",
    "finish_reason": "text",
    "code": "text",
    "partial": "boolean",
    "cancel_requested": "boolean",
    "cancel_reason": "text",
    "window_start_ms": "bigint",
    "window_end_ms": "bigint",
    "created_at_ms": "bigint",
    "accepted_at_ms": "bigint",
    "finished_at_ms": "bigint",
    "updated_at_ms": "bigint",
    "result_expires_at_ms": "bigint",
    "terminal_sequence": "int",  # the terminal event's SSE id (resumable streams; 0/absent: after the last delta)
    "result_stored": "boolean",  # GenerationCompleted.result_stored (False: the worker still held the text)
    # A conversation turn's (ConversationTurnCommitted): its conversation and the revision its user
    # message committed at, so that every edge names the revision the next turn sends (null: stateless,
    # or a row projected before these columns).
    "conversation_id": "text",
    "turn_revision": "int",
    "ledger_partition": "int",
    "revision": "bigint",
}


def generations_ddl(keyspace: str) -> str:
    cols = ",\n    ".join(f"{name} {kind}" for name, kind in GENERATION_COLUMNS.items())
    return (
        f"CREATE TABLE IF NOT EXISTS {keyspace}.{GENERATIONS_TABLE} (\n"
        f"    generation_id text PRIMARY KEY,\n    {cols}\n)"
    )


def results_ddl(keyspace: str) -> str:
    # Keyed by (generation, epoch): a fenced attempt that wrote its text before it learnt it was
    # fenced cannot shadow the text of the epoch that completed; readers ask for that epoch.
    return (
        f"CREATE TABLE IF NOT EXISTS {keyspace}.{RESULTS_TABLE} (\n"
        "    generation_id text,\n    epoch int,\n    text text,\n    input_tokens int,\n"
        "    output_tokens int,\n    stored_at_ms bigint,\n    expires_at_ms bigint,\n"
        "    PRIMARY KEY ((generation_id), epoch)\n"
        ") WITH CLUSTERING ORDER BY (epoch DESC)\n"
        "  AND gc_grace_seconds = 3600"
    )


ADDED_GENERATION_COLUMNS = {
    "terminal_sequence": "int", "result_stored": "boolean", "conversation_id": "text", "turn_revision": "int",
}


async def _add_column(session: Any, keyspace: str, table: str, column: str, kind: str) -> None:
    """``ALTER TABLE ... ADD`` unless the column exists (Cassandra has no ``ADD IF NOT EXISTS`` before 5.0)."""
    from cassandra import InvalidRequest

    try:
        await execute(session, f"ALTER TABLE {keyspace}.{table} ADD {column} {kind}", timeout_s=DDL_TIMEOUT_S)
    except InvalidRequest as exc:
        if "conflicts with an existing column" not in str(exc) and "already exists" not in str(exc):
            raise


def replay_ddl(keyspace: str) -> str:
    # One row per text delta, keyed by the worker's sequence (the SSE event id): a replay reads a
    # range after the client's Last-Event-ID. Rows carry the result TTL (written USING TTL).
    return (
        f"CREATE TABLE IF NOT EXISTS {keyspace}.{REPLAY_TABLE} (\n"
        "    generation_id text,\n    seq int,\n    epoch int,\n    text text,\n"
        "    PRIMARY KEY ((generation_id), seq)\n"
        ") WITH CLUSTERING ORDER BY (seq ASC)\n"
        "  AND gc_grace_seconds = 3600"
    )


def keyspace_ddl(keyspace: str, replication_factor: int) -> str:
    return (
        f"CREATE KEYSPACE IF NOT EXISTS {keyspace} WITH replication = "
        f"{{'class': 'SimpleStrategy', 'replication_factor': {int(replication_factor)}}}"
    )


@dataclass(frozen=True)
class ReadModelSettings:
    """Where the read models live and how long they keep things; every field has a ``CHATPLANE_*`` variable,
    read by the shared loader (``infra.runtime.settings``)."""

    hosts: tuple[str, ...] = setting(
        "CHATPLANE_CASSANDRA_HOSTS", ("127.0.0.1",), parse=comma_list, expected="comma-separated host names"
    )
    port: int = setting("CHATPLANE_CASSANDRA_PORT", 9042, ge=1, le=65_535)
    keyspace: str = setting("CHATPLANE_CASSANDRA_KEYSPACE", KEYSPACE)  # a plain CQL identifier (__post_init__)
    replication_factor: int = setting("CHATPLANE_CASSANDRA_RF", 1, ge=1)
    result_ttl_s: int = setting("CHATPLANE_RESULT_TTL_S", RESULT_TTL_S_DEFAULT, ge=1)
    metadata_ttl_s: int = setting("CHATPLANE_GENERATION_METADATA_TTL_S", GENERATION_METADATA_TTL_S_DEFAULT, ge=1)
    read_deadline_s: float = setting("CHATPLANE_READ_DEADLINE_S", READ_DEADLINE_S_DEFAULT, gt=0)
    # How long after a completion whose worker still held the text (``result_stored`` False) a read
    # without a stored result answers result_pending (503, retry) rather than result_unavailable
    # (410): the worker's later write may still land. Keep it at the worker's
    # CHATPLANE_WORKER_RESULT_PENDING_AGE_MAX_S (600 s), after which the worker gives the text up.
    result_pending_s: float = setting("CHATPLANE_RESULT_PENDING_S", 600.0, ge=0)
    # Command ids the projection remembers to skip a redelivering processor's re-sends (writer.py).
    seen_commands_max: int = setting("CHATPLANE_READMODEL_SEEN_COMMANDS_MAX", 100_000, ge=1)
    # After a poll that found entries, the projection waits this long and polls again before writing,
    # so that more of one generation's events fold into one UPDATE (issue 14: Cassandra's CPU per
    # generation). It adds as much to the read model's lag; 0 writes what each poll found.
    batch_linger_ms: int = setting("CHATPLANE_READMODEL_BATCH_LINGER_MS", 100, ge=0, le=5_000)

    def __post_init__(self) -> None:
        # Also checked for values passed from code: the keyspace is interpolated into CQL.
        if not _IDENT.match(self.keyspace):
            var = env_var(ReadModelSettings, "keyspace")
            raise SettingsError(f"{var}={self.keyspace!r}: expected a plain CQL identifier")
        if self.result_ttl_s <= 0 or self.metadata_ttl_s <= self.result_ttl_s:
            ttl, metadata_ttl = env_var(ReadModelSettings, "result_ttl_s"), env_var(ReadModelSettings, "metadata_ttl_s")
            raise SettingsError(
                f"{ttl}={self.result_ttl_s}, {metadata_ttl}={self.metadata_ttl_s}: "
                "expected 0 < result TTL < metadata TTL (the metadata outlives the content)"
            )


def _connect_blocking(settings: ReadModelSettings) -> tuple[Any, Any]:
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import ConstantReconnectionPolicy, RoundRobinPolicy

    cluster = Cluster(
        contact_points=list(settings.hosts),
        port=settings.port,
        protocol_version=CQL_PROTOCOL_VERSION,
        connect_timeout=DRIVER_CONNECT_TIMEOUT_S,
        reconnection_policy=ConstantReconnectionPolicy(RECONNECT_DELAY_S, max_attempts=None),
        execution_profiles={
            EXEC_PROFILE_DEFAULT: ExecutionProfile(load_balancing_policy=RoundRobinPolicy(), row_factory=named_tuple_rows)
        },
    )
    try:
        return cluster, cluster.connect()
    except BaseException:
        cluster.shutdown()
        raise


async def open_session(settings: ReadModelSettings) -> tuple[Any, Any]:
    """Connect off the loop; returns ``(cluster, session)``. Call ``close_cluster(cluster)`` when done."""
    async with asyncio.timeout(CONNECT_TIMEOUT_S):
        return await asyncio.to_thread(_connect_blocking, settings)


async def close_cluster(cluster: Any) -> None:
    await asyncio.to_thread(cluster.shutdown)


async def prepare(session: Any, cql: str) -> Any:
    """Prepare off the loop (the driver's ``prepare`` blocks); the driver re-prepares after a restart."""
    async with asyncio.timeout(DDL_TIMEOUT_S):
        return await asyncio.to_thread(session.prepare, cql)


async def ensure_schema(session: Any, settings: ReadModelSettings, *, create_keyspace: bool = True) -> None:
    """Create the keyspace (unless told not to) and its tables if missing (the read model's and the
    conversation history's); safe to run any number of times."""
    if create_keyspace:
        await execute(session, keyspace_ddl(settings.keyspace, settings.replication_factor), timeout_s=DDL_TIMEOUT_S)
    await execute(session, generations_ddl(settings.keyspace), timeout_s=DDL_TIMEOUT_S)
    # Columns added after the table was first created (an existing keyspace keeps its table).
    for column, kind in ADDED_GENERATION_COLUMNS.items():
        await _add_column(session, settings.keyspace, GENERATIONS_TABLE, column, kind)
    await execute(session, results_ddl(settings.keyspace), timeout_s=DDL_TIMEOUT_S)
    await execute(session, replay_ddl(settings.keyspace), timeout_s=DDL_TIMEOUT_S)
    # The conversation history's tables live in the same keyspace (infra/stores/history.py).
    from infra.stores.history import history_ddl

    for cql in history_ddl(settings.keyspace):
        await execute(session, cql, timeout_s=DDL_TIMEOUT_S)
