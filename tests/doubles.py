"""Test doubles for our own seams, kept out of the installed packages (nothing in them imports ``tests``).

``MemoryResultSink`` stands in for the Cassandra result store behind ``workers.worker.ResultSink``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

RESULTS_KEPT_MAX = 1_000


@dataclass
class MemoryResultSink:
    """Keeps results in memory, the newest ``max_items`` of them; a ``workers.worker.ResultSink``."""

    max_items: int = RESULTS_KEPT_MAX
    items: collections.OrderedDict[tuple[str, int], tuple[str, tuple[int, int]]] = field(
        default_factory=collections.OrderedDict
    )

    async def put(self, generation_id: str, epoch: int, text: str, usage: tuple[int, int]) -> bool | None:
        self.items[(generation_id, epoch)] = (text, usage)
        while len(self.items) > self.max_items:
            self.items.popitem(last=False)
        return True
