"""Prometheus metrics of the read-side consumers: the read-model projection (``python -m
projections.readmodel``, ``CHATPLANE_READMODEL_METRICS_PORT``) and the history writer (``python -m
projections.history``, ``CHATPLANE_HISTORY_METRICS_PORT``). Served by infra/runtime/metrics_http.py;
every series is in docs/metrics.md.

Both are read when Prometheus scrapes, from the process's stats object (``ProjectionStats``,
``HistoryStats``) and its consumer: counters of writes, retries and failures, and the lag, as records
not yet handled per partition (the consumer's high watermark - the next offset to handle) and, for the
projection, as the age of the last batch's oldest record when its writes were committed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# (stats field, series suffix, help) of the read-model projection's counters.
READMODEL_COUNTERS = (
    ("entries", "entries", "Ledger entries read."),
    ("rows_written", "writes", "Row updates written to generations_by_id (one per generation per batch)."),
    ("write_retries", "write_retries", "Batch writes retried after a Cassandra failure."),
    ("dead_lettered", "failures", "Ledger entries that could not be decoded (sent to the dead-letter topic)."),
    ("duplicates_skipped", "duplicates_skipped", "Entries skipped as re-sends of a command already projected."),
    ("batches", "batches", "Batches written and committed."),
)
# The history writer's.
HISTORY_COUNTERS = (
    ("answers_stored", "answers_stored", "Conversation answers written to the history store."),
    ("answers_skipped", "answers_skipped", "Answers skipped: their conversation was deleted (or never confirmed)."),
    ("turns_stored", "turns_stored", "User turns written to the history store."),
    ("turn_inputs_missing", "turn_inputs_missing", "Committed user turns whose text the edge never wrote (should stay 0)."),
    ("commits_sent", "commits_sent", "CommitAnswer commands sent to the processor."),
    ("deletes", "deletes", "Conversations deleted from the history store."),
    ("write_retries", "write_retries", "Writes retried after a failure."),
    ("undecodable", "failures", "Records that could not be decoded (skipped)."),
    ("batches", "batches", "Batches handled and committed."),
)


class ConsumerMetrics:
    """The registry of one read-side consumer process; ``bind(owner)`` reads ``owner.stats`` and
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


def readmodel_metrics(topology: Any) -> ConsumerMetrics:
    return ConsumerMetrics("chatplane_readmodel", READMODEL_COUNTERS, {topology.ledger.name: "ledger"}, batch_age=True)


def history_metrics(topology: Any) -> ConsumerMetrics:
    return ConsumerMetrics(
        "chatplane_history", HISTORY_COUNTERS, {topology.ledger.name: "ledger", topology.answers.name: "answers"}
    )


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
