"""The edge application: FastAPI app factory, its lifespan, and health, readiness and metrics.

Where this sits (DESIGN section 3)::

    client --HTTP/SSE--> edge --SubmitGeneration/CancelGeneration--> COMMANDS --> admission processor
                          ^ <----------- EDGE_INBOX partition of this edge: Outcome, TextDelta,
                          |              GenerationFinalized, PromptRequest (answered on WORKER_CONTROL)
                          `--- CAPACITY (worker heartbeats -> queue-wait estimate)

``create_app(settings)`` builds one ``Edge`` (settings, authenticator, buckets, stream hub, capacity
view, command client) and starts its Kafka clients in the lifespan. ``python -m edge`` runs it under
uvicorn with drain-on-SIGTERM (``edge.__main__``). Logs carry opaque ids only.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiokafka import AIOKafkaProducer
from fastapi import Depends, FastAPI
from starlette.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from edge import errors
from edge.admission import AdmissionProbe
from edge.body import refuse_unexpected_body
from edge.auth import Authenticator
from edge.capacity import CapacityReader, CapacityView
from edge.client_ip import ClientAddresses, IpLimiter
from edge.deps import new_request_id
from edge.metrics import EdgeMetrics
from edge.openai_compat import catalog_written_s
from edge.outcomes import OutcomeLog, OutcomeMiddleware
from edge.ratelimit import TokenBuckets
from edge.history import History
from edge.readmodel import ReadModel
from edge.replay import ReplayAccess
from edge.routes import conversations, generations, internal, openai, ui, usage
from edge.settings import EdgeSettings
from edge.shedding import LoadShedder
from edge.streams import GenerationView, StreamHub
from edge.presence import PresenceBeacon
from edge.tokens import input_token_counter
from infra.models.catalog import load_catalog
from infra.runtime.command_client import CommandClient
from infra.runtime.gc_tuning import tune_gc
from infra.runtime.kafka_settings import producer_kwargs
from infra.content.policy_checks import PolicySettings, load_policy_check
from schemas.codes import RequestStatus
from schemas.messages import ChatMessage
from schemas.wire import WIRE_CONTENT_MESSAGE_BYTES_MAX

log = logging.getLogger("chatplane.edge")

OPENAPI_TITLE = "chatplane edge"
OPENAPI_VERSION = "1.0.0"
# How long a browser may cache a CORS preflight answer.
CORS_MAX_AGE_S = 600


class Edge:
    """The process-wide parts the routes use (``request.app.state.edge``)."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.metrics = EdgeMetrics()
        self.auth = Authenticator(settings)
        self.buckets = TokenBuckets.for_fleet(
            settings.bucket_capacity_tokens,
            settings.bucket_refill_interval_s,
            settings.bucket_users_max,
            settings.edge_replicas,
            settings.users_sticky,
        )
        # The page's first-token beacons, per user (edge/routes/ui.py): apart from the generation bucket.
        self.beacon_buckets = TokenBuckets.for_fleet(
            settings.beacon_bucket_capacity_tokens,
            settings.beacon_bucket_refill_interval_s,
            settings.beacon_bucket_users_max,
            settings.edge_replicas,
            settings.users_sticky,
        )
        # The per-address bucket, taken before authentication (edge/client_ip.py): this edge's share.
        self.ip_limiter = IpLimiter.for_fleet(
            ClientAddresses(
                settings.trusted_proxies, settings.client_ip_header, settings.client_ip_hops_max,
                settings.ipv4_prefix, settings.ipv6_prefix,
            ),
            settings.ip_rate_per_s, settings.ip_burst, settings.ip_buckets_max, settings.edge_replicas,
        )
        # The prompt check before admission (infra/content/policy_checks.py); None: no check.
        self.policy_check = load_policy_check() if PolicySettings().prompts else None
        # This process as a reader of its clients' generations: new at every start (edge/presence.py).
        self.edge_id = uuid.uuid4().hex
        self.hub = StreamHub(settings, self.metrics, self.edge_id)
        self.presence = PresenceBeacon(self.edge_id, settings.topology, settings.presence_interval_s, self.metrics)
        # One content-free record per admission request, for the SLO report (edge/outcomes.py).
        self.outcomes = (
            OutcomeLog(
                settings.topology.outcomes.name, settings.outcomes_buffer_max, settings.outcomes_batch_max,
                settings.outcomes_flush_interval_s, settings.outcomes_flush_timeout_s, self.metrics,
            )
            if settings.outcomes
            else None
        )
        self.capacity = CapacityView(
            settings.heartbeat_stale_ms,
            settings.generation_service_ms_estimate,
            settings.decode_tokens_per_s_estimate,
            settings.prefill_tokens_per_s_estimate,
        )
        self.catalog = load_catalog()
        # GET /v1/models' "created" of an alias whose catalog entry gives none (edge.openai_compat).
        self.catalog_written_s = catalog_written_s(self.catalog)
        self.count_tokens = input_token_counter(self.catalog)
        self.client: Any = None
        self.ready = False
        self._capacity_reader: CapacityReader | None = None
        self._producer: AIOKafkaProducer | None = None
        self.reader: ReadModel | None = ReadModel() if settings.read_model else None
        # Conversation history (edge/history.py): opened on first use; stateless requests never use it.
        self.history = History()
        # Resumable streams (edge/replay.py): the stored deltas, opened on first use.
        self.replay = ReplayAccess()
        # Refuses submits at once while their decision would come late (edge.shedding).
        self.shedder = LoadShedder(
            settings.shed_decision_age_ms, settings.shed_loop_lag_ms, client=lambda: self.client,
            latency_target_ms=settings.shed_latency_target_ms, streams_min=settings.shed_streams_min,
            streams_max=settings.streams_max, held=lambda: len(self.hub.streams),
        )
        self.metrics.shed_limit.set(self.shedder.limit)
        # Whether a decision round trip works, probed in the background (edge.admission); reported by
        # GET /healthz/admission, never by /readyz.
        self.admission = AdmissionProbe(
            settings.inbox_partition, settings.admission_probe_interval_s, settings.admission_probe_timeout_s,
            self.metrics, client=lambda: self.client,
        )

    async def start(self) -> None:
        s = self.settings
        if self.auth.remote is not None:
            await self.auth.remote.start()
        # Load each model's tokenizer now (its vocabulary takes most of a second), not on a request.
        for alias in s.policy.models:
            self.count_tokens(alias, (ChatMessage(role="user", content="warm-up"),))
        self.client = CommandClient(
            s.kafka_bootstrap, s.topology, s.inbox_partition, on_message=self.hub.on_message,
            decision_timeout_s=s.decision_timeout_s,
        )
        await self.client.start()
        self.hub.client = self.client
        self._producer = AIOKafkaProducer(
            bootstrap_servers=s.kafka_bootstrap, acks="all", linger_ms=0, max_request_size=WIRE_CONTENT_MESSAGE_BYTES_MAX + 4096,
            **producer_kwargs(),
        )
        await self._producer.start()
        self.hub.producer = self._producer
        self.presence.start(self._producer)
        if self.outcomes is not None:
            self.outcomes.start(self._producer)
        if s.capacity_check:
            self._capacity_reader = CapacityReader(s.kafka_bootstrap, s.topology, self.capacity)
            await self._capacity_reader.start()
        # One admission round trip before the edge calls itself ready: the first one pays for the reply
        # partition's first fetch (a few hundred ms), and a submit arriving meanwhile would find a
        # decision pending past the shedder's age bound and be refused for a warm-up. Bounded by the
        # probe's timeout; a processor that is down does not keep the edge from serving reads.
        await self.admission.probe_once()
        self.ready = True
        self.shedder.start()
        self.admission.start()
        log.info("edge ready inbox_partition=%d edge_id=%s", s.inbox_partition, self.edge_id)

    async def stop(self) -> None:
        self.ready = False
        if self.auth.remote is not None:
            await self.auth.remote.stop()
        await self.admission.stop()
        await self.shedder.stop()
        await self.hub.flush_background()
        await self.presence.stop()
        if self._capacity_reader is not None:
            await self._capacity_reader.stop()
        if self.outcomes is not None:
            await self.outcomes.stop()  # before the producer: what is buffered is flushed on it
        if self._producer is not None:
            await self._producer.stop()
        if self.client is not None:
            await self.client.stop()
        if self.reader is not None:
            await self.reader.close()
        await self.history.close()
        await self.replay.close()

    async def lookup(self, generation_id: str, user_id: str) -> GenerationView | None:
        """The generation if ``user_id`` owns it: this edge's memory first, then the read model."""
        view = self.hub.recent.get(generation_id)
        if view is None and self.reader is not None:
            view = await self.reader.lookup(generation_id, user_id)
        if view is None or view.owner != user_id:
            return None  # another user's id answers exactly like an unknown one
        return view

    async def lookup_with_result(self, generation_id: str, user_id: str) -> tuple[GenerationView | None, str | None]:
        """For GET: the generation if ``user_id`` owns it and, when completed, its retained text
        (None once expired). From this edge's memory, else one read-model call."""
        view = self.hub.recent.get(generation_id)
        if view is None and self.reader is not None:
            view, text = await self.reader.lookup_with_result(generation_id, user_id)
            if view is None or view.owner != user_id:
                return None, None
            if text is None and view.status is RequestStatus.COMPLETED:
                text = self.hub.result_of(generation_id)
            return view, text
        if view is None or view.owner != user_id:
            return None, None  # another user's id answers exactly like an unknown one
        text = await self.result(generation_id, user_id) if view.status is RequestStatus.COMPLETED else None
        return view, text

    async def result(self, generation_id: str, user_id: str) -> str | None:
        """The retained text of a completed generation the caller owns; None once it has expired."""
        text = self.hub.result_of(generation_id)
        if text is None and self.reader is not None:
            text = await self.reader.result(generation_id, user_id)
        return text


class RequestIdMiddleware:
    """Gives every request an opaque ``request_id`` (``request.state.request_id``, ``X-Request-Id``).

    Plain ASGI rather than ``BaseHTTPMiddleware``: that one runs each response in an extra task group
    with its own disconnect listener, which cost a third of the edge's CPU per streaming request.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append(header)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _cache_openapi(app: FastAPI) -> dict[str, Any]:
    from edge.openapi import build

    app.openapi_schema = build(app)
    return app.openapi_schema


def create_app(settings: EdgeSettings | None = None) -> FastAPI:
    edge = Edge(settings or EdgeSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await edge.start()
        tune_gc(edge.settings.gc_gen0_threshold)
        try:
            yield
        finally:
            await edge.stop()

    app = FastAPI(
        title=OPENAPI_TITLE,
        version=OPENAPI_VERSION,
        description="The HTTP/SSE edge of chatplane: submit, read and cancel generations.",
        lifespan=lifespan,
        # A path with a trailing slash is an unknown route (typed 404), never a redirect: Starlette's
        # redirect builds its Location from the client's Host header.
        redirect_slashes=False,
        # Every route reads its body through edge.body; one that takes none refuses any.
        dependencies=[Depends(refuse_unexpected_body)],
    )
    app.state.edge = edge
    app.openapi = lambda: app.openapi_schema or _cache_openapi(app)  # type: ignore[method-assign]
    app.include_router(generations.router)
    app.include_router(openai.router)
    app.include_router(usage.router)
    app.include_router(conversations.router)
    app.include_router(internal.router)  # the proxy's route-key look-up; not in the OpenAPI document
    ui.install(app, edge.settings.dev_mode)
    app.add_exception_handler(errors.ApiError, errors.api_error_handler)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)

    app.add_middleware(OutcomeMiddleware, edge=edge)  # inside RequestIdMiddleware: it reads the request id
    app.add_middleware(RequestIdMiddleware)
    if edge.settings.cors_origin_list:
        # Outermost: a preflight is answered before authentication. Bearer tokens travel in a header,
        # so no credentials mode (cookies) is allowed; scripts may read the retry and request-id headers.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=edge.settings.cors_origin_list,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
            expose_headers=["Retry-After", "X-Request-Id", "retry-after-ms", "x-should-retry"],
            allow_credentials=False,
            max_age=CORS_MAX_AGE_S,
        )

    @app.get("/healthz", include_in_schema=True, tags=["operations"], summary="Liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], summary="Readiness: fails first when draining")
    async def readyz() -> Response:
        if not edge.ready or edge.hub.draining:
            return JSONResponse({"status": "draining" if edge.hub.draining else "starting"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get(
        "/healthz/admission", tags=["operations"],
        summary="Admission health: whether the processor answers a probe command (not part of readiness)",
        responses={503: {"description": "Admission down: the last probe got no decision in time (or none ended yet)"}},
    )
    async def admission_health() -> Response:
        return JSONResponse(edge.admission.status(), status_code=200 if edge.admission.up else 503)

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(edge.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
