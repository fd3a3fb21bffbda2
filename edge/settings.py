"""Settings of the HTTP/SSE edge (``python -m edge``), read from the environment once at start-up.

Every limit is a named, configurable value with its unit in the name, read by the shared loader
(``infra.runtime.settings``: typed, checked at start, a bad value is one line naming the
variable). The edge shares the admission policy's model catalog and output-token ceiling with the
processor (``policy_from_env``), so it can reject an oversized request before any work, while the
core stays the authority. The request body's bounds (``messages_count_max``,
``policy.max_output_tokens_max``) are also what the OpenAPI document shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.policy import Policy
from edge.client_ip import IPNetwork, parse_networks
from infra.runtime.gc_tuning import GC_GEN0_THRESHOLD_DEFAULT
from infra.runtime.settings import DEV_MODE_ENV, SettingsError, env_var, kafka_bootstrap_setting, policy_from_env, setting
from schemas.outcomes import OUTCOMES_PER_RECORD_DEFAULT
from schemas.topics import Topology

# Built-in secrets, used only in development mode (CHATPLANE_DEV_MODE=1, set by `make up` and the tests)
# when the real ones are unset. Anywhere else an unset secret stops the edge at start (__post_init__):
# a public default would let anyone mint tokens or link request fingerprints.
DEV_JWT_SECRET = "chatplane-local-development-secret-change-me"
DEV_FINGERPRINT_KEY = "chatplane-local-fingerprint-key-change-me"
PORT_MAX = 65_535


@dataclass(frozen=True)
class EdgeSettings:
    kafka_bootstrap: str = kafka_bootstrap_setting()
    topology: Topology = setting("CHATPLANE_NAMESPACE", Topology(""), parse=Topology, expected="a namespace")
    # The edge-inbox partition this process reads (decisions, deltas, finalizations, prompt requests).
    inbox_partition: int = setting("CHATPLANE_EDGE_INBOX_PARTITION", 0, ge=0)
    host: str = setting("CHATPLANE_EDGE_HOST", "127.0.0.1")
    port: int = setting("CHATPLANE_EDGE_PORT", 8080, ge=1, le=PORT_MAX)
    # The kernel send buffer of each client connection (0: the kernel's default, autotuned up to
    # net.ipv4.tcp_wmem's maximum, 4 MiB here). Set, it bounds what a client that stops reading holds
    # in the kernel beyond the stream buffer, so a slow reader meets its ceiling sooner.
    socket_sndbuf_bytes: int = setting("CHATPLANE_EDGE_SOCKET_SNDBUF_BYTES", 0, ge=0, le=64 * 1024 * 1024)
    # Connections (edge.uvicorn_adapter): a request head not read whole within this time (from the
    # accept, or from the first byte of the next request on a kept-alive connection) closes the
    # connection; a connection accepted while connections_max are open is answered 503 and closed.
    # The bound sits above CHATPLANE_EDGE_STREAMS_MAX: each held stream is a connection.
    request_head_timeout_s: float = setting("CHATPLANE_EDGE_REQUEST_HEAD_TIMEOUT_S", 10.0, gt=0)
    connections_max: int = setting("CHATPLANE_EDGE_CONNECTIONS_MAX", 24_000, ge=1)
    # Admission health (edge.admission): a no-op command to the processor every interval, each waiting
    # at most the probe timeout; GET /healthz/admission and chatplane_edge_admission_up report it.
    admission_probe_interval_s: float = setting("CHATPLANE_EDGE_ADMISSION_PROBE_INTERVAL_S", 2.0, gt=0)
    admission_probe_timeout_s: float = setting("CHATPLANE_EDGE_ADMISSION_PROBE_TIMEOUT_S", 2.0, gt=0)

    # Development mode: unset secrets fall back to the built-in ones (DEV_JWT_SECRET, DEV_FINGERPRINT_KEY).
    dev_mode: bool = setting(DEV_MODE_ENV, False)

    # Authentication: HS256 with a shared secret (local), or RS256 against a JWKS (production). Only
    # what the algorithm needs is required: the secret for HS256, the JWKS file for RS256.
    jwt_algorithm: str = setting("CHATPLANE_EDGE_JWT_ALGORITHM", "HS256", choices=("HS256", "RS256"))
    jwt_secret: str = setting("CHATPLANE_EDGE_JWT_SECRET", "")
    jwks_path: str = setting("CHATPLANE_EDGE_JWKS_PATH", "")
    # RS256 keys from the identity provider instead of a file (edge/jwks.py): the JWKS URL, or OIDC
    # discovery from the issuer; refreshed when older than the max age, on an unknown kid at most
    # once per the minimum interval, each fetch bounded by the timeout.
    jwks_url: str = setting("CHATPLANE_EDGE_JWKS_URL", "")
    oidc_discovery: bool = setting("CHATPLANE_EDGE_OIDC_DISCOVERY", False)
    jwks_max_age_s: float = setting("CHATPLANE_EDGE_JWKS_MAX_AGE_S", 3600.0, gt=0)
    jwks_refresh_min_interval_s: float = setting("CHATPLANE_EDGE_JWKS_REFRESH_MIN_INTERVAL_S", 60.0, ge=0)
    jwks_fetch_timeout_s: float = setting("CHATPLANE_EDGE_JWKS_FETCH_TIMEOUT_S", 5.0, gt=0)
    # Browser origins allowed to call the API (CORS), comma-separated, each "scheme://host[:port]";
    # none by default (no CORS headers at all). "*" is refused: the list is explicit.
    cors_origins: str = setting("CHATPLANE_EDGE_CORS_ORIGINS", "")
    jwt_issuer: str = setting("CHATPLANE_EDGE_JWT_ISSUER", "chatplane-local")
    jwt_audience: str = setting("CHATPLANE_EDGE_JWT_AUDIENCE", "chatplane-edge")
    jwt_leeway_s: int = setting("CHATPLANE_EDGE_JWT_LEEWAY_S", 30, ge=0)
    # A token whose expiry lies further ahead than this is refused (401): a stolen token with an
    # expiry of centuries would otherwise be good for ever. Counted from now, so iat is optional.
    jwt_lifetime_max_s: int = setting("CHATPLANE_EDGE_JWT_LIFETIME_MAX_S", 24 * 3600, ge=1)

    # Cyclic GC (infra.runtime.gc_tuning.tune_gc): young-generation size; 0 keeps Python's settings.
    gc_gen0_threshold: int = setting("CHATPLANE_EDGE_GC_GEN0_THRESHOLD", GC_GEN0_THRESHOLD_DEFAULT, ge=0)

    # Keys the request fingerprints (idempotency-key reuse checks); needed whatever the token algorithm.
    fingerprint_key: str = setting("CHATPLANE_FINGERPRINT_KEY", "")

    # Bounds checked before any work.
    request_body_bytes_max: int = setting("CHATPLANE_EDGE_REQUEST_BODY_BYTES_MAX", 256 * 1024, ge=1)
    # A request head (request line and headers) larger than this is answered the typed 400 and the
    # connection closed (edge.uvicorn_adapter), however the bytes arrive.
    request_head_bytes_max: int = setting("CHATPLANE_EDGE_REQUEST_HEAD_BYTES_MAX", 64 * 1024, ge=1024, le=16 * 1024 * 1024)
    messages_count_max: int = setting("CHATPLANE_EDGE_MESSAGES_COUNT_MAX", 256, ge=1)
    input_tokens_max: int = setting("CHATPLANE_EDGE_INPUT_TOKENS_MAX", 32_768, ge=1)

    # Burst token bucket (per user, authoritative on this replica: see docs/edge.md).
    bucket_capacity_tokens: float = setting("CHATPLANE_EDGE_BUCKET_CAPACITY", 20.0, gt=0)
    bucket_refill_interval_s: float = setting("CHATPLANE_EDGE_BUCKET_REFILL_INTERVAL_S", 3.0, gt=0)
    bucket_users_max: int = setting("CHATPLANE_EDGE_BUCKET_USERS_MAX", 200_000, ge=1)
    # How many edge replicas share the user space when users are not sticky; the local bucket is
    # then sized capacity / replicas so the fleet never admits more than one global bucket.
    edge_replicas: int = setting("CHATPLANE_EDGE_REPLICAS", 1, ge=1)
    users_sticky: bool = setting("CHATPLANE_EDGE_USERS_STICKY", True)
    # The web page's first-token beacon (POST /v1/client-metrics) takes a bucket of its own per user,
    # so beacons never spend the user's generation bucket: the same shape (capacity, one token back
    # per refill interval, at most users_max users tracked, least recent dropped; the fleet's share).
    beacon_bucket_capacity_tokens: float = setting("CHATPLANE_EDGE_BEACON_BUCKET_CAPACITY", 20.0, gt=0)
    beacon_bucket_refill_interval_s: float = setting("CHATPLANE_EDGE_BEACON_BUCKET_REFILL_INTERVAL_S", 3.0, gt=0)
    beacon_bucket_users_max: int = setting("CHATPLANE_EDGE_BEACON_BUCKET_USERS_MAX", 200_000, ge=1)
    # Burst token bucket per client address (edge/client_ip.py), taken before authentication: the
    # fleet's rate and burst, of which this edge holds the share 1 / edge_replicas (addresses are not
    # sticky). Burst or rate 0: off. At most ip_buckets_max addresses are tracked (least recent dropped).
    ip_rate_per_s: float = setting("CHATPLANE_EDGE_IP_RATE_PER_S", 20.0, ge=0)
    ip_burst: float = setting("CHATPLANE_EDGE_IP_BURST", 200.0, ge=0)
    ip_buckets_max: int = setting("CHATPLANE_EDGE_IP_BUCKETS_MAX", 100_000, ge=1)
    # Peers (CIDRs, comma-separated) whose forwarding header is believed; none by default: the socket
    # peer is the client. The header is read from the right, at most client_ip_hops_max entries.
    trusted_proxies: tuple[IPNetwork, ...] = setting(
        "CHATPLANE_EDGE_TRUSTED_PROXIES", (), parse=parse_networks, expected="comma-separated CIDRs"
    )
    client_ip_header: str = setting("CHATPLANE_EDGE_CLIENT_IP_HEADER", "X-Forwarded-For")
    client_ip_hops_max: int = setting("CHATPLANE_EDGE_CLIENT_IP_HOPS_MAX", 16, ge=1, le=256)
    # One bucket per network of this prefix length (an IPv6 subscriber usually holds a whole /64).
    ipv4_prefix: int = setting("CHATPLANE_EDGE_IPV4_PREFIX", 32, ge=0, le=32)
    ipv6_prefix: int = setting("CHATPLANE_EDGE_IPV6_PREFIX", 64, ge=0, le=128)

    decision_timeout_s: float = setting("CHATPLANE_EDGE_DECISION_TIMEOUT_S", 2.0, gt=0)
    # A submit carries a decision deadline this much before the edge stops waiting for its decision
    # (SubmitGeneration.decide_by_ms): the processor refuses, holding nothing, a submit it reads after
    # the deadline, so a 503 quota_service_unavailable never charges. The margin covers the skew
    # between the edge's and the processor's clocks plus the decision's trip back; less than the timeout.
    decision_skew_margin_ms: int = setting("CHATPLANE_EDGE_DECISION_SKEW_MARGIN_MS", 300, ge=0)
    # Shedding (edge.shedding): a submit is refused at once (503, Retry-After 1) while the oldest
    # decision this edge awaits has waited longer than the first, or while its event loop runs later
    # than the second. 0 turns a signal off.
    shed_decision_age_ms: int = setting("CHATPLANE_EDGE_SHED_DECISION_AGE_MS", 300, ge=0)
    shed_loop_lag_ms: int = setting("CHATPLANE_EDGE_SHED_LOOP_LAG_MS", 200, ge=0)
    # The adaptive in-flight limit: a submit decided later than the target (from the POST's arrival)
    # cuts it, one decided in time raises it; never below the minimum nor above streams_max.
    shed_latency_target_ms: int = setting("CHATPLANE_EDGE_SHED_LATENCY_TARGET_MS", 150, ge=0)
    shed_streams_min: int = setting("CHATPLANE_EDGE_SHED_STREAMS_MIN", 8, ge=1)

    # Streaming.
    heartbeat_interval_s: float = setting("CHATPLANE_EDGE_HEARTBEAT_INTERVAL_S", 15.0, gt=0)
    stream_buffer_bytes_max: int = setting("CHATPLANE_EDGE_STREAM_BUFFER_BYTES_MAX", 64 * 1024, ge=1)
    aggregate_buffer_bytes_max: int = setting("CHATPLANE_EDGE_AGGREGATE_BUFFER_BYTES_MAX", 256 * 1024 * 1024, ge=1)
    streams_max: int = setting("CHATPLANE_EDGE_STREAMS_MAX", 20_000, ge=1)
    # A reader that disconnects detaches its generation (DetachReader): the processor cancels it this
    # long after, unless a reader attaches again first.
    disconnect_grace_s: float = setting("CHATPLANE_EDGE_DISCONNECT_GRACE_S", 5.0, ge=0, le=3600)
    # The edge's liveness lease: an EdgePresence this often (processors detach the generations of an
    # edge unheard for max(their lease, 3 intervals): projections/ledger/presence.py).
    presence_interval_s: float = setting("CHATPLANE_EDGE_PRESENCE_INTERVAL_S", 1.0, gt=0, le=60)
    # After the worker-side deadlines, how long a held stream waits for its terminal event at most.
    generation_wait_s_max: float = setting("CHATPLANE_EDGE_GENERATION_WAIT_S_MAX", 160.0, gt=0)
    # Non-streaming result buffer.
    result_bytes_max: int = setting("CHATPLANE_EDGE_RESULT_BYTES_MAX", 1024 * 1024, ge=1)

    # Drain on SIGTERM.
    drain_deadline_s: float = setting("CHATPLANE_EDGE_DRAIN_DEADLINE_S", 30.0, ge=0)
    drain_cancel_wait_s: float = setting("CHATPLANE_EDGE_DRAIN_CANCEL_WAIT_S", 5.0, ge=0)

    # Capacity view from worker heartbeats.
    heartbeat_stale_ms: int = setting("CHATPLANE_EDGE_WORKER_HEARTBEAT_STALE_MS", 10_000, ge=1)
    # Publish each submit's prompt on prompts.<pool> beside it, so the worker that takes the dispatch
    # has it without asking this edge (schemas/messages.py PromptPublished); off: workers always ask.
    prompt_topic: bool = setting("CHATPLANE_EDGE_PROMPT_TOPIC", True)
    # POST /v1/chat/completions without max_tokens / max_completion_tokens gets this output budget
    # (capped at CHATPLANE_MAX_OUTPUT_TOKENS_MAX).
    openai_max_tokens_default: int = setting("CHATPLANE_EDGE_OPENAI_MAX_TOKENS_DEFAULT", 512, ge=1)
    # For heartbeats of workers that do not report their work (older versions): one generation's time.
    generation_service_ms_estimate: int = setting("CHATPLANE_EDGE_GENERATION_SERVICE_MS_ESTIMATE", 10_000, ge=0)
    # Until a worker has measured its engine (edge/capacity.py): output tokens per second of one
    # sequence, and prompt tokens per second of prefill.
    decode_tokens_per_s_estimate: float = setting("CHATPLANE_EDGE_DECODE_TOKENS_PER_S_ESTIMATE", 20.0, gt=0)
    prefill_tokens_per_s_estimate: float = setting("CHATPLANE_EDGE_PREFILL_TOKENS_PER_S_ESTIMATE", 1_000.0, gt=0)
    # For tests and benchmarks without workers: skip the capacity view (estimate 0).
    capacity_check: bool = setting("CHATPLANE_EDGE_CAPACITY_CHECK", True)

    # GET and completed same-key retries read the Cassandra read model (infra.stores.queries) for
    # generations this process no longer remembers; off: memory only (tests without the projection).
    read_model: bool = setting("CHATPLANE_EDGE_READ_MODEL", True)
    # Recently seen generations kept for GET when the Cassandra read model is not available.
    recent_generations_max: int = setting("CHATPLANE_EDGE_RECENT_GENERATIONS_MAX", 100_000, ge=0)
    # Final text of completed generations this edge served, kept for same-key retries (oldest dropped).
    result_cache_bytes_max: int = setting("CHATPLANE_EDGE_RESULT_CACHE_BYTES_MAX", 64 * 1024 * 1024, ge=0)

    # Outcome records (edge/outcomes.py, docs/slo.md): one content-free EdgeOutcome per admission request
    # on the outcomes topic, for the SLO report. Buffered (at most buffer_max outcomes; a full buffer
    # drops and counts, never blocks a request), sent in batches of at most batch_max every flush
    # interval, and flushed on shutdown for at most the flush timeout. A batch goes out as one
    # EdgeOutcomeBatch record per per_record_max outcomes (the default, 200, fits Kafka's 1 MiB record
    # limit even at 4 KiB an outcome; one is about 500 bytes); a record over the byte bound is split.
    outcomes: bool = setting("CHATPLANE_EDGE_OUTCOMES", True)
    outcomes_buffer_max: int = setting("CHATPLANE_EDGE_OUTCOMES_BUFFER_MAX", 10_000, ge=1)
    outcomes_batch_max: int = setting("CHATPLANE_EDGE_OUTCOMES_BATCH_MAX", 500, ge=1)
    outcomes_per_record_max: int = setting("CHATPLANE_EDGE_OUTCOMES_PER_RECORD_MAX", OUTCOMES_PER_RECORD_DEFAULT, ge=1)
    outcomes_flush_interval_s: float = setting("CHATPLANE_EDGE_OUTCOMES_FLUSH_INTERVAL_S", 0.5, gt=0)
    outcomes_flush_timeout_s: float = setting("CHATPLANE_EDGE_OUTCOMES_FLUSH_TIMEOUT_S", 5.0, gt=0)

    policy: Policy = field(default_factory=policy_from_env)

    def __post_init__(self) -> None:
        if self.decision_skew_margin_ms >= self.decision_timeout_ms:
            margin, timeout = env_var(EdgeSettings, "decision_skew_margin_ms"), env_var(EdgeSettings, "decision_timeout_s")
            raise SettingsError(
                f"{margin}={self.decision_skew_margin_ms}, {timeout}={self.decision_timeout_s}: "
                "expected the margin (ms) below the decision timeout (s), or no submit could be decided in time"
            )
        # Also checked for values passed from code: a missing secret stops the process before it serves
        # anything. Frozen, so a development stand-in is set through object.__setattr__.
        if self.jwt_algorithm == "HS256":
            object.__setattr__(self, "jwt_secret", self._secret("jwt_secret", DEV_JWT_SECRET, "HS256 tokens need it"))
        elif not (self.jwks_path or self.jwks_url or self.oidc_discovery):
            raise SettingsError(
                f"{env_var(EdgeSettings, 'jwks_path')}, {env_var(EdgeSettings, 'jwks_url')} and "
                f"{env_var(EdgeSettings, 'oidc_discovery')} are unset: RS256 tokens are verified against a JWKS"
            )
        for origin in self.cors_origin_list:
            if origin == "*" or "://" not in origin or origin.endswith("/"):
                raise SettingsError(
                    f"{env_var(EdgeSettings, 'cors_origins')}: {origin!r} is not an origin (scheme://host[:port]; '*' is refused)"
                )
        object.__setattr__(
            self, "fingerprint_key", self._secret("fingerprint_key", DEV_FINGERPRINT_KEY, "request fingerprints need it")
        )

    def _secret(self, field_name: str, built_in: str, why: str) -> str:
        """The field's secret; the built-in one stands in only in development mode, and only there is it accepted."""
        value = str(getattr(self, field_name))
        if self.dev_mode:
            return value or built_in
        var = env_var(EdgeSettings, field_name)
        if not value:
            raise SettingsError(f"{var} is unset: {why} (built-in development secrets only with {DEV_MODE_ENV}=1)")
        if value == built_in:
            raise SettingsError(f"{var} is the public built-in development secret (accepted only with {DEV_MODE_ENV}=1)")
        return value

    @property
    def cors_origin_list(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    @property
    def decision_timeout_ms(self) -> int:
        return int(self.decision_timeout_s * 1000)

    def decide_by_ms(self, now_ms: int) -> int:
        """The decision deadline of a submit sent at ``now_ms`` (this edge's clock)."""
        return now_ms + self.decision_timeout_ms - self.decision_skew_margin_ms

    @property
    def uses_dev_secrets(self) -> bool:
        """Whether a built-in development secret is in use (the edge logs a warning at start)."""
        return self.jwt_secret == DEV_JWT_SECRET or self.fingerprint_key == DEV_FINGERPRINT_KEY
