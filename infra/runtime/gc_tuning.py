"""Cyclic-GC settings for the long-running processes (processor, edge, workers)."""

from __future__ import annotations

import gc

GC_GEN0_THRESHOLD_DEFAULT = 50_000  # Python's own default is 700


def tune_gc(gen0_threshold: int) -> None:
    """Fewer, cheaper cyclic-GC pauses. Python's full collection scans every tracked object: in the
    processor, with the libraries loaded and a thousand users' aggregates decoded, it took 100-160
    ms (seen beside the slowest decisions of bench_processor's latency run). Objects alive at
    start-up (modules, the libraries' state) are moved out of the collector's sight (``gc.freeze``;
    reference counting still frees them), and a young generation of ``gen0_threshold`` allocations (Python: 700)
    makes collections rarer. 0 leaves Python's defaults."""
    if gen0_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
