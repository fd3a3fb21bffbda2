"""Prometheus metrics of the read-model projection (``python -m projections.readmodel``,
``CHATPLANE_READMODEL_METRICS_PORT``). Served by infra/runtime/metrics_http.py; every series is in
docs/metrics.md.

Read when Prometheus scrapes, from the process's stats object (``ProjectionStats``) and its consumer
(``ConsumerMetrics``, projections/follower.py): counters of writes, retries and failures, and the lag,
as records not yet handled per partition (the consumer's high watermark - the next offset to handle)
and as the age of the last batch's oldest record when its writes were committed.
"""

from __future__ import annotations

from typing import Any

from projections.follower import ConsumerMetrics

# (stats field, series suffix, help) of the read-model projection's counters.
READMODEL_COUNTERS = (
    ("entries", "entries", "Ledger entries read."),
    ("rows_written", "writes", "Row updates written to generations_by_id (one per generation per batch)."),
    ("write_retries", "write_retries", "Batch writes retried after a Cassandra failure."),
    ("dead_lettered", "failures", "Ledger entries that could not be decoded (sent to the dead-letter topic)."),
    ("duplicates_skipped", "duplicates_skipped", "Entries skipped as re-sends of a command already projected."),
    ("batches", "batches", "Batches written and committed."),
)


def readmodel_metrics(topology: Any) -> ConsumerMetrics:
    return ConsumerMetrics("chatplane_readmodel", READMODEL_COUNTERS, {topology.ledger.name: "ledger"}, batch_age=True)
