"""``python -m edge``: the edge under uvicorn, with drain on SIGTERM.

First SIGTERM: readiness fails at once (``/readyz`` -> 503) and new submissions are refused
(``capacity_exhausted``, Retry-After 1: the load balancer sends the retry to another replica);
held streams run on until ``CHATPLANE_EDGE_DRAIN_DEADLINE_S``; the rest are cancelled (reason
``drain``) and get their terminal event when the processor commits it (bounded by
``CHATPLANE_EDGE_DRAIN_CANCEL_WAIT_S``); then uvicorn shuts down. A second signal exits at once.

Connections (``uvicorn_config``, ``edge.uvicorn_adapter``): a request head not read within
``CHATPLANE_EDGE_REQUEST_HEAD_TIMEOUT_S`` closes its connection, and a connection accepted while
``CHATPLANE_EDGE_CONNECTIONS_MAX`` are open is answered ``503 capacity_exhausted`` and closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import resource
from types import FrameType
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI

from edge import errors
from edge.app import create_app
from edge.deps import new_request_id
from edge.settings import EdgeSettings
from edge.state import edge_of
from edge.uvicorn_adapter import HEAD_BYTES, bounded_h11_protocol
from infra.stores.schema import ReadModelSettings
from infra.runtime import memtrace, tracing
from infra.runtime.malloc_tuning import tune_malloc
from infra.runtime.log_limits import install_log_limits
from infra.runtime.event_loop import event_loop_kind
from infra.runtime.settings import SettingsError, exit_on_settings_error, log_level
from schemas.codes import RejectionCode
from schemas.messages import RejectionDetails

log = logging.getLogger("chatplane.edge")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app_state: object) -> None:
        super().__init__(config)
        self.edge = app_state
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self.should_exit:
            self.force_exit = True
            self.should_exit = True
            return
        # A signal handler runs between bytecodes of the loop's thread, possibly while the loop
        # sleeps in select(): schedule through the self-pipe so the loop wakes up at once.
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_future()  # marks "drain started" until the task replaces it
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        edge = self.edge
        settings = edge.settings  # type: ignore[attr-defined]
        log.info("drain started: %d streams held", len(edge.hub.streams))  # type: ignore[attr-defined]
        result = await edge.hub.drain(settings.drain_deadline_s, settings.drain_cancel_wait_s)  # type: ignore[attr-defined]
        log.info("drain finished: cancelled=%d unresolved=%d", result["cancelled"], result["unresolved"])
        self.should_exit = True


# File descriptors the process needs besides its client connections (Kafka and Cassandra clients, logs).
DESCRIPTORS_RESERVED = 256


def connection_refusal(connections_max: int) -> bytes:
    """The answer of a connection over ``connections_max``: the typed ``503 capacity_exhausted``
    (Retry-After 1: the load balancer sends the retry to another replica), then the close."""
    body = orjson.dumps(
        errors.error_body(
            RejectionCode.CAPACITY_EXHAUSTED, new_request_id(),
            {"limit": connections_max, "retry_after_ms": errors.DRAINING_RETRY_AFTER_S * 1000},
        )
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncache-control: no-store\r\n"
        f"retry-after: {errors.DRAINING_RETRY_AFTER_S}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def bad_request_refusal(reason: str, head_bytes_max: int) -> bytes:
    """The answer to a request head over ``head_bytes_max`` (``HEAD_BYTES``) or to bytes that are not
    an HTTP/1.1 request (``MALFORMED``): the typed ``400 invalid_request``, then the close."""
    if reason == HEAD_BYTES:
        err = errors.ApiError(
            RejectionCode.INVALID_REQUEST, RejectionDetails(limit=head_bytes_max), field="headers",
            message=f"The request head (request line and headers) is over its limit of {head_bytes_max} bytes.",
        )
    else:
        err = errors.ApiError(RejectionCode.INVALID_REQUEST, field="request", message="The request is not valid HTTP/1.1.")
    body = orjson.dumps(
        errors.error_body(err.code, new_request_id(), errors.details_json(err.details, err.field), message=errors.message_of(err))
    )
    head = (
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncache-control: no-store\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def uvicorn_config(app: FastAPI, settings: EdgeSettings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration of the edge, with the connection bounds of ``edge.uvicorn_adapter``
    (tests serve the app with it too; ``overrides`` replace single options)."""
    metrics = edge_of(app).metrics
    options: dict[str, Any] = dict(
        host=settings.host,
        port=settings.port,
        access_log=False,  # access logs would carry paths with ids only, but the edge logs its own
        timeout_graceful_shutdown=int(settings.drain_deadline_s + settings.drain_cancel_wait_s + 5),
        lifespan="on",
        backlog=4096,
        # The connection bound is the protocol's (connections_max, at accept): uvicorn's own
        # limit_concurrency would count only once a request head is read.
        limit_concurrency=None,
        timeout_keep_alive=15,
        # The client address is the socket peer unless it is a configured trusted proxy (edge/client_ip.py);
        # uvicorn's own rewriting would believe X-Forwarded-For from 127.0.0.1 (FORWARDED_ALLOW_IPS).
        proxy_headers=False,
        # uvloop unless CHATPLANE_EVENT_LOOP=asyncio; uvicorn installs it (infra/runtime/event_loop.py).
        loop=event_loop_kind(),
        http=bounded_h11_protocol(
            head_timeout_s=settings.request_head_timeout_s,
            connections_max=settings.connections_max,
            refusal=lambda: connection_refusal(settings.connections_max),
            on_close=lambda reason: metrics.connections_closed.labels(reason).inc(),
            head_bytes_max=settings.request_head_bytes_max,
            bad_request=lambda reason: bad_request_refusal(reason, settings.request_head_bytes_max),
        ),
        # h11's own bound on an incomplete head, the same as the adapter's (which checks it first).
        h11_max_incomplete_event_size=settings.request_head_bytes_max,
    )
    options.update(overrides)
    return uvicorn.Config(app, **options)


def warn_if_descriptors_short(connections_max: int) -> None:
    """A process limit on open files below the connection bound fails accepts (EMFILE) before it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < connections_max + DESCRIPTORS_RESERVED:
        log.warning(
            "open-file limit %d is below CHATPLANE_EDGE_CONNECTIONS_MAX=%d + %d: accepts fail before the bound",
            soft, connections_max, DESCRIPTORS_RESERVED,
        )


def main() -> None:
    try:
        level = log_level("INFO")
        settings = EdgeSettings()
        if settings.read_model:
            # The read model opens lazily; its settings (CHATPLANE_CASSANDRA_*, ...) are checked now.
            ReadModelSettings()
        tracing.configure("chatplane-edge")
        event_loop_kind()  # a bad CHATPLANE_EVENT_LOOP stops the edge here, named
    except SettingsError as exc:
        exit_on_settings_error(exc)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    install_log_limits()
    tune_malloc()
    memtrace.maybe_start("edge")
    if settings.uses_dev_secrets:
        log.warning("development mode: built-in development secrets in use (never outside a development machine)")
    try:
        app = create_app(settings)  # reads the policy checks' settings too (a bad blocklist stops here)
    except SettingsError as exc:
        exit_on_settings_error(exc)
    warn_if_descriptors_short(settings.connections_max)
    config = uvicorn_config(app, settings, log_level=level.lower())
    server = DrainingServer(config, edge_of(app))
    if settings.socket_sndbuf_bytes:
        server.run(sockets=[listening_socket(settings)])
    else:
        server.run()


def listening_socket(settings: EdgeSettings) -> socket.socket:
    """The listening socket with a fixed kernel send buffer per connection (accepted sockets inherit
    it; Linux then stops autotuning it): what a client that stops reading can hold in the kernel,
    beyond the edge's own stream buffer, is bounded by it."""
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.socket_sndbuf_bytes)
    sock.bind((settings.host, settings.port))
    sock.listen(2048)
    return sock


if __name__ == "__main__":
    main()
