"""Outcome records: one content-free ``EdgeOutcome`` per admission request, sent in batches on the
outcomes topic.

Where this sits (docs/slo.md)::

    request --> OutcomeMiddleware (draft in the ASGI scope) --> route: admit() notes the decision,
                 |                                              errors note the refusal's code
                 `-- response ended --> EdgeOutcome --> OutcomeLog (bounded buffer) --EdgeOutcomeBatch--> OUTCOMES

The edge's own refusals (invalid, unauthorized, rate limited, shed, a decision that did not come in
time) and its latencies never reach the ledger; this record carries them to the SLO report
(``python -m projections.reports.slo``). Only ids, codes and durations: no text, no token content, the user
as an opaque digest.

Recording never slows or fails a request: ``OutcomeLog.append`` puts the outcome in a buffer bounded
by ``CHATPLANE_EDGE_OUTCOMES_BUFFER_MAX`` (full: the outcome is dropped and counted in
``chatplane_edge_outcomes_dropped{reason="buffer_full"}``); a background task takes at most
``CHATPLANE_EDGE_OUTCOMES_BATCH_MAX`` outcomes every ``CHATPLANE_EDGE_OUTCOMES_FLUSH_INTERVAL_S`` and
sends them on the edge's producer as one ``EdgeOutcomeBatch`` record, or several when they are more than
``CHATPLANE_EDGE_OUTCOMES_PER_RECORD_MAX`` or their record would pass ``OUTCOME_BATCH_BYTES_MAX``
(so a busy edge writes about one record per flush, not one per request). Each outcome of a record
whose send failed is counted as ``send_failed``; ``stop`` flushes what is left, for at most
``CHATPLANE_EDGE_OUTCOMES_FLUSH_TIMEOUT_S``. ``CHATPLANE_EDGE_OUTCOMES=0`` turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer

from edge.metrics import EdgeMetrics
from schemas.codes import CancelReason, RejectionCode, RequestStatus
from schemas.outcomes import (
    OUTCOME_BATCH_BYTES_MAX,
    OUTCOMES_PER_RECORD_DEFAULT,
    AdmissionResult,
    EdgeOutcome,
    OutcomeRoute,
    encode_outcomes,
    user_ref,
)

log = logging.getLogger("chatplane.edge.outcomes")

# The ASGI scope's state key holding the request's draft (``request.state.outcome``).
DRAFT_STATE_KEY = "outcome"
# The admission routes whose requests are recorded.
RECORDED_ROUTES = {
    ("POST", "/v1/generations"): OutcomeRoute.GENERATIONS,
    ("POST", "/v1/chat/completions"): OutcomeRoute.CHAT_COMPLETIONS,
}
# HTTP status recorded for a response the application never started (an exception escaped it).
NO_RESPONSE_STATUS = 500


@dataclass(slots=True)
class OutcomeDraft:
    """What the request has shown so far; filled by the route, turned into a record at its end."""

    route: OutcomeRoute
    received_s: float  # monotonic
    received_at_ms: int  # wall clock
    user_id: str = ""
    generation_id: str = ""
    stream: bool | None = None
    result: AdmissionResult = AdmissionResult.NONE
    code: RejectionCode | None = None
    decided_s: float | None = None
    held: Any = None  # the admitted generation's edge.streams.GenerationStream


def draft_of(request: Any) -> OutcomeDraft | None:
    """The request's draft (None for a route that is not recorded, or with recording off)."""
    state = request.scope.get("state")
    draft = state.get(DRAFT_STATE_KEY) if isinstance(state, dict) else None
    return draft if isinstance(draft, OutcomeDraft) else None


def note_user(request: Any, user_id: str) -> None:
    draft = draft_of(request)
    if draft is not None:
        draft.user_id = user_id


def note_refusal(request: Any, code: RejectionCode) -> None:
    """A typed refusal is being answered. After an admission it is the generation's failure (a
    non-streaming answer that failed), which keeps the decision as it was."""
    draft = draft_of(request)
    if draft is None:
        return
    draft.code = code
    if draft.result is AdmissionResult.NONE:
        draft.result = AdmissionResult.REFUSED
        draft.decided_s = time.monotonic()


def note_decision(request: Any, result: AdmissionResult, stream: bool, generation_id: str | None, held: Any = None) -> None:
    """The processor's decision arrived (admitted or existing)."""
    draft = draft_of(request)
    if draft is None:
        return
    draft.result, draft.stream, draft.generation_id, draft.held = result, stream, generation_id or "", held
    draft.decided_s = time.monotonic()


def note_stream(request: Any, stream: bool) -> None:
    draft = draft_of(request)
    if draft is not None:
        draft.stream = stream


def _ms(start_s: float, end_s: float | None) -> float | None:
    return None if end_s is None else round((end_s - start_s) * 1000, 3)


def build_record(
    draft: OutcomeDraft, request_id: str, edge_id: str, http_status: int, ended_s: float, user_key: str = ""
) -> EdgeOutcome:
    """The record of one ended request."""
    held = draft.held
    ttft_s = final_status = cancel_reason = None
    code = draft.code
    if held is not None:
        ttft_s = held.first_token_s
        final_status = held.terminal_status
        if final_status is RequestStatus.FAILED and code is None and held.finalized is not None:
            code = held.finalized.code or RejectionCode.MODEL_BACKEND_ERROR
        if held.overflowed:
            cancel_reason = CancelReason.SLOW_CONSUMER
        elif final_status is None and held.reader_gone:
            cancel_reason = CancelReason.CLIENT_DISCONNECT
    return EdgeOutcome(
        request_id=request_id,
        edge_id=edge_id,
        route=draft.route,
        user_ref=user_ref(draft.user_id, user_key),
        generation_id=draft.generation_id,
        stream=draft.stream,
        result=draft.result,
        code=code,
        http_status=http_status,
        received_at_ms=draft.received_at_ms,
        decision_ms=_ms(draft.received_s, draft.decided_s),
        ttft_ms=_ms(draft.received_s, ttft_s),
        total_ms=round((ended_s - draft.received_s) * 1000, 3),
        final_status=final_status,
        cancel_reason=cancel_reason,
    )


class OutcomeLog:
    """The bounded, non-blocking buffer of outcomes and the task that sends them, many to a record.

    ``start`` takes the producer to send on (the edge's; anything with aiokafka's ``send``)."""

    def __init__(
        self, topic: str, buffer_max: int, batch_max: int, flush_interval_s: float, flush_timeout_s: float,
        metrics: EdgeMetrics, per_record_max: int = OUTCOMES_PER_RECORD_DEFAULT,
    ) -> None:
        self.topic = topic
        self.buffer_max = buffer_max
        self.batch_max = batch_max
        self.per_record_max = per_record_max
        self.flush_interval_s = flush_interval_s
        self.flush_timeout_s = flush_timeout_s
        self.metrics = metrics
        self.buffer: deque[EdgeOutcome] = deque()
        self.sent = 0  # outcomes delivered
        self.records_sent = 0  # records delivered (each holds one or more outcomes)
        self._producer: AIOKafkaProducer | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def append(self, record: EdgeOutcome) -> bool:
        """Buffer ``record``; False (dropped and counted) when the buffer is full. Never waits."""
        if len(self.buffer) >= self.buffer_max:
            self.metrics.outcomes_dropped.labels("buffer_full").inc()
            return False
        self.buffer.append(record)
        if len(self.buffer) >= self.batch_max:
            self._wake.set()
        return True

    def start(self, producer: AIOKafkaProducer) -> None:
        self._producer = producer
        self._task = asyncio.get_running_loop().create_task(self._run(), name="edge-outcomes")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.flush_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            while self.buffer:
                await self._send_batch()

    def _records(self, outcomes: list[EdgeOutcome]) -> list[tuple[list[EdgeOutcome], bytes]]:
        """``outcomes`` as batch records: ``per_record_max`` to a record, a record over
        ``OUTCOME_BATCH_BYTES_MAX`` split in halves."""
        out: list[tuple[list[EdgeOutcome], bytes]] = []
        pending = [outcomes[i : i + self.per_record_max] for i in range(0, len(outcomes), self.per_record_max)]
        pending.reverse()
        while pending:
            chunk = pending.pop()
            value = encode_outcomes(chunk)
            if len(value) <= OUTCOME_BATCH_BYTES_MAX:
                out.append((chunk, value))
            elif len(chunk) > 1:
                half = len(chunk) // 2
                pending += [chunk[half:], chunk[:half]]
            else:  # one outcome is a few hundred bytes: not reached while its fields stay ids and codes
                self.metrics.outcomes_dropped.labels("send_failed").inc()
                log.warning("outcome of %d bytes dropped: over %d", len(value), OUTCOME_BATCH_BYTES_MAX)
        return out

    async def _send_batch(self) -> None:
        """Send up to ``batch_max`` buffered outcomes (one record, or a few when over the bounds of one)
        and wait for their delivery."""
        assert self._producer is not None
        batch = [self.buffer.popleft() for _ in range(min(self.batch_max, len(self.buffer)))]
        futures = []
        counts = []
        for outcomes, value in self._records(batch):
            try:
                futures.append(await self._producer.send(self.topic, value, key=outcomes[0].edge_id.encode()))
                counts.append(len(outcomes))
            except Exception as exc:  # noqa: BLE001 - a broker outage drops records, never requests
                self.metrics.outcomes_dropped.labels("send_failed").inc(len(outcomes))
                log.debug("outcome send failed: %s", type(exc).__name__)
        for count, result in zip(counts, await asyncio.gather(*futures, return_exceptions=True), strict=True):
            if isinstance(result, BaseException):
                self.metrics.outcomes_dropped.labels("send_failed").inc(count)
            else:
                self.sent += count
                self.records_sent += 1

    async def stop(self) -> None:
        """Stop the task, then flush what is buffered (at most ``flush_timeout_s``)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._producer is None:
            return
        try:
            async with asyncio.timeout(self.flush_timeout_s):
                while self.buffer:
                    await self._send_batch()
        except TimeoutError:
            left = len(self.buffer)
            self.buffer.clear()
            self.metrics.outcomes_dropped.labels("send_failed").inc(left)
            log.warning("outcome flush on shutdown timed out: %d outcomes dropped", left)


class OutcomeMiddleware:
    """Opens a draft for each request to an admission route and records it when the response ended.

    Plain ASGI (as ``edge.app.RequestIdMiddleware``), inside that one so the request id is set.
    """

    def __init__(self, app: Any, edge: Any) -> None:
        self.app = app
        self.edge = edge

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = RECORDED_ROUTES.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        log_ = self.edge.outcomes
        if route is None or log_ is None:
            await self.app(scope, receive, send)
            return
        draft = OutcomeDraft(route=route, received_s=time.monotonic(), received_at_ms=int(time.time() * 1000))
        state = scope.setdefault("state", {})
        state[DRAFT_STATE_KEY] = draft
        status = NO_RESPONSE_STATUS

        async def send_noting_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            try:
                record = build_record(
                    draft, str(state.get("request_id", "")), self.edge.edge_id, status, time.monotonic(),
                    self.edge.settings.fingerprint_key,
                )
                log_.append(record)
            except Exception:  # noqa: BLE001 - recording must never fail the request
                log.exception("outcome record not built")
