"""A process's one Cassandra session, opened on first use, and every store built on it.

Where it sits::

    edge (edge.app.Edge) ------------+                        +--> GenerationReader      (edge.readmodel)
                                     |                        +--> HistoryStore          (edge.history)
    worker (workers.__main__.amain) -+--> CassandraSession ---+--> ReplayStore           (edge.replay, workers.replay_sink)
                                          one Cluster,        `--> CassandraResultStore  (workers.result_sink)
                                          one Session

A process builds one ``CassandraSession`` at its start (nothing connects then) and hands it to every
part that reads or writes Cassandra. The first call that needs a store connects (``open_session``: the
driver's ``Cluster.connect`` off the loop), then builds that store on the shared session with the
store's own ``open(settings, session=...)``: its keyspace and tables where it creates them, and its
prepared statements, exactly as before. Later calls get the same session and the same store object.
Stateless work never opens it (an edge serves and admits while Cassandra is still coming up).

The reopen policy (``Reopening``, the one implementation, used for the session and for each store):

* one open at a time, shared by every caller waiting for it, and shielded: a caller whose own
  deadline passes (``store(..., wait_s=...)``, a worker's put budget) leaves the open running for the
  next caller instead of wasting it;
* after a failed open (the connect, or a store's schema and statements) the next try waits at least
  ``reopen_interval_s`` (``CHATPLANE_CASSANDRA_REOPEN_INTERVAL_S``, 5 s) from the failure, and every
  call in between fails at once with ``CassandraUnavailable``: during an outage each request fails
  fast instead of paying a connect;
* once open, it stays open: the driver reconnects to a restarted node by itself (``RECONNECT_DELAY_S``).

``close()`` at the process's shutdown releases the cluster (a store built on the shared session does
not own it: its own ``close()`` releases nothing). ``sessions_opened`` counts the sessions (driver
clusters) this provider opened: one for the life of a process that reached Cassandra once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, Self, TypeVar

from infra.stores.schema import REOPEN_INTERVAL_S_DEFAULT, ReadModelSettings, close_cluster, open_session

log = logging.getLogger("chatplane.stores.session")

# How long a caller waits for an open in flight by default (the open itself goes on: the next caller
# gets it). Kept from the edge's former per-store open bound.
OPEN_WAIT_S = 10.0
# How long ``close`` waits for an open in flight before it gives up on it (it is released on arrival).
CLOSE_WAIT_S = 10.0

T = TypeVar("T")


class CassandraUnavailable(ConnectionError):
    """The session (or a store on it) could not be opened, or the last try failed less than the reopen
    interval ago, or the provider is closed. Callers map it to their typed 503."""


class Reopening(Generic[T]):
    """A resource opened on first use by ``opener``; a failed open is retried no sooner than
    ``interval_s`` after it failed. ``release`` (optional) closes the value at ``close``."""

    def __init__(
        self,
        name: str,
        opener: Callable[[], Awaitable[T]],
        interval_s: float | Callable[[], float] = REOPEN_INTERVAL_S_DEFAULT,
        *,
        release: Callable[[T], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._opener = opener
        self._interval: Callable[[], float] = interval_s if callable(interval_s) else (lambda: float(interval_s))
        self._release = release
        self._clock = clock
        self.value: T | None = None
        self.attempts = 0  # opens started
        self.failures = 0
        self.last_error: str | None = None  # the exception's type name only
        self._failed_at = float("-inf")
        self._opening: asyncio.Task[T] | None = None
        self._closed = False

    @property
    def interval_s(self) -> float:
        return self._interval()

    @interval_s.setter
    def interval_s(self, value: float) -> None:
        self._interval = lambda: float(value)

    async def get(self) -> T:
        """The open value; opens it (or joins the open in flight). Raises ``CassandraUnavailable``
        within the interval after a failure, the open's own error when it fails now."""
        if self.value is not None:
            return self.value
        if self._closed:
            raise CassandraUnavailable(f"{self.name}: closed")
        if self._opening is None:
            since = self._clock() - self._failed_at
            if since < self.interval_s:
                raise CassandraUnavailable(
                    f"{self.name}: the last open failed {since:.1f} s ago ({self.last_error}); "
                    f"retried at most every {self.interval_s:g} s"
                )
            self.attempts += 1
            self._opening = asyncio.create_task(self._opener(), name=f"open {self.name}")
            self._opening.add_done_callback(self._opened)
        # Shielded: a caller cancelled by its own deadline leaves the open running for the next one.
        return await asyncio.shield(self._opening)

    def _opened(self, task: asyncio.Task[T]) -> None:
        self._opening = None
        exc = None if task.cancelled() else task.exception()
        if task.cancelled() or exc is not None:
            self._failed_at = self._clock()
            self.failures += 1
            self.last_error = "CancelledError" if exc is None else type(exc).__name__
            log.warning("%s: open failed (%s); retried at most every %g s", self.name, self.last_error, self.interval_s)
            return
        value = task.result()
        if self._closed:  # arrived after close gave up waiting for it: released, never handed out
            if self._release is not None:
                _background(self._release(value))
            return
        self.value = value

    async def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Release the value (waiting at most ``wait_s`` for an open in flight); later ``get`` calls fail."""
        self._closed = True
        opening = self._opening
        if opening is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(opening), wait_s)
        value, self.value = self.value, None
        if value is not None and self._release is not None:
            await self._release(value)


_pending_releases: set[asyncio.Task[Any]] = set()


def _background(coro: Awaitable[None]) -> None:
    async def run() -> None:
        with contextlib.suppress(Exception):
            await coro

    task = asyncio.get_running_loop().create_task(run())
    _pending_releases.add(task)  # a reference until it ends
    task.add_done_callback(_pending_releases.discard)


class Store(Protocol):
    """What ``CassandraSession.store`` builds: every store in ``infra.stores`` has this ``open``."""

    @classmethod
    async def open(cls, settings: ReadModelSettings | None = None, *, session: Any = None) -> Self: ...

    async def close(self) -> None: ...


S = TypeVar("S", bound=Store)


class CassandraSession:
    """A process's one Cassandra session and the stores on it, opened on first use (module docstring).

    ``settings``: where Cassandra is; None reads ``ReadModelSettings()`` from the environment at the
    first open (so a process that never needs Cassandra never reads them). ``reopen_interval_s``
    overrides the settings' ``reopen_interval_s``. ``connect`` (tests) replaces ``open_session``.
    """

    def __init__(
        self,
        settings: ReadModelSettings | None = None,
        *,
        reopen_interval_s: float | None = None,
        connect: Callable[[ReadModelSettings], Awaitable[tuple[Any, Any]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._reopen_interval_s = reopen_interval_s
        self._connect = connect
        self._clock = clock
        self.sessions_opened = 0  # driver clusters this provider connected (the must-show counts them)
        # The value is (cluster, session): the cluster is what close releases.
        self._session: Reopening[tuple[Any, Any]] = Reopening(
            "cassandra session", self._open_session, self._interval, release=_close_cluster, clock=clock
        )
        self._stores: dict[type, Reopening[Any]] = {}

    @property
    def settings(self) -> ReadModelSettings:
        if self._settings is None:
            self._settings = ReadModelSettings()
        return self._settings

    @property
    def reopen_interval_s(self) -> float:
        return self._interval()

    def _interval(self) -> float:
        if self._reopen_interval_s is not None:
            return self._reopen_interval_s
        return self._settings.reopen_interval_s if self._settings is not None else REOPEN_INTERVAL_S_DEFAULT

    @property
    def is_open(self) -> bool:
        return self._session.value is not None

    async def _open_session(self) -> tuple[Any, Any]:
        settings = self.settings  # a bad CHATPLANE_CASSANDRA_* value fails this open (and is logged)
        cluster, session = await (self._connect or open_session)(settings)
        self.sessions_opened += 1
        log.info("cassandra session open (%s:%d)", ",".join(settings.hosts), settings.port)
        return cluster, session

    async def session(self) -> Any:
        """The shared driver session (opened now if needed). Raises ``CassandraUnavailable`` or the
        connect's error."""
        _, session = await self._session.get()
        return session

    def reopening(self, kind: type[S]) -> Reopening[S]:
        """The lazily built ``kind`` store on the shared session (one per kind, same policy)."""
        lazy = self._stores.get(kind)
        if lazy is None:

            async def build() -> S:
                return await kind.open(self.settings, session=await self.session())

            lazy = self._stores[kind] = Reopening(kind.__name__, build, self._interval, release=_close_store, clock=self._clock)
        return lazy

    async def store(self, kind: type[S], *, wait_s: float | None = OPEN_WAIT_S) -> S:
        """The ``kind`` store built on the shared session, opening what is not open yet; the caller
        waits at most ``wait_s`` (None: unbounded) for an open in flight (``TimeoutError``)."""
        lazy = self.reopening(kind)
        if lazy.value is not None:
            return lazy.value
        if wait_s is None:
            return await lazy.get()
        async with asyncio.timeout(wait_s):
            return await lazy.get()

    async def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Release the stores and the cluster (at the process's shutdown), waiting at most ``wait_s``
        for an open in flight (one arriving later is released on arrival); later calls fail."""
        for lazy in list(self._stores.values()):
            await lazy.close(wait_s)
        await self._session.close(wait_s)


async def _close_store(store: Any) -> None:
    await store.close()  # a store on a shared session releases nothing of the session's


async def _close_cluster(opened: tuple[Any, Any]) -> None:
    await close_cluster(opened[0])
