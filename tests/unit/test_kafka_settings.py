"""Every Kafka client of ours paces its retries the same way (``infra.runtime.kafka_settings``).

aiokafka 0.14 reconnects to a dead broker as often as its callers retry, and they wait
``retry_backoff_ms`` between tries (a broker restart wrote tens of thousands of lines).
Checked three ways, without a broker: every client constructor in the product passes
``**kafka_client_kwargs()`` (an ``ast`` walk, so a new client cannot forget it); those keyword
arguments reach the clients aiokafka builds (producer, consumer, admin: their sender, fetcher,
coordinator and metadata retries); and the processor's faust app builds its consumer and producer
with the same value (tests/unit/test_faust_contract.py checks the faust internals that relies on).
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from infra.runtime.kafka_settings import KAFKA_RETRY_BACKOFF_MS, kafka_client_kwargs

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("projections", "edge", "workers")
CLIENT_CLASSES = {"AIOKafkaConsumer", "AIOKafkaProducer", "AIOKafkaAdminClient", "AIOKafkaClient"}
BOOTSTRAP = "127.0.0.1:1"  # never connected to


def client_constructions() -> list[tuple[str, int, ast.Call]]:
    found = []
    for package in PRODUCT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in CLIENT_CLASSES:
                    found.append((str(path.relative_to(ROOT)), node.lineno, node))
    return found


def shared_kwargs_of(call: ast.Call) -> set[str]:
    return {
        getattr(kw.value.func, "id", "") for kw in call.keywords if kw.arg is None and isinstance(kw.value, ast.Call)
    }


def passes_shared_kwargs(call: ast.Call) -> bool:
    """A producer takes producer_kwargs() (the shared kwargs plus its compression), any other client
    kafka_client_kwargs()."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    return ("producer_kwargs" if name == "AIOKafkaProducer" else "kafka_client_kwargs") in shared_kwargs_of(call)


def test_every_kafka_client_in_the_product_is_built_with_the_shared_kwargs():
    constructions = client_constructions()
    assert len(constructions) >= 12  # the walk finds them: edge 2, shared 6, readmodel 2, processor 2, workers 3
    missing = [f"{path}:{line}" for path, line, call in constructions if not passes_shared_kwargs(call)]
    assert missing == [], f"Kafka clients without **kafka_client_kwargs() (producers: **producer_kwargs()): {missing}"


def test_producer_kwargs_are_the_shared_ones_plus_the_compression(monkeypatch):
    from infra.runtime.kafka_settings import producer_kwargs

    monkeypatch.delenv("CHATPLANE_KAFKA_COMPRESSION", raising=False)
    assert producer_kwargs() == {**kafka_client_kwargs(), "compression_type": "lz4"}
    monkeypatch.setenv("CHATPLANE_KAFKA_COMPRESSION", "none")
    assert producer_kwargs()["compression_type"] is None
    monkeypatch.setenv("CHATPLANE_KAFKA_COMPRESSION", "brotli")
    with pytest.raises(SystemExit, match="CHATPLANE_KAFKA_COMPRESSION='brotli'"):
        producer_kwargs()


async def test_every_codec_offered_is_usable_by_aiokafka():
    from infra.runtime.kafka_settings import KAFKA_COMPRESSIONS

    for codec in KAFKA_COMPRESSIONS:
        producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, compression_type=None if codec == "none" else codec)
        await producer.stop()  # the constructor refuses a codec whose library is missing


async def test_the_shared_kwargs_reach_every_retry_loop_of_the_clients():
    backoff_s = KAFKA_RETRY_BACKOFF_MS / 1000
    assert KAFKA_RETRY_BACKOFF_MS > 100  # above aiokafka's default, which made the storm
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, **kafka_client_kwargs())
    consumer = AIOKafkaConsumer(bootstrap_servers=BOOTSTRAP, **kafka_client_kwargs())
    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP, **kafka_client_kwargs())
    try:
        # The producer's sender and its client; the consumer's fetcher and coordinator (built at
        # start from _retry_backoff_ms) and its client; the admin client's client.
        assert producer._sender._retry_backoff == producer.client._retry_backoff == backoff_s
        assert consumer._retry_backoff_ms == KAFKA_RETRY_BACKOFF_MS and consumer._client._retry_backoff == backoff_s
        assert admin._client._retry_backoff == backoff_s
    finally:
        await producer.stop()
        await consumer.stop()
        await admin.close()


async def test_the_processors_faust_clients_carry_the_shared_backoff(monkeypatch):
    monkeypatch.delenv("CHATPLANE_KAFKA_COMPRESSION", raising=False)
    from projections.ledger.processor import AdmissionProcessor
    from projections.ledger.settings import ProcessorSettings

    processor = AdmissionProcessor(ProcessorSettings(kafka_bootstrap=BOOTSTRAP))
    consumer = processor.app.consumer._thread._create_consumer(asyncio.get_running_loop())
    producer = processor.app.producer._new_producer()
    try:
        assert consumer._retry_backoff_ms == KAFKA_RETRY_BACKOFF_MS
        assert consumer._client._retry_backoff == KAFKA_RETRY_BACKOFF_MS / 1000
        assert producer.client._retry_backoff == producer._sender._retry_backoff == KAFKA_RETRY_BACKOFF_MS / 1000
        # faust's own settings are still there (the adapter extends them, it does not replace them)
        assert consumer._group_instance_id == processor.settings.instance_id
        assert producer._sender._acks == -1  # the processor's producer_acks=-1
        assert producer._compression_type == "lz4"  # CHATPLANE_KAFKA_COMPRESSION's default reaches faust's producer
    finally:
        await consumer.stop()
        await producer.stop()


@pytest.mark.parametrize("name", sorted(kafka_client_kwargs()))
def test_each_shared_kwarg_is_accepted_by_every_client_class(name):
    import inspect

    for cls in (AIOKafkaProducer, AIOKafkaConsumer, AIOKafkaAdminClient):
        assert name in inspect.signature(cls.__init__).parameters, f"{cls.__name__} has no {name}"
