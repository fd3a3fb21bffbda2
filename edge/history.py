"""The edge's side of conversations: the history store, opened lazily, and a turn's context.

Data flow of a turn (``POST /v1/generations`` with ``conversation_id``; docs/conversations.md)::

    client --turn--> edge: conversation row (owner, parked revision)   <-- Cassandra
                           history newest first, by tokens (edge.context) <-- Cassandra messages
                           the user message -> turn_inputs (Cassandra), BEFORE the submit
                     --SubmitGeneration(conversation_id, expected_revision)--> processor (the decision)

The context is built here because the command's ``input_tokens`` must count exactly what the engine
sees (quota and token budgets are decided on it): the prompt published beside the submit is this
context, and the worker runs it as given. The user message is stored before the submit so that no
crash loses a turn the processor committed (the history writer copies it into ``messages`` from
``turn_inputs``, keyed by the generation id the submit will get: a same-key retry never stores it
twice, and a refused turn's text is only an orphan ``turn_inputs`` row that its TTL removes).

Failures: any store failure is ``503 history_unavailable`` (retryable, Retry-After), for conversation
reads and turns only; stateless requests never touch the store. A committed revision the store has
not caught up with yet (the history writer lags the ledger by a few milliseconds) is waited for, at
most ``CATCH_UP_WAIT_S``; it is never built around: a context that silently omits the user's
just-committed message is the one thing a turn must not do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from edge.context import NoTurnToRegenerate, TurnTooLarge, build_context, history_page_reader
from edge.errors import ApiError
from edge.metrics import EdgeMetrics
from infra.models.catalog import CatalogModel
from infra.stores.history import BucketBudget, ConversationRow, HistoryStore, HistoryUnavailable, StoredMessage
from infra.stores.session import CassandraSession
from schemas.codes import RejectionCode
from schemas.messages import ChatMessage, RejectionDetails

log = logging.getLogger("chatplane.edge.history")

CATCH_UP_WAIT_S = 2.0  # a turn waits this long for the store to show the revision it was sent against
CATCH_UP_POLL_S = 0.02
HISTORY_RETRY_AFTER_S = 1
# A turn's end (its JSON answer, its stream's terminal event) waits this long for the store to show
# the revision its answer committed at, so that any read after the client has the answer shows it
# (read-your-writes); the history writer applies the ledger's commit milliseconds after it.
ANSWER_VISIBLE_WAIT_S = 2.0


def unavailable() -> ApiError:
    return ApiError(RejectionCode.HISTORY_UNAVAILABLE, retry_after_s=HISTORY_RETRY_AFTER_S)


@contextlib.contextmanager
def _answered_as_unavailable() -> Iterator[None]:
    """A store failure (``HistoryUnavailable``) becomes ``503 history_unavailable``; argument errors
    (``ValueError``: an invalid cursor, a limit out of range) pass through to the route."""
    try:
        yield
    except HistoryUnavailable:
        raise unavailable() from None


class History:
    """The edge's ``HistoryStore``, built on the process's shared Cassandra session on first use; one
    method per store operation the edge uses, every failure answered as ``history_unavailable``."""

    def __init__(self, cassandra: CassandraSession) -> None:
        self._cassandra = cassandra
        self._store: HistoryStore | None = None

    async def store(self) -> HistoryStore:
        if self._store is None:
            try:
                self._store = await self._cassandra.store(HistoryStore)
            except Exception:  # noqa: BLE001 - any failure is "unavailable" (logged by the session); retried later
                raise unavailable() from None
        return self._store

    async def get_conversation(self, conversation_id: str) -> ConversationRow | None:
        store = await self.store()
        with _answered_as_unavailable():
            return await store.get_conversation(conversation_id)

    async def put_conversation(self, conversation_id: str, user_id: str, title: str | None, created_at_ms: int) -> None:
        store = await self.store()
        with _answered_as_unavailable():
            await store.put_conversation(conversation_id, user_id, title, created_at_ms)

    async def confirm_conversation(self, conversation_id: str, user_id: str, created_at_ms: int) -> None:
        store = await self.store()
        with _answered_as_unavailable():
            await store.confirm_conversation(conversation_id, user_id, created_at_ms)

    async def mark_deleted(self, conversation_id: str) -> None:
        store = await self.store()
        with _answered_as_unavailable():
            await store.mark_deleted(conversation_id)

    async def list_conversations(
        self, user_id: str, limit: int, cursor: str | None
    ) -> tuple[list[ConversationRow], str | None]:
        """One page of the sidebar; ``ValueError`` for an invalid cursor or limit."""
        store = await self.store()
        with _answered_as_unavailable():
            return await store.list_conversations(user_id, limit, cursor)

    async def put_turn_input(self, generation_id: str, conversation_id: str, content: str, created_at_ms: int) -> None:
        store = await self.store()
        with _answered_as_unavailable():
            await store.put_turn_input(generation_id, conversation_id, content, created_at_ms)

    async def read_after(
        self, conversation_id: str, after_seq: int, limit: int, up_to_seq: int, *, budget: BucketBudget | None = None
    ) -> list[StoredMessage]:
        store = await self.store()
        with _answered_as_unavailable():
            return await store.read_after(conversation_id, after_seq, limit, up_to_seq, budget=budget)

    async def read_before(
        self, conversation_id: str, before_seq: int, limit: int, *, budget: BucketBudget | None = None
    ) -> list[StoredMessage]:
        store = await self.store()
        with _answered_as_unavailable():
            return await store.read_before(conversation_id, before_seq, limit, budget=budget)


async def owned_conversation(history: History, conversation_id: str, user_id: str) -> ConversationRow:
    """The conversation's row if ``user_id`` owns it and it is live; else 404 exactly like an unknown id."""
    row = await history.get_conversation(conversation_id)
    if row is None or row.user_id != user_id or row.status != "active":
        raise ApiError(RejectionCode.NOT_FOUND)
    return row


@dataclass(frozen=True, slots=True)
class PreparedTurn:
    conversation_id: str
    expected_revision: int
    regenerate: bool
    restore_revision: int
    messages: tuple[ChatMessage, ...]  # the whole context the engine sees, oldest first
    input_tokens: int
    new_message: ChatMessage | None
    history_used: int


async def prepare_turn(
    history: History,
    model: CatalogModel,
    user_id: str,
    conversation_id: str,
    expected_revision: int,
    regenerate: bool,
    new_message: ChatMessage | None,
    max_output_tokens: int,
) -> PreparedTurn:
    """Authorize the conversation and build the turn's context by tokens (see the module docstring)."""
    row = await owned_conversation(history, conversation_id, user_id)
    await _caught_up(history, conversation_id, expected_revision)
    store = await history.store()
    read_page = history_page_reader(functools.partial(store.read_before, conversation_id))
    # A turn reads everything up to the revision it was sent against; a regeneration everything
    # below the answer it replaces (whose seq is that revision), so its newest item is the user turn.
    before = expected_revision if regenerate else expected_revision + 1
    try:
        built = await build_context(model, before, read_page, None if regenerate else new_message, max_output_tokens)
    except HistoryUnavailable:
        raise unavailable() from None
    except TurnTooLarge as exc:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="messages", details=RejectionDetails(limit=exc.limit)) from None
    except NoTurnToRegenerate:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="regenerate") from None
    return PreparedTurn(
        conversation_id=conversation_id,
        expected_revision=expected_revision,
        regenerate=regenerate,
        restore_revision=row.parked_revision if row.parked_revision is not None else -1,
        messages=built.messages,
        input_tokens=built.input_tokens,
        new_message=new_message,
        history_used=built.history_used,
    )


async def _caught_up(history: History, conversation_id: str, expected_revision: int) -> None:
    """Wait (bounded) until the store holds the committed message at ``expected_revision``."""
    if expected_revision == 0:
        return
    deadline = time.monotonic() + CATCH_UP_WAIT_S
    while True:
        # Only the bucket that holds ``expected_revision``: a revision past the end must not walk
        # every empty bucket below it on each poll.
        rows = await history.read_before(conversation_id, expected_revision + 1, 1, budget=BucketBudget(1))
        if rows and rows[0].seq == expected_revision and rows[0].status is not None:
            return
        if time.monotonic() >= deadline:
            # Either the writer lags (retry helps) or the revision was never committed (the client's
            # mistake); neither may be built around.
            raise unavailable()
        await asyncio.sleep(CATCH_UP_POLL_S)


async def answer_visible(history: History, metrics: EdgeMetrics, conversation_id: str, revision: int) -> bool:
    """Wait (at most ``ANSWER_VISIBLE_WAIT_S``) until the store's conversation row shows ``revision``.

    Called before a turn's end is told to its client: the ledger has committed the answer at
    ``revision`` (the history writer stored its text first), and the writer copies the commit (the
    answer's status, the row's revision and ``updated_at``) a moment later. Waiting here, rather than
    on the next read, means a client that holds the answer never reads an older revision, on any
    edge (every store statement runs at LOCAL_QUORUM). True once shown, or once there is nothing to
    wait for (the conversation was deleted meanwhile); False when the bound passed or the store
    failed, in which case the answer goes out anyway: the generation has ended, and withholding its
    end would not make the store catch up. Each such answer is counted
    (``chatplane_edge_answers_not_visible_total`` by reason): a client holding it may read an older
    revision, so the count is how often read-your-writes was not kept.
    """
    deadline = time.monotonic() + ANSWER_VISIBLE_WAIT_S
    while True:
        try:
            row = await history.get_conversation(conversation_id)
        except ApiError:
            metrics.answers_not_visible.labels("history_unavailable").inc()
            return False
        if row is None or row.status != "active" or row.revision >= revision:
            return True
        if time.monotonic() >= deadline:
            metrics.answers_not_visible.labels("timeout").inc()
            log.warning("conversation %s: the store did not show revision %d in time", conversation_id, revision)
            return False
        await asyncio.sleep(CATCH_UP_POLL_S)
