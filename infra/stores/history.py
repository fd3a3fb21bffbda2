"""The conversation history store: messages, conversation metadata, the sidebar index and the user-turn
spool, in Cassandra (docs/conversations.md, Storage).

Data flow::

    edge POST (new conversation) --put_conversation--> conversations            (status null: unconfirmed)
    edge POST (a turn, BEFORE it submits the turn) --put_turn_input--> turn_inputs   (USING TTL 7 days)
    worker --get_turn_input / read_before (context)--> turn_inputs, messages
    worker / ledger follower --write_message, set_message_status, mark_superseded--> messages
    ledger follower, in ledger order per user --confirm_conversation, set_revision, set_parked,
        mark_deleted, delete_conversation--> conversations, conversations_by_user (and the rest on delete)
    edge GET --get_conversation, list_conversations, read_after, read_before--> the same tables

The per-user ledger in Kafka is the authority for a conversation's existence, revision and deletion;
these tables hold only what the ledger never carries (text, titles) and copies of what it decided
(revision, status) so that reads need no ledger. Nothing here logs, and no error string carries, any
message text or title.

Bucket size. ``messages`` is partitioned by ``(conversation_id, bucket)`` with ``bucket = seq //
MESSAGES_PER_BUCKET``, so a long conversation spreads over many partitions and a read of the newest
``n`` messages touches ``ceil(n / MESSAGES_PER_BUCKET) + 1`` partitions at most, whatever the
conversation's length. A message holds at most ``MESSAGE_CONTENT_CHARS_MAX`` (256 Ki) characters,
i.e. at most 1 MiB of UTF-8 (4 bytes a character, ``write_message`` refuses more). With 64 messages a
bucket the worst partition is 64 MiB of text even if every message is that large in 4-byte
characters (16 MiB in ASCII), under Cassandra's ~100 MB partition guidance; the typical partition
(1-2 KB a message) is 64-128 KB. 256 a bucket would allow a 256 MiB worst case; 16 would make a
typical context read (tens to a few hundred messages) cost many more partition reads.

Consistency. Every statement runs at LOCAL_QUORUM (``HISTORY_CONSISTENCY``), writes and reads, so a
read sees every acknowledged write (W + R > RF): the worker reading a turn the edge just spooled, the
edge reading a message the worker just wrote. On the single-node development cluster (RF 1) it is
the same as ONE. (The read-model stores run at the driver's default, LOCAL_ONE, which suffices for
their single writer and retried readers.)

Bounds. Every statement is bounded by ``timeout_s`` (client side; the driver is told the same); the
multi-statement reads (``read_after``, ``read_before``, ``list_conversations``) are bounded as a whole
by ``timeout_s`` too. Every Cassandra failure or timeout surfaces as ``HistoryUnavailable`` (its cause
chained), which callers map to HTTP 503 ``history_unavailable``; argument errors (an invalid cursor, a
limit out of range, an oversized message) raise ``ValueError`` before anything is sent.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from cassandra import ConsistencyLevel
from cassandra.query import UNSET_VALUE, BatchStatement, BatchType

from infra.stores.cassandra import execute
from infra.stores.schema import DDL_TIMEOUT_S, ReadModelSettings, close_cluster, open_session, prepare
# Table names and DDL are schema (schemas.topics, schemas.tables).
from schemas.tables import history_ddl, keyspace_ddl
from schemas.topics import (
    CONVERSATIONS_BY_USER_TABLE,
    CONVERSATIONS_TABLE,
    MESSAGES_TABLE,
    REPLAY_TABLE,
    RESULTS_TABLE,
    TURN_INPUTS_TABLE,
)

# Partitioning of ``messages`` (the module docstring has the arithmetic).
MESSAGES_PER_BUCKET = 64
MESSAGE_CONTENT_CHARS_MAX = 256 * 1024  # one message's text, in characters (the request body bound)
UTF8_BYTES_PER_CHAR_MAX = 4
PARTITION_BYTES_GUIDANCE = 100 * 1000 * 1000  # Cassandra's rule of thumb for one partition
MESSAGES_PARTITION_BYTES_WORST = MESSAGES_PER_BUCKET * MESSAGE_CONTENT_CHARS_MAX * UTF8_BYTES_PER_CHAR_MAX
assert MESSAGES_PARTITION_BYTES_WORST < PARTITION_BYTES_GUIDANCE, "a messages bucket could outgrow a partition"

TURN_INPUT_TTL_S = 7 * 24 * 3600  # the spooled text of a user turn; far longer than any turn takes to commit

HISTORY_STATEMENT_TIMEOUT_S = 2.0  # default bound on one statement, and on one multi-statement read
CONVERSATIONS_PAGE_MAX = 200  # list_conversations' limit
MESSAGES_READ_MAX = 256  # read_after / read_before's limit; callers page on with the last seq
CONCURRENT_STATEMENTS_MAX = 32  # statements in flight for one call (a list page's metadata, a delete's rows)
CURSOR_CHARS_MAX = 512  # a list cursor longer than this is invalid
BIGINT_MAX = 2**63 - 1  # Cassandra's bigint: a larger value cannot be bound, so it is refused before a query
# delete_conversation also clears the bucket of ``revision + 1``: the answer of a generation still in
# flight when the ledger deleted the conversation may have been written there (one generation at a
# time per conversation, so one seq past the committed revision at most).
DELETE_TAIL_SEQS = 1

HISTORY_CONSISTENCY = ConsistencyLevel.LOCAL_QUORUM

ROLES = ("user", "assistant")
MESSAGE_STATUSES = ("completed", "incomplete")
CONVERSATION_ACTIVE = "active"
CONVERSATION_DELETED = "deleted"


class HistoryUnavailable(RuntimeError):
    """Cassandra failed or did not answer in time (the cause is chained); callers answer 503
    ``history_unavailable``. The message names the operation and the error type, never content."""


@dataclass(slots=True)
class BucketBudget:
    """How many ``messages`` partitions one caller (one HTTP read, one poll) may still query.

    ``read_after`` and ``read_before`` spend one unit per bucket query and stop, returning what they
    found so far, when none is left; ``ran_out`` then says the result may be short although more
    rows exist. It bounds the work of any one request whatever its cursor, instead of the store's
    time bound turning a request that can never succeed into a retryable timeout.
    """

    buckets_left: int
    ran_out: bool = False

    def take(self) -> bool:
        """One bucket query's worth; False (and ``ran_out``) when the budget is spent."""
        if self.buckets_left <= 0:
            self.ran_out = True
            return False
        self.buckets_left -= 1
        return True


class MessageTooLarge(ValueError):
    """A message or spooled turn over ``MESSAGE_CONTENT_CHARS_MAX`` characters; nothing was written."""


def bucket_of(seq: int) -> int:
    """The ``messages`` partition bucket of a message seq."""
    return seq // MESSAGES_PER_BUCKET


@dataclass(frozen=True, slots=True)
class StoredMessage:
    conversation_id: str
    seq: int  # == the conversation revision this message committed at (1, 2, 3, ...)
    role: str  # "user" | "assistant"
    content: str  # "" allowed (an answer cancelled before any text)
    status: str | None  # "completed" | "incomplete"; user turns "completed"; None = not yet set
    generation_id: str
    created_at_ms: int
    parent_seq: int = 0  # for an assistant message: the seq of the user turn it answers
    superseded_by: int | None = None  # set when a regenerated answer replaced this one in the active branch


@dataclass(frozen=True, slots=True)
class ConversationRow:
    conversation_id: str
    user_id: str
    title: str | None
    created_at_ms: int
    updated_at_ms: int
    revision: int
    status: str | None  # None = written by the edge, not yet confirmed by the ledger; "active"; "deleted"
    parked_revision: int | None  # set while the ledger has parked the conversation; None otherwise


# ------------------------------------------------------------------------------------------------
# list cursors


def encode_cursor(updated_at_ms: int, conversation_id: str) -> str:
    """An opaque page cursor: base64url (unpadded) of the JSON ``[updated_at_ms, conversation_id]``."""
    raw = json.dumps([int(updated_at_ms), conversation_id], separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, str]:
    """The ``(updated_at_ms, conversation_id)`` of ``encode_cursor``; ``ValueError`` for anything else."""
    if not isinstance(cursor, str) or not cursor or len(cursor) > CURSOR_CHARS_MAX:
        raise ValueError("invalid cursor")
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
        value = json.loads(raw.decode("utf-8"))
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError("invalid cursor") from exc
    if (
        not isinstance(value, list)
        or len(value) != 2
        or type(value[0]) is not int
        or value[0] < 0
        or value[0] > BIGINT_MAX
        or not isinstance(value[1], str)
        or not value[1]
    ):
        raise ValueError("invalid cursor")
    return value[0], value[1]


# ------------------------------------------------------------------------------------------------
# the store


@dataclass(frozen=True, slots=True)
class _Statements:
    conv_insert: Any
    conv_confirm: Any
    conv_select: Any
    conv_set_revision: Any
    conv_set_parked: Any
    conv_set_status: Any
    conv_delete: Any
    index_insert: Any
    index_delete: Any
    index_first: Any
    index_after: Any
    turn_insert: Any
    turn_select: Any
    turn_delete: Any
    msg_insert: Any
    msg_set_status: Any
    msg_set_superseded: Any
    msg_after: Any
    msg_before: Any
    msg_generation_ids: Any
    msg_delete_bucket: Any
    result_delete: Any
    replay_delete: Any


_CONVERSATION_COLUMNS = (
    "conversation_id, user_id, title, created_at_ms, updated_at_ms, revision, status, parked_revision"
)
_MESSAGE_COLUMNS = (
    "conversation_id, seq, role, content, status, generation_id, created_at_ms, parent_seq, superseded_by"
)


def _statement_cql(ks: str) -> dict[str, str]:
    conv, index, msgs, turns = (
        f"{ks}.{CONVERSATIONS_TABLE}",
        f"{ks}.{CONVERSATIONS_BY_USER_TABLE}",
        f"{ks}.{MESSAGES_TABLE}",
        f"{ks}.{TURN_INPUTS_TABLE}",
    )
    msg_key = "conversation_id = ? AND bucket = ? AND seq = ?"
    return {
        "conv_insert": f"INSERT INTO {conv} (conversation_id, user_id, title, created_at_ms) VALUES (?, ?, ?, ?)",
        "conv_confirm": f"UPDATE {conv} SET user_id = ?, created_at_ms = ?, status = ? WHERE conversation_id = ?",
        "conv_select": f"SELECT {_CONVERSATION_COLUMNS} FROM {conv} WHERE conversation_id = ?",
        "conv_set_revision": f"UPDATE {conv} SET revision = ?, updated_at_ms = ? WHERE conversation_id = ?",
        "conv_set_parked": f"UPDATE {conv} SET parked_revision = ? WHERE conversation_id = ?",
        "conv_set_status": f"UPDATE {conv} SET status = ? WHERE conversation_id = ?",
        "conv_delete": f"DELETE FROM {conv} WHERE conversation_id = ?",
        "index_insert": f"INSERT INTO {index} (user_id, updated_at_ms, conversation_id) VALUES (?, ?, ?)",
        "index_delete": f"DELETE FROM {index} WHERE user_id = ? AND updated_at_ms = ? AND conversation_id = ?",
        "index_first": f"SELECT updated_at_ms, conversation_id FROM {index} WHERE user_id = ? LIMIT ?",
        "index_after": (
            f"SELECT updated_at_ms, conversation_id FROM {index} "
            "WHERE user_id = ? AND (updated_at_ms, conversation_id) < (?, ?) LIMIT ?"
        ),
        "turn_insert": (
            f"INSERT INTO {turns} (generation_id, conversation_id, content, created_at_ms) VALUES (?, ?, ?, ?) "
            "USING TTL ?"
        ),
        "turn_select": f"SELECT conversation_id, content FROM {turns} WHERE generation_id = ?",
        "turn_delete": f"DELETE FROM {turns} WHERE generation_id = ?",
        "msg_insert": (
            f"INSERT INTO {msgs} (conversation_id, bucket, seq, role, content, status, generation_id, "
            "created_at_ms, parent_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        ),
        "msg_set_status": f"UPDATE {msgs} SET status = ? WHERE {msg_key}",
        "msg_set_superseded": f"UPDATE {msgs} SET superseded_by = ? WHERE {msg_key}",
        "msg_after": (
            f"SELECT {_MESSAGE_COLUMNS} FROM {msgs} "
            "WHERE conversation_id = ? AND bucket = ? AND seq > ? AND seq <= ? LIMIT ?"
        ),
        "msg_before": (
            f"SELECT {_MESSAGE_COLUMNS} FROM {msgs} "
            "WHERE conversation_id = ? AND bucket = ? AND seq < ? ORDER BY seq DESC LIMIT ?"
        ),
        "msg_generation_ids": f"SELECT generation_id FROM {msgs} WHERE conversation_id = ? AND bucket = ?",
        "msg_delete_bucket": f"DELETE FROM {msgs} WHERE conversation_id = ? AND bucket = ?",
        "result_delete": f"DELETE FROM {ks}.{RESULTS_TABLE} WHERE generation_id = ?",
        "replay_delete": f"DELETE FROM {ks}.{REPLAY_TABLE} WHERE generation_id = ?",
    }


def _unavailable(op: str, exc: BaseException) -> HistoryUnavailable:
    # The type only: a driver message may quote the statement, and this string reaches logs.
    return HistoryUnavailable(f"history store: {op} failed ({type(exc).__name__})")


def _message(conversation_id: str, row: Any) -> StoredMessage | None:
    # A row without a role was never written by write_message: a status or supersede update that
    # landed first (an UPDATE creates the row). It is not a message yet; readers skip it.
    if row.role is None:
        return None
    return StoredMessage(
        conversation_id=conversation_id,
        seq=row.seq,
        role=row.role,
        content=row.content or "",
        status=row.status,
        generation_id=row.generation_id or "",
        created_at_ms=row.created_at_ms or 0,
        parent_seq=row.parent_seq or 0,
        superseded_by=row.superseded_by,
    )


def _conversation(row: Any) -> ConversationRow | None:
    # A row without an owner was created by an update alone (set_parked or mark_deleted before
    # put/confirm): no conversation to show.
    if row is None or row.user_id is None:
        return None
    created = row.created_at_ms or 0
    return ConversationRow(
        conversation_id=row.conversation_id,
        user_id=row.user_id,
        title=row.title,
        created_at_ms=created,
        # put_conversation writes neither column (so that a repeated put cannot roll back a
        # confirmed revision): absent, they read as revision 0, updated at creation.
        updated_at_ms=row.updated_at_ms if row.updated_at_ms is not None else created,
        revision=row.revision or 0,
        status=row.status,
        parked_revision=row.parked_revision,
    )


def _check_limit(limit: int, maximum: int) -> int:
    if type(limit) is not int or not 1 <= limit <= maximum:
        raise ValueError(f"limit must be an integer in [1, {maximum}]")
    return limit


def _check_content(content: str) -> None:
    if len(content) > MESSAGE_CONTENT_CHARS_MAX:
        raise MessageTooLarge(f"content over {MESSAGE_CONTENT_CHARS_MAX} characters")


class HistoryStore:
    """The history tables on one open session; every method is a coroutine bounded by ``timeout_s``.

    Statements are prepared once, on first use (or by ``open``), at ``HISTORY_CONSISTENCY``.
    """

    def __init__(
        self, session: Any, settings: ReadModelSettings, *, timeout_s: float = HISTORY_STATEMENT_TIMEOUT_S
    ) -> None:
        if not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        self.session = session
        self.settings = settings
        self.timeout_s = float(timeout_s)
        self._statements: _Statements | None = None
        self._prepare_lock = asyncio.Lock()
        self._cluster: Any = None
        # ``messages`` partition queries made by read_after / read_before since open: how tests and
        # benchmarks see the work a read did (its bucket count, not its wall-clock time).
        self.bucket_reads_total = 0

    @classmethod
    async def open(
        cls,
        settings: ReadModelSettings | None = None,
        *,
        session: Any = None,
        timeout_s: float = HISTORY_STATEMENT_TIMEOUT_S,
    ) -> HistoryStore:
        """Create the schema if missing and prepare, on ``session`` (a process's shared one, which
        stays its owner's: ``infra.stores.session.CassandraSession``) or, without one, on a cluster and
        session of its own that ``close()`` releases.

        Raises ``HistoryUnavailable`` when Cassandra cannot be reached (bounded by the connect timeout).
        """
        settings = settings or ReadModelSettings()
        cluster = None
        if session is None:
            try:
                cluster, session = await open_session(settings)
            except Exception as exc:  # noqa: BLE001 - any failure to connect is unavailability
                raise _unavailable("connect", exc) from exc
        try:
            store = cls(session, settings, timeout_s=timeout_s)
            await store.ensure_schema()
            await store._prepared()
        except BaseException:
            if cluster is not None:
                await close_cluster(cluster)
            raise
        store._cluster = cluster
        return store

    async def close(self) -> None:
        """Shut the cluster down if ``open`` made it (a session passed in belongs to its caller)."""
        if self._cluster is not None:
            cluster, self._cluster = self._cluster, None
            await close_cluster(cluster)

    async def ensure_schema(self) -> None:
        """Create the keyspace (as the read model's ``ensure_schema`` does) and the tables if missing."""
        ks = self.settings.keyspace
        for cql in [keyspace_ddl(ks, self.settings.replication_factor), *history_ddl(ks)]:
            await self._run("ensure_schema", cql, None, timeout_s=DDL_TIMEOUT_S)

    # -- plumbing ----------------------------------------------------------------------------------

    async def _prepared(self) -> _Statements:
        if self._statements is None:
            async with self._prepare_lock:
                if self._statements is None:
                    prepared: dict[str, Any] = {}
                    for name, cql in _statement_cql(self.settings.keyspace).items():
                        try:
                            stmt = await prepare(self.session, cql)
                        except Exception as exc:  # noqa: BLE001
                            raise _unavailable("prepare", exc) from exc
                        stmt.consistency_level = HISTORY_CONSISTENCY
                        prepared[name] = stmt
                    self._statements = _Statements(**prepared)
        return self._statements

    async def _run(self, op: str, statement: Any, params: Any, *, timeout_s: float | None = None) -> list:
        """One statement, bounded; any failure (driver error, timeout) becomes ``HistoryUnavailable``."""
        try:
            return await execute(self.session, statement, params, timeout_s=timeout_s or self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - every Cassandra failure is unavailability to callers
            raise _unavailable(op, exc) from exc

    async def _run_all(self, op: str, calls: Sequence[tuple[Any, Any]]) -> list[list]:
        """Several statements, at most ``CONCURRENT_STATEMENTS_MAX`` in flight; all finish (each bounded)
        before the first failure is raised, so none is left running behind the caller."""
        gate = asyncio.Semaphore(CONCURRENT_STATEMENTS_MAX)

        async def one(statement: Any, params: Any) -> list:
            async with gate:
                return await self._run(op, statement, params)

        results = await asyncio.gather(*(one(s, p) for s, p in calls), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]

    @contextlib.asynccontextmanager
    async def _whole_call(self, op: str) -> AsyncIterator[None]:
        """Bounds a multi-statement call as a whole by ``timeout_s``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                yield
        except TimeoutError as exc:
            raise _unavailable(op, exc) from exc

    # -- conversations -----------------------------------------------------------------------------

    async def put_conversation(self, conversation_id: str, user_id: str, title: str | None, created_at_ms: int) -> None:
        """The edge's row for a new conversation, before the ledger confirms it: ``status`` stays null.

        Writes only what never changes (owner, title, creation time); ``revision`` and
        ``updated_at_ms`` stay absent and read as 0 and ``created_at_ms``, so a repeated put after
        the ledger moved the conversation on cannot roll it back.
        """
        st = await self._prepared()
        params = (conversation_id, user_id, UNSET_VALUE if title is None else title, int(created_at_ms))
        await self._run("put_conversation", st.conv_insert, params)

    async def confirm_conversation(self, conversation_id: str, user_id: str, created_at_ms: int) -> None:
        """The ledger created it: ``status='active'`` and its sidebar row at ``created_at_ms``. Idempotent.

        A replay after ``set_revision`` re-inserts the creation-time index row; ``list_conversations``
        skips index rows whose time disagrees with the metadata row, so it shows no duplicate.
        """
        st = await self._prepared()
        await self._run(
            "confirm_conversation",
            st.conv_confirm,
            (user_id, int(created_at_ms), CONVERSATION_ACTIVE, conversation_id),
        )
        await self._run("confirm_conversation", st.index_insert, (user_id, int(created_at_ms), conversation_id))

    async def get_conversation(self, conversation_id: str) -> ConversationRow | None:
        """The metadata row (any status, deleted included), or None if there is none."""
        st = await self._prepared()
        rows = await self._run("get_conversation", st.conv_select, (conversation_id,))
        return _conversation(rows[0]) if rows else None

    async def set_revision(
        self, conversation_id: str, user_id: str, revision: int, updated_at_ms: int, previous_updated_at_ms: int
    ) -> None:
        """The ledger committed ``revision`` at ``updated_at_ms``: update the metadata row and move the
        sidebar row from ``previous_updated_at_ms`` to ``updated_at_ms``.

        Called in ledger order per user, so plain (last-write-wins) writes suffice. The index move is
        one single-partition batch, so it is atomic: the old and new rows never both show.
        """
        st = await self._prepared()
        await self._run(
            "set_revision", st.conv_set_revision, (int(revision), int(updated_at_ms), conversation_id)
        )
        batch = BatchStatement(batch_type=BatchType.UNLOGGED, consistency_level=HISTORY_CONSISTENCY)
        # A delete and an insert of the same key in one batch share a timestamp, and the tombstone
        # would win: when the time did not change there is nothing to delete.
        if int(previous_updated_at_ms) != int(updated_at_ms):
            batch.add(st.index_delete, (user_id, int(previous_updated_at_ms), conversation_id))
        batch.add(st.index_insert, (user_id, int(updated_at_ms), conversation_id))
        await self._run("set_revision", batch, None)

    async def set_parked(self, conversation_id: str, parked_revision: int | None) -> None:
        """Record (or, with None, clear) the revision at which the ledger parked the conversation."""
        st = await self._prepared()
        value = None if parked_revision is None else int(parked_revision)
        await self._run("set_parked", st.conv_set_parked, (value, conversation_id))

    async def mark_deleted(self, conversation_id: str) -> None:
        """``status='deleted'``: reads answer 404 at once, before ``delete_conversation`` removes the rows."""
        st = await self._prepared()
        await self._run("mark_deleted", st.conv_set_status, (CONVERSATION_DELETED, conversation_id))

    async def list_conversations(
        self, user_id: str, limit: int, cursor: str | None
    ) -> tuple[list[ConversationRow], str | None]:
        """One page of the user's active conversations, most recently updated first.

        Reads ``limit`` index rows after ``cursor`` (at most ``CONVERSATIONS_PAGE_MAX``), then their
        metadata rows (at most ``CONCURRENT_STATEMENTS_MAX`` reads in flight), and keeps those that
        are active, owned by ``user_id`` and updated at the index row's time (a stale index row, left
        by a replayed confirm or a repeated move, is skipped). A page may therefore hold fewer than
        ``limit`` rows while more follow. The next cursor, or None at the end, encodes the last
        index row read. ``ValueError`` for a limit out of range or an invalid cursor.
        """
        _check_limit(limit, CONVERSATIONS_PAGE_MAX)
        after = decode_cursor(cursor) if cursor is not None else None
        st = await self._prepared()
        async with self._whole_call("list_conversations"):
            if after is None:
                index_rows = await self._run("list_conversations", st.index_first, (user_id, limit))
            else:
                index_rows = await self._run("list_conversations", st.index_after, (user_id, *after, limit))
            metadata = await self._run_all(
                "list_conversations", [(st.conv_select, (r.conversation_id,)) for r in index_rows]
            )
        page: list[ConversationRow] = []
        for index_row, rows in zip(index_rows, metadata):
            conv = _conversation(rows[0]) if rows else None
            if (
                conv is not None
                and conv.user_id == user_id
                and conv.status == CONVERSATION_ACTIVE
                and conv.updated_at_ms == index_row.updated_at_ms
            ):
                page.append(conv)
        next_cursor = None
        if len(index_rows) == limit:
            last = index_rows[-1]
            next_cursor = encode_cursor(last.updated_at_ms, last.conversation_id)
        return page, next_cursor

    # -- the user-turn spool ---------------------------------------------------------------------

    async def put_turn_input(self, generation_id: str, conversation_id: str, content: str, created_at_ms: int) -> None:
        """Spool a user turn's text before the edge submits the turn; kept ``TURN_INPUT_TTL_S``."""
        _check_content(content)
        st = await self._prepared()
        params = (generation_id, conversation_id, content, int(created_at_ms), TURN_INPUT_TTL_S)
        await self._run("put_turn_input", st.turn_insert, params)

    async def get_turn_input(self, generation_id: str) -> tuple[str, str] | None:
        """``(conversation_id, content)`` of a spooled turn, or None (never spooled, expired or deleted)."""
        st = await self._prepared()
        rows = await self._run("get_turn_input", st.turn_select, (generation_id,))
        if not rows:
            return None
        return rows[0].conversation_id, rows[0].content or ""

    # -- messages ----------------------------------------------------------------------------------

    async def write_message(self, m: StoredMessage) -> None:
        """Write one message at ``(conversation_id, bucket_of(seq), seq)``; idempotent (same key, same values).

        ``status`` is written only when set, and ``superseded_by`` never (``mark_superseded`` owns
        it), so a repeated write cannot undo a later status or supersede.
        """
        if type(m.seq) is not int or m.seq < 1:
            raise ValueError("seq must be a positive integer")
        if m.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if m.status is not None and m.status not in MESSAGE_STATUSES:
            raise ValueError(f"status must be None or one of {MESSAGE_STATUSES}")
        _check_content(m.content)
        st = await self._prepared()
        params = (
            m.conversation_id,
            bucket_of(m.seq),
            m.seq,
            m.role,
            m.content,
            UNSET_VALUE if m.status is None else m.status,
            m.generation_id,
            int(m.created_at_ms),
            int(m.parent_seq),
        )
        await self._run("write_message", st.msg_insert, params)

    async def set_message_status(self, conversation_id: str, seq: int, status: str) -> None:
        """Write only the ``status`` column of one message."""
        if status not in MESSAGE_STATUSES:
            raise ValueError(f"status must be one of {MESSAGE_STATUSES}")
        st = await self._prepared()
        await self._run("set_message_status", st.msg_set_status, (status, conversation_id, bucket_of(seq), seq))

    async def mark_superseded(self, conversation_id: str, seq: int, by_seq: int) -> None:
        """Record that the answer at ``by_seq`` replaced the one at ``seq`` in the active branch."""
        st = await self._prepared()
        params = (int(by_seq), conversation_id, bucket_of(seq), seq)
        await self._run("mark_superseded", st.msg_set_superseded, params)

    async def read_after(
        self, conversation_id: str, after_seq: int, limit: int, up_to_seq: int, *, budget: BucketBudget | None = None
    ) -> list[StoredMessage]:
        """Messages with ``after_seq < seq <= up_to_seq``, ascending, at most ``limit``
        (``<= MESSAGES_READ_MAX``), superseded ones included (the caller filters).

        One bucket query at a time, from ``bucket_of(after_seq + 1)`` upwards, each asking only for
        the rows still wanted, stopping once ``limit`` are found, ``up_to_seq``'s bucket is read or
        ``budget`` (if given) is spent.
        """
        _check_limit(limit, MESSAGES_READ_MAX)
        st = await self._prepared()
        low = max(int(after_seq), 0)  # exclusive
        high = int(up_to_seq)  # inclusive
        out: list[StoredMessage] = []
        if high <= low:
            return out
        bucket, last_bucket = bucket_of(low + 1), bucket_of(high)
        async with self._whole_call("read_after"):
            while bucket <= last_bucket and len(out) < limit:
                if budget is not None and not budget.take():
                    break
                wanted = limit - len(out)
                self.bucket_reads_total += 1
                rows = await self._run("read_after", st.msg_after, (conversation_id, bucket, low, high, wanted))
                out.extend(m for m in (_message(conversation_id, r) for r in rows) if m is not None)
                if rows:
                    low = rows[-1].seq
                if len(rows) < wanted:  # this bucket has no more in range
                    bucket += 1
        return out

    async def read_before(
        self, conversation_id: str, before_seq: int, limit: int, *, budget: BucketBudget | None = None
    ) -> list[StoredMessage]:
        """Messages with ``seq < before_seq``, newest first, at most ``limit`` (``<= MESSAGES_READ_MAX``).

        One bucket query at a time, from ``bucket_of(before_seq - 1)`` downwards, each asking only for
        the rows still wanted: ``ceil(limit / MESSAGES_PER_BUCKET) + 1`` queries for a conversation
        whose seqs are dense, whatever its length. Pass at most the conversation's revision + 1: every
        empty bucket above the newest message costs one query (the whole call is bounded by
        ``timeout_s``, and by ``budget`` when given: a caller taking a cursor from a client passes one).
        """
        _check_limit(limit, MESSAGES_READ_MAX)
        st = await self._prepared()
        high = int(before_seq)  # exclusive
        out: list[StoredMessage] = []
        if high <= 1:
            return out
        bucket = bucket_of(high - 1)
        async with self._whole_call("read_before"):
            while bucket >= 0 and len(out) < limit:
                if budget is not None and not budget.take():
                    break
                wanted = limit - len(out)
                self.bucket_reads_total += 1
                rows = await self._run("read_before", st.msg_before, (conversation_id, bucket, high, wanted))
                out.extend(m for m in (_message(conversation_id, r) for r in rows) if m is not None)
                if rows:
                    high = rows[-1].seq
                if len(rows) < wanted:
                    bucket -= 1
        return out

    # -- deletion ----------------------------------------------------------------------------------

    async def delete_conversation(
        self, conversation_id: str, user_id: str, revision: int, updated_at_ms: int
    ) -> list[str]:
        """Remove everything of a conversation the ledger deleted; returns the generation ids found.

        Bucket by bucket, ``0 .. bucket_of(revision + DELETE_TAIL_SEQS)``: read the bucket's generation
        ids, delete their ``results_by_generation`` and ``turn_inputs`` partitions, then the bucket's
        ``messages`` partition; then the sidebar rows (at ``updated_at_ms`` and at the metadata row's
        creation and update times) and last the metadata row. Each step is idempotent and a bucket's
        messages go only after its other rows, so a retry after a failure finishes the job (it
        returns only the ids it still found). Every statement is bounded by ``timeout_s``; the call
        makes O(buckets + generations) of them, ``CONCURRENT_STATEMENTS_MAX`` at a time within a bucket.
        """
        st = await self._prepared()
        found: dict[str, None] = {}  # insertion-ordered set
        last_bucket = bucket_of(max(int(revision), 0) + DELETE_TAIL_SEQS)
        for bucket in range(last_bucket + 1):
            rows = await self._run("delete_conversation", st.msg_generation_ids, (conversation_id, bucket))
            in_bucket = dict.fromkeys(r.generation_id for r in rows if r.generation_id)
            fresh = [g for g in in_bucket if g not in found]
            calls = (
                [(st.result_delete, (g,)) for g in fresh]
                + [(st.replay_delete, (g,)) for g in fresh]
                + [(st.turn_delete, (g,)) for g in fresh]
            )
            await self._run_all("delete_conversation", calls)
            found.update(dict.fromkeys(fresh))
            await self._run("delete_conversation", st.msg_delete_bucket, (conversation_id, bucket))
        rows = await self._run("delete_conversation", st.conv_select, (conversation_id,))
        index_times = {int(updated_at_ms)}
        if rows:
            index_times.update(t for t in (rows[0].created_at_ms, rows[0].updated_at_ms) if t is not None)
        await self._run_all(
            "delete_conversation",
            [(st.index_delete, (user_id, t, conversation_id)) for t in sorted(index_times)],
        )
        await self._run("delete_conversation", st.conv_delete, (conversation_id,))
        return list(found)
