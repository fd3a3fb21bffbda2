"""Worker settings, read from the environment once at start-up (``python -m workers``).

Every bound has its unit in the name. ``CHATPLANE_*`` variables:
    KAFKA_BOOTSTRAP, NAMESPACE, WORKER_ID, WORKER_POOL, WORKER_MODEL_ALIAS, WORKER_SLOTS,
    WORKER_PAID_WEIGHT, WORKER_FREE_MIN_SHARE, WORKER_HEARTBEAT_INTERVAL_S, WORKER_RENEW_INTERVAL_S,
    WORKER_PROMPT_TIMEOUT_S, WORKER_DECISION_TIMEOUT_S, WORKER_GENERATION_DURATION_MAX_S,
    WORKER_ENGINE_STALL_MAX_S, WORKER_SESSION_TIMEOUT_MS, SGLANG_MODEL_PATH, SGLANG_ENGINE_ARGS,
    WORKER_RESULT_STORE (cassandra|none), WORKER_RESULT_PUT_ATTEMPTS_MAX, WORKER_RESULT_PUT_BACKOFF_S,
    WORKER_RESULT_PUT_DEADLINE_S, WORKER_ATTEMPT_TRACES_MAX, WORKER_METRICS_PORT, METRICS_HOST; the result store's Cassandra (CASSANDRA_HOSTS,
    CASSANDRA_PORT, CASSANDRA_KEYSPACE, RESULT_TTL_S) is read by
    ``infra.stores.schema.ReadModelSettings``.
Parsed and checked by the shared loader (``infra.runtime.settings``): a bad value stops the worker
at start with one line naming the variable.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

from infra.runtime.metrics_http import METRICS_HOST_DEFAULT, METRICS_HOST_ENV
from infra.runtime.settings import kafka_bootstrap_setting, SettingsError, env_var, setting
from control_plane.policy import LEASE_MS_DEFAULT
from schemas.topics import Topology

RESULT_STORES = ("cassandra", "none")


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerSettings:
    kafka_bootstrap: str = kafka_bootstrap_setting()
    topology: Topology = setting("CHATPLANE_NAMESPACE", Topology(""), parse=Topology, expected="a namespace")
    worker_id: str = setting("CHATPLANE_WORKER_ID", kind=str, default_factory=_default_worker_id)
    model_alias: str = setting("CHATPLANE_WORKER_MODEL_ALIAS", "fast-text-model")
    # Slots: generations in flight at once (capped by the engine's own ceiling).
    slots: int = setting("CHATPLANE_WORKER_SLOTS", 0, ge=0)  # 0: the engine's ceiling
    # Weighted share of paid vs free dispatches, and the smallest share free work always gets.
    paid_weight: int = setting("CHATPLANE_WORKER_PAID_WEIGHT", 3, ge=0)
    free_min_share: float = setting("CHATPLANE_WORKER_FREE_MIN_SHARE", 0.2, ge=0, le=1)
    heartbeat_interval_s: float = setting("CHATPLANE_WORKER_HEARTBEAT_INTERVAL_S", 1.0, gt=0)
    # A change of free slots sends a heartbeat at once, but never more than one per this interval.
    heartbeat_min_interval_s: float = setting("CHATPLANE_WORKER_HEARTBEAT_MIN_INTERVAL_S", 0.05, ge=0)
    renew_interval_s: float = setting("CHATPLANE_WORKER_RENEW_INTERVAL_S", 3.0, gt=0)
    # The processor's lease (the same variable it reads, default Policy.lease_ms): an attempt whose
    # lease no renewal confirmed in time stops its engine ("lease_lost") instead of computing on.
    lease_ms: int = setting("CHATPLANE_LEASE_MS", LEASE_MS_DEFAULT, ge=1)
    # Deltas to the edge: the first text of a generation goes at once; after it, engine text is
    # gathered into the next delta until the previous one is acknowledged by Kafka and at least
    # delta_interval_ms passed since it was sent (0: only the acknowledgement), up to
    # delta_coalesce_chars_max characters (0: one delta per engine chunk, no gathering). At 100
    # tokens/s per stream, 50 ms is 3 to 5 tokens per delta: a third to a fifth of the messages for the
    # worker, Kafka and the edge, and a pause no reader sees.
    delta_interval_ms: float = setting("CHATPLANE_WORKER_DELTA_INTERVAL_MS", 50.0, ge=0)
    delta_coalesce_chars_max: int = setting("CHATPLANE_WORKER_DELTA_COALESCE_CHARS_MAX", 4096, ge=0)
    prompt_timeout_s: float = setting("CHATPLANE_WORKER_PROMPT_TIMEOUT_S", 2.0, gt=0)
    # Prompts published beside submits (workers/prompts.py): read them from prompts.<pool>, and wait
    # this long for one not read yet before asking the edge; the buffer's bounds. Off: always ask.
    prompt_topic: bool = setting("CHATPLANE_WORKER_PROMPT_TOPIC", True)
    prompt_topic_wait_ms: float = setting("CHATPLANE_WORKER_PROMPT_TOPIC_WAIT_MS", 25.0, ge=0, le=2_000)
    prompt_buffer_max: int = setting("CHATPLANE_WORKER_PROMPT_BUFFER_MAX", 4_096, ge=1)
    prompt_buffer_bytes_max: int = setting("CHATPLANE_WORKER_PROMPT_BUFFER_BYTES_MAX", 16 * 1024 * 1024, ge=1)
    prompt_buffer_ttl_s: float = setting("CHATPLANE_WORKER_PROMPT_BUFFER_TTL_S", 60.0, gt=0)
    decision_timeout_s: float = setting("CHATPLANE_WORKER_DECISION_TIMEOUT_S", 3.0, gt=0)
    decision_attempts_max: int = setting("CHATPLANE_WORKER_DECISION_ATTEMPTS_MAX", 3, ge=1)
    # Sends of a conversation turn's answer to the answers topic before the report says none was spooled.
    spool_attempts_max: int = setting("CHATPLANE_WORKER_SPOOL_ATTEMPTS_MAX", 3, ge=1)
    generation_duration_max_s: float = setting("CHATPLANE_WORKER_GENERATION_DURATION_MAX_S", 120.0, gt=0)
    # No chunk from the engine for this long: the engine is hung; abort it and fail the attempt.
    engine_stall_max_s: float = setting("CHATPLANE_WORKER_ENGINE_STALL_MAX_S", 30.0, gt=0)
    # Queue deadline check tolerance for clock skew between processor and worker (ms).
    session_timeout_ms: int = setting("CHATPLANE_WORKER_SESSION_TIMEOUT_MS", 10_000, ge=1)
    # Where the final text goes before completion is reported (workers.result_sink): "cassandra" for
    # python -m workers, "none" to keep nothing (then every same-key retry answers result_unavailable).
    result_store: str = setting("CHATPLANE_WORKER_RESULT_STORE", "cassandra", choices=RESULT_STORES)
    # Deltas stored before they are sent, for resumable streams (workers/replay_sink.py); "none" turns
    # replay off (measuring what it costs: bench/bench_replay.py). Off too when the result store is.
    replay_store: str = setting("CHATPLANE_WORKER_REPLAY_STORE", "cassandra", choices=RESULT_STORES)
    # One put's bounds: attempts, pause between them, and the whole budget (lazy open included); it stays
    # under lease_ms (10 s) minus renew_interval_s, since the lease is no longer renewed during the put.
    result_put_attempts_max: int = setting("CHATPLANE_WORKER_RESULT_PUT_ATTEMPTS_MAX", 3, ge=1)
    result_put_backoff_s: float = setting("CHATPLANE_WORKER_RESULT_PUT_BACKOFF_S", 0.2, ge=0)
    result_put_deadline_s: float = setting("CHATPLANE_WORKER_RESULT_PUT_DEADLINE_S", 4.0, gt=0)
    # Results whose put ran out of budget are held for a later write (workers/result_sink.py): at most
    # this many, this many bytes of text, this long; the later write passes once per interval.
    result_pending_max: int = setting("CHATPLANE_WORKER_RESULT_PENDING_MAX", 1_000, ge=0)
    result_pending_bytes_max: int = setting("CHATPLANE_WORKER_RESULT_PENDING_BYTES_MAX", 16 * 1024 * 1024, ge=0)
    result_pending_age_max_s: float = setting("CHATPLANE_WORKER_RESULT_PENDING_AGE_MAX_S", 600.0, ge=0)
    result_retry_interval_s: float = setting("CHATPLANE_WORKER_RESULT_RETRY_INTERVAL_S", 2.0, gt=0)
    max_output_tokens_max: int = setting("CHATPLANE_MAX_OUTPUT_TOKENS_MAX", 4096, ge=1)
    # Tokens this worker's engine can hold in its KV cache at once (prompt plus output over every
    # sequence); heartbeats report what the held attempts leave free, so an edge does not count a
    # free slot as room for a prompt that would not fit. 0: not known (not reported).
    kv_tokens_max: int = setting("CHATPLANE_WORKER_KV_TOKENS_MAX", 0, ge=0)
    # AttemptTraces kept in Worker.traces (the newest; for tests and benchmarks): one per attempt would
    # grow without end at thousands of attempts per second, so python -m workers keeps none.
    attempt_traces_max: int = setting("CHATPLANE_WORKER_ATTEMPT_TRACES_MAX", 0, ge=0)
    # Prometheus /metrics of python -m workers (docs/metrics.md): the port (0: not served) and the
    # address it binds.
    metrics_port: int = setting("CHATPLANE_WORKER_METRICS_PORT", 0, ge=0, le=65_535)
    metrics_host: str = setting(METRICS_HOST_ENV, METRICS_HOST_DEFAULT)

    def __post_init__(self) -> None:
        # Also checked when the value comes from code (the environment's is refused while reading).
        if self.result_store not in RESULT_STORES:
            var = env_var(WorkerSettings, "result_store")
            raise SettingsError(f"{var}={self.result_store!r}: expected one of {', '.join(RESULT_STORES)}")

    def group_id(self, pool: str) -> str:
        """The consumer group of a pool's workers (the pool is the served model's, from the catalog)."""
        ns = self.topology.namespace
        return f"{ns}.chatplane-workers.{pool}" if ns else f"chatplane-workers.{pool}"
