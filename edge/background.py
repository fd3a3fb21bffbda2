"""The edge's fire-and-forget sends: commands and messages a handler or the inbox reader must not
wait for, run as tasks with a bounded count.

Data flow::

    StreamHub (CancelGeneration, DetachReader, AttachReader)  --+
    PromptPublisher (PromptPublished, PromptPayload)            +--> BackgroundSends.spawn --> task
    edge.replay (AttachReader / DetachReader of a replay)     --+        (failure: logged, not raised)
    Edge.stop / StreamHub.drain  --> BackgroundSends.flush (waits for what is in flight, bounded)

Bound: at most ``BACKGROUND_SENDS_MAX`` in flight at once, all senders together; beyond it a send is
dropped (its coroutine closed) and counted in ``dropped``. The processor's deadlines still settle
the generation whose cancel or detach was dropped, and a worker that gets no prompt asks again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

# The logger these sends always logged under (before they left edge/streams.py).
log = logging.getLogger("chatplane.edge.streams")

# Background sends (cancels, prompt payloads) in flight at once; beyond this they are dropped and
# counted, and the processor's deadlines still settle the generation.
BACKGROUND_SENDS_MAX = 10_000


class BackgroundSends:
    """Runs sends in the background, at most ``BACKGROUND_SENDS_MAX`` at once."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.dropped = 0

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task; drop it (counted) when the bound is reached."""
        if len(self._tasks) >= BACKGROUND_SENDS_MAX:
            coro.close()
            self.dropped += 1
            return
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (at most ``timeout_s``) for the sends in flight."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background send failed: %s", type(task.exception()).__name__)
