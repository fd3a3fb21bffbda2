"""Bounded reads of the outcomes and ledger topics by time, and of a recorded file (docs/slo.md).

Where it sits: an unassigned consumer of its own (no group, nothing committed), as
``infra.runtime.topic_reader``, so reading never disturbs the processes on the same topics.
Each partition is read from ``offsets_for_times(from)`` up to the first record stamped at or after
``until`` or the end offset at the time of the call, whichever comes first; at most ``records_max``
records per topic, an outcomes record counted as the outcomes it holds.

An outcomes record is an ``EdgeOutcomeBatch`` (the outcomes one edge sent together) or, in records
written before batches, one bare ``EdgeOutcome``: both are expanded into ``Records.outcomes``
(``schemas.outcomes.decode_outcomes``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from infra.runtime.kafka_settings import kafka_client_kwargs
from schemas.events import LedgerEntry
from schemas.outcomes import EdgeOutcome, decode_outcomes
from schemas.topics import TopicSpec
from schemas.wire import WireError, decode_ledger_entry

FETCH_TIMEOUT_MS = 500
# How an outcome is spelled in a record as the edge writes it (compact JSON), counted to weigh a record.
_OUTCOME_TYPE = b'"type":"EdgeOutcome"'


def outcomes_in(value: bytes) -> int:
    """About how many outcomes an outcomes record holds (at least 1), for the ``records_max`` bound
    only: it counts the outcomes' type tags without parsing the record."""
    return max(1, value.count(_OUTCOME_TYPE))


@dataclass(slots=True)
class Records:
    outcomes: list[EdgeOutcome]
    entries: list[LedgerEntry]
    truncated: bool = False  # a topic had more than records_max records in the range
    undecodable: int = 0  # records skipped because they did not decode


async def read_range(
    bootstrap: str, spec: TopicSpec, from_ms: int, until_ms: int, records_max: int, timeout_s: float,
    weigh: Callable[[bytes], int] | None = None,
) -> tuple[list[bytes], bool]:
    """The values of ``spec``'s records stamped in ``[from_ms, until_ms)``; True when cut at ``records_max``
    (each record counted as ``weigh(value)``, 1 without it)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest", **kafka_client_kwargs())
    await consumer.start()
    try:
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        found = await consumer.offsets_for_times({tp: from_ms for tp in tps})
        for tp in tps:
            offset = found.get(tp)
            consumer.seek(tp, offset.offset if offset is not None else ends[tp])
        remaining = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
        values: list[bytes] = []
        counted = 0
        async with asyncio.timeout(timeout_s):
            while remaining:
                batch = await consumer.getmany(*remaining, timeout_ms=FETCH_TIMEOUT_MS)
                for tp, items in batch.items():
                    for r in items:
                        if tp not in remaining:
                            break
                        if r.offset >= ends[tp] or r.timestamp >= until_ms:
                            remaining.discard(tp)
                            break
                        if r.value is not None:
                            weight = 1 if weigh is None else weigh(r.value)
                            if counted + weight > records_max:
                                return values, True
                            counted += weight
                            values.append(r.value)
                for tp in list(remaining):
                    if await consumer.position(tp) >= ends[tp]:
                        remaining.discard(tp)
        return values, False
    finally:
        await consumer.stop()


def decode_records(values: Iterable[bytes | str], source: str = "") -> Records:
    """Outcome and ledger records from their JSON values (a topic's, or a file's lines); a batch of
    outcomes is expanded into its outcomes."""
    out = Records([], [])
    for i, value in enumerate(values, 1):
        if not value.strip():
            continue
        try:
            kind = orjson.loads(value).get("type")
            if kind in ("EdgeOutcomeBatch", "EdgeOutcome"):
                out.outcomes.extend(decode_outcomes(value))
            elif kind == "LedgerEntry":
                out.entries.append(decode_ledger_entry(value))
            else:
                raise ValueError(f"type {kind!r} is neither EdgeOutcomeBatch, EdgeOutcome nor LedgerEntry")
        except (ValueError, WireError, AttributeError) as exc:
            if source:
                raise ValueError(f"{source}:{i}: {exc}") from None
            out.undecodable += 1
    return out


def read_file(path: Path) -> Records:
    """A recorded dump: one JSON record per line, each an ``EdgeOutcomeBatch``, an ``EdgeOutcome`` or a
    ``LedgerEntry``."""
    with path.open("rb") as f:
        return decode_records(f, source=str(path))


async def read_topics(bootstrap: str, outcomes: TopicSpec, ledger: TopicSpec, from_ms: int, until_ms: int, records_max: int, timeout_s: float) -> tuple[Records, list[bytes]]:
    """Both topics' records in the range, decoded (undecodable ones counted), and their raw values."""
    outcome_values, cut_outcomes = await read_range(bootstrap, outcomes, from_ms, until_ms, records_max, timeout_s, weigh=outcomes_in)
    ledger_values, cut_ledger = await read_range(bootstrap, ledger, from_ms, until_ms, records_max, timeout_s)
    raw = [*outcome_values, *ledger_values]
    records = decode_records(raw)
    records.truncated = cut_outcomes or cut_ledger
    return records, raw
