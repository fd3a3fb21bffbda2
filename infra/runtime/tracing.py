"""Traces across the log: one OpenTelemetry trace per generation, off by default.

Where this sits: every process that touches a generation calls the hooks below at one or two
lines per site; the trace context travels between processes only in Kafka record headers (W3C
``traceparent``/``tracestate``), never in a payload, and a span carries ids, codes and counts only
(``ATTRIBUTES``: an attribute outside the list is a programming error, refused at the call).

    edge       edge.generation (the root, from the request's arrival) -- edge.checks, edge.command_append
                  | SubmitGeneration's headers
    processor  processor.decide (child of the command's context); every record it routes for that
                  | command (ledger, reply, dispatch, stop) carries the decision's context in its headers
    readmodel  readmodel.write (child of the ledger record's context)
    worker     worker.dispatch (child of the dispatch record's context) -- worker.prompt, worker.accept
                  (AcceptAttempt's headers), worker.first_token, worker.cancel (StopAttempt linked),
                  worker.finalize (ReportAttemptFinished's headers) -> processor.decide -> readmodel.write
    edge       edge.cancel (child of the generation's root when this edge admitted it, else a root)

Off (``CHATPLANE_TRACING=off``, the default) every hook returns at a check of the module-level
``ENABLED`` flag: no span object, no header encoding, no OpenTelemetry import (the package is not
needed then). On, the modes are:

    otlp   spans batched to an OTLP/HTTP collector: OTEL_EXPORTER_OTLP_ENDPOINT (and the other standard
           OTEL_EXPORTER_OTLP_* variables) configure the exporter; needs ``pip install 'chatplane[tracing]'``
    drop   spans batched, encoded as OTLP protobuf (JSON when the OTLP encoder is not installed) and
           dropped: the whole cost of tracing except the network, for benchmarks (bench/bench_stack.py --tracing)
    file   one JSON line per span appended to CHATPLANE_TRACING_FILE as each span ends (at most
           CHATPLANE_TRACING_FILE_SPANS_MAX), for tests that collect spans from subprocesses

Bounds: the batch processor's queue (``CHATPLANE_TRACING_QUEUE_MAX``; spans beyond it are dropped by
the SDK), the edge's memory of the roots of the generations it admitted, for cancels
(``CHATPLANE_TRACING_ROOTS_MAX``, oldest forgotten first), the file's span count, the length of a
string attribute (``ATTRIBUTE_CHARS_MAX``). Sampling: ``CHATPLANE_TRACING_SAMPLE_RATIO`` at the root
(the edge), every other process follows its parent's decision.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from control_plane.ids import generation_id_for
from infra.runtime.settings import SettingsError, env_value

log = logging.getLogger("chatplane.tracing")

# The module-level switch every hook checks first; set only by ``configure``/``install``.
ENABLED = False

MODES = ("off", "otlp", "drop", "file")
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_HEADER_KEYS = (TRACEPARENT, TRACESTATE)
ATTRIBUTE_CHARS_MAX = 128  # ids are short: a longer string is cut (never a place for text)
ROOTS_MAX_DEFAULT = 10_000
QUEUE_MAX_DEFAULT = 2_048
FILE_SPANS_MAX_DEFAULT = 100_000

# The only attribute names a span may carry (as ``chatplane.<name>``): ids, codes, counts.
ATTRIBUTES = frozenset({
    "generation_id", "epoch", "command_id", "command_type", "outcome", "code", "status", "redelivered",
    "worker_id", "pool", "tier", "partition", "offset", "finish_reason", "stop_reason", "output_tokens",
    "rows", "found", "accepted", "http_status", "user_partition",
})

Headers = list[tuple[str, bytes]]

_tracer: Any = None
_provider: Any = None
_roots: collections.OrderedDict[str, Any] = collections.OrderedDict()
_roots_max = ROOTS_MAX_DEFAULT
_propagator: Any = None
_span_api: Any = None  # opentelemetry.trace, imported when tracing is on
_no_parent: Any = None  # an empty opentelemetry Context: a span started in it is a root


class TracingUnavailable(SettingsError):
    """Tracing was asked for and the OpenTelemetry SDK is not installed."""


# ------------------------------------------------------------------------------------------------
# configuration


def configure(service: str) -> bool:
    """Read ``CHATPLANE_TRACING*`` once at a process's start; True when tracing is now on.

    Raises ``SettingsError`` (one line naming the variable) for a bad value, or when a mode is asked
    for without the SDK installed."""
    mode = env_value("CHATPLANE_TRACING", "off", choices=MODES)
    if mode == "off":
        return False
    ratio = env_value("CHATPLANE_TRACING_SAMPLE_RATIO", 1.0, ge=0.0, le=1.0)
    queue_max = env_value("CHATPLANE_TRACING_QUEUE_MAX", QUEUE_MAX_DEFAULT, ge=1)
    roots_max = env_value("CHATPLANE_TRACING_ROOTS_MAX", ROOTS_MAX_DEFAULT, ge=1)
    try:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise TracingUnavailable(
            f"CHATPLANE_TRACING={mode!r}: the OpenTelemetry SDK is not installed (pip install 'chatplane[tracing]')"
        ) from None
    if mode == "file":
        path = env_value("CHATPLANE_TRACING_FILE", "")
        if not path:
            raise SettingsError("CHATPLANE_TRACING_FILE='': expected a file path (CHATPLANE_TRACING=file)")
        spans_max = env_value("CHATPLANE_TRACING_FILE_SPANS_MAX", FILE_SPANS_MAX_DEFAULT, ge=1)
        processor = SimpleSpanProcessor(_jsonl_exporter(path, spans_max))
    elif mode == "drop":
        processor = BatchSpanProcessor(_dropping_exporter(), max_queue_size=queue_max)
    else:
        if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
            raise SettingsError(
                "CHATPLANE_TRACING='otlp': expected OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) to be set"
            )
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TracingUnavailable(
                "CHATPLANE_TRACING='otlp': the OTLP exporter is not installed (pip install 'chatplane[tracing]')"
            ) from None
        processor = BatchSpanProcessor(OTLPSpanExporter(), max_queue_size=queue_max)
    install(processor, service, sample_ratio=ratio, roots_max=roots_max)
    log.info("tracing on: %s, sample ratio %s", mode, ratio)
    return True


def install(span_processor: Any, service: str, sample_ratio: float = 1.0, roots_max: int = ROOTS_MAX_DEFAULT) -> None:
    """Turn tracing on with this SDK span processor (tests pass a ``SimpleSpanProcessor`` of an
    ``InMemorySpanExporter``). The provider is this module's own, not OpenTelemetry's global one, so a
    test can install and uninstall as often as it likes."""
    global ENABLED, _tracer, _provider, _propagator, _span_api, _roots_max, _no_parent
    from opentelemetry import trace as span_api
    from opentelemetry.context import Context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        shutdown_on_exit=True,
    )
    provider.add_span_processor(span_processor)
    _provider, _tracer = provider, provider.get_tracer("chatplane")
    _propagator, _span_api, _no_parent = TraceContextTextMapPropagator(), span_api, Context()
    _roots_max = roots_max
    _roots.clear()
    ENABLED = True


def uninstall() -> None:
    """Tracing off again (tests): flush and shut down the provider, forget the roots."""
    global ENABLED, _tracer, _provider
    ENABLED = False
    provider, _provider, _tracer = _provider, None, None
    _roots.clear()
    if provider is not None:
        provider.shutdown()


def flush(timeout_ms: int = 5_000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


# ------------------------------------------------------------------------------------------------
# headers


def extract(headers: Sequence[tuple[str, bytes]] | None) -> Any:
    """The remote parent a Kafka record's headers carry, or None (off, no headers, no traceparent)."""
    if not ENABLED or not headers:
        return None
    carrier = {k: v.decode("latin-1") for k, v in headers if k in _HEADER_KEYS and v}
    if TRACEPARENT not in carrier:
        return None
    span = _span_api.get_current_span(_propagator.extract(carrier))
    return span if span.get_span_context().is_valid else None


def headers(span: Any) -> Headers | None:
    """The Kafka record headers that carry ``span``'s context on; None when there is no span."""
    if span is None:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=_span_api.set_span_in_context(span))
    return [(k, v.encode("latin-1")) for k, v in carrier.items()]


# ------------------------------------------------------------------------------------------------
# spans


def wall_ns(monotonic_s: float) -> int:
    """The wall-clock time (ns since the epoch) of an earlier ``time.monotonic()`` reading."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _attributes(attrs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in attrs.items():
        if key not in ATTRIBUTES:
            raise ValueError(f"span attribute {key!r} is not an id, code or count (tracing.ATTRIBUTES)")
        if value is None:
            continue
        if isinstance(value, str):
            value = value[:ATTRIBUTE_CHARS_MAX]
        elif not isinstance(value, (bool, int, float)):
            value = str(getattr(value, "value", value))[:ATTRIBUTE_CHARS_MAX]  # an enum: its code
        out[f"chatplane.{key}"] = value
    return out


def start(name: str, parent: Any = None, *, root: bool = False, start_ns: int | None = None,
          links: Iterable[Any] = (), **attrs: Any) -> Any:
    """A started span, child of ``parent`` (a span from ``start`` or ``extract``); None when tracing
    is off, or when there is no parent and ``root`` is not asked (only the edge starts traces)."""
    if not ENABLED or (parent is None and not root):
        return None
    context = _span_api.set_span_in_context(parent) if parent is not None else _no_parent
    span_links = [_span_api.Link(p.get_span_context()) for p in links if p is not None]
    return _tracer.start_span(name, context=context, attributes=_attributes(attrs), start_time=start_ns,
                              links=span_links)


def end(span: Any, **attrs: Any) -> None:
    """End ``span`` (None: nothing), after setting ``attrs``."""
    if span is None:
        return
    if attrs:
        span.set_attributes(_attributes(attrs))
    span.end()


def record(name: str, parent: Any, start_ns: int, **attrs: Any) -> Any:
    """A span from ``start_ns`` until now, child of ``parent``: for a step measured after the fact."""
    span = start(name, parent, start_ns=start_ns, **attrs)
    end(span)
    return span


def now_ns() -> int:
    """``time.time_ns()`` when tracing is on, 0 when off (a start time taken before a span may exist)."""
    return time.time_ns() if ENABLED else 0


def parents(polled: Iterable[Sequence[Any]]) -> list[tuple[Any, int, int]]:
    """(parent, partition, offset) of every traced record of a poll (``{tp: [ConsumerRecord]}.values()``)."""
    if not ENABLED:
        return []
    out = []
    for records in polled:
        for r in records:
            parent = extract(r.headers)
            if parent is not None:
                out.append((parent, r.partition, r.offset))
    return out


# ------------------------------------------------------------------------------------------------
# the edge: one generation's root, and its memory for cancels


def begin_generation(received_s: float, command: Any) -> tuple[Any, Any] | None:
    """The edge's root span from the request's arrival (``time.monotonic()`` then), its checks as a
    finished child, and the command-append span whose headers ``command`` (a ``SubmitGeneration``)
    carries; None when off. The root names the generation id a new key's submit gets (a same-key
    retry's existing id is on the processor's span)."""
    if not ENABLED:
        return None
    attrs = {"generation_id": generation_id_for(command.user_id, command.command_id),
             "command_id": command.command_id, "command_type": command.type}
    received_ns = wall_ns(received_s)
    root = start("edge.generation", root=True, start_ns=received_ns, **attrs)
    record("edge.checks", root, received_ns, **attrs)
    return root, start("edge.command_append", root, **attrs)


def generation_headers(traced: tuple[Any, Any] | None) -> Headers | None:
    return headers(traced[1]) if traced is not None else None


def end_generation(traced: tuple[Any, Any] | None, **attrs: Any) -> None:
    if traced is not None:
        end(traced[1])
        end(traced[0], **attrs)


def remember(generation_id: str | None, traced: tuple[Any, Any] | None) -> None:
    """Keep the root's context of a generation this edge admitted (bounded), for its cancel."""
    if traced is None or traced[0] is None or not generation_id:
        return
    _roots[generation_id] = _span_api.NonRecordingSpan(traced[0].get_span_context())
    while len(_roots) > _roots_max:
        _roots.popitem(last=False)


def recall(generation_id: str) -> Any:
    """The root of a generation this edge admitted, or None (off, forgotten, admitted elsewhere)."""
    if not ENABLED:
        return None
    return _roots.get(generation_id)


# ------------------------------------------------------------------------------------------------
# exporters of the non-network modes


def span_record(s: Any) -> dict[str, Any]:
    """One finished SDK span as the plain record the file mode writes (and tests compare)."""
    ctx, parent = s.get_span_context(), s.parent
    return {
        "name": s.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "service": s.resource.attributes.get("service.name"),
        "start_ns": s.start_time,
        "end_ns": s.end_time,
        "attributes": dict(s.attributes or {}),
        "links": [f"{link.context.span_id:016x}" for link in s.links],
    }


def _jsonl_exporter(path: str, spans_max: int) -> Any:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonlFileExporter(SpanExporter):
        """Appends one JSON line per span; stops writing after ``spans_max`` (dev and tests only)."""

        def __init__(self) -> None:
            self.written = 0
            self._lock = threading.Lock()

        def export(self, spans: Sequence[Any]) -> Any:
            with self._lock:
                room = max(0, spans_max - self.written)
                lines = [json.dumps(span_record(s)) + "\n" for s in list(spans)[:room]]
                if lines:
                    with open(path, "a", encoding="utf-8") as f:
                        f.write("".join(lines))
                        f.flush()
                        os.fsync(f.fileno())
                    self.written += len(lines)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            return None

    return JsonlFileExporter()


def _dropping_exporter() -> Any:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    try:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        def encode(spans: Sequence[Any]) -> bytes:
            return encode_spans(spans).SerializePartialToString()
    except ImportError:

        def encode(spans: Sequence[Any]) -> bytes:
            return json.dumps([span_record(s) for s in spans]).encode()

    class DroppingExporter(SpanExporter):
        """Encodes each batch as an exporter would send it, then drops it (benchmarks: the cost of
        tracing without a collector); counts what it dropped."""

        def __init__(self) -> None:
            self.spans = 0
            self.bytes = 0

        def export(self, spans: Sequence[Any]) -> Any:
            self.bytes += len(encode(spans))
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            log.info("tracing (drop): %d spans, %d bytes encoded and dropped", self.spans, self.bytes)

    return DroppingExporter()


def read_span_file(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The span records a file-mode process wrote (tests)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
