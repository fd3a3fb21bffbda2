"""Shedding: refuse a submit at once, typed and retryable, when this edge can already see that
its decision would come late, instead of queueing it behind the backlog.

The seed's admission objective is a typed decision for 99.95 % of bounded valid requests within
500 ms, and "a quick 503 satisfies it". Without shedding an overloaded stack queues: each submit's
command waits behind every earlier one in the processor's partition, and at 2-3x capacity decisions
took seconds (the whole-stack benchmark: 3.5 % within 500 ms at 100/s). Two signals, both read in
O(1) on the submit path, before anything is sent or counted against the user:

- **late decisions**: the oldest decision this edge still awaits (``CommandClient``) has waited more
  than ``CHATPLANE_EDGE_SHED_DECISION_AGE_MS``: the processor's partitions are behind, and a new
  command would queue behind that one. Refused ``503 quota_service_unavailable``, Retry-After 1.
- **a busy edge**: this process's event loop runs late by more than ``CHATPLANE_EDGE_SHED_LOOP_LAG_MS``
  (measured by a timer every ``LAG_PROBE_INTERVAL_S``; a stall still in progress counts as it
  happens): the edge itself cannot serve more. Refused ``503 capacity_exhausted``, Retry-After 1.

- **too much work in flight** (adaptive, additive-increase / multiplicative-decrease): the edge holds
  a limit on the generations it holds plus the submits it awaits decisions for. A submit whose
  decision round trip (from its append) took longer than ``CHATPLANE_EDGE_SHED_LATENCY_TARGET_MS``,
  or timed out, cuts the limit to 0.9 x what is in flight then (at most one cut per
  ``CUT_SPACING_TARGETS`` targets); each one decided in time while the limit is in use raises it by
  one. A submit arriving while ``limit`` are in flight is refused ``503 capacity_exhausted``.
  The limit never falls below ``CHATPLANE_EDGE_SHED_STREAMS_MIN`` nor rises above
  ``CHATPLANE_EDGE_STREAMS_MAX``. This is the signal that caps the work that costs CPU after the
  decision (the streams), which the other two see only once the machine is already behind.

Any setting at 0 turns its signal off. The shedding heals itself: refused submits add no pending
decisions, so the oldest pending age falls as soon as the processor catches up. Counted in
``chatplane_edge_shed{reason}`` and under the code in ``chatplane_edge_admissions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from edge.errors import ApiError
from edge.metrics import SHED_REASONS
from schemas.codes import RejectionCode

LAG_PROBE_INTERVAL_S = 0.1
SHED_RETRY_AFTER_S = 1
DECREASE_FACTOR = 0.9
# At most one cut of the in-flight limit per this many latency targets: the decisions late in one
# burst are one signal, not one each (a one-second processor pause at 50/s would otherwise make ~50
# cuts and collapse the limit to its minimum).
CUT_SPACING_TARGETS = 4
DECISIONS_LATE, EDGE_BUSY, IN_FLIGHT_LIMIT = SHED_REASONS


class LoadShedder:
    def __init__(
        self,
        decision_age_max_ms: int,
        loop_lag_max_ms: int,
        client: Callable[[], Any],
        *,
        latency_target_ms: int = 0,
        streams_min: int = 1,
        streams_max: int = 1,
        held: Callable[[], int] = lambda: 0,
    ) -> None:
        """``client()`` gives the edge's ``CommandClient`` (None before the edge started); ``held()``
        the number of generations the edge holds now."""
        self.decision_age_max_s = decision_age_max_ms / 1000
        self.loop_lag_max_s = loop_lag_max_ms / 1000
        self.latency_target_s = latency_target_ms / 1000
        self.streams_min, self.streams_max = max(1, streams_min), max(1, streams_min, streams_max)
        self.limit = float(self.streams_max)
        self.deciding = 0  # submits sent and not yet decided (they become held streams if admitted)
        self._last_cut = -float("inf")
        self._client = client
        self._held = held
        self.loop_lag_s = 0.0  # how late the last lag probe ran
        self._next_tick = 0.0  # monotonic time the next probe is due
        self._task: asyncio.Task[None] | None = None

    def lag_s(self) -> float:
        """The event loop's lateness now: the last probe's, or the one still overdue."""
        if self._task is None:
            return 0.0
        return max(self.loop_lag_s, time.monotonic() - self._next_tick)

    def refusal(self) -> tuple[str, ApiError] | None:
        """Why a submit arriving now is refused (its reason, one of ``SHED_REASONS``, and its answer),
        or None to go on."""
        if self.decision_age_max_s > 0:
            client = self._client()
            if client is not None and client.oldest_pending_age_s() > self.decision_age_max_s:
                return DECISIONS_LATE, ApiError(RejectionCode.QUOTA_SERVICE_UNAVAILABLE, retry_after_s=SHED_RETRY_AFTER_S)
        if self.loop_lag_max_s > 0 and self.lag_s() > self.loop_lag_max_s:
            return EDGE_BUSY, ApiError(RejectionCode.CAPACITY_EXHAUSTED, retry_after_s=SHED_RETRY_AFTER_S)
        if self.latency_target_s > 0 and self.in_flight() >= int(self.limit):
            return IN_FLIGHT_LIMIT, ApiError(RejectionCode.CAPACITY_EXHAUSTED, retry_after_s=SHED_RETRY_AFTER_S)
        return None

    def in_flight(self) -> int:
        """Generations held plus submits awaiting their decision."""
        return self._held() + self.deciding

    def observe(self, round_trip_s: float) -> None:
        """A submit's decision took ``round_trip_s`` from its append (a timeout: pass the wait); adjust the
        in-flight limit. Only the round trip counts, never the client's upload or the edge's own checks."""
        if self.latency_target_s <= 0:
            return
        in_flight = self.in_flight()
        now = time.monotonic()
        if round_trip_s > self.latency_target_s:
            if now - self._last_cut >= CUT_SPACING_TARGETS * self.latency_target_s:
                self._last_cut = now
                self.limit = float(max(self.streams_min, int(min(self.limit, in_flight) * DECREASE_FACTOR)))
        elif in_flight + 1 >= int(self.limit):
            self.limit = min(float(self.streams_max), self.limit + 1)

    async def _probe(self) -> None:
        while True:
            self._next_tick = time.monotonic() + LAG_PROBE_INTERVAL_S
            await asyncio.sleep(LAG_PROBE_INTERVAL_S)
            self.loop_lag_s = max(0.0, time.monotonic() - self._next_tick)

    def start(self) -> None:
        if self.loop_lag_max_s > 0:
            self._next_tick = time.monotonic() + LAG_PROBE_INTERVAL_S
            self._task = asyncio.get_running_loop().create_task(self._probe(), name="loop-lag-probe")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
