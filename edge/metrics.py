"""Prometheus metrics of one edge process, served at ``/metrics``.

Labels are closed vocabularies (decision codes, event kinds), never ids or content. Admissions are
counted by code so ``quota_exhausted``, ``rate_limited``, ``concurrency_limited`` and
``capacity_exhausted`` stay apart (seed section 11: a global 429 count hides the client's action).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from infra.runtime.metrics_http import LATENCY_BUCKETS_S
from schemas.codes import REJECTIONS

# Every label value a submit decision can count under, exported at 0 from the start so a dashboard
# shows quota_exhausted, rate_limited, concurrency_limited and capacity_exhausted apart before the
# first of each happens.
ADMISSION_LABELS = ("admitted", "existing", *(code.value for code in REJECTIONS))
SLOW_CONSUMER_LIMITS = ("stream_bytes", "aggregate_bytes", "result_bytes", "result_tokens")
# How an admission probe ended (edge.admission.ProbeResult) and why the edge closed a connection itself
# (edge.uvicorn_adapter): written out here so this module imports neither.
ADMISSION_PROBE_RESULTS = ("up", "timeout", "error")
CONNECTION_CLOSE_REASONS = ("head_timeout", "connections_max", "head_bytes", "malformed")
SHED_REASONS = ("decisions_late", "edge_busy", "in_flight_limit")  # edge.shedding
OUTCOME_DROP_REASONS = ("buffer_full", "send_failed")  # edge.outcomes
# Why a conversation turn's end went out before the history store showed its answer's revision
# (edge.history.answer_visible): the bound passed, or the store failed.
ANSWER_NOT_VISIBLE_REASONS = ("timeout", "history_unavailable")



class EdgeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.admissions = Counter(
            "chatplane_edge_admissions", "Submit decisions by outcome code (admitted, existing or a rejection code).",
            ["code"], registry=r,
        )
        self.decision_latency = Histogram(
            "chatplane_edge_decision_seconds", "POST received -> typed decision (admission or refusal).",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.first_token = Histogram(
            "chatplane_edge_time_to_first_text_token_seconds", "POST received -> first text delta forwarded.",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        # Reported by the web page (POST /v1/client-metrics): Enter -> first token rendered, as the
        # person saw it, beside the server-side figure above (seed: tracked separately).
        self.client_first_token = Histogram(
            "chatplane_edge_client_first_token_seconds",
            "Client-observed time from send to first rendered token (web page beacon; content-free).",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.queue_age = Histogram(
            "chatplane_edge_queue_age_seconds", "Admission -> first text delta (queueing plus prefill).",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.active_streams = Gauge("chatplane_edge_active_streams", "Generations held by this edge.", registry=r)
        self.buffered_bytes = Gauge("chatplane_edge_buffered_bytes", "Bytes waiting in stream buffers.", registry=r)
        self.slow_consumer_cancels = Counter(
            "chatplane_edge_slow_consumer_cancels", "Generations cancelled because their reader fell behind.",
            ["limit"], registry=r,
        )
        self.readers_detached = Counter(
            "chatplane_edge_readers_detached",
            "Generations detached because their client disconnected (cancelled after the grace unless reattached).",
            registry=r
        )
        self.presence_failures = Counter(
            "chatplane_edge_presence_failures", "Liveness beats (EdgePresence) that could not be sent.", registry=r
        )
        self.deltas_dropped = Counter(
            "chatplane_edge_deltas_dropped", "Text deltas dropped (stale epoch, duplicate, or no stream held).",
            ["reason"], registry=r,
        )
        self.terminal_events = Counter(
            "chatplane_edge_terminal_events", "Terminal events sent, by status.", ["status"], registry=r
        )
        self.prompt_requests = Counter(
            "chatplane_edge_prompt_requests", "Prompt requests from workers, by whether the prompt was held.",
            ["found"], registry=r,
        )
        self.prompts_published = Counter(
            "chatplane_edge_prompts_published", "Prompts published beside submits (prompts.<pool>), by whether the send succeeded.",
            ["sent"], registry=r,
        )
        self.unhandled_errors = Counter(
            "chatplane_edge_unhandled_errors", "Requests that hit a bug (answered as a typed 500 internal_error); should stay 0.", registry=r
        )
        for label in ADMISSION_LABELS:
            self.admissions.labels(label)
        for limit in SLOW_CONSUMER_LIMITS:
            self.slow_consumer_cancels.labels(limit)
        self.shed = Counter(
            "chatplane_edge_shed", "Submits refused before they were sent, because a decision would come late.",
            ["reason"], registry=r,
        )
        for reason in SHED_REASONS:
            self.shed.labels(reason)
        self.shed_limit = Gauge(
            "chatplane_edge_shed_in_flight_limit", "The adaptive limit on generations held (edge.shedding).", registry=r
        )
        self.draining = Gauge("chatplane_edge_draining", "1 while this edge drains.", registry=r)
        self.admission_up = Gauge(
            "chatplane_edge_admission_up",
            "1 while the last admission probe (a no-op command) was decided by the processor in time.", registry=r,
        )
        self.admission_probe_latency = Histogram(
            "chatplane_edge_admission_probe_seconds", "Admission probe appended -> its decision back (answered probes).",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.admission_probes = Counter(
            "chatplane_edge_admission_probes", "Admission probes by result (up, timeout, error).", ["result"], registry=r
        )
        self.connections_closed = Counter(
            "chatplane_edge_connections_closed",
            "Connections the edge closed itself: request head not read in time, or over the connection bound.",
            ["reason"], registry=r,
        )
        for result in ADMISSION_PROBE_RESULTS:
            self.admission_probes.labels(result)
        for reason in CONNECTION_CLOSE_REASONS:
            self.connections_closed.labels(reason)
        # Outcome records (edge/outcomes.py, docs/slo.md): never blocking a request, so a full buffer
        # or a failed send drops the record and counts it here.
        self.outcomes_dropped = Counter(
            "chatplane_edge_outcomes_dropped",
            "Outcome records (one per admission request) dropped: buffer full or the send failed.",
            ["reason"], registry=r,
        )
        for reason in OUTCOME_DROP_REASONS:
            self.outcomes_dropped.labels(reason)
        # Read-your-writes not kept: a turn's end told to its client while the history store still
        # showed an older revision (a read right after it may show the older one).
        self.answers_not_visible = Counter(
            "chatplane_edge_answers_not_visible",
            "Conversation turns whose end was answered before the history store showed the answer's revision.",
            ["reason"], registry=r,
        )
        for reason in ANSWER_NOT_VISIBLE_REASONS:
            self.answers_not_visible.labels(reason)
