"""The retention settings of docs/retention.md are what the broker actually holds, on both creation
paths (``infra.runtime.kafka_admin.ensure_topics`` and ``infra/create-topics``, whose second run
re-applies the configs to existing topics)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from infra.runtime.kafka_admin import delete_topics, deployment_topics, ensure_topics
from schemas import topics as T
from tests.integration.test_infra import run

pytestmark = pytest.mark.integration

CONFIG_KEYS = ("retention.ms", "cleanup.policy", "segment.ms", "max.compaction.lag.ms")


async def broker_configs(kafka_admin, specs) -> dict[str, dict[str, str]]:
    responses = await kafka_admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, s.name, configs=dict.fromkeys(CONFIG_KEYS)) for s in specs]
    )
    got: dict[str, dict[str, str]] = {}
    for r in responses:
        for res in r.to_object()["resources"]:
            assert res["error_code"] == 0, (res["resource_name"], res["error_code"], res["error_message"])
            got[res["resource_name"]] = {e["config_names"]: e["config_value"] for e in res["config_entries"]}
    return got


def expected(spec: T.TopicSpec, broker: dict[str, str]) -> dict[str, str]:
    # keys the schema leaves unset keep the broker's default
    return {k: spec.configs().get(k, broker[k]) for k in CONFIG_KEYS}


CONFIGS_SEEN_TIMEOUT_S = 30.0


async def configs_as(kafka_admin, specs, want) -> dict[str, dict[str, str]]:
    """The broker's configs once every topic's are ``want(spec, configs)``, or the last read after
    ``CONFIGS_SEEN_TIMEOUT_S``. An alter is answered once the controller committed it; the broker
    describing the topic applies it from its metadata log a moment later (seen under load: a read
    right after the answer still showed the previous value)."""
    deadline = time.monotonic() + CONFIGS_SEEN_TIMEOUT_S
    while True:
        got = await broker_configs(kafka_admin, specs)
        if all(got[s.name] == want(s, got[s.name]) for s in specs) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


async def test_ensure_topics_applies_every_retention_setting(kafka_bootstrap, kafka_admin):
    specs = deployment_topics(T.Topology(f"ret-{uuid.uuid4().hex[:10]}"))
    try:
        await ensure_topics(kafka_bootstrap, specs)
        got = await configs_as(kafka_admin, specs, expected)
        for s in specs:
            assert got[s.name] == expected(s, got[s.name]), s.name
        inbox = next(s for s in specs if s.name.endswith(T.EDGE_INBOX.name))
        assert got[inbox.name]["segment.ms"] == str(T.CONTENT_SEGMENT_MS)  # not the broker's 7-day default
        changelog = next(s for s in specs if s.cleanup_policy == "compact")
        assert got[changelog.name]["max.compaction.lag.ms"] == str(T.CHANGELOG_MAX_COMPACTION_LAG_MS)
    finally:
        await delete_topics(kafka_bootstrap, [s.name for s in specs])


async def test_create_topics_applies_and_reapplies_every_retention_setting(kafka_bootstrap, kafka_admin, cassandra_hosts, cassandra_port):
    ns = f"ret-{uuid.uuid4().hex[:10]}"
    specs = deployment_topics(T.Topology(ns))
    env = {"CHATPLANE_NAMESPACE": ns, "CHATPLANE_KAFKA_BOOTSTRAP": kafka_bootstrap,
           "CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts), "CHATPLANE_CASSANDRA_PORT": str(cassandra_port)}
    try:
        first = run("create-topics", env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        got = await configs_as(kafka_admin, specs, expected)
        for s in specs:
            assert got[s.name] == expected(s, got[s.name]), s.name
        # an existing topic that drifted is put back by the next run
        inbox = next(s for s in specs if s.name.endswith(T.EDGE_INBOX.name))
        await kafka_admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, inbox.name, configs={"retention.ms": "1"})])
        drifted = await configs_as(kafka_admin, [inbox], lambda s, c: {**c, "retention.ms": "1"})
        assert drifted[inbox.name]["retention.ms"] == "1"  # the drift is seen before the next run
        again = run("create-topics", env=env)
        assert again.returncode == 0, again.stdout + again.stderr
        got = await configs_as(kafka_admin, specs, expected)
        for s in specs:
            assert got[s.name] == expected(s, got[s.name]), s.name
    finally:
        await delete_topics(kafka_bootstrap, [s.name for s in specs])
