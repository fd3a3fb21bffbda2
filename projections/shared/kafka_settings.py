"""The retry pacing every Kafka client of ours shares, in one place.

Every ``AIOKafkaProducer``, ``AIOKafkaConsumer`` and ``AIOKafkaAdminClient`` the edge, the processor,
the read-model writer, the workers and ``infra/`` create takes ``**kafka_client_kwargs()``; the
processor's faust consumer and producer get the same value through
``projections.ledger.faust_adapter.use_kafka_client_settings`` (faust passes no retry setting to aiokafka).

Why (issue 13): while a broker is down, aiokafka 0.14 has no reconnect backoff (there is no
``reconnect_backoff_ms``, unlike the Java client). Each failed connection makes the client refresh
its metadata at once (``AIOKafkaClient._get_conn`` -> ``force_metadata_update``), and the loops that
hit the dead node (fetcher, group coordinator lookup, heartbeat, producer sender, coordinator
lookup) wait ``retry_backoff_ms`` before the next try. That pause is the only thing between two
reconnects, so it is what bounds a reconnect storm: each of those loops retries at most
``1000 / KAFKA_RETRY_BACKOFF_MS`` times a second, and each try logs one or two error lines.

``metadata_max_age_ms`` stays at aiokafka's default (5 minutes): it is the period of the refresh
when nothing fails, and a failure triggers a refresh regardless of it, so it does not pace a storm.
The log lines a storm still writes are bounded by ``projections.shared.log_limits``.
"""

from __future__ import annotations

# The pause before a client retries after a retriable error or an unreachable node (aiokafka's
# default is 100 ms). 500 ms: a restart of a few seconds costs a few hundred milliseconds of extra
# recovery at most, well inside the edge's decision timeout (2 s), and five times fewer reconnects.
KAFKA_RETRY_BACKOFF_MS = 500


def kafka_client_kwargs() -> dict[str, int]:
    """The keyword arguments every aiokafka client of ours is built with (producer, consumer, admin)."""
    return {"retry_backoff_ms": KAFKA_RETRY_BACKOFF_MS}
