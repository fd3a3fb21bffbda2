"""The infra/ scripts themselves: topics as the schema says, idempotent starts and creates, and
one-line errors when a prerequisite is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from infra.stores.cassandra import execute
from infra.runtime.kafka_admin import deployment_topics
from schemas import topics as T

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
SCRIPT_TIMEOUT_S = 120.0
ALREADY_RUNNING_MAX_S = 15.0
LOCAL_KAFKA = not os.environ.get("CHATPLANE_TEST_KAFKA_BOOTSTRAP")


def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(INFRA / script), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )


async def test_create_topics_follows_the_schema_and_is_idempotent(
    kafka_bootstrap, kafka_admin, cassandra_hosts, cassandra_port, cassandra_session
):
    ns = f"test-ns-{uuid.uuid4().hex[:10]}"
    env = {
        "CHATPLANE_NAMESPACE": ns,
        "CHATPLANE_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts),
        "CHATPLANE_CASSANDRA_PORT": str(cassandra_port),
    }
    specs = deployment_topics(T.Topology(ns))
    assert specs, "the schema lists no topics"
    try:
        first = run("create-topics", env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        assert first.stdout.count(": created (") == len(specs)

        meta = {t["topic"]: t for t in await kafka_admin.describe_topics([s.name for s in specs])}
        for s in specs:
            assert meta[s.name]["error_code"] == 0, s.name
            assert len(meta[s.name]["partitions"]) == s.partitions, s.name
        responses = await kafka_admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, s.name, configs={"retention.ms": None, "cleanup.policy": None}) for s in specs]
        )
        got = {}
        for r in responses:
            for res in r.to_object()["resources"]:
                entries = {e["config_names"]: e["config_value"] for e in res["config_entries"]}
                got[res["resource_name"]] = (entries["retention.ms"], entries["cleanup.policy"])
        assert got == {s.name: (str(s.retention_ms), s.cleanup_policy) for s in specs}

        again = run("create-topics", env=env)
        assert again.returncode == 0, again.stdout + again.stderr
        assert ": created (" not in again.stdout
        assert again.stdout.count(": exists (") == len(specs)

        rows = await execute(
            cassandra_session,
            "SELECT replication FROM system_schema.keyspaces WHERE keyspace_name = %s",
            (T.KEYSPACE,),
        )
        assert rows and rows[0].replication["class"].endswith("SimpleStrategy")
    finally:
        existing = [t for t in await kafka_admin.list_topics() if t.startswith(ns + ".")]
        if existing:
            await kafka_admin.delete_topics(existing)


@pytest.mark.skipif(not LOCAL_KAFKA, reason="tests an external Kafka")
def test_start_is_idempotent_when_already_running(kafka_bootstrap, cassandra_hosts):
    for name in ("kafka", "cassandra"):
        t0 = time.monotonic()
        res = run(f"{name}-start")
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.strip().splitlines()[-1] == f"chatplane-infra: {name} already running"
        assert time.monotonic() - t0 < ALREADY_RUNNING_MAX_S
    status = run("status")
    assert status.returncode == 0, status.stdout
    assert status.stdout.count(" ready") == 2


def test_missing_java_is_one_clear_line(tmp_path):
    res = run(
        "kafka-start",
        env={
            "CHATPLANE_JAVA": "/nonexistent/bin/java",
            "CHATPLANE_KAFKA_PORT": "1",  # nothing answers there
            "CHATPLANE_VAR_DIR": str(tmp_path / "var"),
            "CHATPLANE_RUN_DIR": str(tmp_path / "run"),
        },
    )
    assert res.returncode == 1
    errors = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "install a JDK" in errors[0], res.stderr


def test_missing_mvn_is_one_clear_line(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    java = shutil.which("java")
    if java:
        (bin_dir / "java").symlink_to(java)
    res = subprocess.run(
        ["/bin/bash", str(INFRA / "fetch")],
        env={"PATH": str(bin_dir), "CHATPLANE_LIB_DIR": str(tmp_path / "lib"), "JAVA_HOME": "/x"},
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "install Maven" in res.stderr, res.stderr


JAVA_25 = Path("/usr/lib/jvm/temurin-25-jdk-amd64/bin/java")


@pytest.mark.skipif(not JAVA_25.exists(), reason="no Java 25 on this machine")
def test_cassandra_refuses_an_unsupported_java(tmp_path):
    res = run(
        "cassandra-start",
        env={
            "CHATPLANE_JAVA": str(JAVA_25),
            "CHATPLANE_CASSANDRA_PORT": "1",  # nothing answers there
            "CHATPLANE_VAR_DIR": str(tmp_path / "var"),
            "CHATPLANE_RUN_DIR": str(tmp_path / "run"),
        },
    )
    assert res.returncode == 1
    errors = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "cannot run on Java 25" in errors[0], res.stderr
