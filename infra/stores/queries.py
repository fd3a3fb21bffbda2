"""The read API the edge calls: a generation's status, usage and retained result, from Cassandra.

Data flow::

    LEDGER --projections.readmodel--> generations_by_id --+
    worker --infra.stores.results----> results_by_generation --+--> GenerationReader --> edge

The whole API (for the edge engineer)::

    reader = await GenerationReader.open(ReadModelSettings())     # connects off the loop; reader.close()
    view = await reader.get(generation_id, owner=principal_user_id)
        # -> GenerationView | None. None: unknown id, or owned by someone else (answer 404 not_found
        #    either way, so ids do not leak). Raises ReadModelUnavailable on any Cassandra error or
        #    when the read did not finish within settings.read_deadline_s (default 1 s): never hangs.
        #    The edge answers it as a typed 503 STORE_UNAVAILABLE (retryable) with Retry-After:
        #    ReadModelUnavailable.retry_after_s, apart from admission's QUOTA_SERVICE_UNAVAILABLE.
        # view.status, view.model_version, view.input_tokens, view.output_tokens, timestamps ...
        # view.result is a ResultState: AVAILABLE (view.result_text holds the text), EXPIRED (completed
        #    but past the TTL: 410 result_unavailable for the content, status and usage still served),
        #    PENDING (completed, its worker still held the text for a later write when it reported, and
        #    within settings.result_pending_s of the completion: 503 result_pending, retry shortly),
        #    NOT_APPLICABLE (not completed: no content exists).
    stored = await reader.result_for_outcome(outcome)
        # for a same-key retry the processor answered Outcome(kind=EXISTING, status=completed, ...):
        # -> StoredResult (text, usage) or raises ResultUnavailable (410 result_unavailable; never
        #    rerun inference). Raises ReadModelUnavailable like ``get``.

Owner checks happen here (``owner=``), not in the edge's handlers, so no code path can forget one.
The view carries generated text only in ``result_text``; nothing in this module logs it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from infra.stores.cassandra import execute
from infra.stores.results import CassandraResultStore, StoredResult
from infra.stores.schema import ReadModelSettings, close_cluster, open_session, prepare
from schemas.codes import RejectionCode, RequestStatus
from schemas.messages import Outcome, OutcomeKind
from schemas.tables import GENERATION_COLUMNS
from schemas.topics import GENERATIONS_TABLE

# Retry-After the edge should send with a ReadModelUnavailable 503.
READ_MODEL_RETRY_AFTER_S = 2


class ReadModelUnavailable(RuntimeError):
    """Cassandra failed or did not answer within the read deadline; the edge answers a typed 503."""

    retry_after_s = READ_MODEL_RETRY_AFTER_S

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ResultUnavailable(LookupError):
    """The generation completed but its content is no longer retained: 410 ``result_unavailable``."""

    code = RejectionCode.RESULT_UNAVAILABLE

    def __init__(self, generation_id: str) -> None:
        super().__init__(f"result of {generation_id} is no longer retained")
        self.generation_id = generation_id


class ResultPending(LookupError):
    """The generation completed but its text is not stored yet (the worker holds it for a later
    write): 503 ``result_pending``, retryable."""

    code = RejectionCode.RESULT_PENDING

    def __init__(self, generation_id: str) -> None:
        super().__init__(f"result of {generation_id} is not stored yet")
        self.generation_id = generation_id


class ResultState(StrEnum):
    AVAILABLE = "available"
    EXPIRED = "expired"  # -> RejectionCode.RESULT_UNAVAILABLE for the content
    PENDING = "pending"  # -> RejectionCode.RESULT_PENDING: the worker's later write may still store it
    NOT_APPLICABLE = "not_applicable"  # not completed: there is no content to serve


@dataclass(frozen=True, slots=True)
class GenerationView:
    """What ``GET /v1/generations/{id}`` shows; ``revision`` is the ledger offset the row reflects."""

    generation_id: str
    user_id: str
    status: RequestStatus
    model_alias: str | None
    model_version: str | None
    tier: str | None
    stream: bool | None
    epoch: int
    input_tokens: int
    output_tokens: int
    usage_recorded: bool
    finish_reason: str | None
    terminal_reason: str | None
    code: RejectionCode | None
    partial: bool
    cancel_requested: bool
    window_start_ms: int | None
    window_end_ms: int | None
    created_at_ms: int | None
    accepted_at_ms: int | None
    finished_at_ms: int | None
    updated_at_ms: int | None
    result_expires_at_ms: int | None
    revision: int
    result: ResultState
    result_text: str | None = None
    terminal_sequence: int = 0  # the terminal event's SSE id (0: after the last stored delta)
    # A conversation turn's conversation and the revision its user message committed at (its answer
    # commits at the next one); None for a stateless request and for rows projected before them.
    conversation_id: str | None = None
    turn_revision: int | None = None

    def require_result(self) -> str:
        """The retained text, or ``ResultUnavailable`` (completed, expired) / ``ResultPending``
        (completed, not stored yet) / ``LookupError`` (not completed)."""
        if self.result is ResultState.AVAILABLE and self.result_text is not None:
            return self.result_text
        if self.result is ResultState.EXPIRED:
            raise ResultUnavailable(self.generation_id)
        if self.result is ResultState.PENDING:
            raise ResultPending(self.generation_id)
        raise LookupError(f"generation {self.generation_id} is {self.status.value}: no result")


def _view(row: Any, stored: StoredResult | None, now_ms: int, pending_ms: int = 0) -> GenerationView:
    status = RequestStatus(row.status)
    expires = row.result_expires_at_ms
    live = expires is None or now_ms < expires
    if status is not RequestStatus.COMPLETED:
        result, text = ResultState.NOT_APPLICABLE, None
    elif stored is not None and live and stored.epoch == (row.epoch or stored.epoch):
        result, text = ResultState.AVAILABLE, stored.text
    elif (
        live
        and getattr(row, "result_stored", None) is False
        and row.finished_at_ms is not None
        and now_ms < row.finished_at_ms + pending_ms
    ):
        # Not "expired": the worker reported before its result store took the text and holds it for
        # a later write (workers/result_sink.py), which may still land.
        result, text = ResultState.PENDING, None
    else:
        result, text = ResultState.EXPIRED, None
    return GenerationView(
        generation_id=row.generation_id,
        user_id=row.user_id,
        status=status,
        model_alias=row.model_alias,
        model_version=row.model_version,
        tier=row.tier,
        stream=row.stream,
        epoch=row.epoch or 0,
        input_tokens=row.input_tokens or 0,
        output_tokens=row.output_tokens or 0,
        usage_recorded=row.usage_epoch is not None,
        finish_reason=row.finish_reason,
        terminal_reason=row.terminal_reason,
        code=RejectionCode(row.code) if row.code else None,
        partial=bool(row.partial),
        cancel_requested=bool(row.cancel_requested),
        window_start_ms=row.window_start_ms,
        window_end_ms=row.window_end_ms,
        created_at_ms=row.created_at_ms,
        accepted_at_ms=row.accepted_at_ms,
        finished_at_ms=row.finished_at_ms,
        updated_at_ms=row.updated_at_ms,
        result_expires_at_ms=expires,
        revision=row.revision or 0,
        result=result,
        result_text=text,
        terminal_sequence=getattr(row, "terminal_sequence", None) or 0,
        conversation_id=getattr(row, "conversation_id", None) or None,
        turn_revision=getattr(row, "turn_revision", None) or None,
    )


class GenerationReader:
    """Owner-checked reads of ``generations_by_id`` and ``results_by_generation``, bounded by a deadline."""

    def __init__(self, session: Any, settings: ReadModelSettings) -> None:
        self.session = session
        self.settings = settings
        self.deadline_s = settings.read_deadline_s
        self.results = CassandraResultStore(session, settings)
        self._select: Any = None
        self._cluster: Any = None

    @classmethod
    async def open(cls, settings: ReadModelSettings | None = None, *, session: Any = None) -> GenerationReader:
        """Prepare (the schema must exist: the projection creates it), on ``session`` (a process's
        shared one, which stays its owner's) or, without one, on a connection of its own that
        ``close()`` releases."""
        settings = settings or ReadModelSettings()
        cluster = None
        if session is None:
            cluster, session = await open_session(settings)
        reader = cls(session, settings)
        reader._cluster = cluster
        try:
            await reader.prepare()
        except BaseException:
            await reader.close()
            raise
        return reader

    async def close(self) -> None:
        if self._cluster is not None:
            await close_cluster(self._cluster)
            self._cluster = None

    async def prepare(self) -> None:
        cols = ", ".join(("generation_id", *GENERATION_COLUMNS))
        self._select = await prepare(
            self.session, f"SELECT {cols} FROM {self.settings.keyspace}.{GENERATIONS_TABLE} WHERE generation_id = ?"
        )
        await self.results.prepare()

    async def _bounded(self, coro: Any) -> Any:
        # asyncio.timeout, not wait_for: no extra task per read, and a caller that cancels the read
        # (its own deadline) leaves no orphaned task whose driver error nobody retrieves.
        try:
            async with asyncio.timeout(self.deadline_s):
                return await coro
        except TimeoutError as exc:
            raise ReadModelUnavailable(f"no answer from Cassandra within {self.deadline_s}s") from exc
        except (ReadModelUnavailable, ResultUnavailable):
            raise
        except Exception as exc:  # noqa: BLE001 - every driver error is "the read model is unavailable"
            raise ReadModelUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def get(self, generation_id: str, *, owner: str | None = None, include_result: bool = True) -> GenerationView | None:
        """The generation's view, or None when unknown or not ``owner``'s. Raises ``ReadModelUnavailable``."""
        return await self._bounded(self._get(generation_id, owner, include_result))

    async def _get(self, generation_id: str, owner: str | None, include_result: bool) -> GenerationView | None:
        if self._select is None:
            await self.prepare()
        # The metadata and the result are read concurrently: one round trip of latency, not two.
        meta_task = execute(self.session, self._select, (generation_id,), timeout_s=self.deadline_s)
        if include_result:
            rows, stored = await asyncio.gather(
                meta_task, self.results.get(generation_id, timeout_s=self.deadline_s)
            )
        else:
            rows, stored = await meta_task, None
        if not rows or rows[0].user_id is None or rows[0].status is None:
            return None
        row = rows[0]
        if owner is not None and row.user_id != owner:
            return None
        if stored is not None and row.epoch is not None and stored.epoch != row.epoch:
            # The latest stored epoch is not the one that completed: ask for that epoch exactly.
            stored = await self.results.get(generation_id, row.epoch, timeout_s=self.deadline_s)
        return _view(row, stored, int(time.time() * 1000), int(self.settings.result_pending_s * 1000))

    async def result_for_outcome(self, outcome: Outcome) -> StoredResult:
        """For a same-key retry answered EXISTING/completed: the stored result or ``ResultUnavailable``."""
        if outcome.kind is not OutcomeKind.EXISTING or outcome.status is not RequestStatus.COMPLETED:
            raise ValueError(f"not a completed existing generation: {outcome.kind} {outcome.status}")
        gid = outcome.generation_id or ""
        now_ms = int(time.time() * 1000)
        if outcome.result_expires_at_ms is None or now_ms >= outcome.result_expires_at_ms:
            raise ResultUnavailable(gid)
        stored = await self._bounded(self.results.get(gid, outcome.epoch or None, timeout_s=self.deadline_s))
        if stored is None:
            raise ResultUnavailable(gid)
        return stored
