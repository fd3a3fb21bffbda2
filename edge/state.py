"""The edge's process-wide state: one ``Edge`` per app, built by ``edge.app.create_app`` and kept at
``app.state.edge``; routes take it typed through ``edge.deps.EdgeDep``, other code through
``edge_of(app)`` (or ``edge.deps.edge_state(request)``).

Its own module so that what reads it (``edge.deps``, the routes, the OpenAPI customisation) imports
the class without importing ``edge.app``, which imports all of them.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from aiokafka import AIOKafkaProducer
from starlette.applications import Starlette

from edge.admission import AdmissionProbe
from edge.auth import Authenticator
from edge.background import BackgroundSends
from edge.capacity import CapacityReader, CapacityView
from edge.client_ip import ClientAddresses, IpLimiter
from edge.history import History
from edge.metrics import EdgeMetrics
from edge.openai_compat import catalog_written_s
from edge.outcomes import OutcomeLog
from edge.presence import PresenceBeacon
from edge.prompt_publisher import PromptPublisher
from edge.ratelimit import TokenBuckets
from edge.readmodel import ReadModel
from edge.replay import ReplayAccess
from edge.result_retention import ResultRetention
from edge.settings import EdgeSettings
from edge.shedding import LoadShedder
from edge.streams import GenerationView, StreamHub
from edge.tokens import input_token_counter
from infra.content.policy_checks import PolicySettings, load_policy_check
from infra.models.catalog import load_catalog
from infra.runtime.command_client import CommandClient
from infra.runtime.kafka_settings import producer_kwargs
from infra.stores.session import CassandraSession
from schemas.codes import RequestStatus
from schemas.messages import ChatMessage
from schemas.wire import WIRE_CONTENT_MESSAGE_BYTES_MAX

log = logging.getLogger("chatplane.edge")


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
        # The stream registry and, beside it, what it hands work to: background sends, prompts to the
        # workers (edge/prompt_publisher.py), completed results kept for GET (edge/result_retention.py).
        self.background = BackgroundSends()
        self.prompts = PromptPublisher(self.metrics, self.background)
        self.retention = ResultRetention.from_settings(settings)
        self.hub = StreamHub(
            settings, self.metrics, self.edge_id,
            background=self.background, prompts=self.prompts, retention=self.retention,
        )
        self.presence = PresenceBeacon(self.edge_id, settings.topology, settings.presence_interval_s, self.metrics)
        # One content-free outcome per admission request, sent many to a record, for the SLO report
        # (edge/outcomes.py).
        self.outcomes = (
            OutcomeLog(
                settings.topology.outcomes.name, settings.outcomes_buffer_max, settings.outcomes_batch_max,
                settings.outcomes_flush_interval_s, settings.outcomes_flush_timeout_s, self.metrics,
                per_record_max=settings.outcomes_per_record_max,
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
        # The process's one Cassandra session (infra/stores/session.py), opened on first use: the read
        # model, the history and the replay store are built on it; stateless requests never open it.
        self.cassandra = CassandraSession()
        self.reader: ReadModel | None = ReadModel(self.cassandra) if settings.read_model else None
        # Conversation history (edge/history.py): built on first use.
        self.history = History(self.cassandra)
        # Resumable streams (edge/replay.py): the stored deltas, built on first use.
        self.replay = ReplayAccess(self.cassandra)
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
        self.prompts.start(self._producer)
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
        await self.background.flush()
        await self.presence.stop()
        if self._capacity_reader is not None:
            await self._capacity_reader.stop()
        if self.outcomes is not None:
            await self.outcomes.stop()  # before the producer: what is buffered is flushed on it
        if self._producer is not None:
            await self._producer.stop()
        if self.client is not None:
            await self.client.stop()
        await self.cassandra.close()

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
                text = self.retention.result_of(generation_id)
            return view, text
        if view is None or view.owner != user_id:
            return None, None  # another user's id answers exactly like an unknown one
        text = await self.result(generation_id, user_id) if view.status is RequestStatus.COMPLETED else None
        return view, text

    async def result(self, generation_id: str, user_id: str) -> str | None:
        """The retained text of a completed generation the caller owns; None once it has expired."""
        text = self.retention.result_of(generation_id)
        if text is None and self.reader is not None:
            text = await self.reader.result(generation_id, user_id)
        return text


def edge_of(app: Starlette) -> Edge:
    """The app's ``Edge`` (``app.state.edge``, set by ``edge.app.create_app``), typed."""
    edge: Edge = app.state.edge
    return edge
