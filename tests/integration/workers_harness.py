"""Helpers for the worker tests. ``TestEdge`` (standing in for the edge on one inbox partition),
``worker_settings`` and ``served`` are in ``infra.harness.worker_edge``, ``python -m workers`` as a
subprocess is ``infra.harness.processes.WorkerProcess`` (shared with the benchmarks); here, reading the
ledger back.
"""

from __future__ import annotations

from typing import Any

from infra.runtime.topic_reader import read_topic
from schemas.topics import Topology
from schemas.wire import decode_ledger_entry


async def ledger_events(bootstrap: str, topology: Topology, generation_id: str | None = None) -> list[Any]:
    entries = [decode_ledger_entry(r[3]) for r in await read_topic(bootstrap, topology.ledger)]
    events = [e for entry in entries for e in entry.events]
    return [e for e in events if generation_id is None or getattr(e, "generation_id", None) == generation_id]
