"""aiokafka against the real broker: idempotent produce, and a transactional
consume-transform-produce round trip whose aborted output a read_committed reader never sees."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

pytestmark = pytest.mark.integration

CONSUME_TIMEOUT_S = 30.0
POLL_TIMEOUT_MS = 500


async def consume_exactly(consumer: AIOKafkaConsumer, n: int, timeout_s: float = CONSUME_TIMEOUT_S, settle_s: float = 1.0):
    """Read until n records arrived, then keep polling settle_s more to catch any extra ones."""
    records = []
    deadline = time.monotonic() + timeout_s
    while len(records) < n and time.monotonic() < deadline:
        batch = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
        for recs in batch.values():
            records.extend(recs)
    settle_end = time.monotonic() + settle_s
    while time.monotonic() < settle_end:
        batch = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
        for recs in batch.values():
            records.extend(recs)
    return records


def reader(bootstrap: str, topic: str, isolation_level: str = "read_committed") -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level=isolation_level,
    )


async def test_idempotent_producer_round_trip(kafka_bootstrap, fresh_topic):
    topic = await fresh_topic("idem", partitions=3)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True, acks="all")
    await producer.start()
    sent = []
    try:
        for i in range(60):
            key, value = f"user-{i % 5}".encode(), f"event-{i}".encode()
            md = await producer.send_and_wait(topic, value, key=key)
            sent.append((md.partition, md.offset, key, value))
    finally:
        await producer.stop()

    consumer = reader(kafka_bootstrap, topic)
    await consumer.start()
    try:
        got = await consume_exactly(consumer, len(sent))
    finally:
        await consumer.stop()

    assert sorted((r.partition, r.offset, r.key, r.value) for r in got) == sorted(sent)
    # Same key -> same partition, in send order.
    by_key: dict[bytes, list[bytes]] = {}
    for r in sorted(got, key=lambda r: (r.partition, r.offset)):
        by_key.setdefault(r.key, []).append(r.value)
    for key, values in by_key.items():
        expected = [v for (_, _, k, v) in sent if k == key]
        assert values == expected
        assert len({r.partition for r in got if r.key == key}) == 1


async def test_transactional_consume_transform_produce(kafka_bootstrap, fresh_topic, unique_name, kafka_admin):
    src = await fresh_topic("txn-in", partitions=2)
    dst = await fresh_topic("txn-out", partitions=2)
    group = unique_name("txn-group")
    n = 10

    plain = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True)
    await plain.start()
    try:
        for i in range(n):
            await plain.send_and_wait(src, f"in-{i}".encode(), key=f"k{i % 3}".encode())
    finally:
        await plain.stop()

    consumer = AIOKafkaConsumer(
        src,
        bootstrap_servers=kafka_bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=unique_name("txn-id"))
    await consumer.start()
    await producer.start()
    try:

        async def transform_once(attempt: str, commit: bool) -> int:
            records = await consume_exactly(consumer, n, settle_s=0.2)
            assert records, "no input consumed"
            await producer.begin_transaction()
            for r in records:
                await producer.send(dst, r.value.replace(b"in-", f"out-{attempt}-".encode()), key=r.key)
            offsets = {}
            for r in records:
                tp = TopicPartition(r.topic, r.partition)
                offsets[tp] = max(offsets.get(tp, 0), r.offset + 1)
            await producer.send_offsets_to_transaction(offsets, group)
            if commit:
                await producer.commit_transaction()
            else:
                await producer.abort_transaction()
            return len(records)

        # Attempt 1 is aborted: its output and its offsets must vanish.
        assert await transform_once("a1", commit=False) == n
        committed = await kafka_admin.list_consumer_group_offsets(group)
        assert all(om.offset in (-1, None) for om in committed.values()) or not committed
        # Rewind like a restarted processor would: to the group's committed position (none yet).
        await consumer.seek_to_beginning()
        # Attempt 2 is committed.
        assert await transform_once("a2", commit=True) == n
    finally:
        await producer.stop()
        await consumer.stop()

    committed = await kafka_admin.list_consumer_group_offsets(group)
    assert sum(om.offset for tp, om in committed.items() if tp.topic == src) == n

    rc = reader(kafka_bootstrap, dst, "read_committed")
    await rc.start()
    try:
        seen = await consume_exactly(rc, n)
    finally:
        await rc.stop()
    values = Counter(r.value for r in seen)
    assert values == Counter(f"out-a2-{i}".encode() for i in range(n))  # each exactly once, none from a1

    # The aborted records are really in the log: a read_uncommitted reader sees both attempts.
    ru = reader(kafka_bootstrap, dst, "read_uncommitted")
    await ru.start()
    try:
        raw = await consume_exactly(ru, 2 * n)
    finally:
        await ru.stop()
    assert Counter(r.value for r in raw) == Counter(
        [f"out-a1-{i}".encode() for i in range(n)] + [f"out-a2-{i}".encode() for i in range(n)]
    )
