"""``GET /metrics`` (Prometheus text) of one process, served inside that process's asyncio loop.

Every process but the edge (which serves its own through FastAPI, ``edge/app.py``) starts one
``MetricsServer`` on its own port setting (docs/metrics.md)::

    processor  CHATPLANE_PROCESSOR_METRICS_PORT   (projections.ledger.settings.ProcessorSettings)
    worker     CHATPLANE_WORKER_METRICS_PORT      (workers.settings.WorkerSettings)
    read model CHATPLANE_READMODEL_METRICS_PORT   (python -m projections.readmodel)
    history    CHATPLANE_HISTORY_METRICS_PORT     (python -m projections.history)
    all        CHATPLANE_METRICS_HOST             (the address they bind; default 127.0.0.1)

A port of 0 (the default) serves nothing: two processes on one host would otherwise fight over a
fixed default, and a test that starts many workers gives each its own port. ``make up`` and the
Kubernetes manifests name the ports.

Serving in the process's own loop (not prometheus_client's threaded server) means the collectors read
the process's dicts and counters from the thread that changes them. Everything is bounded: at most
``METRICS_CONNECTIONS_MAX`` connections at once (more are closed unanswered), a request head of at
most ``METRICS_REQUEST_HEAD_BYTES_MAX`` bytes read within ``METRICS_REQUEST_TIMEOUT_S``, one request
per connection. Nothing but ``GET /metrics`` (and ``GET /healthz``) is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from bisect import bisect_left

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.utils import floatToGoString

from infra.runtime.settings import env_value

log = logging.getLogger("chatplane.metrics")

METRICS_HOST_ENV = "CHATPLANE_METRICS_HOST"
METRICS_HOST_DEFAULT = "127.0.0.1"
PORT_MAX = 65_535
METRICS_CONNECTIONS_MAX = 16  # scrapes served at once; one Prometheus needs one
METRICS_REQUEST_HEAD_BYTES_MAX = 8_192  # request line plus headers
METRICS_REQUEST_TIMEOUT_S = 5.0  # to read the request head, and to write the answer
# Histogram buckets of request-scale latencies (decisions, first tokens, queue age, stops), shared by the
# edge's and the workers' series so their panels compare bucket for bucket.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class MetricsPortUnavailable(RuntimeError):
    """The metrics port could not be bound (in use, or not allowed); the message is one line."""


def metrics_host() -> str:
    """``CHATPLANE_METRICS_HOST``: the address every process's metrics server binds."""
    return str(env_value(METRICS_HOST_ENV, METRICS_HOST_DEFAULT))


def metrics_port(var: str) -> int:
    """A process's metrics port variable (0: off), read and checked by the shared loader."""
    return int(env_value(var, 0, ge=0, le=PORT_MAX))


class MetricsServer:
    """Serves one ``CollectorRegistry`` at ``/metrics`` on ``host:port`` (``start``/``close``)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, *, name: str = "metrics",
                 connections_max: int = METRICS_CONNECTIONS_MAX) -> None:
        self.registry = registry
        self.host, self.port = host, port
        self.name = name
        self.connections_max = connections_max
        self.connections = 0
        self.scrapes = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        """Bind and serve; returns the bound port (logged). ``MetricsPortUnavailable`` when it cannot bind."""
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, self.port, limit=METRICS_REQUEST_HEAD_BYTES_MAX
            )
        except OSError as exc:
            raise MetricsPortUnavailable(
                f"{self.name} metrics: cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("%s metrics on http://%s:%d/metrics", self.name, self.host, self.port)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):  # a scrape in progress ends now (its reader sees EOF)
                writer.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.connections_max:
            writer.close()
            return
        self.connections += 1
        self._writers.add(writer)
        try:
            async with asyncio.timeout(METRICS_REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
                status, content_type, body = self._answer(head)
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n".encode() + body
                )
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that sent no whole request in time, or went away: nothing to answer
        except asyncio.CancelledError:
            # The loop is shutting down. This is the connection's own task, which nothing awaits:
            # ending it quietly spares asyncio's "exception in callback" log line for every scrape.
            pass
        finally:
            self.connections -= 1
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[str, str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3:
            return "400 Bad Request", "text/plain", b"bad request\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method != b"GET":
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if target == b"/metrics":
            self.scrapes += 1
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if target == b"/healthz":
            return "200 OK", "text/plain", b"ok\n"
        return "404 Not Found", "text/plain", b"not found\n"


class LoopHistogram:
    """A histogram for a hot path of one event loop: ``observe`` is a bisect and two additions.

    prometheus_client's ``Histogram.observe`` takes a lock and walks its buckets (about 3 us a call on
    this shared 2-core machine); this one is read by a collector at scrape time (``buckets``), in the
    same loop, so it needs no lock.
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, +Inf last, as ``HistogramMetricFamily.add_metric`` takes them."""
        out, running = [], 0
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)


async def start_metrics_server(registry: CollectorRegistry, port: int, *, name: str,
                               host: str | None = None) -> MetricsServer | None:
    """A started server for ``registry`` on ``port`` of ``host`` (``CHATPLANE_METRICS_HOST``), or
    None when ``port`` is 0 (off)."""
    if port <= 0:
        return None
    server = MetricsServer(registry, host or metrics_host(), port, name=name)
    await server.start()
    return server
