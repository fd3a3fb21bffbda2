"""The worker's result sink on Cassandra: the final text goes to ``results_by_generation`` (with its TTL)
before the worker reports completion, so a same-key retry of a completed request is answered from it.

Data flow::

    Worker._run (after the engine's Finished, BEFORE ReportAttemptFinished)
        --CassandraResultSink.put--> infra.stores.results.CassandraResultStore --> results_by_generation

``python -m workers`` injects this sink by default (``CHATPLANE_WORKER_RESULT_STORE=cassandra``;
``none`` turns it off, and ``workers.Worker`` built in-process keeps ``NullResultSink`` unless told).

Failure behaviour (bounded, typed, never hangs the worker):

* The store is built lazily on the first ``put``, on the worker's one Cassandra session
  (``infra.stores.session.CassandraSession``, shared with the replay sink), so the worker starts and
  serves while Cassandra is still coming up. One open is in flight at a time; a failed open is
  retried no more often than every ``CHATPLANE_CASSANDRA_REOPEN_INTERVAL_S`` (the session's one
  reopen policy), so during an outage each ``put`` fails fast.
* One ``put`` makes at most ``settings.result_put_attempts_max`` attempts, ``result_put_backoff_s``
  apart, each write bounded by ``deadline / attempts``, all inside one budget of
  ``settings.result_put_deadline_s`` (default 4 s, under the 10 s lease minus the 3 s renewal
  interval: the lease renewer has stopped by then). The budget covers the lazy open too.
* When the budget or the attempts run out, ``put`` returns without raising: the worker reports the
  completion anyway (the client that streamed already has its text, and the ledger's record of what
  happened must not depend on the content store). The result is kept for a later write: a background
  task writes the held results, oldest first, every ``retry_interval_s`` until each is stored or held
  longer than ``pending_age_max_s``. What is held is bounded by ``pending_max`` results and
  ``pending_bytes_max`` bytes of text; beyond either the oldest is given up. A result given up (or
  over ``RESULT_TEXT_BYTES_MAX``, or held when the worker stops) is counted (``not_stored``) and logged
  without its text; a same-key retry of that generation is answered 410 ``result_unavailable``
  exactly as after the TTL, and inference is never rerun for it. Until a held result is written, a
  retry gets 503 ``result_pending`` (retryable, with Retry-After): ``put`` returns False, the worker
  reports ``result_stored=False`` and the read model answers "pending" for
  ``CHATPLANE_RESULT_PENDING_S`` after the completion, then ``result_unavailable`` (the
  chaos run found 31 completed results lost to a 10-second Cassandra restart before the later write
  existed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from infra.stores.results import CassandraResultStore, ResultTooLarge
from infra.stores.schema import REOPEN_INTERVAL_S_DEFAULT, ReadModelSettings
from infra.stores.session import CassandraSession, Reopening

log = logging.getLogger("chatplane.workers.results")


@dataclass
class ResultSinkStats:
    stored: int = 0
    stored_later: int = 0  # of ``stored``: written by the later write, after put's budget ran out
    not_stored: int = 0  # given up (held too long, over the bounds, or held at stop): a retry gets result_unavailable
    held: int = 0  # waiting for the later write now
    too_large: int = 0
    write_failures: int = 0  # writes (put attempts and later writes) that failed; each is retried or held
    last_error: str | None = None  # the exception's type name only (never the text)


class CassandraResultSink:
    """A ``workers.worker.ResultSink`` backed by ``CassandraResultStore``; opened lazily, bounded per put."""

    def __init__(
        self,
        settings: ReadModelSettings | None = None,
        *,
        cassandra: CassandraSession | None = None,
        attempts_max: int = 3,
        backoff_s: float = 0.2,
        deadline_s: float = 4.0,
        reopen_interval_s: float | None = None,
        opener: Callable[[], Awaitable[Any]] | None = None,
        pending_max: int = 1_000,
        pending_bytes_max: int = 16 * 1024 * 1024,
        pending_age_max_s: float = 600.0,
        retry_interval_s: float = 2.0,
    ) -> None:
        if attempts_max < 1 or deadline_s <= 0 or backoff_s < 0:
            raise ValueError("need attempts_max >= 1, deadline_s > 0, backoff_s >= 0")
        if pending_max < 0 or pending_bytes_max < 0 or pending_age_max_s < 0 or retry_interval_s <= 0:
            raise ValueError("need pending_max, pending_bytes_max, pending_age_max_s >= 0 and retry_interval_s > 0")
        # Results whose put ran out of budget, oldest first: (generation, epoch) -> (text, its bytes, usage, held since).
        self.pending_max, self.pending_bytes_max = pending_max, pending_bytes_max
        self.pending_age_max_s, self.retry_interval_s = pending_age_max_s, retry_interval_s
        self._pending: OrderedDict[tuple[str, int], tuple[str, int, tuple[int, int], float]] = OrderedDict()
        self._pending_bytes = 0
        self._retrying: asyncio.Task[None] | None = None
        self.attempts_max = attempts_max
        self.backoff_s = backoff_s
        self.deadline_s = deadline_s
        self.stats = ResultSinkStats()
        # Where the store comes from, opened lazily under the session's one reopen policy (shielded:
        # a put whose budget runs out leaves the open running for the next put). By default the
        # CassandraResultStore on the worker's shared session (``cassandra``), else on a session of
        # this sink's own (``settings``); tests pass ``opener`` (a fake store).
        self._own_session: CassandraSession | None = None
        self._owns_opener = opener is not None
        self._store_open: Reopening[Any]
        if opener is not None:
            self._store_open = Reopening("result store", opener, REOPEN_INTERVAL_S_DEFAULT, release=_close)
        else:
            if cassandra is None:
                cassandra = self._own_session = CassandraSession(settings)
            self._store_open = cassandra.reopening(CassandraResultStore)
        if reopen_interval_s is not None:
            self.reopen_interval_s = reopen_interval_s

    @property
    def reopen_interval_s(self) -> float:
        """A failed open is retried no more often than this (the session's policy unless set)."""
        return self._store_open.interval_s

    @reopen_interval_s.setter
    def reopen_interval_s(self, value: float) -> None:
        self._store_open.interval_s = value

    async def _get_store(self) -> Any:
        return await self._store_open.get()

    async def put(self, generation_id: str, epoch: int, text: str, usage: tuple[int, int]) -> bool | None:
        """True: stored; False: held for the later write; None: over the size limit (never stored)."""
        error = "deadline"
        attempt_timeout_s = self.deadline_s / self.attempts_max  # one hung write cannot eat the whole budget
        try:
            async with asyncio.timeout(self.deadline_s):
                for attempt in range(1, self.attempts_max + 1):
                    try:
                        store = await self._get_store()
                        await store.put(generation_id, epoch, text, usage, timeout_s=attempt_timeout_s)
                        self.stats.stored += 1
                        return True
                    except ResultTooLarge:
                        self.stats.too_large += 1
                        log.warning("result of %s epoch %d over the size limit: not stored", generation_id, epoch)
                        return None
                    except Exception as exc:  # noqa: BLE001 - any driver/connection error is retried, bounded
                        error = type(exc).__name__
                        self.stats.last_error = error
                        self.stats.write_failures += 1
                        if attempt < self.attempts_max:
                            await asyncio.sleep(self.backoff_s)
        except TimeoutError:
            self.stats.write_failures += 1  # the budget ran out (mid-write or mid-open)
        log.warning(
            "result of %s epoch %d not stored (%s, %d attempts max, %.1f s budget): completion reported "
            "anyway; held for a later write", generation_id, epoch, error, self.attempts_max, self.deadline_s,
        )
        self._hold(generation_id, epoch, text, usage)
        return False

    def _hold(self, generation_id: str, epoch: int, text: str, usage: tuple[int, int]) -> None:
        size = len(text.encode())
        earlier = self._pending.pop((generation_id, epoch), None)  # a second put of the same attempt replaces it
        if earlier is not None:
            self._pending_bytes -= earlier[1]
        self._pending[(generation_id, epoch)] = (text, size, usage, time.monotonic())
        self._pending_bytes += size
        while self._pending and (len(self._pending) > self.pending_max or self._pending_bytes > self.pending_bytes_max):
            self._give_up(next(iter(self._pending)), "the held results are over their bounds")
        self.stats.held = len(self._pending)
        if self._pending and (self._retrying is None or self._retrying.done()):
            self._retrying = asyncio.create_task(self._write_later(), name="result-sink-later")

    def held_oldest_age_s(self) -> float:
        """How long the oldest result held for the later write has waited (0 when none is held)."""
        if not self._pending:
            return 0.0
        return max(0.0, time.monotonic() - next(iter(self._pending.values()))[3])

    def _give_up(self, key: tuple[str, int], why: str) -> None:
        _, size, _, _ = self._pending.pop(key)
        self._pending_bytes -= size
        self.stats.not_stored += 1
        self.stats.held = len(self._pending)
        log.warning("result of %s epoch %d given up (%s): a same-key retry answers result_unavailable", key[0], key[1], why)

    async def _write_later(self) -> None:
        """Write the held results, oldest first, until none is left; one pass per retry interval."""
        while self._pending:
            await asyncio.sleep(self.retry_interval_s)
            for key in list(self._pending):
                if key not in self._pending:
                    continue
                text, size, usage, since = self._pending[key]
                if time.monotonic() - since > self.pending_age_max_s:
                    self._give_up(key, f"held over {self.pending_age_max_s:.0f} s")
                    continue
                try:
                    store = await asyncio.wait_for(self._get_store(), self.deadline_s)
                    await store.put(key[0], key[1], text, usage, timeout_s=self.deadline_s / self.attempts_max)
                except ResultTooLarge:
                    self._give_up(key, "over the size limit")
                    continue
                except Exception as exc:  # noqa: BLE001 - still down: the next pass tries again
                    self.stats.last_error = type(exc).__name__
                    self.stats.write_failures += 1
                    break
                self._pending.pop(key)
                self._pending_bytes -= size
                self.stats.stored += 1
                self.stats.stored_later += 1
                self.stats.held = len(self._pending)
                log.info("result of %s epoch %d stored by the later write", key[0], key[1])

    async def close(self) -> None:
        if self._retrying is not None:
            self._retrying.cancel()
            with contextlib.suppress(BaseException):
                await self._retrying
        for key in list(self._pending):
            self._give_up(key, "the worker stopped")
        # The store of a test's opener, or the session this sink opened for itself: released here
        # (waiting for an open in flight at most the put budget). A shared session is its owner's.
        if self._own_session is not None:
            await self._own_session.close(self.deadline_s)
        elif self._owns_opener:
            await self._store_open.close(self.deadline_s)


async def _close(store: Any) -> None:
    await store.close()
