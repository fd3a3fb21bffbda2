"""Prometheus metrics of one worker process (and its result sink), served at ``/metrics`` on
``CHATPLANE_WORKER_METRICS_PORT`` (infra/runtime/metrics_http.py; docs/metrics.md).

Where the numbers come from:

- ``WorkerMetrics.observe_attempt`` is the worker's ``on_trace``: called once per attempt when it is
  done, with its ``AttemptTrace`` (times, tokens, stop and decline reasons; never content). The
  per-attempt histograms are therefore observed when an attempt ends.
- The gauges are read when Prometheus scrapes (``_ScrapeCollector``): slots, active sequences, the
  batch's composition (held attempts by phase and tier), and the figures the worker's capacity
  heartbeat carries (tokens/s, the engine's KV-cache pressure, dispatch backlog), read from
  ``Worker.heartbeat()`` so the dashboards see what the edges' capacity view sees.
- The result sink's counters (``workers.result_sink.ResultSinkStats``) when it is the Cassandra one.

What the engine does not report is not exported: every engine reports a KV-cache pressure figure
(sglang: its streams over its slots; the simulator and llama.cpp: a proxy, see docs/metrics.md), none
reports GPU memory, so there is no GPU memory series.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from infra.runtime.metrics_http import LATENCY_BUCKETS_S
from schemas.codes import FinishOutcome, Tier
from workers.attempt import AttemptState, AttemptTrace, DeclineReason, StopReason

# Why an attempt never ran: a DeclineReason (the processor was told), "stopped_before_accept" (a
# cancel or fence arrived first), "not_accepted" (the processor refused the AcceptAttempt or did not answer).
DECLINE_REASONS = (*(r.value for r in DeclineReason), "stopped_before_accept", "not_accepted")
# The batch's composition: where each attempt this worker holds is.
PHASES = ("preparing", "prefill", "decode", "stopping")
_PREPARING = frozenset({AttemptState.TAKEN, AttemptState.PROMPT_REQUESTED, AttemptState.ACCEPT_REQUESTED, AttemptState.ACCEPTED})

_INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


def decline_label(declined: str) -> str:
    """``AttemptTrace.declined`` as a closed label ("not_accepted:<code>" -> "not_accepted")."""
    return declined.split(":", 1)[0]


class WorkerMetrics:
    """The worker's registry. ``observe_attempt`` is its ``on_trace``; ``bind`` adds the scraped gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.accepted = Counter(
            "chatplane_worker_attempts_accepted", "Attempts the processor accepted here (their message was consumed).",
            registry=r,
        )
        self.ended = Counter(
            "chatplane_worker_attempts_ended", "Accepted attempts ended, by how the worker reported them.",
            ["outcome"], registry=r,
        )
        self.declines = Counter(
            "chatplane_worker_declines", "Dispatches taken here that never ran, by reason.", ["reason"], registry=r,
        )
        self.output_tokens = Counter(
            "chatplane_worker_output_tokens", "Output tokens the engine generated (usage, stopped attempts included).",
            registry=r,
        )
        self.queue_age = Histogram(
            "chatplane_worker_queue_age_at_acceptance_seconds",
            "Dispatch authorized (admission) -> the processor's acceptance arrived here (processor and worker clocks).",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.first_token = Histogram(
            "chatplane_worker_time_to_first_token_seconds",
            "Dispatch authorized (admission) -> the engine's first token here (queueing, prompt, accept, prefill).",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.prefill = Histogram(
            "chatplane_worker_prefill_seconds", "Engine started -> its first token.", buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.inter_token = Histogram(
            "chatplane_worker_inter_token_seconds",
            "Mean time between output tokens of one attempt that ran to its end (first token -> end, per token).",
            buckets=_INTER_TOKEN_BUCKETS_S, registry=r,
        )
        self.stop_latency = Histogram(
            "chatplane_worker_stop_seconds",
            "Stop requested (cancel, fence, lease lost, max tokens, ...) -> the engine acknowledged it stopped.",
            ["reason"], buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.tokens_after_stop = Histogram(
            "chatplane_worker_tokens_after_stop", "Tokens the engine generated after a stop was requested.",
            ["reason"], buckets=_TOKEN_BUCKETS, registry=r,
        )
        for outcome in FinishOutcome:
            self.ended.labels(outcome.value)
        for reason in DECLINE_REASONS:
            self.declines.labels(reason)
        for stop in StopReason:
            self.stop_latency.labels(stop.value)
            self.tokens_after_stop.labels(stop.value)

    def bind(self, worker: Any, result_sink: Any = None) -> None:
        """Add the series read from ``worker`` (a ``workers.worker.Worker``) and, if it keeps
        ``ResultSinkStats``, its result sink, when scraped."""
        self.registry.register(_ScrapeCollector(worker, result_sink))

    def observe_attempt(self, trace: AttemptTrace) -> None:
        """One attempt is done (``Worker(on_trace=...)``): observe what its trace recorded."""
        if trace.declined is not None:
            self.declines.labels(decline_label(trace.declined)).inc()
            return
        if not trace.accepted:
            return
        self.accepted.inc()
        if trace.outcome is not None:
            self.ended.labels(trace.outcome.value).inc()
        self.output_tokens.inc(trace.output_tokens)
        # Monotonic instants -> wall clock, to compare with the processor's authorization time.
        to_wall = time.time() - time.monotonic()
        authorized_s = trace.authorized_at_ms / 1000
        if trace.accepted_at is not None and trace.authorized_at_ms:
            self.queue_age.observe(max(0.0, trace.accepted_at + to_wall - authorized_s))
        first = trace.engine_first_token_at
        if first is not None:
            if trace.authorized_at_ms:
                self.first_token.observe(max(0.0, first + to_wall - authorized_s))
            if trace.engine_started_at is not None:
                self.prefill.observe(max(0.0, first - trace.engine_started_at))
            if trace.stop_requested_at is None and trace.stopped_at is not None and trace.output_tokens >= 2:
                self.inter_token.observe(max(0.0, trace.stopped_at - first) / (trace.output_tokens - 1))
        if trace.stop_requested_at is not None and trace.stop_reason is not None:
            reason = trace.stop_reason.value
            if trace.stopped_at is not None:
                self.stop_latency.labels(reason).observe(max(0.0, trace.stopped_at - trace.stop_requested_at))
            after = trace.tokens_after_stop
            if after is not None:
                self.tokens_after_stop.labels(reason).observe(max(0, after))


class _ScrapeCollector(Collector):
    """The worker's gauges, read when scraped (in the worker's loop, see metrics_http)."""

    def __init__(self, worker: Any, result_sink: Any) -> None:
        self.worker = worker
        self.sink = result_sink

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        w = self.worker
        beat = w.heartbeat()
        for name, value, doc in (
            ("slots", w.slots, "Generations this worker runs at once (its engine's ceiling or CHATPLANE_WORKER_SLOTS)."),
            ("free_slots", beat.free_slots, "Slots free now."),
            ("active_sequences", beat.active_sequences, "Attempts the engine is running (or stopping) now."),
            ("preparing", beat.queued, "Dispatches taken, not yet accepted or declined."),
            ("tokens_per_second", beat.tokens_per_s, "Output tokens per second over the trailing 10 s."),
            ("prefill_tokens_per_second", beat.prefill_tokens_per_s, "Measured prefill rate (input tokens/s)."),
            ("decode_tokens_per_second", beat.decode_tokens_per_s, "Measured decode rate (output tokens/s per sequence)."),
            ("kv_pressure", beat.kv_pressure, "The engine's KV-cache pressure, 0..1 (a proxy on sim and cpu: docs/metrics.md)."),
            ("dispatch_backlog", beat.dispatch_backlog, "Dispatches waiting in this worker's assigned partitions."),
            ("queued_input_tokens", beat.queued_input_tokens, "Input tokens of the attempts held here not yet running."),
            ("output_tokens_left", beat.output_tokens_left, "Output tokens the held attempts may still generate."),
        ):
            gauge = GaugeMetricFamily(f"chatplane_worker_{name}", doc)
            gauge.add_metric([], value)
            yield gauge
        if beat.kv_tokens_free >= 0:  # only when CHATPLANE_WORKER_KV_TOKENS_MAX says what the cache holds
            gauge = GaugeMetricFamily("chatplane_worker_kv_tokens_free", "KV-cache tokens the held attempts leave free.")
            gauge.add_metric([], beat.kv_tokens_free)
            yield gauge
        batch = GaugeMetricFamily(
            "chatplane_worker_sequences", "Attempts held here by phase (preparing, prefill, decode, stopping) and tier.",
            labels=["phase", "tier"],
        )
        counts = {(phase, tier.value): 0 for phase in PHASES for tier in Tier}
        for attempt in list(w.held.values()):
            state = attempt.state
            if state in _PREPARING:
                phase = "preparing"
            elif state is AttemptState.RUNNING:
                phase = "prefill" if attempt.trace.engine_first_token_at is None else "decode"
            elif state is AttemptState.STOPPING:
                phase = "stopping"
            else:
                continue  # ended: reporting, holds no engine work
            counts[(phase, attempt.d.tier.value)] += 1
        for (phase, tier), n in counts.items():
            batch.add_metric([phase, tier], n)
        yield batch
        stats = getattr(self.sink, "stats", None)
        if stats is None:
            return
        for name, value, doc in (
            ("stored", stats.stored, "Final texts written to the result store (by the put or the later write)."),
            ("stored_later", stats.stored_later, "Of those, written by the later write after the put's budget ran out."),
            ("not_stored", stats.not_stored, "Final texts given up (a same-key retry answers result_unavailable)."),
            ("too_large", stats.too_large, "Final texts over the size limit (not stored)."),
            ("write_failures", stats.write_failures, "Failed writes (each is retried, bounded, or held for the later write)."),
        ):
            counter = CounterMetricFamily(f"chatplane_result_sink_{name}", doc)
            counter.add_metric([], value)
            yield counter
        held = GaugeMetricFamily("chatplane_result_sink_held", "Final texts held for the later write now.")
        held.add_metric([], stats.held)
        yield held
        lag = GaugeMetricFamily(
            "chatplane_result_sink_lag_seconds", "How long the oldest held text has waited for the later write (0: none).",
        )
        lag.add_metric([], self.sink.held_oldest_age_s())
        yield lag

