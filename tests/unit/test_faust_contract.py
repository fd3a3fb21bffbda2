"""Contract tests: what ``projections/ledger/faust_adapter.py`` relies on in faust-streaming.

Each test checks one reliance named in an adapter docstring against the installed faust, without a
broker: the shape of the internals (``inspect``, attribute presence) and their behaviour on
in-memory objects (an unstarted ``faust.App``, its consumer, table and sensors). When a faust
upgrade fails one of these, read the adapter function named in the test before changing either.
The producer here is a fake (``FakeProducer``): it records what the adapter hands to faust's
transport producer, whose real ``send`` needs a broker (the integration tests exercise it).
"""

from __future__ import annotations

import inspect
import logging
import re
import tomllib
from pathlib import Path
from typing import Any

import faust
import pytest
from faust.sensors import Monitor
from faust.stores.memory import Store as MemoryStore
from faust.transport.consumer import Consumer
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP
from faust.types.tuples import Message

from projections.ledger import faust_adapter
from schemas.topics import USER_TO_LEDGER_TABLE, Topology

ROOT = Path(__file__).resolve().parents[2]
TOPIC = "contract.commands"
PARTITIONS = 4


class FakeProducer:
    """Stands in for faust's transport producer: records sends and flushes, in order."""

    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    async def send(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append(("send", args, kwargs))
        return "delivery-future"

    async def flush(self) -> None:
        self.calls.append(("flush",))


def new_app(app_id: str = "contract-app") -> faust.App:
    """An unstarted app configured like the processor's (AdmissionProcessor.__init__)."""
    return faust.App(
        app_id,
        broker="kafka://127.0.0.1:1",  # never connected to
        store="memory://",
        topic_partitions=PARTITIONS,
        topic_allow_declare=False,
        table_standby_replicas=0,
        processing_guarantee="at_least_once",
        web_enabled=False,
    )


def new_table(app: faust.App) -> faust.Table:
    return app.Table(USER_TO_LEDGER_TABLE, partitions=PARTITIONS, key_type=bytes, value_type=bytes, default=None)


def message(topic: str, partition: int, offset: int, key: bytes | None = b"k", value: bytes | None = b"v") -> Message:
    return Message(
        topic=topic, partition=partition, offset=offset, timestamp=0.0, timestamp_type=0,
        headers=[], key=key, value=value, checksum=None,
    )


async def consuming_app(calls: list[Any], assigned: set[TP]) -> faust.App:
    """An app whose consumer acks ``TOPIC`` and commits into ``calls`` after a fake flush."""
    app = new_app()
    app.topics.add(app.topic(TOPIC, key_type=bytes, value_type=bytes, partitions=PARTITIONS, internal=False))
    await app.topics._update_indices()  # what the conductor does when it starts (enables acks)
    app.producer = FakeProducer(calls)
    consumer = app.consumer

    async def commit(offsets: dict[TP, int]) -> bool:
        calls.append(("commit", dict(offsets)))
        return True

    consumer._commit = commit  # the aiokafka commit itself
    consumer.assignment = lambda: assigned
    return app


# --- the supported range ---------------------------------------------------------------------


def test_the_installed_faust_is_within_the_supported_range():
    assert faust_adapter.faust_version_supported(), (
        f"faust-streaming {faust.__version__} is outside {faust_adapter.SUPPORTED_FAUST}: review every "
        "function of projections/ledger/faust_adapter.py against it, then move the range"
    )


def test_pyproject_pins_a_faust_within_the_supported_range():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in dependencies if re.match(r"faust-streaming\b", d)]
    assert len(pins) == 1, pins
    match = re.fullmatch(r"faust-streaming==(\d+)\.(\d+)\.(\d+)", pins[0])
    assert match, f"expected an exact pin (docs/ledger.md), got {pins[0]!r}"
    assert faust_adapter.faust_version_supported(tuple(int(g) for g in match.groups()))
    assert faust_adapter.faust_version() == tuple(int(g) for g in match.groups()), "the venv is not at the pin"


@pytest.mark.parametrize(
    ("version", "supported"), [((0, 15, 2), False), ((0, 15, 3), True), ((0, 15, 9), True), ((0, 16, 0), False)]
)
def test_the_supported_range_bounds(version, supported):
    assert faust_adapter.faust_version_supported(version) is supported


# --- send_record: the transport producer ------------------------------------------------------


def test_app_producer_is_the_aiokafka_transport_producer_with_a_positional_send():
    app = new_app()
    assert isinstance(app.producer, faust_aiokafka.Producer)
    send = faust_aiokafka.Producer.send
    assert inspect.iscoroutinefunction(send)
    params = list(inspect.signature(send).parameters.values())
    assert [p.name for p in params[:7]] == ["self", "topic", "key", "value", "partition", "timestamp", "headers"]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[1:7])
    assert all(p.kind is p.KEYWORD_ONLY for p in params[7:])


async def test_send_record_hands_the_record_to_the_producer_as_is_and_returns_its_delivery_future():
    app, calls = new_app(), []
    app.producer = FakeProducer(calls)
    assert await faust_adapter.send_record(app, "t", b"k", b"v", 3) == "delivery-future"
    assert calls == [("send", ("t", b"k", b"v", 3, None, None), {})]


async def test_the_commit_flushes_the_producer_before_it_commits_offsets():
    """At-least-once: a record given to the producer before its command is acked is in Kafka
    before the command's offset is committed (send_record, put_table_entry)."""
    tp, calls = TP(TOPIC, 0), []
    app = await consuming_app(calls, {tp})
    assert app.consumer.ack(message(TOPIC, 0, 0))
    assert await app.consumer.commit()
    assert calls == [("flush",), ("commit", {tp: 1})]


# --- mark_offsets_handled: Consumer._add_gap --------------------------------------------------


def test_add_gap_is_a_coroutine_method_taking_tp_and_an_inclusive_offset_range():
    assert isinstance(new_app().consumer, Consumer)
    add_gap = Consumer._add_gap
    assert inspect.iscoroutinefunction(add_gap)
    assert list(inspect.signature(add_gap).parameters) == ["self", "tp", "offset_from", "offset_to"]
    assert callable(Consumer._new_offset)
    assert TP(TOPIC, 2) == (TOPIC, 2) and TP(TOPIC, 2).partition == 2


async def test_offsets_marked_handled_let_the_commit_pass_a_hole():
    tp, calls = TP(TOPIC, 2), []
    app = await consuming_app(calls, {tp})
    consumer = app.consumer
    consumer._committed_offset[tp] = 10  # as after seeking to the group's committed offset
    for offset in (10, 11, 14, 15):  # 12 and 13 never delivered
        assert consumer.ack(message(TOPIC, 2, offset))
    assert await consumer.commit()
    assert calls[-1] == ("commit", {tp: 12}), "the commit must stop before a hole nobody marked"
    await faust_adapter.mark_offsets_handled(app, TOPIC, 2, 12, 13)
    assert await consumer.commit()
    assert calls[-1] == ("commit", {tp: 16})


async def test_offsets_marked_handled_at_the_committed_offset_are_passed():
    """The processor marks a hole that starts at the committed offset; faust clamps the range to
    after the committed offset and passes the head of it with its one-offset tolerance."""
    tp, calls = TP(TOPIC, 1), []
    app = await consuming_app(calls, {tp})
    app.consumer._committed_offset[tp] = 170
    for offset in (172, 173):
        assert app.consumer.ack(message(TOPIC, 1, offset))
    await faust_adapter.mark_offsets_handled(app, TOPIC, 1, 170, 171)
    assert await app.consumer.commit()
    assert calls == [("flush",), ("commit", {tp: 174})]


async def test_faust_commits_past_a_one_offset_hole_at_the_committed_offset_without_any_gap():
    """The faust behaviour the processor's own delivery check was written for (docs/ledger.md):
    if an upgrade stops doing this, the check is still right but the reason in the docs is not."""
    tp, calls = TP(TOPIC, 3), []
    app = await consuming_app(calls, {tp})
    app.consumer._committed_offset[tp] = 170
    assert app.consumer.ack(message(TOPIC, 3, 171))  # 170 never delivered
    assert await app.consumer.commit()
    assert calls[-1] == ("commit", {tp: 172})


# --- put_table_entry / delete_table_entry: the changelog and the store -------------------------


def test_the_changelog_topic_is_named_app_id_table_changelog_as_the_topology_creates_it():
    for namespace in ("", "contract-ns"):
        topology = Topology(namespace)
        app = new_app(topology.processor_app_id)
        assert new_table(app).changelog_topic_name == topology.changelog.name
    assert new_app("cp-test-counter").Table("counts", default=int).changelog_topic_name == "cp-test-counter-counts-changelog"


def test_the_processors_table_is_a_raw_bytes_table_in_a_memory_store(monkeypatch):
    from projections.ledger.processor import AdmissionProcessor
    from projections.ledger.settings import ProcessorSettings

    monkeypatch.setenv("CHATPLANE_NAMESPACE", "contract")
    settings = ProcessorSettings()
    processor = AdmissionProcessor(settings)
    table = processor.table
    assert table.changelog_topic_name == settings.topology.changelog.name
    assert type(table.data) is MemoryStore  # the bypass skips the persisted offset a RocksDB store needs
    assert (table.key_serializer, table.value_serializer) == ("raw", "raw")
    assert table.key_type is bytes and table.value_type is bytes


async def test_changelog_records_written_by_hand_recover_as_the_same_bytes():
    """Recovery decodes the changelog with the table's schema: raw bytes in, the same bytes out;
    a ``None`` value deletes the key (faust.stores.memory.Store.apply_changelog_batch)."""
    table = new_table(new_app())
    changelog = table.changelog_topic
    key, value = b"\x00\x00\x05alice-settled", b"\x00\x00\x00\x00\x00\x00\x00\x07{\"layout\":2}\xff"
    event = await changelog.decode(message(table.changelog_topic_name, 1, 0, key, value), propagate=True)
    table.apply_changelog_batch([event])
    assert table.get(key) == value and type(table.get(key)) is bytes
    tombstone = await changelog.decode(message(table.changelog_topic_name, 1, 1, key, None), propagate=True)
    table.apply_changelog_batch([tombstone])
    assert table.get(key) is None and key not in table.data


def test_table_data_is_a_mutable_store_that_sends_nothing(monkeypatch):
    table = new_table(new_app())

    def no_changelog(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the store write sent a changelog record")

    monkeypatch.setattr(table, "send_changelog", no_changelog)
    monkeypatch.setattr(table, "on_key_set", no_changelog)
    monkeypatch.setattr(table, "on_key_del", no_changelog)
    data = table.data
    assert data is table.data, "Table.data must be one store, not a new one per access"
    value = bytes(bytearray(b"hot value"))
    data[b"u"] = value
    assert table.get(b"u") is value, "the processor's decode cache checks the table value by identity"
    assert dict(table.items()) == {b"u": value}
    assert data.pop(b"u", None) is value
    assert data.pop(b"u", None) is None
    assert table.get(b"u") is None


async def test_put_and_delete_table_entry_send_to_the_changelog_partition_then_change_the_store():
    app, calls = new_app(), []
    app.producer = FakeProducer(calls)
    table = new_table(app)
    await faust_adapter.put_table_entry(app, table, 2, b"u", b"v1")
    assert calls == [("send", (table.changelog_topic_name, b"u", b"v1", 2, None, None), {})]
    assert table.get(b"u") == b"v1"
    await faust_adapter.delete_table_entry(app, table, 2, b"u")
    await faust_adapter.delete_table_entry(app, table, 2, b"u")  # already gone: tolerated
    assert calls[1:] == [("send", (table.changelog_topic_name, b"u", None, 2, None, None), {})] * 2
    assert table.get(b"u") is None


# --- remove_monitor_sensor: App.monitor and App.sensors ----------------------------------------


def test_the_app_adds_its_monitor_to_the_sensors_at_start_and_it_can_be_removed(monkeypatch):
    app = new_app()
    list(app.on_init_dependencies())  # what Service start does before anything is consumed
    monitor = app.monitor
    assert isinstance(monitor, Monitor) and app.monitor is monitor
    assert monitor in app.sensors
    seen: list[int] = []
    monkeypatch.setattr(monitor, "on_message_in", lambda tp, offset, msg: seen.append(offset))
    app.sensors.on_message_in(TP(TOPIC, 0), 1, message(TOPIC, 0, 1))
    assert seen == [1]

    assert faust_adapter.remove_monitor_sensor(app) is True
    assert monitor not in app.sensors
    app.sensors.on_message_in(TP(TOPIC, 0), 2, message(TOPIC, 0, 2))
    assert seen == [1], "a removed sensor is still called"
    assert faust_adapter.remove_monitor_sensor(app) is False
    # The consumer still calls the Monitor directly after a commit.
    monitor.on_tp_commit({TP(TOPIC, 0): 3})


# --- assigned_partitions: the consumer's assignment --------------------------------------------


def test_assigned_partitions_is_empty_before_the_consumer_started_and_filters_by_topic():
    app = new_app()
    assert callable(type(app.consumer).assignment)
    assert faust_adapter.assigned_partitions(app, TOPIC) == set()  # not started: faust raises
    app.consumer.assignment = lambda: {TP(TOPIC, 0), TP(TOPIC, 3), TP("other", 1)}
    assert faust_adapter.assigned_partitions(app, TOPIC) == {0, 3}


# --- use_kafka_client_settings --------------------------------------------------------------------


def _retry_backoff_places(consumer: Any) -> dict[str, Any]:
    """Every attribute of an aiokafka consumer and of its client, by dotted name."""
    return {**{f"consumer.{k}": v for k, v in vars(consumer).items()}, **{f"client.{k}": v for k, v in vars(consumer._client).items()}}


async def test_set_consumer_retry_backoff_sets_every_place_the_constructor_keeps_it():
    from aiokafka import AIOKafkaConsumer

    built = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1", retry_backoff_ms=1_234)
    default = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")
    try:
        # The only attributes the argument changes are the two the adapter sets (nothing else built
        # in the constructor keeps a copy), and after the adapter's set they agree.
        differ = {k for k, v in _retry_backoff_places(built).items() if _retry_backoff_places(default).get(k) != v and isinstance(v, (int, float))}
        assert differ == {"consumer._retry_backoff_ms", "client._retry_backoff"}, differ
        faust_adapter.set_consumer_retry_backoff(default, 1_234)
        assert (default._retry_backoff_ms, default._client._retry_backoff) == (built._retry_backoff_ms, built._client._retry_backoff)
    finally:
        await built.stop()
        await default.stop()


async def test_the_transport_builds_its_consumer_and_producer_through_the_overridden_methods():
    import asyncio

    from infra.runtime.kafka_settings import KAFKA_RETRY_BACKOFF_MS

    app = new_app()
    assert app._transport is None and app._producer_transport is None  # built lazily: the setters come first
    faust_adapter.use_kafka_client_settings(app)
    assert isinstance(app.transport, faust_adapter.KafkaTransport) and isinstance(app.producer_transport, faust_adapter.KafkaTransport)
    assert list(inspect.signature(faust_aiokafka.AIOKafkaConsumerThread._create_consumer).parameters) == ["self", "loop"]
    consumer = app.consumer._thread._create_consumer(asyncio.get_running_loop())
    settings = app.producer._settings_default()
    producer = app.producer._new_producer()
    try:
        assert consumer._retry_backoff_ms == KAFKA_RETRY_BACKOFF_MS
        assert settings["retry_backoff_ms"] == KAFKA_RETRY_BACKOFF_MS and "bootstrap_servers" in settings
        assert producer._sender._retry_backoff == KAFKA_RETRY_BACKOFF_MS / 1000
    finally:
        await consumer.stop()
        await producer.stop()


# --- the public API the processor's acking relies on -------------------------------------------


def test_streams_have_manual_acks():
    assert callable(faust.Stream.noack)
    assert inspect.isasyncgenfunction(faust.Stream.events)
    assert inspect.iscoroutinefunction(faust.Stream.ack)
    assert list(inspect.signature(faust.Stream.ack).parameters) == ["self", "event"]


# --- the tests' own reach: the worker's ready line ---------------------------------------------


async def test_the_worker_logs_the_ready_line_the_table_recovery_test_waits_for(caplog):
    from tests.integration.test_faust_table_recovery import WORKER_READY_LINE

    worker = faust.Worker(new_app(), loglevel="info", quiet=True)
    worker.on_setup_root_logger(logging.getLogger("contract"), logging.INFO)  # -l info: no spinner
    with caplog.at_level(logging.INFO):
        await worker.on_startup_finished()
    assert WORKER_READY_LINE in caplog.text, caplog.text


# --- restart_stalled_recovery: the table recovery's state and the consumer's seek -------------------


def test_app_tasks_start_only_after_the_first_table_recovery():
    # Why the processor starts its recovery watch from the assignment signal, not as an app task.
    source = inspect.getsource(faust.App.on_started)
    assert source.index("_wait_for_table_recovery_completed") < source.index("on_started_init_extra_tasks")


def test_recovery_keeps_the_state_restart_stalled_recovery_reads():
    app = new_app()
    new_table(app)
    recovery = app.tables.recovery
    for name in ("in_recovery", "active_tps", "active_offsets", "active_highwaters",
                 "_recovery_started_at", "_active_events_received_at"):
        assert hasattr(recovery, name), name
    assert list(inspect.signature(recovery._seek_offsets).parameters) == ["consumer", "tps", "offsets", "title"]
    consumer = app.consumer
    for name in ("seek_wait", "position", "highwaters"):
        assert inspect.iscoroutinefunction(getattr(consumer, name)), name
    for name in ("resume_partitions", "resume_flow", "_paused_partitions", "_read_offset", "flow_active"):
        assert hasattr(consumer, name), name
    assert callable(app.flow_control.resume)


async def test_restart_stalled_recovery_seeks_only_partitions_with_nothing_received_and_records_still_needed(monkeypatch):
    app = new_app()
    new_table(app)
    recovery = app.tables.recovery
    changelog = app.tables[USER_TO_LEDGER_TABLE].changelog_topic_name
    stalled, fed, done = TP(changelog, 0), TP(changelog, 1), TP(changelog, 2)
    now = faust_adapter.time.monotonic()
    recovery.in_recovery = True
    recovery._recovery_started_at = now - 20
    recovery.active_tps = {stalled, fed, done}
    recovery.active_offsets.update({stalled: 4, fed: 1, done: 9})
    recovery.active_highwaters.update({stalled: 9, fed: 9, done: 9})
    recovery._active_events_received_at[fed] = now - 1  # received a second ago
    consumer = app.consumer
    seeks: list[dict[TP, int]] = []

    async def seek_wait(offsets: dict[TP, int]) -> None:
        seeks.append(dict(offsets))

    async def position(tp: TP) -> int:
        return 10

    monkeypatch.setattr(consumer, "seek_wait", seek_wait)
    monkeypatch.setattr(consumer, "position", position)
    consumer.pause_partitions([stalled])
    consumer.stop_flow()
    last: dict[Any, float] = {}

    found = await faust_adapter.restart_stalled_recovery(app, 15.0, last)
    assert seeks == [{stalled: 4}]
    assert [(p.partition, p.offset, p.highwater, p.position, p.paused, p.flow_active) for p in found] == \
        [(0, 4, 9, 10, True, False)]
    assert stalled not in consumer._paused_partitions and consumer.flow_active
    # Not again within the stall time; nothing when recovery is over.
    assert await faust_adapter.restart_stalled_recovery(app, 15.0, last) == []
    recovery.in_recovery = False
    last.clear()
    assert await faust_adapter.restart_stalled_recovery(app, 15.0, last) == [] and seeks == [{stalled: 4}]
