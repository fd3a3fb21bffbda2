"""Read a whole topic from Kafka, start to the end offsets at call time (the audit, the usage report, tests).

Where it sits: a reader of the log with its own unassigned consumer (no group, nothing committed),
so it never disturbs the processes that consume the same topics.
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition

from infra.runtime.kafka_settings import kafka_client_kwargs
from schemas.topics import TopicSpec

FETCH_TIMEOUT_MS = 1_000
READ_IDLE_ROUNDS_MAX = 30  # consecutive empty fetches before giving up on reaching the end offsets


async def read_topic(
    bootstrap: str, spec: TopicSpec, start: dict[int, int] | None = None, from_time_ms: int | None = None
) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """Every record of ``spec`` from ``start`` (or the beginning, or a time) to its end at call time."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest", **kafka_client_kwargs()
    )
    await consumer.start()
    try:
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        if from_time_ms is not None:
            found = await consumer.offsets_for_times({tp: from_time_ms for tp in tps})
            for tp in tps:
                offset = found.get(tp)
                consumer.seek(tp, offset.offset if offset is not None else ends[tp])
        else:
            for tp in tps:
                consumer.seek(tp, (start or {}).get(tp.partition, 0))
        records: list[tuple[int, int, bytes | None, bytes | None]] = []
        remaining = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
        idle = 0
        while remaining and idle < READ_IDLE_ROUNDS_MAX:
            batch = await consumer.getmany(*remaining, timeout_ms=FETCH_TIMEOUT_MS)
            idle = 0 if batch else idle + 1
            for tp, items in batch.items():
                for r in items:
                    if r.offset < ends[tp]:
                        records.append((tp.partition, r.offset, r.key, r.value))
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
        if remaining:
            raise TimeoutError(f"could not read {spec.name} to its end offsets")
        return records
    finally:
        await consumer.stop()
