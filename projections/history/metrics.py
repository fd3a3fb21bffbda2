"""Prometheus metrics of the history writer (``python -m projections.history``,
``CHATPLANE_HISTORY_METRICS_PORT``). Served by infra/runtime/metrics_http.py; every series is in
docs/metrics.md.

Read when Prometheus scrapes, from the process's stats object (``HistoryStats``) and its consumer
(``ConsumerMetrics``, projections/follower.py): counters of writes, retries and failures, and the lag,
as records not yet handled per partition and source topic (the consumer's high watermark - the next
offset to handle).
"""

from __future__ import annotations

from typing import Any

from projections.follower import ConsumerMetrics

# (stats field, series suffix, help) of the history writer's counters.
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


def history_metrics(topology: Any) -> ConsumerMetrics:
    return ConsumerMetrics(
        "chatplane_history", HISTORY_COUNTERS, {topology.ledger.name: "ledger", topology.answers.name: "answers"}
    )
