"""infra.runtime.malloc_tuning and infra.runtime.memtrace: the soak's memory settings and
diagnostics (each run in a fresh interpreter, so the test process keeps its own allocator and tracer)."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TUNE = """
import threading
from infra.runtime.malloc_tuning import tune_malloc
print(tune_malloc(), sorted(t.name for t in threading.enumerate() if t.name == "malloc-trim"))
"""

TRACE = """
import threading, tracemalloc
from infra.runtime import memtrace
print(memtrace.maybe_start("unit"), tracemalloc.is_tracing())
keep = [bytes(1000) for _ in range(2000)]
for t in threading.enumerate():
    if t.name == "memtrace":
        t.join(timeout=30)  # the thread ends by itself after SNAPSHOTS_MAX snapshots; a thread still
        print("ended" if not t.is_alive() else "running")  # writing after that is the defect tested
"""


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CHATPLANE_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**base, **env},
                          timeout=60)


def test_defaults_cap_the_arenas_and_start_the_trim_thread():
    out = run(TUNE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(None, 1) == ["True", "['malloc-trim']\n"]


def test_zero_changes_nothing():
    out = run(TUNE, CHATPLANE_MALLOC_ARENA_MAX="0", CHATPLANE_MALLOC_TRIM_INTERVAL_S="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(None, 1) == ["False", "[]\n"]


def test_a_bad_value_stops_the_process_naming_the_variable():
    out = run(TUNE, CHATPLANE_MALLOC_TRIM_INTERVAL_S="soon")
    assert out.returncode != 0
    assert "CHATPLANE_MALLOC_TRIM_INTERVAL_S='soon'" in out.stderr


def test_memtrace_is_off_unless_a_directory_is_named():
    out = run(TRACE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]  # and no memtrace thread to wait for


def test_memtrace_writes_snapshots_that_the_diff_reads(tmp_path):
    out = run(TRACE, CHATPLANE_MEMTRACE_DIR=str(tmp_path), CHATPLANE_MEMTRACE_INTERVAL_S="0.2",
              CHATPLANE_MEMTRACE_SNAPSHOTS_MAX="3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "ended"]
    snaps = sorted(tmp_path.glob("unit-*.snap"))
    assert len(snaps) == 3  # bounded by SNAPSHOTS_MAX: the thread stopped after the third
    assert sum(t.size for t in tracemalloc.Snapshot.load(str(snaps[-1])).traces) > 2_000_000
    diff = subprocess.run([sys.executable, "-m", "infra.runtime.memtrace", str(snaps[0]), str(snaps[-1]), "--top", "3"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout.startswith("total diff ")
