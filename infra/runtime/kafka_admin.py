"""Topic creation (the one path) and the co-partitioning check, shared by ``infra/``, the processes and the tests.

Partition counts are schema (``schemas.topics``): topics are created explicitly with them, never by
broker auto-creation, and a running component refuses to start if the cluster disagrees.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from infra.models.catalog import Catalog, load_catalog
from infra.runtime.kafka_settings import kafka_client_kwargs
from infra.runtime.settings import env_value
from schemas.topics import TopicSpec, Topology

ADMIN_REQUEST_TIMEOUT_MS = 30_000
TOPIC_ALREADY_EXISTS = 36
# CreateTopics returns once the controller committed the topics; the broker serves them (metadata,
# DescribeConfigs, produce) only after it applied that record. Creation waits for that, bounded.
# CHATPLANE_TOPIC_READY_TIMEOUT_S overrides the default, read when a wait starts.
TOPIC_READY_TIMEOUT_S_DEFAULT = 30.0
TOPIC_READY_POLL_S = 0.1


class TopologyError(RuntimeError):
    """The cluster's topics do not match the schema (missing, or a different partition count)."""


async def wait_topics_ready(
    admin: AIOKafkaAdminClient, partitions_by_name: Mapping[str, int], timeout_s: float | None = None
) -> None:
    """Until the broker lists every named topic with that many partitions, each with a leader."""
    if timeout_s is None:
        timeout_s = env_value("CHATPLANE_TOPIC_READY_TIMEOUT_S", TOPIC_READY_TIMEOUT_S_DEFAULT, gt=0)
    want = dict(partitions_by_name)
    if not want:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        meta = {t["topic"]: t for t in await admin.describe_topics(list(want))}
        pending = [
            name
            for name, partitions in want.items()
            if not _served(meta.get(name), partitions)
        ]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TopologyError(f"topics not served by the broker after {timeout_s} s: {', '.join(sorted(pending))}")
        await asyncio.sleep(TOPIC_READY_POLL_S)


def _served(topic: dict | None, partitions: int) -> bool:
    if topic is None or topic.get("error_code", 0) != 0:
        return False
    parts = topic["partitions"]
    return len(parts) == partitions and all(p["leader"] >= 0 for p in parts)


def deployment_topics(topology: Topology, catalog: Catalog | None = None) -> tuple[TopicSpec, ...]:
    """Every topic of a deployment: the fixed ones plus a dispatch topic per catalog pool and tier."""
    return topology.all((catalog or load_catalog()).pools())


async def ensure_topics(
    bootstrap: str,
    specs: Iterable[TopicSpec],
    replication_factor: int = 1,
    report: Callable[[str], None] | None = None,
) -> list[str]:
    """Create the missing topics with their schema partitions and configs; return the created names.

    The one path that creates topics (``infra/create-topics``, the tests, the benchmarks). An existing
    topic must have its schema partition count (``TopologyError`` otherwise: partition counts are
    schema, a cluster that disagrees is fixed by hand) and gets its configs re-applied (idempotent),
    so retention follows the schema. ``report`` receives one line per topic.
    """
    specs = list(specs)
    say = report or (lambda _line: None)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=ADMIN_REQUEST_TIMEOUT_MS, **kafka_client_kwargs())
    await admin.start()
    try:
        # Only the topics asked for are described (a shared cluster may hold thousands of others).
        present = set(await admin.list_topics())
        wanted = [s.name for s in specs if s.name in present]
        described = await admin.describe_topics(wanted) if wanted else []
        existing = {t["topic"]: t for t in described if t.get("error_code", 0) == 0}
        missing = [s for s in specs if s.name not in existing]
        if missing:
            response = await admin.create_topics(
                [NewTopic(s.name, s.partitions, replication_factor, topic_configs=s.configs()) for s in missing],
                timeout_ms=ADMIN_REQUEST_TIMEOUT_MS,
            )
            for error in response.topic_errors:
                if error[1] not in (0, TOPIC_ALREADY_EXISTS):
                    raise TopologyError(f"creating topic {error[0]} failed with error code {error[1]} {error[2:] or ''}")
            await wait_topics_ready(admin, {s.name: s.partitions for s in missing})
            for s in missing:
                say(f"topic {s.name}: created ({s.partitions} partitions, retention.ms={s.retention_ms})")
        for s in specs:
            if s.name not in existing:
                continue
            have = len(existing[s.name]["partitions"])
            if have != s.partitions:
                raise TopologyError(
                    f"topic {s.name} exists with {have} partitions, the schema says {s.partitions}: "
                    "partition counts are schema, fix the cluster by hand"
                )
            responses = await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, s.name, configs=s.configs())])
            for r in responses:
                for res in r.to_object()["resources"]:
                    if res["error_code"] != 0:
                        raise TopologyError(
                            f"setting configs of topic {s.name} failed: error code {res['error_code']} "
                            f"{res.get('error_message') or ''}"
                        )
            say(f"topic {s.name}: exists ({have} partitions), retention.ms={s.retention_ms}")
        return [s.name for s in missing]
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, names: Iterable[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=ADMIN_REQUEST_TIMEOUT_MS, **kafka_client_kwargs())
    await admin.start()
    try:
        present = set(await admin.list_topics())
        doomed = [n for n in names if n in present]
        if doomed:
            await admin.delete_topics(doomed, timeout_ms=ADMIN_REQUEST_TIMEOUT_MS)
    finally:
        await admin.close()


async def assert_topology(bootstrap: str, specs: Iterable[TopicSpec]) -> None:
    """Fail fast unless every topic exists with exactly its schema partition count."""
    specs = list(specs)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=ADMIN_REQUEST_TIMEOUT_MS, **kafka_client_kwargs())
    await admin.start()
    try:
        described = {t["topic"]: t for t in await admin.describe_topics([s.name for s in specs])}
    finally:
        await admin.close()
    for spec in specs:
        topic = described.get(spec.name)
        if topic is None or topic.get("error_code", 0) != 0:
            raise TopologyError(f"topic {spec.name} is missing; create it with infra/create-topics")
        have = len(topic["partitions"])
        if have != spec.partitions:
            raise TopologyError(f"topic {spec.name} has {have} partitions, the schema says {spec.partitions}")


async def assert_copartitioned(bootstrap: str, topology: Topology) -> None:
    """COMMANDS, the processor's changelog and LEDGER must have the same partition count."""
    specs = [topology.commands, topology.changelog, topology.ledger, topology.usage]
    if len({s.partitions for s in specs}) != 1:
        raise TopologyError("schema error: commands, changelog, ledger and usage partition counts differ")
    await assert_topology(bootstrap, specs)
