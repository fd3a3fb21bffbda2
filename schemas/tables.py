"""Every Cassandra table's DDL: the read models' (generations, results, replay) and the conversation
history's (conversations, the sidebar index, messages, the user-turn spool). Pure strings.

Table names are schema (``schemas.topics``); this module holds the columns and keys. The stores
(``infra.stores.schema.ensure_schema``, ``infra.stores.history.HistoryStore.ensure_schema``) run these
statements; ``python -m infra.k8s.generate`` writes them into ``infra/k8s/base/keyspace.cql``. Every
statement is idempotent (``IF NOT EXISTS``); columns added after a table was first created are listed
in ``ADDED_GENERATION_COLUMNS`` (an existing table gains them by ``ALTER TABLE``).
"""

from __future__ import annotations

from schemas.topics import (
    CONVERSATIONS_BY_USER_TABLE,
    CONVERSATIONS_TABLE,
    GENERATIONS_TABLE,
    MESSAGES_TABLE,
    REPLAY_TABLE,
    RESULTS_TABLE,
    TURN_INPUTS_TABLE,
)

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

# Columns of ``generations_by_id`` added after the table was first created (an existing keyspace keeps its table).
ADDED_GENERATION_COLUMNS = {
    "terminal_sequence": "int", "result_stored": "boolean", "conversation_id": "text", "turn_revision": "int",
}

# The sidebar index moves a row on every turn (a row tombstone each time), and a resurrected index
# row is harmless (the listing skips index rows that disagree with the metadata row), so its
# tombstones need not outlive a repair cycle: purge them after an hour instead of the default 10 days.
INDEX_GC_GRACE_S = 3600


def keyspace_ddl(keyspace: str, replication_factor: int) -> str:
    return (
        f"CREATE KEYSPACE IF NOT EXISTS {keyspace} WITH replication = "
        f"{{'class': 'SimpleStrategy', 'replication_factor': {int(replication_factor)}}}"
    )


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


def conversations_ddl(keyspace: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {keyspace}.{CONVERSATIONS_TABLE} (\n"
        "    conversation_id text PRIMARY KEY,\n    user_id text,\n    title text,\n"
        "    created_at_ms bigint,\n    updated_at_ms bigint,\n    revision bigint,\n    status text,\n"
        "    parked_revision bigint\n"
        ")"
    )


def conversations_by_user_ddl(keyspace: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {keyspace}.{CONVERSATIONS_BY_USER_TABLE} (\n"
        "    user_id text,\n    updated_at_ms bigint,\n    conversation_id text,\n"
        "    PRIMARY KEY ((user_id), updated_at_ms, conversation_id)\n"
        ") WITH CLUSTERING ORDER BY (updated_at_ms DESC, conversation_id DESC)\n"
        f"  AND gc_grace_seconds = {INDEX_GC_GRACE_S}"
    )


def messages_ddl(keyspace: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {keyspace}.{MESSAGES_TABLE} (\n"
        "    conversation_id text,\n    bucket bigint,\n    seq bigint,\n    role text,\n    content text,\n"
        "    status text,\n    generation_id text,\n    created_at_ms bigint,\n    parent_seq bigint,\n"
        "    superseded_by bigint,\n"
        "    PRIMARY KEY ((conversation_id, bucket), seq)\n"
        ") WITH CLUSTERING ORDER BY (seq ASC)"
    )


def turn_inputs_ddl(keyspace: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {keyspace}.{TURN_INPUTS_TABLE} (\n"
        "    generation_id text PRIMARY KEY,\n    conversation_id text,\n    content text,\n"
        "    created_at_ms bigint\n"
        ")"
    )


def history_ddl(keyspace: str) -> list[str]:
    """The history tables, plus ``results_by_generation`` and ``generation_events`` (the read model's
    DDL), which ``HistoryStore.delete_conversation`` deletes from."""
    return [
        conversations_ddl(keyspace),
        conversations_by_user_ddl(keyspace),
        messages_ddl(keyspace),
        turn_inputs_ddl(keyspace),
        results_ddl(keyspace),
        replay_ddl(keyspace),
    ]
