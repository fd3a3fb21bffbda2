"""Settings of the HTTP/SSE edge (``python -m edge``), read from the environment once at start-up.

Every limit is a named value with its unit in the name (DESIGN section 7). The edge shares the
admission policy's model catalog and output-token ceiling with the processor (``policy_from_env``),
so it can reject an oversized request before any work, while the core stays the authority.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from control_plane.policy import Policy
from projections.shared.gc_tuning import GC_GEN0_THRESHOLD_DEFAULT
from projections.shared.settings import policy_from_env
from schemas.topics import Topology


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw in (None, "") else int(raw)


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if raw in (None, "") else float(raw)


def _str(name: str, default: str) -> str:
    raw = os.environ.get(name)
    return default if raw in (None, "") else raw


def _partitions(name: str, default: str) -> tuple[int, ...]:
    return tuple(int(p) for p in _str(name, default).split(",") if p.strip())


# Development default for HS256 tokens; a deployment sets CHATPLANE_EDGE_JWT_SECRET (or a JWKS).
DEV_JWT_SECRET = "chatplane-local-development-secret-change-me"
DEV_FINGERPRINT_KEY = "chatplane-local-fingerprint-key-change-me"


@dataclass(frozen=True)
class EdgeSettings:
    kafka_bootstrap: str = field(default_factory=lambda: _str("CHATPLANE_KAFKA_BOOTSTRAP", "127.0.0.1:9092"))
    topology: Topology = field(default_factory=lambda: Topology(os.environ.get("CHATPLANE_NAMESPACE", "")))
    # The edge-inbox partition this process reads (decisions, deltas, finalizations, prompt requests).
    inbox_partition: int = field(default_factory=lambda: _partitions("CHATPLANE_EDGE_INBOX_PARTITION", "0")[0])
    host: str = field(default_factory=lambda: _str("CHATPLANE_EDGE_HOST", "127.0.0.1"))
    port: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_PORT", 8080))

    # Authentication: HS256 with a shared secret (local), or RS256 against a JWKS (production).
    jwt_algorithm: str = field(default_factory=lambda: _str("CHATPLANE_EDGE_JWT_ALGORITHM", "HS256"))
    jwt_secret: str = field(default_factory=lambda: _str("CHATPLANE_EDGE_JWT_SECRET", DEV_JWT_SECRET))
    jwks_path: str = field(default_factory=lambda: _str("CHATPLANE_EDGE_JWKS_PATH", ""))
    jwt_issuer: str = field(default_factory=lambda: _str("CHATPLANE_EDGE_JWT_ISSUER", "chatplane-local"))
    jwt_audience: str = field(default_factory=lambda: _str("CHATPLANE_EDGE_JWT_AUDIENCE", "chatplane-edge"))
    jwt_leeway_s: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_JWT_LEEWAY_S", 30))

    # Cyclic GC (projections.shared.gc_tuning.tune_gc): young-generation size; 0 keeps Python's settings.
    gc_gen0_threshold: int = field(
        default_factory=lambda: _int("CHATPLANE_EDGE_GC_GEN0_THRESHOLD", GC_GEN0_THRESHOLD_DEFAULT)
    )

    fingerprint_key: str = field(default_factory=lambda: _str("CHATPLANE_FINGERPRINT_KEY", DEV_FINGERPRINT_KEY))

    # Bounds checked before any work.
    request_body_bytes_max: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_REQUEST_BODY_BYTES_MAX", 256 * 1024))
    messages_count_max: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_MESSAGES_COUNT_MAX", 256))
    input_tokens_max: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_INPUT_TOKENS_MAX", 32_768))

    # Burst token bucket (per user, authoritative on this replica: see docs/edge.md).
    bucket_capacity_tokens: float = field(default_factory=lambda: _float("CHATPLANE_EDGE_BUCKET_CAPACITY", 20.0))
    bucket_refill_interval_s: float = field(default_factory=lambda: _float("CHATPLANE_EDGE_BUCKET_REFILL_INTERVAL_S", 3.0))
    bucket_users_max: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_BUCKET_USERS_MAX", 200_000))
    # How many edge replicas share the user space when users are not sticky; the local bucket is
    # then sized capacity / replicas so the fleet never admits more than one global bucket.
    edge_replicas: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_REPLICAS", 1))
    users_sticky: bool = field(default_factory=lambda: _str("CHATPLANE_EDGE_USERS_STICKY", "1") == "1")

    decision_timeout_s: float = field(default_factory=lambda: _float("CHATPLANE_EDGE_DECISION_TIMEOUT_S", 2.0))

    # Streaming.
    heartbeat_interval_s: float = field(default_factory=lambda: _float("CHATPLANE_EDGE_HEARTBEAT_INTERVAL_S", 15.0))
    stream_buffer_bytes_max: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_STREAM_BUFFER_BYTES_MAX", 64 * 1024))
    aggregate_buffer_bytes_max: int = field(
        default_factory=lambda: _int("CHATPLANE_EDGE_AGGREGATE_BUFFER_BYTES_MAX", 256 * 1024 * 1024)
    )
    streams_max: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_STREAMS_MAX", 20_000))
    disconnect_grace_s: float = field(default_factory=lambda: _float("CHATPLANE_EDGE_DISCONNECT_GRACE_S", 5.0))
    # After the worker-side deadlines, how long a held stream waits for its terminal event at most.
    generation_wait_s_max: float = field(default_factory=lambda: _float("CHATPLANE_EDGE_GENERATION_WAIT_S_MAX", 160.0))
    # Non-streaming result buffer.
    result_bytes_max: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_RESULT_BYTES_MAX", 1024 * 1024))

    # Drain on SIGTERM.
    drain_deadline_s: float = field(default_factory=lambda: _float("CHATPLANE_EDGE_DRAIN_DEADLINE_S", 30.0))
    drain_cancel_wait_s: float = field(default_factory=lambda: _float("CHATPLANE_EDGE_DRAIN_CANCEL_WAIT_S", 5.0))

    # Capacity view from worker heartbeats.
    heartbeat_stale_ms: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_WORKER_HEARTBEAT_STALE_MS", 10_000))
    generation_service_ms_estimate: int = field(
        default_factory=lambda: _int("CHATPLANE_EDGE_GENERATION_SERVICE_MS_ESTIMATE", 10_000)
    )
    # For tests and benchmarks without workers: skip the capacity view (estimate 0).
    capacity_check: bool = field(default_factory=lambda: _str("CHATPLANE_EDGE_CAPACITY_CHECK", "1") == "1")

    # GET and completed same-key retries read the Cassandra read model (projections.readmodel.queries) for
    # generations this process no longer remembers; off: memory only (tests without the projection).
    read_model: bool = field(default_factory=lambda: _str("CHATPLANE_EDGE_READ_MODEL", "1") == "1")
    # Recently seen generations kept for GET when the Cassandra read model is not available.
    recent_generations_max: int = field(default_factory=lambda: _int("CHATPLANE_EDGE_RECENT_GENERATIONS_MAX", 100_000))

    policy: Policy = field(default_factory=policy_from_env)
