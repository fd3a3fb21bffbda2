"""The worker's result sink on Cassandra: the final text goes to ``results_by_generation`` (with its TTL)
before the worker reports completion, so a same-key retry of a completed request is answered from it.

Data flow::

    Worker._run (after the engine's Finished, BEFORE ReportAttemptFinished)
        --CassandraResultSink.put--> projections.readmodel.results.CassandraResultStore --> results_by_generation

``python -m workers`` injects this sink by default (``CHATPLANE_WORKER_RESULT_STORE=cassandra``;
``none`` turns it off, and ``workers.Worker`` built in-process keeps ``NullResultSink`` unless told).

Failure behaviour (bounded, typed, never hangs the worker):

* The connection is opened lazily on the first ``put`` (the worker starts and serves while Cassandra
  is still coming up). One open is in flight at a time; a failed open is retried no more often than
  every ``RESULT_REOPEN_INTERVAL_S``, so during an outage each ``put`` fails fast.
* One ``put`` makes at most ``settings.result_put_attempts_max`` attempts, ``result_put_backoff_s``
  apart, each write bounded by ``deadline / attempts``, all inside one budget of
  ``settings.result_put_deadline_s`` (default 4 s, under the 10 s lease minus the 3 s renewal
  interval: the lease renewer has stopped by then). The budget covers the lazy open too.
* When the budget or the attempts run out (or the text is over ``RESULT_TEXT_BYTES_MAX``), ``put``
  returns without raising; the outcome is counted (``not_stored``) and logged without the text. The
  worker then reports the completion anyway: the client that streamed already has its text, and the
  ledger's record of what happened must not depend on the content store. A later same-key retry of
  that generation finds no stored row and is answered 410 ``result_unavailable`` exactly as after the
  TTL; inference is never rerun for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from projections.readmodel.schema import ReadModelSettings
from projections.readmodel.results import CassandraResultStore, ResultTooLarge

log = logging.getLogger("chatplane.workers.results")

RESULT_REOPEN_INTERVAL_S = 5.0  # a failed lazy open is retried no more often than this


@dataclass
class ResultSinkStats:
    stored: int = 0
    not_stored: int = 0  # attempts or budget ran out: completion reported, a retry gets result_unavailable
    too_large: int = 0
    last_error: str | None = None  # the exception's type name only (never the text)


class CassandraResultSink:
    """A ``workers.worker.ResultSink`` backed by ``CassandraResultStore``; opened lazily, bounded per put."""

    def __init__(
        self,
        settings: ReadModelSettings | None = None,
        *,
        attempts_max: int = 3,
        backoff_s: float = 0.2,
        deadline_s: float = 4.0,
        reopen_interval_s: float = RESULT_REOPEN_INTERVAL_S,
        opener: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        if attempts_max < 1 or deadline_s <= 0 or backoff_s < 0:
            raise ValueError("need attempts_max >= 1, deadline_s > 0, backoff_s >= 0")
        self._settings = settings
        # How the store is opened (tests pass a fake); by default CassandraResultStore.open(settings).
        self._opener = opener or (lambda: CassandraResultStore.open(self._settings or ReadModelSettings()))
        self.attempts_max = attempts_max
        self.backoff_s = backoff_s
        self.deadline_s = deadline_s
        self.reopen_interval_s = reopen_interval_s
        self.stats = ResultSinkStats()
        self._store: Any = None
        self._opening: asyncio.Task[Any] | None = None
        self._open_failed_at = float("-inf")

    async def _get_store(self) -> Any:
        if self._store is not None:
            return self._store
        if self._opening is None:
            if time.monotonic() - self._open_failed_at < self.reopen_interval_s:
                raise ConnectionError("result store unavailable (last open failed recently)")
            self._opening = asyncio.create_task(self._opener())
            self._opening.add_done_callback(self._opened)
        # Shielded: a put whose budget runs out leaves the open running for the next put (no leak).
        return await asyncio.shield(self._opening)

    def _opened(self, task: asyncio.Task[Any]) -> None:
        self._opening = None
        if task.cancelled():
            self._open_failed_at = time.monotonic()
            return
        exc = task.exception()
        if exc is not None:
            self._open_failed_at = time.monotonic()
            self.stats.last_error = type(exc).__name__
            log.warning("result store: open failed (%s); retried at most every %.0f s", type(exc).__name__,
                        self.reopen_interval_s)
            return
        self._store = task.result()  # close() releases it, also when it arrives after close() began

    async def put(self, generation_id: str, epoch: int, text: str, usage: tuple[int, int]) -> None:
        error = "deadline"
        attempt_timeout_s = self.deadline_s / self.attempts_max  # one hung write cannot eat the whole budget
        try:
            async with asyncio.timeout(self.deadline_s):
                for attempt in range(1, self.attempts_max + 1):
                    try:
                        store = await self._get_store()
                        await store.put(generation_id, epoch, text, usage, timeout_s=attempt_timeout_s)
                        self.stats.stored += 1
                        return
                    except ResultTooLarge:
                        self.stats.too_large += 1
                        log.warning("result of %s epoch %d over the size limit: not stored", generation_id, epoch)
                        return
                    except Exception as exc:  # noqa: BLE001 - any driver/connection error is retried, bounded
                        error = type(exc).__name__
                        self.stats.last_error = error
                        if attempt < self.attempts_max:
                            await asyncio.sleep(self.backoff_s)
        except TimeoutError:
            pass
        self.stats.not_stored += 1
        log.warning(
            "result of %s epoch %d not stored (%s, %d attempts max, %.1f s budget): completion reported "
            "anyway; a same-key retry answers result_unavailable", generation_id, epoch, error,
            self.attempts_max, self.deadline_s,
        )

    async def close(self) -> None:
        if self._opening is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self._opening), self.deadline_s)
        if self._store is not None:
            store, self._store = self._store, None
            await store.close()
