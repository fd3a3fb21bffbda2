"""What the ledger's followers share: the read-model projection (``projections.readmodel``) and the
history writer (``projections.history``) are each one consumer-group process that reads topics in
batches, writes what they imply, and commits the batch's offsets only after every write succeeded.

This module holds the part of that process that is not theirs to differ in: the consumer (one
configuration for both), the commit after a batch, the metrics of a consumer process (its registry,
read at scrape time from the follower's stats and consumer), and the process itself
(``run_follower``: signals, the metrics server, start, run, close, and the exit codes). The followers
never import each other; both import this.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from infra.runtime.kafka_settings import kafka_client_kwargs
from infra.runtime.metrics_http import MetricsPortUnavailable, start_metrics_server

POLL_TIMEOUT_MS = 500
MAX_POLL_INTERVAL_MS = 300_000  # a follower's write retries give up (and it exits) well before this
SESSION_TIMEOUT_MS = 10_000

# Exit codes of a follower process (``run_follower``).
EXIT_OK = 0
EXIT_METRICS_PORT = 2  # the metrics port could not be bound
EXIT_STALLED = 3  # its store stayed unreachable: the restart resumes from the last committed offset
EXIT_KAFKA = 4


def follower_group(namespace: str, name: str) -> str:
    """A follower's consumer group: ``<namespace>.<name>``, or ``name`` without a namespace."""
    return f"{namespace}.{name}" if namespace else name


def follower_consumer(bootstrap: str, topics: tuple[str, ...], group_id: str, batch_records_max: int) -> AIOKafkaConsumer:
    """The (unstarted) consumer of a follower: committed by hand after each batch's writes, from the
    first offset kept for a new group."""
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_interval_ms=MAX_POLL_INTERVAL_MS,
        session_timeout_ms=SESSION_TIMEOUT_MS,
        heartbeat_interval_ms=SESSION_TIMEOUT_MS // 3,
        max_poll_records=batch_records_max,
        **kafka_client_kwargs(),
    )


async def commit_offsets(
    consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, int], positions: dict[TopicPartition, int], log: logging.Logger
) -> None:
    """Commit a written batch's offsets (``offsets``: the next offset per partition), then record them
    in ``positions`` (the metrics' lag). A commit refused after a rebalance is logged: the partition's
    new owner handles the batch again from the last commit (the followers' writes are idempotent)."""
    try:
        await consumer.commit(offsets)
    except CommitFailedError as exc:
        log.warning("offset commit failed after a rebalance: %s", exc)
    positions.update(offsets)


class Follower(Protocol):
    """What ``run_follower`` and ``ConsumerMetrics`` use of a follower."""

    stats: Any  # its counters, and ``positions`` (partition -> the next offset to handle)
    consumer: AIOKafkaConsumer | None
    group_id: str

    def stop(self) -> None: ...

    async def start(self) -> None: ...

    async def run(self) -> None: ...

    async def close(self) -> None: ...


async def run_follower(
    follower: Follower,
    *,
    name: str,
    label: str,
    metrics: ConsumerMetrics,
    metrics_port: int,
    stalled: type[Exception],
    started: str,
    log: logging.Logger,
    close_also: Callable[[], Awaitable[Any]] | None = None,
) -> int:
    """Run a follower process until SIGTERM or SIGINT (then stop after the batch in hand) or a failure;
    returns the process's exit code.

    Args:
        name: the process's short name (its metrics server's, and the ``<name>: started`` line on stdout).
        label: how its stop line names it in the log.
        metrics: its registry, bound to ``follower`` here and served on ``metrics_port`` (0: not served).
        stalled: the error its ``run`` raises when its writes kept failing (exit code ``EXIT_STALLED``).
        started: logged once it started.
        close_also: closed after the follower (e.g. a store it was given), on every path once it was passed.
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, follower.stop)
    metrics.bind(follower)
    try:
        metrics_server = await start_metrics_server(metrics.registry, metrics_port, name=name)
    except MetricsPortUnavailable as exc:
        log.error("%s", exc)
        if close_also is not None:
            await close_also()
        return EXIT_METRICS_PORT
    await follower.start()
    log.info("%s", started)
    print(f"{name}: started", flush=True)
    try:
        await follower.run()
    except stalled as exc:
        log.error("%s; exiting to resume from the last committed offset", exc)
        return EXIT_STALLED
    except KafkaError as exc:
        log.error("Kafka error: %r", exc)
        return EXIT_KAFKA
    finally:
        await follower.close()
        if close_also is not None:
            await close_also()
        if metrics_server is not None:
            await metrics_server.close()
    log.info("%s stopped: %s", label, follower.stats)
    return EXIT_OK


# --- metrics ----------------------------------------------------------------------------------------


class ConsumerMetrics:
    """The registry of one follower process; ``bind(owner)`` reads ``owner.stats`` and
    ``owner.consumer`` at scrape time.

    Args:
        prefix: the series' prefix (``chatplane_readmodel``, ``chatplane_history``).
        counters: (stats field, series suffix, help) of the counters.
        sources: topic name -> its role (the ``source`` label of the lag), e.g. {ledger topic: "ledger"}.
        batch_age: whether ``owner.stats.last_lag_ms`` exists (exported as ``<prefix>_lag_seconds``).
    """

    def __init__(self, prefix: str, counters: tuple[tuple[str, str, str], ...], sources: dict[str, str],
                 batch_age: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.prefix, self.counters, self.sources, self.batch_age = prefix, counters, sources, batch_age

    def bind(self, owner: Any) -> None:
        self.registry.register(_ConsumerCollector(self, owner))


class _ConsumerCollector(Collector):
    def __init__(self, metrics: ConsumerMetrics, owner: Any) -> None:
        self.metrics, self.owner = metrics, owner

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        m, stats = self.metrics, self.owner.stats
        for field_name, suffix, doc in m.counters:
            counter = CounterMetricFamily(f"{m.prefix}_{suffix}", doc)
            counter.add_metric([], getattr(stats, field_name))
            yield counter
        lag = GaugeMetricFamily(
            f"{m.prefix}_lag_records",
            "Records not yet handled per assigned partition: the consumer's high watermark - the next offset to handle.",
            labels=["source", "partition"],
        )
        consumer = self.owner.consumer
        if consumer is not None:
            for tp in sorted(consumer.assignment()):
                highwater = consumer.highwater(tp)
                position = stats.positions.get(tp)
                if highwater is None or position is None:
                    continue  # nothing fetched or handled yet on this partition since the start
                lag.add_metric([m.sources.get(tp.topic, "other"), str(tp.partition)], max(0, highwater - position))
        yield lag
        if m.batch_age:
            age = GaugeMetricFamily(
                f"{m.prefix}_lag_seconds",
                "The last batch: its oldest record's Kafka timestamp -> its writes committed.",
            )
            age.add_metric([], max(0.0, stats.last_lag_ms) / 1000)
            yield age
