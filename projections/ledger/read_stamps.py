"""The processor's read stamps, recalled from the ledger so that a command decided again decides the same.

Where this sits: the admission processor (``processor.py``) stamps every ``SubmitGeneration`` that
carries a decision deadline with the time it reads it (``read_at_ms``) before ``handle``; ``decide``
refuses, holding nothing, a submit read after its deadline (the edge has already answered 503). Every
other input of a decision comes from the log or is derived from it; this stamp is the one input a
second reading of the same command would see differently.

A second reading happens after a crash: the processor sends a command's outputs before its state is
durable (``AdmissionProcessor._drain``), and the commands after the durable state are decided again
from it. A submit first read in time, whose ``GenerationAdmitted`` already reached the ledger, would
be read too late the second time and refused under the same event ids: the ledger would hold two
different events under one id (the audit's invariant 0), and the edge may already have told the
client it was admitted. So ``route`` writes the stamp on the command's ledger entry
(``LedgerEntry.read_at_ms``), and when partitions are assigned the processor reads the tail of each
assigned ledger partition and gives every command found there the stamp its first decision used.

The tail read is bounded (``CHATPLANE_PROCESSOR_STAMP_RECALL_ENTRIES_MAX`` entries per partition):
the decisions whose outputs can be in the ledger while their state is not durable are the
processor's pending ones (``CHATPLANE_PROCESSOR_PENDING_MAX``) and those whose state was still in
the producer when it died, all at the end of the ledger partition. A decision whose reply or
dispatch left but whose ledger entry did not has no stamp to recall; it is decided afresh, its
events reuse no id, and nothing is charged (see docs/ledger.md).
"""

from __future__ import annotations

import asyncio
import time

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

# What marks an entry worth decoding: only submits with a decision deadline carry a stamp.
_SUBMIT_MARK = b'"command_type":"SubmitGeneration"'
FETCH_RECORDS_MAX = 2_000


def stamp_of(value: bytes | None) -> tuple[str, int] | None:
    """``(command_id, read_at_ms)`` of a ledger entry that records a read stamp, else ``None``.

    Only the two fields are read (no validation of the events): an entry the auditor would call
    undecodable is not this reader's concern, and a field that is not what it should be is skipped.
    """
    if not value or _SUBMIT_MARK not in value:
        return None
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    command_id, stamp = doc.get("command_id"), doc.get("read_at_ms")
    if isinstance(command_id, str) and isinstance(stamp, int) and stamp > 0:
        return command_id, stamp
    return None


async def recall_read_stamps(
    reader: AIOKafkaConsumer, ledger_topic: str, partitions: list[int], entries_max: int, timeout_s: float
) -> dict[int, dict[str, int]]:
    """Per partition, ``command_id -> read_at_ms`` from its last ``entries_max`` ledger entries.

    ``reader`` is an unstarted consumer outside any group (the caller builds it with its client
    settings); it is started here and always stopped. The first stamp recorded for a command wins:
    a redelivery answered from the decision memory re-sends the same events under a newer stamp, but
    the decision was made with the first one. Raises ``TimeoutError`` when the tails cannot be read
    within ``timeout_s`` without progress.
    """
    tps = [TopicPartition(ledger_topic, p) for p in partitions]
    stamps: dict[int, dict[str, int]] = {p: {} for p in partitions}
    try:
        async with asyncio.timeout(timeout_s):
            await reader.start()
            if not tps:
                return stamps
            reader.assign(tps)
            ends = await reader.end_offsets(tps)
            firsts = await reader.beginning_offsets(tps)
        remaining = set()
        for tp in tps:
            if ends[tp] > firsts[tp] and entries_max > 0:
                reader.seek(tp, max(firsts[tp], ends[tp] - entries_max))
                remaining.add(tp)
        progress_at = time.monotonic()
        while remaining:
            if time.monotonic() - progress_at > timeout_s:
                raise TimeoutError(f"no ledger record came in {timeout_s} s while recalling read stamps")
            batch = await reader.getmany(*remaining, timeout_ms=500, max_records=FETCH_RECORDS_MAX)
            for tp, records in batch.items():
                for record in records:
                    if record.offset >= ends[tp]:
                        break
                    progress_at = time.monotonic()
                    found = stamp_of(record.value)
                    if found is not None:
                        stamps[tp.partition].setdefault(*found)
            for tp in list(remaining):
                async with asyncio.timeout(timeout_s):
                    if await reader.position(tp) >= ends[tp]:
                        remaining.discard(tp)
    finally:
        await reader.stop()
    return stamps
