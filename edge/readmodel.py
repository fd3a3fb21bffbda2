"""Adapter from the edge to the Cassandra read model (``infra.stores.queries.GenerationReader``).

Data flow: ``GET /v1/generations/{id}`` and a same-key retry of a completed request ->
``Edge.lookup``/``Edge.result`` -> this edge's memory of generations it admitted (fresh, exact) ->
here -> ``generations_by_id`` / ``results_by_generation``. The owner check is done by the reader
(``owner=``): another user's id answers ``None`` exactly like an unknown one. A Cassandra failure or
a read past its deadline (``ReadModelUnavailable``) is answered as a typed ``503 store_unavailable``
with Retry-After: a read failed, admission did not (``quota_service_unavailable`` is kept for that, so
dashboards tell the two apart). The reader is built on the edge's one Cassandra session
(``infra.stores.session``), opened on first use and re-tried at most every
``CHATPLANE_CASSANDRA_REOPEN_INTERVAL_S``, so an edge starts and admits while Cassandra is still
coming up.
"""

from __future__ import annotations

from typing import Any

from edge.errors import ApiError
from edge.streams import GenerationView
from infra.stores.queries import GenerationReader, ReadModelUnavailable, ResultState
from infra.stores.session import CassandraSession
from schemas.codes import RejectionCode, RequestStatus

# Retry-After of a 503 result_pending: the worker's result sink retries its held texts every 2 s
# (CHATPLANE_WORKER_RESULT_RETRY_INTERVAL_S).
RESULT_PENDING_RETRY_AFTER_S = 2


class ReadModel:
    """The edge's ``GenerationReader``, built on the process's shared session on first use."""

    def __init__(self, cassandra: CassandraSession) -> None:
        self._cassandra = cassandra
        self._reader: Any = None  # the GenerationReader once built (tests may put a stand-in here)

    async def _get_reader(self) -> Any:
        if self._reader is None:
            try:
                self._reader = await self._cassandra.store(GenerationReader)
            except Exception:  # noqa: BLE001 - any failure is "unavailable" (logged by the session); retried later
                raise _unavailable() from None
        return self._reader

    async def lookup(self, generation_id: str, owner: str) -> GenerationView | None:
        reader = await self._get_reader()
        try:
            v = await reader.get(generation_id, owner=owner, include_result=False)
        except ReadModelUnavailable:
            raise _unavailable() from None
        return None if v is None else _view(v)

    async def lookup_with_result(self, generation_id: str, owner: str) -> tuple[GenerationView | None, str | None]:
        """The generation and, when completed and retained, its text: one read-model call (GET)."""
        reader = await self._get_reader()
        try:
            v = await reader.get(generation_id, owner=owner, include_result=True)
        except ReadModelUnavailable:
            raise _unavailable() from None
        if v is None:
            return None, None
        view = _view(v)
        view.result_pending = v.result is ResultState.PENDING
        return view, (v.result_text if v.result is ResultState.AVAILABLE else None)

    async def result(self, generation_id: str, owner: str) -> str | None:
        """The retained text of a generation the caller knows completed (the ledger's finalization
        or the processor's answer), or None when it has expired (410). Raises the 503
        ``result_pending`` while the worker still holds a text it could not store yet, and while the
        read model has not projected the completion (it trails the ledger): not expired, not yet."""
        reader = await self._get_reader()
        try:
            v = await reader.get(generation_id, owner=owner, include_result=True)
        except ReadModelUnavailable:
            raise _unavailable() from None
        if v is None or v.result is ResultState.PENDING or v.status is not RequestStatus.COMPLETED:
            raise result_pending(generation_id)
        if v.result is not ResultState.AVAILABLE:
            return None
        return v.result_text


def _view(v: Any) -> GenerationView:
    view = GenerationView(
        v.generation_id, v.user_id, RequestStatus(v.status), v.model_version or "", v.input_tokens,
        v.output_tokens, v.code, v.partial,
    )
    view.terminal_sequence, view.result_expires_at_ms = v.terminal_sequence, v.result_expires_at_ms
    if v.conversation_id and v.turn_revision:
        # A conversation turn: every edge names its revision (and the next turn's), not only the
        # edge that admitted it.
        view.conversation_id, view.revision = v.conversation_id, v.turn_revision
    return view


def result_pending(generation_id: str, extra: dict[str, Any] | None = None) -> ApiError:
    """503 result_pending (retryable): completed, its text held by the worker for a later write."""
    return ApiError(RejectionCode.RESULT_PENDING, retry_after_s=RESULT_PENDING_RETRY_AFTER_S,
                    extra={"generation_id": generation_id, **(extra or {})})


def _unavailable() -> ApiError:
    return ApiError(RejectionCode.STORE_UNAVAILABLE, retry_after_s=2)
