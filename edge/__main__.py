"""``python -m edge``: the edge under uvicorn, with drain on SIGTERM.

First SIGTERM: readiness fails at once (``/readyz`` -> 503) and new submissions are refused
(``capacity_exhausted``, Retry-After 1: the load balancer sends the retry to another replica);
held streams run on until ``CHATPLANE_EDGE_DRAIN_DEADLINE_S``; the rest are cancelled (reason
``drain``) and get their terminal event when the processor commits it (bounded by
``CHATPLANE_EDGE_DRAIN_CANCEL_WAIT_S``); then uvicorn shuts down. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from edge.app import create_app
from edge.settings import EdgeSettings
from projections.readmodel.schema import ReadModelSettings
from projections.shared.log_limits import install_log_limits
from projections.shared.settings import SettingsError, exit_on_settings_error, log_level

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


def main() -> None:
    try:
        level = log_level("INFO")
        settings = EdgeSettings()
        if settings.read_model:
            # The read model opens lazily; its settings (CHATPLANE_CASSANDRA_*, ...) are checked now.
            ReadModelSettings()
    except SettingsError as exc:
        exit_on_settings_error(exc)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    install_log_limits()
    if settings.uses_dev_secrets:
        log.warning("development mode: built-in development secrets in use (never outside a development machine)")
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=level.lower(),
        access_log=False,  # access logs would carry paths with ids only, but the edge logs its own
        timeout_graceful_shutdown=int(settings.drain_deadline_s + settings.drain_cancel_wait_s + 5),
        lifespan="on",
        backlog=4096,
        limit_concurrency=None,
        timeout_keep_alive=15,
    )
    server = DrainingServer(config, app.state.edge)
    server.run()


if __name__ == "__main__":
    main()
