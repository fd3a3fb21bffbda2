"""Where a process's memory goes, for the soak (bench/soak.py): tracemalloc snapshots written on a timer.

Off unless ``CHATPLANE_MEMTRACE_DIR`` names a directory: then the process starts ``tracemalloc``
(``CHATPLANE_MEMTRACE_FRAMES`` frames per allocation, default 8) and a daemon thread writes one
snapshot every ``CHATPLANE_MEMTRACE_INTERVAL_S`` seconds (default 60) to
``<dir>/<component>-<pid>-<n>.snap``, at most ``CHATPLANE_MEMTRACE_SNAPSHOTS_MAX`` of them (default 60).
``python -m infra.runtime.memtrace A.snap B.snap`` prints what grew between two snapshots, by
traceback. tracemalloc costs CPU and memory of its own: a diagnostic, never a production setting.
"""

from __future__ import annotations

import argparse
import os
import threading
import tracemalloc
from pathlib import Path



def _number(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = -1.0
    if value <= 0:
        raise SystemExit(f"{name}={raw!r}: expected a number > 0")
    return value


def maybe_start(component: str) -> bool:
    """Start the snapshot thread when ``CHATPLANE_MEMTRACE_DIR`` is set; True when it was."""
    directory = os.environ.get("CHATPLANE_MEMTRACE_DIR")
    if not directory:
        return False
    frames = int(_number("CHATPLANE_MEMTRACE_FRAMES", 8))
    interval_s = _number("CHATPLANE_MEMTRACE_INTERVAL_S", 60)
    snapshots_max = int(_number("CHATPLANE_MEMTRACE_SNAPSHOTS_MAX", 60))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(max(1, frames))

    def run() -> None:
        stop = threading.Event()
        for n in range(max(1, snapshots_max)):
            if stop.wait(interval_s):
                return
            snapshot = tracemalloc.take_snapshot().filter_traces(
                (tracemalloc.Filter(False, tracemalloc.__file__),)
            )
            snapshot.dump(str(out / f"{component}-{os.getpid()}-{n:03d}.snap"))

    threading.Thread(target=run, name="memtrace", daemon=True).start()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description="What grew between two tracemalloc snapshots.")
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--group", choices=("traceback", "lineno", "filename"), default="traceback")
    parser.add_argument("--frames", type=int, default=6, help="frames printed per traceback")
    args = parser.parse_args()
    before = tracemalloc.Snapshot.load(args.before)
    after = tracemalloc.Snapshot.load(args.after)
    stats = after.compare_to(before, args.group)
    total = sum(s.size_diff for s in stats)
    print(f"total diff {total / 1024:+.1f} KiB over {len(stats)} groups")
    for stat in stats[: args.top]:
        print(f"{stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+8d} blocks (now {stat.size / 1024:.1f} KiB)")
        if args.group == "traceback":
            for line in stat.traceback.format(limit=args.frames, most_recent_first=True):
                print("      " + line.strip())
        else:
            print("      " + str(stat.traceback[0]))


if __name__ == "__main__":
    main()
