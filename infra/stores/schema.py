"""The Cassandra read models' schema, settings and connection, shared by their writers and readers.

Data flow::

    LEDGER --projections.readmodel--> generations_by_id      (status and usage by id, revision = offset)
    worker --infra.stores.results----> results_by_generation  (final text, USING TTL)
    edge GET /v1/generations/{id} <--infra.stores.queries-- both tables

The CQL is created idempotently (``IF NOT EXISTS``) by ``ensure_schema``; the writers call it at
start, so a fresh keyspace needs no separate migration step. Table names come from
``schemas.topics`` and every table's DDL from ``schemas.tables`` (they are schema). Connecting
(``open_session``) runs the driver's blocking ``Cluster.connect`` on a thread, bounded by
``CONNECT_TIMEOUT_S``, so it never blocks the loop; a process opens one session, through
``infra.stores.session.CassandraSession``, and builds every store on it.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from infra.stores.cassandra import execute, named_tuple_rows
from infra.runtime.settings import SettingsError, comma_list, env_var, setting
from schemas.tables import (
    ADDED_GENERATION_COLUMNS,
    generations_ddl,
    history_ddl,
    keyspace_ddl,
    replay_ddl,
    results_ddl,
)
from schemas.topics import GENERATIONS_TABLE, KEYSPACE

CQL_PROTOCOL_VERSION = 5  # Cassandra 4.0+; skips the driver's downgrade round trips
CONNECT_TIMEOUT_S = 30.0  # one attempt to reach a contact point and open a session
DDL_TIMEOUT_S = 60.0  # schema statements wait for agreement, slower than reads
RECONNECT_DELAY_S = 1.0  # the driver retries a down node this often (constant, so a restart is seen fast)
DRIVER_CONNECT_TIMEOUT_S = 5.0  # the driver's own per-connection timeout

# Default retention of the two tables (docs/retention.md). The metadata outlives the content.
RESULT_TTL_S_DEFAULT = 3600  # 1 h, as the processor's Policy.result_ttl_ms
GENERATION_METADATA_TTL_S_DEFAULT = 30 * 24 * 3600  # 30 days: longer than the 24 h dedup retention
READ_DEADLINE_S_DEFAULT = 1.0  # one GET's whole budget against Cassandra

# A failed open of a process's Cassandra session (infra/stores/session.py) is retried no more often than this.
REOPEN_INTERVAL_S_DEFAULT = 5.0

_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,47}$")


async def _add_column(session: Any, keyspace: str, table: str, column: str, kind: str) -> None:
    """``ALTER TABLE ... ADD`` unless the column exists (Cassandra has no ``ADD IF NOT EXISTS`` before 5.0)."""
    from cassandra import InvalidRequest

    try:
        await execute(session, f"ALTER TABLE {keyspace}.{table} ADD {column} {kind}", timeout_s=DDL_TIMEOUT_S)
    except InvalidRequest as exc:
        if "conflicts with an existing column" not in str(exc) and "already exists" not in str(exc):
            raise


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
    # so that more of one generation's events fold into one UPDATE (less Cassandra CPU per
    # generation). It adds as much to the read model's lag; 0 writes what each poll found.
    batch_linger_ms: int = setting("CHATPLANE_READMODEL_BATCH_LINGER_MS", 100, ge=0, le=5_000)
    # A process's one Cassandra session (infra/stores/session.py) opens on first use; after a failed
    # open (or a store's failed schema and statements) the next try waits at least this long, so
    # during an outage every call fails fast instead of each paying a connect.
    reopen_interval_s: float = setting("CHATPLANE_CASSANDRA_REOPEN_INTERVAL_S", REOPEN_INTERVAL_S_DEFAULT, ge=0)

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
    for cql in history_ddl(settings.keyspace):
        await execute(session, cql, timeout_s=DDL_TIMEOUT_S)
