"""Every place the admission processor goes around faust-streaming's public API, one function each.

    AdmissionProcessor (processor.py)
        outputs, dead letters, ReconcileDue  --> send_record            (faust's transport producer)
        a command's state, once durable      --> put_table_entry        (changelog by hand + the table's
                                                  delete_table_entry      store, around Table.__setitem__)
        offsets faust never delivered        --> mark_offsets_handled   (Consumer._add_gap)
        the agent's start                    --> remove_monitor_sensor  (App.monitor out of App.sensors)
        the deadline timer                   --> assigned_partitions    (the transport consumer's assignment)
        the app's Kafka clients              --> use_kafka_client_settings (a transport whose consumer and
                                                  producer carry infra.runtime.kafka_settings)
        a table recovery that reads nothing  --> restart_stalled_recovery (seek the changelog partitions
                                                  again from what recovery applied, resume them)

The processor calls faust only through its public API (``App``, ``App.topic``, ``App.Table``,
``App.agent``, ``App.timer``, the partition signals, ``Stream.noack``/``events``/``ack``,
``Table.get``/``items``, ``App.crash``, ``faust.Worker``) and through this module. Each function says
what faust does at that point, why the processor bypasses it, and what of faust it relies on;
``tests/unit/test_faust_contract.py`` checks each of those reliances against the installed faust
without a broker, so an upgrade that changes one fails there rather than in production. The
supported faust-streaming versions are ``SUPPORTED_FAUST`` (docs/ledger.md, "faust-streaming: what we
rely on"); pyproject.toml pins the one the contract tests and the integration tests ran against.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

import faust
from aiokafka import AIOKafkaConsumer
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from infra.runtime.kafka_settings import kafka_client_kwargs

# The faust-streaming versions this module was checked against. 0.15.3 is the one the processor's
# integration tests and benchmarks ran on; a release below 0.16 is assumed to keep the internals used
# here (the contract tests decide), anything from 0.16 on must be reviewed against every docstring
# below first. pyproject.toml keeps the exact pin for reproducible installs.
SUPPORTED_FAUST = ">=0.15.3,<0.16"
FAUST_VERSION_MIN = (0, 15, 3)
FAUST_VERSION_BELOW = (0, 16, 0)


def faust_version() -> tuple[int, ...]:
    """The installed faust-streaming version as numbers (``"0.15.3"`` -> ``(0, 15, 3)``)."""
    return tuple(int(part) for part in faust.__version__.split(".")[:3] if part.isdigit())


def faust_version_supported(version: tuple[int, ...] | None = None) -> bool:
    """Whether ``version`` (by default the installed one) is within ``SUPPORTED_FAUST``."""
    version = faust_version() if version is None else version
    return FAUST_VERSION_MIN <= version < FAUST_VERSION_BELOW


async def send_record(
    app: faust.App, topic: str, key: bytes | None, value: bytes | None, partition: int | None,
    headers: list[tuple[str, bytes]] | None = None,
) -> Awaitable[Any]:
    """Hand one already-encoded record to faust's Kafka producer; returns its delivery future.

    What faust does: ``Topic.send`` (the public way) serializes through the topic's schema, wraps the
    record in a ``FutureMessage``, calls the sensors' ``on_send_initiated``/``on_send_completed`` and
    may attach it to the current event's offset; it needs a ``faust.Topic`` declared per topic name.
    ``app.producer.send`` is the transport producer (``faust.transport.drivers.aiokafka.Producer``)
    underneath it, which gives the record to aiokafka as is.

    Why we bypass it: every record the processor writes is already bytes with its partition chosen
    by ``control_plane.routing`` (ledger and usage on the command's own partition, a reply on the
    edge's inbox partition, dispatch topics named per pool), and ``_drain`` needs each record's own
    delivery future: a command's state is written, and the command acked, only once Kafka
    acknowledged every one of its outputs.

    Relies on: ``App.producer`` is the started transport producer; its ``send`` is a coroutine
    function taking ``(topic, key, value, partition, timestamp, headers)`` positionally whose result
    is an awaitable that resolves once Kafka acknowledged the record (``RecordMetadata``) or raises;
    and ``Consumer.commit`` awaits ``App.producer.flush()`` (which waits for aiokafka's own batches)
    before it commits offsets, so a record sent before its command was acked is in Kafka before
    that command's offset is committed (at-least-once without faust's exactly-once mode). ``headers``
    (the trace context, infra/runtime/tracing.py) go to aiokafka as a list of ``(str, bytes)``.
    """
    return await app.producer.send(topic, key, value, partition, None, headers)


async def put_table_entry(app: faust.App, table: faust.Table, partition: int, key: bytes, value: bytes) -> None:
    """Set ``table[key] = value``: the changelog record straight to the producer, then the store.

    What faust does: ``Table.__setitem__`` calls ``Table.on_key_set``, which queues the changelog
    record with ``Table.send_changelog`` -> ``Topic.send_soon`` into faust's ``ProducerBuffer``
    (partition: the current event's, so only inside an agent), calls the table sensors, and then
    sets the value in the table's store (``Table.data``).

    Why we bypass it: before a commit faust flushes that buffer with
    ``ProducerBuffer.flush_atmost``, which gives up after 0.1 s without a sent message; under load
    an offset was committed before the state it implied was sent (the fresh-clone CI run: after a
    restart commands were decided again against older state and event ids were reused with other
    content). A record given to the producer itself is flushed by the commit (see ``send_record``).
    The processor also writes a command's state from its drain task, after the command's outputs
    were acknowledged, where faust has no current event to take the partition from.

    Relies on: ``Table.changelog_topic_name`` is the topic faust recovers the table from,
    ``"<app id>-<table name>-changelog"`` (schemas.topics.Topology.changelog creates it under that
    name; the processor's app has ``topic_allow_declare=False``); recovery decodes the changelog with
    the table's schema, which for ``key_type=bytes, value_type=bytes`` is ``raw`` both ways, so the
    record reads back as exactly these bytes; the changelog partition equals the command partition
    (co-partitioning, asserted at start-up); ``Table.data`` of a ``memory://`` table is a
    ``faust.stores.memory.Store`` whose ``__setitem__`` stores the object itself (``Table.get``
    returns that very object, which the processor's decode cache checks by identity) and sends
    nothing. faust's ``Table._on_changelog_sent`` (the persisted offset) is skipped, which is a no-op
    for ``memory://``; a persistent store (RocksDB) would need it. The memory store only remembers a
    key's partition for records it applied in recovery (``Store._key_partition``), so after a
    rebalance keys written here stay in the store for partitions that moved away; the processor
    looks at the table only for its assigned partitions.
    """
    await app.producer.send(table.changelog_topic_name, key, value, partition, None, None)
    table.data[key] = value


async def delete_table_entry(app: faust.App, table: faust.Table, partition: int, key: bytes) -> None:
    """Delete ``table[key]``: a tombstone straight to the producer, then out of the store.

    What faust does: ``Table.__delitem__`` calls ``Table.on_key_del``, which queues a changelog
    record with value ``None`` (``value_serializer="raw"``) through the same buffer as a set, and then
    deletes the key from the store (raising ``KeyError`` when it is not there).

    Why we bypass it: as for ``put_table_entry`` (the buffer's 0.1 s flush; no current event in the
    drain task); the store delete tolerates a key that is already gone (a superseded settled entry
    deleted once, its redelivered command deleting it again).

    Relies on: what ``put_table_entry`` relies on, and that faust's recovery removes a key whose
    changelog value is ``None`` (``faust.stores.memory.Store.apply_changelog_batch``), and that
    ``Table.data.pop(key, default)`` removes without sending anything.
    """
    await app.producer.send(table.changelog_topic_name, key, None, partition, None, None)
    table.data.pop(key, None)


async def mark_offsets_handled(app: faust.App, topic: str, partition: int, first: int, last: int) -> None:
    """Tell faust's commit bookkeeping that offsets ``first..last`` (inclusive) of a partition are done.

    What faust does: the consumer commits, per partition, the end of the first run of consecutive
    offsets acked by the streams (``Consumer._new_offset``), after filling in the ranges recorded
    by ``Consumer._add_gap``; faust itself adds a gap when its fetch loop sees offsets jump (records
    removed by compaction or transaction markers). An offset never delivered to a stream is never
    acked, so the commit would stop before it for good.

    Why we bypass it: faust-streaming 0.15.3 was seen not delivering a few offsets of a partition
    right after a restart (a ``kill -9`` under a backlog: 169, then 171). The processor reads such
    offsets straight from Kafka and decides them in order (``AdmissionProcessor._fill_gap``); once
    their state is durable it marks them here so the commit can move past them. There is no public
    way to ack an offset that has no faust event.

    Relies on: ``App.consumer`` is faust's transport consumer (``faust.transport.consumer.Consumer``)
    with a coroutine method ``_add_gap(tp, offset_from, offset_to)``, ``offset_to`` inclusive, offsets
    at or below the committed offset ignored; ``_new_offset`` counting gap offsets as acked; and
    ``faust.types.TP(topic, partition)`` as its partition key. faust's commit also passes a
    one-offset hole right at the committed offset without any gap (why the processor checks the
    offsets it is given itself, docs/ledger.md).
    """
    await app.consumer._add_gap(TP(topic, partition), first, last)  # noqa: SLF001 - see the docstring


def remove_monitor_sensor(app: faust.App) -> bool:
    """Take faust's built-in ``Monitor`` out of the app's sensors; True when it was there.

    What faust does: ``App.on_init_dependencies`` adds ``App.monitor`` (a ``faust.sensors.Monitor``)
    to ``App.sensors`` when the app starts; the ``SensorDelegate`` then calls it on every message in,
    every stream event in and out, every send and every table get/set, where it keeps counters,
    latency deques and per-partition offsets for faust's web views.

    Why we bypass it: nothing in chatplane reads those statistics (the web server is disabled), and
    on two cores they cost a measurable share of each command (commit 264fd7f). faust has no setting
    to leave the Monitor out while the consumer keeps calling it directly.

    Relies on: ``App.monitor`` returns the same ``Monitor`` that was added; ``App.sensors`` supports
    ``in`` and ``remove(sensor)`` and a removed sensor is no longer called by the delegate; the
    consumer's own direct calls (``App.monitor.on_tp_commit``, ``track_tp_end_offset``) still work on
    the removed Monitor. Must run after the app started (the agent's start), or faust adds it back.
    """
    if app.monitor in app.sensors:
        app.sensors.remove(app.monitor)
        return True
    return False


def assigned_partitions(app: faust.App, topic: str) -> set[int]:
    """The partitions of ``topic`` assigned to this app's consumer now; empty when it has none yet.

    What faust does: ``App.consumer`` is the transport consumer; ``assignment()`` asks aiokafka for
    the current assignment, and raises (``ConsumerNotStarted`` or an aiokafka error) before the
    consumer started or in the middle of a rebalance.

    Why we bypass it: the deadline timer needs the partitions that are this instance's right now to
    rebuild its deadline index from the table; faust's public ``on_partitions_assigned`` signal gives
    only the changes, and the timer may run before the first one.

    Relies on: ``Consumer.assignment()`` returning a set of ``TP`` (``.topic``, ``.partition``).
    """
    try:
        assignment = app.consumer.assignment()
    except Exception:  # noqa: BLE001 - not started or mid-rebalance: nothing is ours yet
        return set()
    return {tp.partition for tp in assignment if tp.topic == topic}


def set_consumer_retry_backoff(consumer: AIOKafkaConsumer, retry_backoff_ms: int) -> None:
    """What ``AIOKafkaConsumer(retry_backoff_ms=...)`` sets, done on a consumer someone else built (not started yet).

    Relies on (aiokafka 0.14): the constructor keeps the value in ``AIOKafkaConsumer._retry_backoff_ms``
    (read by ``start()`` for its fetcher and group coordinator) and in its client's
    ``AIOKafkaClient._retry_backoff`` (seconds; the client's own metadata retries); nothing reads it
    before ``start()``.
    """
    consumer._retry_backoff_ms = retry_backoff_ms  # noqa: SLF001 - see the docstring
    consumer._client._retry_backoff = retry_backoff_ms / 1000  # noqa: SLF001


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_consumer(self, loop: asyncio.AbstractEventLoop) -> AIOKafkaConsumer:
        consumer = super()._create_consumer(loop)
        set_consumer_retry_backoff(consumer, kafka_client_kwargs()["retry_backoff_ms"])
        return consumer


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class _Producer(faust_aiokafka.Producer):
    def _settings_default(self) -> Mapping[str, Any]:
        return {**super()._settings_default(), **kafka_client_kwargs()}


class KafkaTransport(faust_aiokafka.Transport):
    """faust's aiokafka transport whose consumer and producer carry ``kafka_client_kwargs()``."""

    Consumer = _Consumer
    Producer = _Producer


def use_kafka_client_settings(app: faust.App) -> None:
    """Make ``app`` (just built: before its first topic, table or agent) build its Kafka clients with
    ``infra.runtime.kafka_settings``'s values, as every other client of ours.

    What faust does: the transport (``faust.transport.drivers.aiokafka.Transport``, chosen by the
    broker URL's scheme) builds the consumer in ``AIOKafkaConsumerThread._create_consumer`` and the
    producer from ``Producer._settings_default``, each from faust's own settings; no faust setting
    maps to aiokafka's ``retry_backoff_ms``, so they retried an unreachable broker every 100 ms
    (aiokafka's default), each try logging one or two lines: a broker restart flooded the log.

    Why we bypass it: that pause is the only pacing of aiokafka 0.14's reconnects (it has no
    ``reconnect_backoff_ms``), see ``infra.runtime.kafka_settings``.

    Relies on: ``App.transport`` and ``App.producer_transport`` setters (the app builds its consumer,
    producer and conductor lazily from them); a transport's ``Consumer``/``Producer`` class attributes
    choose the classes it builds; ``Consumer._new_consumer_thread`` builds the
    ``AIOKafkaConsumerThread`` whose ``_create_consumer(loop)`` returns the not yet started
    ``AIOKafkaConsumer``; ``Producer._settings_default`` returns the keyword arguments of every
    ``AIOKafkaProducer`` faust builds (also its threaded and transactional ones); and
    ``set_consumer_retry_backoff``'s reliances on aiokafka.
    """
    app.transport = KafkaTransport(app.conf.broker_consumer, app)
    app.producer_transport = KafkaTransport(app.conf.broker_producer, app)


@dataclass(frozen=True)
class StalledPartition:
    """A changelog partition the table recovery waits on while nothing of it arrives: what recovery
    applied and needs (its ``offset`` and ``highwater``) and what the consumer held for it before the
    restart (``position``: aiokafka's fetch position; ``paused``: in faust's paused set;
    ``read_offset``: the offset below which faust drops a fetched record; ``flow_active``)."""

    topic: str
    partition: int
    offset: int
    highwater: int
    position: int | None
    paused: bool
    read_offset: int | None
    flow_active: bool


async def restart_stalled_recovery(app: faust.App, stall_s: float, last_restart: dict[Any, float]) -> list[StalledPartition]:
    """When the table recovery has received nothing of an active changelog partition for ``stall_s``
    while it still needs records of it, seek that partition to the last offset recovery applied,
    resume it and the consumer's flow; returns what was restarted (with the consumer's state before).
    Each partition is restarted at most once per ``stall_s`` (``last_restart``, by partition, the
    caller's and bounded by the assignment).

    What faust does: after a rebalance ``Recovery._restart_recovery`` seeks each active changelog
    partition to the offset it holds, resumes those partitions and the flow, starts the fetcher and
    waits until ``_slurp_changelogs`` has applied every record up to the highwater read at the start;
    the fetch loop (``Consumer._drain_messages``) drops a fetched record whose delivery a flow
    suspension interrupted, and every later one below the offset it saw last. Until recovery ends the
    agent gets no command of any partition.

    Why we bypass it: faust-streaming 0.15.3 was seen (the fleet test, a processor leaving under
    load) waiting on seven changelog partitions for minutes with fetch requests going out and not one
    record delivered; nothing in faust retries, so the staying processor decided nothing. The
    records recovery needs are still in Kafka: reading them again from the offset recovery applied
    last repeats at most that one record (recovery skips an offset at or below the one it has).

    Relies on: ``App.tables.recovery`` (``faust.tables.recovery.Recovery``) with ``in_recovery``,
    ``active_tps``, ``active_offsets`` and ``active_highwaters`` (``Counter[TP]``, -1 before any
    record), ``_recovery_started_at`` and ``_active_events_received_at`` (monotonic seconds, by TP);
    ``App.consumer`` (faust's transport consumer) with ``seek_wait({TP: offset})``, ``position(TP)``,
    ``resume_partitions``, ``resume_flow``, ``flow_active``, ``_paused_partitions`` and
    ``_read_offset``; ``App.flow_control.resume()``.
    """
    recovery = app.tables.recovery
    started = recovery._recovery_started_at  # noqa: SLF001 - see the docstring
    if not recovery.in_recovery or started is None:
        return []
    now = time.monotonic()
    if now - started < stall_s:
        return []
    received = recovery._active_events_received_at  # noqa: SLF001
    stalled = [
        tp for tp in sorted(recovery.active_tps)
        if recovery.active_highwaters[tp] > recovery.active_offsets[tp]
        and now - received.get(tp, started) >= stall_s
        and now - last_restart.get(tp, started) >= stall_s
    ]
    if not stalled:
        return []
    consumer = app.consumer
    found = []
    for tp in stalled:
        try:
            position = await consumer.position(tp)
        except Exception:  # noqa: BLE001 - a diagnostic: the partition may be mid-revoke
            position = None
        found.append(StalledPartition(
            tp.topic, tp.partition, int(recovery.active_offsets[tp]), int(recovery.active_highwaters[tp]), position,
            tp in consumer._paused_partitions, consumer._read_offset.get(tp), bool(consumer.flow_active),  # noqa: SLF001
        ))
    await consumer.seek_wait({tp: max(int(recovery.active_offsets[tp]), 0) for tp in stalled})
    consumer.resume_partitions(stalled)
    app.flow_control.resume()
    consumer.resume_flow()
    for key in [k for k in last_restart if k not in recovery.active_tps]:
        del last_restart[key]
    last_restart.update((tp, now) for tp in stalled)
    return found


def stall_first_recovery_for_test(app: faust.App) -> None:
    """Test-only fault (``CHATPLANE_FAULT_STALL_FIRST_RECOVERY``): the first table recovery that has
    changelog records to read finds its active partitions sought to their ends, right after it sought
    them to where it starts reading, so it receives nothing of them, as was seen of faust-streaming
    (``restart_stalled_recovery``).

    Relies on: ``Recovery._seek_offsets(consumer, tps, offsets, title)``, awaited by
    ``Recovery._restart_recovery`` with ``title == "active"`` for the active changelog partitions after
    the highwaters were read; the transport consumer's ``highwaters(*tps)`` (end offsets) and
    ``seek_wait``.
    """
    recovery = app.tables.recovery
    original = recovery._seek_offsets  # noqa: SLF001 - see the docstring
    done = False

    async def seek_then_skip(consumer: Any, tps: Any, offsets: Any, title: str) -> None:
        nonlocal done
        await original(consumer, tps, offsets, title)
        if done or title != "active" or not recovery.need_recovery():
            return
        done = True
        ends = await consumer.highwaters(*tps)
        await consumer.seek_wait({tp: end for tp, end in ends.items() if end})

    recovery._seek_offsets = seek_then_skip  # noqa: SLF001


__all__ = [
    "StalledPartition",
    "KafkaTransport",
    "FAUST_VERSION_BELOW",
    "FAUST_VERSION_MIN",
    "SUPPORTED_FAUST",
    "assigned_partitions",
    "delete_table_entry",
    "faust_version",
    "faust_version_supported",
    "mark_offsets_handled",
    "put_table_entry",
    "remove_monitor_sensor",
    "restart_stalled_recovery",
    "send_record",
    "stall_first_recovery_for_test",
    "set_consumer_retry_backoff",
    "use_kafka_client_settings",
]
