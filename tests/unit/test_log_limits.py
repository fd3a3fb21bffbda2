"""The bound on repeated log lines (``infra.runtime.log_limits``), on a fake clock.

A storm of one (logger, template) lets ``burst_max`` lines through per window and then writes one
summary line; other templates, other loggers and lines below WARNING are not affected; and every
process entry point installs the filter on the root logger's handlers.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from infra.runtime.log_limits import LOG_REPEATS_PER_INTERVAL_MAX, RepeatedLogFilter, install_log_limits

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1_000.0

    def __call__(self) -> float:
        return self.now_s


class ListHandler(logging.Handler):
    """Keeps the formatted lines it emits."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name} {record.getMessage()}")


def limited(burst_max: int = 3, interval_s: float = 10.0, templates_max: int = 100) -> tuple[logging.Logger, ListHandler, FakeClock]:
    clock = FakeClock()
    handler = ListHandler()
    handler.addFilter(RepeatedLogFilter(handler.handle, burst_max=burst_max, interval_s=interval_s,
                                        templates_max=templates_max, clock=clock))
    logger = logging.getLogger(f"test.log_limits.{id(handler)}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    return logger, handler, clock


def test_a_storm_passes_burst_max_lines_per_window_then_one_summary():
    logger, handler, clock = limited(burst_max=3, interval_s=10.0)
    for node in range(1_000):  # the arguments differ, the template is the same
        logger.error("Unable connect to node with id %s: %s", node, "refused")
        clock.now_s += 0.001
    assert len(handler.lines) == 3
    assert handler.lines[0] == f"ERROR {logger.name} Unable connect to node with id 0: refused"
    clock.now_s += 10.0  # the window is over: the next limited line writes the summary first
    logger.error("Unable connect to node with id %s: %s", 7, "refused")
    assert handler.lines[3:] == [
        f"ERROR {logger.name} suppressed 997 similar lines in a 10 s window: Unable connect to node with id %s: %s",
        f"ERROR {logger.name} Unable connect to node with id 7: refused",  # a new window
    ]


def test_each_template_and_each_logger_has_its_own_window():
    logger, handler, clock = limited(burst_max=2)
    other = logging.getLogger(logger.name + ".other")
    for _ in range(5):
        logger.warning("Unable to update metadata from %s", [1])
        logger.warning("Failed fetch messages from %s: %s", 1, "NodeNotReadyError")
        other.warning("Unable to update metadata from %s", [1])
    assert len(handler.lines) == 6  # 2 of each of the three (logger, template) pairs


def test_lines_below_warning_are_never_limited():
    logger, handler, _ = limited(burst_max=1)
    for i in range(50):
        logger.info("decided %d", i)
    assert len(handler.lines) == 50


def test_a_storm_that_stops_is_summarized_by_the_next_warning_of_any_template():
    logger, handler, clock = limited(burst_max=1)
    for _ in range(4):
        logger.warning("Heartbeat failed: %r", "x")
    clock.now_s += 11.0
    logger.warning("something else")
    assert handler.lines == [
        f"WARNING {logger.name} Heartbeat failed: 'x'",
        f"WARNING {logger.name} suppressed 3 similar lines in a 10 s window: Heartbeat failed: %r",
        f"WARNING {logger.name} something else",
    ]


def test_a_quiet_window_ends_without_a_summary_and_the_next_window_starts_fresh():
    logger, handler, clock = limited(burst_max=2)
    logger.error("a %s", 1)
    clock.now_s += 10.0
    for _ in range(3):
        logger.error("a %s", 2)
    assert [line.endswith("a 2") for line in handler.lines] == [False, True, True]


def test_the_templates_tracked_are_bounded_and_an_evicted_window_is_summarized():
    logger, handler, _ = limited(burst_max=1, templates_max=2)
    logger.error("first")
    logger.error("first")  # suppressed
    logger.error("second")
    logger.error("third")  # evicts the window of "first", which had one suppressed line
    assert handler.lines == [
        f"ERROR {logger.name} first",
        f"ERROR {logger.name} second",
        f"ERROR {logger.name} suppressed 1 similar lines in a 10 s window: first",
        f"ERROR {logger.name} third",
    ]


def test_install_puts_one_filter_on_each_root_handler_and_is_idempotent():
    root = logging.Logger("fake-root")
    root.addHandler(ListHandler())
    root.addHandler(ListHandler())
    install_log_limits(root)
    install_log_limits(root)
    assert [sum(isinstance(f, RepeatedLogFilter) for f in h.filters) for h in root.handlers] == [1, 1]
    assert LOG_REPEATS_PER_INTERVAL_MAX >= 1


def _calls_install(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "install_log_limits"
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize(
    "entry_point",
    ["edge/__main__.py", "projections/ledger/processor.py", "workers/__main__.py", "projections/readmodel/writer.py"],
)
def test_every_process_entry_point_installs_the_filter(entry_point):
    assert _calls_install(ROOT / entry_point), f"{entry_point} does not call install_log_limits()"


def test_the_processor_installs_it_on_the_root_logger_faust_configures():
    from projections.ledger.processor import _Worker

    root = logging.Logger("fake-root")
    root.addHandler(ListHandler())
    worker = _Worker.__new__(_Worker)  # the hook only; a real worker would start faust
    worker.spinner = None
    worker.on_setup_root_logger(root, logging.WARNING)
    assert any(isinstance(f, RepeatedLogFilter) for f in root.handlers[0].filters)
