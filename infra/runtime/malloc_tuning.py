"""glibc malloc settings for the long-running processes (processor, read model, workers, edge).

The soak (bench/soak.py) saw the edge's, the processor's and the worker's RSS grow 5-9 %
between minute 5 and minute 30 while tracemalloc (``CHATPLANE_MEMTRACE_DIR``) showed the memory
Python holds flat after its bounded caches filled (the edge: 109.7 -> 110.6 MiB traced over 8 minutes
while its RSS rose ~30 MiB): memory freed back to malloc but not to the system. glibc gives every
thread that allocates its own arena (up to 8 per core: the Cassandra driver's and the executor's
threads, llama.cpp's tokenizer, the event loop) and returns a freed page inside an arena only when
asked. So each process, at start, before its threads exist:

- caps the arenas at ``CHATPLANE_MALLOC_ARENA_MAX`` (default 2; 0 keeps glibc's own), and
- every ``CHATPLANE_MALLOC_TRIM_INTERVAL_S`` (default 60; 0 never) calls ``malloc_trim(0)`` from a
  daemon thread (ctypes releases the GIL for the call), which gives free pages back with madvise.

A trim holds the arenas' locks while it walks them: ~10 ms on a fragmented 150 MiB heap (measured
here), during which another thread's malloc waits; once a minute that is a pause well below the
edge's shedding threshold for a late event loop (200 ms).

Not glibc (musl, another libc): nothing is changed, and the function says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger("chatplane.malloc")

M_ARENA_MAX = -8  # glibc's mallopt parameter number
ARENA_MAX_DEFAULT = 2
TRIM_INTERVAL_S_DEFAULT = 60.0


def _setting(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r}: expected a number >= 0") from None
    if value < 0:
        raise SystemExit(f"{name}={raw!r}: expected a number >= 0")
    return value


def tune_malloc() -> bool:
    """Apply the settings above; True when this is glibc and something was set."""
    arena_max = int(_setting("CHATPLANE_MALLOC_ARENA_MAX", ARENA_MAX_DEFAULT))
    trim_interval_s = _setting("CHATPLANE_MALLOC_TRIM_INTERVAL_S", TRIM_INTERVAL_S_DEFAULT)
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        log.info("not glibc: malloc settings left as they are")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    if arena_max > 0 and mallopt(M_ARENA_MAX, arena_max) != 1:  # glibc: 1 on success
        log.warning("mallopt(M_ARENA_MAX, %d) refused: arenas left as they are", arena_max)
        arena_max = 0
    if trim_interval_s > 0:
        stop = threading.Event()

        def trim() -> None:
            while not stop.wait(trim_interval_s):
                malloc_trim(0)

        threading.Thread(target=trim, name="malloc-trim", daemon=True).start()
    return arena_max > 0 or trim_interval_s > 0
