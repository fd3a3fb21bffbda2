"""infra.runtime.gc_tuning: the processor's and the edge's cyclic-GC settings (run in a fresh
interpreter so the test process keeps its own)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc, sys
from infra.runtime.gc_tuning import tune_gc
before = gc.get_threshold()
tune_gc(int(sys.argv[1]))
print(before[0], gc.get_threshold()[0], gc.get_freeze_count() > 0)
"""


def probe(gen0: int) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(gen0)], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_a_threshold_freezes_the_start_up_objects_and_enlarges_the_young_generation():
    assert probe(50_000) == ["700", "50000", "True"]


def test_zero_keeps_pythons_settings():
    assert probe(0) == ["700", "700", "False"]
