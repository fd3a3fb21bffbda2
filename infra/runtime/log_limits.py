"""A bound on repeated log lines, installed by every process entry point.

When Kafka or Cassandra is unreachable, the client libraries log the same error line on every retry
(a 10-second broker restart wrote tens of thousands of lines to the processor's log). The
retries themselves are paced by ``infra.runtime.kafka_settings``; this filter bounds what they
write. Per (logger, message template) it lets the first ``LOG_REPEATS_PER_INTERVAL_MAX`` records of
each ``LOG_REPEAT_INTERVAL_S`` window through, drops the rest of that window, and writes one summary
line once the window is over::

    ERROR aiokafka.client suppressed 68 similar lines in a 10 s window: Unable connect to node with id %s: %s

The template is the record's unformatted message (``record.msg``), so lines that differ only in
their arguments (a node id, an error) count as one. Only WARNING and above are limited: INFO lines
are the product's own per-event lines (one per request, per rebalance) and are kept whole. The
summary of a window is written when the next limited record arrives (any template) after the window
ended, since a filter has no timer; a storm that stops is summarized by the next warning, or never
if none comes. At most ``LOG_TEMPLATES_TRACKED_MAX`` templates are tracked (the oldest window is
closed, with its summary, to make room).

``install_log_limits()`` puts one filter on each handler of the root logger, after the entry point
configured logging (faust's worker replaces the root handlers: the processor installs it from the
worker's root-logger hook). Records from every logger reach those handlers by propagation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

LOG_REPEATS_PER_INTERVAL_MAX = 10  # records of one template let through per window
LOG_REPEAT_INTERVAL_S = 10.0  # the window
LOG_LIMITED_LEVEL_MIN = logging.WARNING  # records below this level pass untouched
LOG_TEMPLATES_TRACKED_MAX = 1_000  # windows remembered at once (bounded memory under any log content)


@dataclass(slots=True)
class _Window:
    start_s: float
    passed: int = 0
    suppressed: int = 0
    level: int = logging.NOTSET  # the highest level suppressed: the summary's level


class RepeatedLogFilter(logging.Filter):
    """Lets ``burst_max`` records per (logger, template) through per ``interval_s``; summarizes the rest.

    Args:
        emit: where a summary record goes (the handler's ``handle``: the summary passes this filter
            like any record, under its own template).
        burst_max, interval_s, level_min, templates_max: see the module's constants.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        emit: Callable[[logging.LogRecord], object],
        *,
        burst_max: int = LOG_REPEATS_PER_INTERVAL_MAX,
        interval_s: float = LOG_REPEAT_INTERVAL_S,
        level_min: int = LOG_LIMITED_LEVEL_MIN,
        templates_max: int = LOG_TEMPLATES_TRACKED_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        assert burst_max >= 1 and interval_s > 0 and templates_max >= 1
        self.emit = emit
        self.burst_max = burst_max
        self.interval_s = interval_s
        self.level_min = level_min
        self.templates_max = templates_max
        self.clock = clock
        # (logger name, template) -> its current window, oldest window first.
        self._windows: OrderedDict[tuple[str, str], _Window] = OrderedDict()
        self._lock = threading.Lock()  # faust's consumer and the Cassandra driver log from their threads

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level_min:
            return True
        now_s = self.clock()
        key = (record.name, str(record.msg))
        with self._lock:
            ended = self._close_ended_windows(now_s)
            window = self._windows.get(key)
            if window is None:
                window = self._windows[key] = _Window(start_s=now_s)
                if len(self._windows) > self.templates_max:
                    ended.append(self._windows.popitem(last=False))
            if window.passed < self.burst_max:
                window.passed += 1
                passes = True
            else:
                window.suppressed += 1
                window.level = max(window.level, record.levelno)
                passes = False
        for (name, template), closed in ended:
            if closed.suppressed:
                self.emit(self._summary(name, template, closed))
        return passes

    def _close_ended_windows(self, now_s: float) -> list[tuple[tuple[str, str], _Window]]:
        """Remove the windows that ended by ``now_s`` (oldest first, so the scan stops at the first open one)."""
        ended = []
        while self._windows:
            key, window = next(iter(self._windows.items()))
            if now_s - window.start_s < self.interval_s:
                break
            ended.append(self._windows.popitem(last=False))
        return ended

    def _summary(self, name: str, template: str, window: _Window) -> logging.LogRecord:
        return logging.LogRecord(
            name, window.level, __file__, 0,
            "suppressed %d similar lines in a %.0f s window: %s", (window.suppressed, self.interval_s, template), None,
        )


def install_log_limits(logger: logging.Logger | None = None) -> None:
    """Put a ``RepeatedLogFilter`` on each handler of ``logger`` (the root logger) that has none yet."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RepeatedLogFilter) for f in handler.filters):
            handler.addFilter(RepeatedLogFilter(handler.handle))
