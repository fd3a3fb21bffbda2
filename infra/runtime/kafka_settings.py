"""The retry pacing every Kafka client of ours shares, in one place.

Every ``AIOKafkaProducer``, ``AIOKafkaConsumer`` and ``AIOKafkaAdminClient`` the edge, the processor,
the read-model writer, the workers and ``infra/`` create takes ``**kafka_client_kwargs()``; the
processor's faust consumer and producer get the same value through
``projections.ledger.faust_adapter.use_kafka_client_settings`` (faust passes no retry setting to aiokafka).

Why: while a broker is down, aiokafka 0.14 has no reconnect backoff (there is no
``reconnect_backoff_ms``, unlike the Java client). Each failed connection makes the client refresh
its metadata at once (``AIOKafkaClient._get_conn`` -> ``force_metadata_update``), and the loops that
hit the dead node (fetcher, group coordinator lookup, heartbeat, producer sender, coordinator
lookup) wait ``retry_backoff_ms`` before the next try. That pause is the only thing between two
reconnects, so it is what bounds a reconnect storm: each of those loops retries at most
``1000 / KAFKA_RETRY_BACKOFF_MS`` times a second, and each try logs one or two error lines.

``metadata_max_age_ms`` stays at aiokafka's default (5 minutes): it is the period of the refresh
when nothing fails, and a failure triggers a refresh regardless of it, so it does not pace a storm.
The log lines a storm still writes are bounded by ``infra.runtime.log_limits``.
"""

from __future__ import annotations

import os

# The pause before a client retries after a retriable error or an unreachable node (aiokafka's
# default is 100 ms). 500 ms: a restart of a few seconds costs a few hundred milliseconds of extra
# recovery at most, well inside the edge's decision timeout (2 s), and five times fewer reconnects.
KAFKA_RETRY_BACKOFF_MS = 500


def kafka_client_kwargs() -> dict[str, int]:
    """The keyword arguments every aiokafka client of ours is built with (producer, consumer, admin)."""
    return {"retry_backoff_ms": KAFKA_RETRY_BACKOFF_MS}


# Compression of every record batch our producers write (CHATPLANE_KAFKA_COMPRESSION: none, gzip,
# lz4, zstd or snappy; lz4, zstd and snappy through cramjam, a dependency). Why: the processor's
# changelog value for a user repeats the same JSON keys and near-identical remembered decisions; a
# 6.2 KiB hot value is 0.7 KiB in lz4 (0.5 KiB in zstd). Brokers keep the producer's codec
# (topics' compression.type=producer) and consumers decompress whatever they read.
KAFKA_COMPRESSIONS = ("none", "gzip", "lz4", "zstd", "snappy")
KAFKA_COMPRESSION_DEFAULT = "lz4"


def kafka_compression() -> str | None:
    """The producers' codec (None: uncompressed)."""
    raw = os.environ.get("CHATPLANE_KAFKA_COMPRESSION", "") or KAFKA_COMPRESSION_DEFAULT
    if raw not in KAFKA_COMPRESSIONS:
        raise SystemExit(f"CHATPLANE_KAFKA_COMPRESSION={raw!r}: expected one of {', '.join(KAFKA_COMPRESSIONS)}")
    return None if raw == "none" else raw


def producer_kwargs() -> dict[str, int | str | None]:
    """``kafka_client_kwargs()`` plus what only a producer takes (its compression)."""
    return {**kafka_client_kwargs(), "compression_type": kafka_compression()}


# How long the broker holds a fetch of a reply partition (the edge inbox, a worker's control
# partition) that found nothing: CHATPLANE_REPLY_FETCH_MAX_WAIT_MS. With fetch_min_bytes=1 the broker
# answers as soon as a record arrives, so this is not a latency floor; it bounds the empty fetches of
# an idle client (at 5 ms, ~200 a second per client: ~5 % of a core on each edge and worker and ~20 %
# on the broker, bench/bench_stack.py's idle figure).
REPLY_FETCH_MAX_WAIT_MS_DEFAULT = 500


def reply_fetch_max_wait_ms() -> int:
    raw = os.environ.get("CHATPLANE_REPLY_FETCH_MAX_WAIT_MS", "")
    try:
        value = int(raw) if raw else REPLY_FETCH_MAX_WAIT_MS_DEFAULT
    except ValueError:
        raise SystemExit(f"CHATPLANE_REPLY_FETCH_MAX_WAIT_MS={raw!r}: expected an integer 1..10000") from None
    if not 1 <= value <= 10_000:
        raise SystemExit(f"CHATPLANE_REPLY_FETCH_MAX_WAIT_MS={raw!r}: expected an integer 1..10000")
    return value
