"""Admission health: a bounded background probe of the decision round trip, reported apart from readiness.

    edge --ReconcileDue(user_id = probe_user_id(inbox partition))--> COMMANDS --> admission processor
      ^ <------------------------- Outcome on this edge's EDGE_INBOX partition ----------'

``/readyz`` is about the edge itself (started, not draining). It does not follow the processor: a
processor outage must not take every edge out of the load balancer, since the edge still answers
the typed ``503 quota_service_unavailable`` to submits and serves GET and cancel. Whether a decision
round trip works is reported here instead: ``GET /healthz/admission`` (200 up / 503 down), the gauge
``chatplane_edge_admission_up``, the histogram ``chatplane_edge_admission_probe_seconds`` and the
counter ``chatplane_edge_admission_probes_total{result}``. ``infra/edge-wait`` (``make up``) waits
for both, so the stack is reported up only once it can decide.

The probe is one command at a time, every ``CHATPLANE_EDGE_ADMISSION_PROBE_INTERVAL_S``, each waiting
at most ``CHATPLANE_EDGE_ADMISSION_PROBE_TIMEOUT_S``. It is a ``ReconcileDue`` for a reserved user id
(``PROBE_USER_ID_PREFIX``, one per edge inbox partition; ``edge.auth`` refuses tokens for it, so it
is never a real user's). What it leaves behind does not grow: ``decide`` on that user's empty ledger
emits no events (nothing on the ledger, usage, dispatch or read model; the outcome is ``existing``),
and the processor's table keeps one entry for the user: the empty ledger plus its last
``control_plane.aggregate.RECENT_DECISIONS_MAX`` remembered decisions, rewritten in place (the
changelog is compacted by key), with no deadline scheduled.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from edge.metrics import EdgeMetrics
from schemas.commands import ReconcileDue

log = logging.getLogger("chatplane.edge")

# User ids under this prefix are the edge's own probes; a token whose ``sub`` starts with it is refused.
PROBE_USER_ID_PREFIX = "chatplane-admission-probe/"


def probe_user_id(inbox_partition: int) -> str:
    """The reserved user the probes of the edge on ``inbox_partition`` are decided for."""
    return f"{PROBE_USER_ID_PREFIX}edge-inbox-{inbox_partition}"


class ProbeResult(enum.Enum):
    """How the last probe ended (the ``result`` label of ``chatplane_edge_admission_probes_total``)."""

    UP = "up"  # the processor answered within the probe timeout
    TIMEOUT = "timeout"  # no answer within the probe timeout
    ERROR = "error"  # the command could not be sent (Kafka unreachable, too many decisions pending)
    NOT_PROBED = "not_probed"  # no probe has ended yet (the edge is starting)


class AdmissionProbe:
    """Sends the probes and keeps the last result (``status()``), the gauge and the histogram."""

    def __init__(
        self,
        inbox_partition: int,
        interval_s: float,
        timeout_s: float,
        metrics: EdgeMetrics,
        client: Callable[[], Any],
    ) -> None:
        """``client()`` gives the edge's ``CommandClient`` (None before the edge started)."""
        self.user_id = probe_user_id(inbox_partition)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._client = client
        self.result = ProbeResult.NOT_PROBED
        self.round_trip_ms: float | None = None  # of the last answered probe
        self.as_of_ms: int | None = None  # wall-clock time the last probe ended
        self._task: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        return self.result is ProbeResult.UP

    def status(self) -> dict[str, Any]:
        """The body of ``GET /healthz/admission``."""
        as_of = None
        if self.as_of_ms is not None:
            as_of = dt.datetime.fromtimestamp(self.as_of_ms / 1000, tz=dt.UTC).isoformat(timespec="milliseconds")
        return {
            "admission": "up" if self.up else "down",
            "result": self.result.value,
            "round_trip_ms": self.round_trip_ms if self.up else None,
            "as_of": as_of,
            "probe_timeout_s": self.timeout_s,
        }

    async def probe_once(self) -> ProbeResult:
        """One probe, bounded by ``timeout_s``; records its result."""
        client = self._client()
        if client is None:
            return self.result
        now_ms = int(time.time() * 1000)
        probe = ReconcileDue(
            command_id=f"probe-{uuid.uuid4().hex}",
            user_id=self.user_id,
            issued_at_ms=now_ms,
            as_of_ms=now_ms,
            reply_to=client.reply_to(),
        )
        started = time.monotonic()
        failure = ""
        try:
            async with asyncio.timeout(self.timeout_s):
                await client.decide(probe, timeout_s=self.timeout_s)
        except TimeoutError:  # DecisionTimeout is one, and so is our own bound on the send
            result = ProbeResult.TIMEOUT
        except Exception as exc:  # noqa: BLE001 - any failure to get a decision means down
            result, failure = ProbeResult.ERROR, f" ({type(exc).__name__})"
        else:
            result = ProbeResult.UP
            elapsed_s = time.monotonic() - started
            self.round_trip_ms = round(elapsed_s * 1000, 1)
            self.metrics.admission_probe_latency.observe(elapsed_s)
        # Logged when it changes, not every probe (ids and class names only).
        if result is not self.result:
            if result is ProbeResult.UP:
                log.info("admission up: round trip %.1f ms", self.round_trip_ms)
            else:
                log.warning("admission down: probe %s%s", result.value, failure)
        self.result = result
        self.as_of_ms = int(time.time() * 1000)
        self.metrics.admission_up.set(1 if result is ProbeResult.UP else 0)
        self.metrics.admission_probes.labels(result.value).inc()
        return result

    async def run(self) -> None:
        """Probe every ``interval_s`` (from one probe's start to the next) until cancelled."""
        while True:
            started = time.monotonic()
            await self.probe_once()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="admission-probe")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
