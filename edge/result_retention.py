"""Completed results this edge keeps in memory: the text of each generation it held that completed,
for GET and same-key retries when the read model is off (or has not projected it yet).

Data flow::

    StreamHub (GenerationFinalized, completed, text whole)  --retain(id, text)-->  ResultRetention
    Edge.lookup_with_result / Edge.result (GET, retries)    --result_of(id)---->   text, or None
                                                                                   once expired

Bounds: every entry lives ``ttl_s`` (the policy's ``result_ttl_ms``), and all entries together count
at most ``bytes_max`` (``result_cache_bytes_max``, CHATPLANE_EDGE_RESULT_CACHE_BYTES_MAX): each its
text bytes plus ``RESULT_ENTRY_OVERHEAD_BYTES``, so that many short or empty results are bounded too
(counting the text alone let empty results pile up without end). Expired entries go first, then the
oldest (every entry has the same time to live, so the oldest is also the first to expire).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from edge.settings import EdgeSettings

# What each retained result counts besides its text (see the module docstring).
RESULT_ENTRY_OVERHEAD_BYTES = 256


class ResultRetention:
    """Completed results by generation id, each for ``ttl_s``, at most ``bytes_max`` in all."""

    def __init__(self, ttl_s: float, bytes_max: int) -> None:
        self.ttl_s = ttl_s
        self.bytes_max = bytes_max
        self.entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (text, expires monotonic s)
        self.bytes_held = 0

    @classmethod
    def from_settings(cls, settings: EdgeSettings) -> ResultRetention:
        return cls(settings.policy.result_ttl_ms / 1000, settings.result_cache_bytes_max)

    def retain(self, generation_id: str, text: str) -> None:
        """Keep ``text`` as the result of ``generation_id`` (replacing any), evicting what is
        expired or over the bound, oldest first."""
        now = time.monotonic()
        self.forget(generation_id)
        self.entries[generation_id] = (text, now + self.ttl_s)
        self.bytes_held += result_cost(text)
        while self.entries:
            oldest_id, (_, expires) = next(iter(self.entries.items()))
            if expires > now and self.bytes_held <= self.bytes_max:
                break
            self.forget(oldest_id)

    def forget(self, generation_id: str) -> None:
        item = self.entries.pop(generation_id, None)
        if item is not None:
            self.bytes_held -= result_cost(item[0])

    def result_of(self, generation_id: str) -> str | None:
        """The retained text of ``generation_id``; None if there is none or it has expired."""
        item = self.entries.get(generation_id)
        if item is None:
            return None
        text, expires = item
        if time.monotonic() >= expires:
            return None
        return text


def result_cost(text: str) -> int:
    """What one retained result counts against ``result_cache_bytes_max`` (CHATPLANE_EDGE_RESULT_CACHE_BYTES_MAX)."""
    return len(text.encode()) + RESULT_ENTRY_OVERHEAD_BYTES
