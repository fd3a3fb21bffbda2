"""Shared test fixtures: real Kafka and Cassandra, started lazily through infra/.

Servers start only when a test asks for ``kafka_bootstrap`` / ``cassandra_hosts`` (or a fixture
built on them), so pure unit tests need no servers. They are started with the same scripts as
``make up`` (``infra/kafka-start``, ``infra/cassandra-start``), which return once a real client
request succeeds; a server already answering on the configured port is reused and left running.
What this session started, it stops at the end.

External clusters instead of local servers::

    CHATPLANE_TEST_KAFKA_BOOTSTRAP=host:9092[,host2:9092]
    CHATPLANE_TEST_CASSANDRA_HOSTS=host1,host2     CHATPLANE_TEST_CASSANDRA_PORT=9042

Local ports follow infra/ (CHATPLANE_KAFKA_PORT, CHATPLANE_CASSANDRA_PORT; see docs/infra.md).

Fixtures:
    kafka_bootstrap      (session) "127.0.0.1:9092"-style bootstrap string
    cassandra_hosts      (session) tuple of contact-point host names
    cassandra_port       (session) int CQL native port
    cassandra_session    (session) a connected cassandra-driver Session (no keyspace set)
    kafka_admin          (function) started AIOKafkaAdminClient
    fresh_topic          (function) async factory: ``name = await fresh_topic("label", partitions=3,
                         retention_ms=60000)`` (keyword configs: "_" -> "."); returns once every
                         partition has a leader; every topic it made is deleted after the test
    fresh_keyspace       (function) name of a new SimpleStrategy RF1 keyspace, dropped afterwards
    unique_name          (function) factory: ``unique_name("group")`` -> "test-group-<hex>"
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"

# Every process of the run (this one and the subprocesses it starts) reads the tests' model catalog:
# the default one's model plus the simulator (infra/harness/models.py). Tests of the default catalog name
# its path explicitly.
from infra.harness.models import TEST_CATALOG_PATH  # noqa: E402

os.environ["CHATPLANE_MODEL_CATALOG"] = str(TEST_CATALOG_PATH)

# The run is a development setting: the edges it builds and starts may use the built-in development
# secrets (edge.settings). Tests of the refusal outside development mode unset it themselves.
os.environ["CHATPLANE_DEV_MODE"] = "1"

# Bounds on the infra start/stop scripts (they have their own ready timeouts inside, which are
# shorter; these only guard against a hung script).
SERVER_START_SCRIPT_TIMEOUT_S = 600.0
SERVER_STOP_SCRIPT_TIMEOUT_S = 120.0
ADMIN_REQUEST_TIMEOUT_MS = 30000
CQL_DDL_TIMEOUT_S = 60.0
CQL_PROTOCOL_VERSION = 5  # Cassandra 4.0+; saves the driver's downgrade round trips

# Env vars that point the *application* at external clusters must not redirect the test servers.
_APP_ENV_OVERRIDES = ("CHATPLANE_KAFKA_BOOTSTRAP", "CHATPLANE_CASSANDRA_HOSTS")


def _infra_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _APP_ENV_OVERRIDES}
    return env


def _run_infra(script: str, timeout_s: float) -> str:
    proc = subprocess.run(
        [str(INFRA / script)],
        cwd=ROOT,
        env=_infra_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"infra/{script} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _start_server(name: str) -> bool:
    """Start (or reuse) a local server through infra/; True when this call started it."""
    t0 = time.monotonic()
    out = _run_infra(f"{name}-start", SERVER_START_SCRIPT_TIMEOUT_S)
    lines = [ln for ln in out.strip().splitlines() if ln.startswith("chatplane-infra:")]
    last = lines[-1] if lines else ""
    started = f"{name} started pid=" in last
    print(f"\n[conftest] {name}: {'started' if started else 'reused'} in {time.monotonic() - t0:.1f}s")
    return started


def _stop_server(name: str) -> None:
    try:
        _run_infra(f"{name}-stop", SERVER_STOP_SCRIPT_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - teardown must not mask test results
        print(f"[conftest] stopping {name} failed: {exc}")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value else default


# ------------------------------------------------------------------------------------------------
# servers (session scope, lazy)


@pytest.fixture(scope="session")
def kafka_bootstrap():
    external = os.environ.get("CHATPLANE_TEST_KAFKA_BOOTSTRAP", "")
    if external:
        yield external
        return
    started = _start_server("kafka")
    try:
        yield f"127.0.0.1:{_env_int('CHATPLANE_KAFKA_PORT', 9092)}"
    finally:
        if started:
            _stop_server("kafka")


@pytest.fixture(scope="session")
def cassandra_port() -> int:
    if os.environ.get("CHATPLANE_TEST_CASSANDRA_HOSTS", ""):
        return _env_int("CHATPLANE_TEST_CASSANDRA_PORT", 9042)
    return _env_int("CHATPLANE_CASSANDRA_PORT", 9042)


@pytest.fixture(scope="session")
def cassandra_hosts(cassandra_port):
    external = os.environ.get("CHATPLANE_TEST_CASSANDRA_HOSTS", "")
    if external:
        yield tuple(h.strip() for h in external.split(",") if h.strip())
        return
    started = _start_server("cassandra")
    try:
        yield ("127.0.0.1",)
    finally:
        if started:
            _stop_server("cassandra")


@pytest.fixture(scope="session")
def cassandra_session(cassandra_hosts, cassandra_port):
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import RoundRobinPolicy

    cluster = Cluster(
        contact_points=list(cassandra_hosts),
        port=cassandra_port,
        protocol_version=CQL_PROTOCOL_VERSION,
        execution_profiles={EXEC_PROFILE_DEFAULT: ExecutionProfile(load_balancing_policy=RoundRobinPolicy())},
    )
    session = cluster.connect()
    try:
        yield session
    finally:
        cluster.shutdown()


# ------------------------------------------------------------------------------------------------
# per-test helpers


# Quota windows are fixed UTC 3-hour windows of the real clock (control_plane.policy.Policy), and the
# processes a test starts read that clock. A test that counts messages ("one message spent") assumes
# its requests and its usage query fall in one window; a test begun just before 00:00, 03:00, ...
# 21:00 UTC could see its reservation in one window and an empty next one (the likely cause of a CI
# failure on 2026-12-06 near 21:00). So a test that would start within this margin of a boundary
# waits the boundary out first: at most once per run, at most this long.
WINDOW_MARGIN_S = float(os.environ.get("CHATPLANE_TEST_WINDOW_MARGIN_S", "150"))


def seconds_to_next_window(now_s: float) -> float:
    from control_plane.policy import Policy

    policy, now_ms = Policy(), int(now_s * 1000)
    return (policy.window_start_ms(now_ms) + policy.window_ms - now_ms) / 1000


@pytest.fixture(autouse=True)
def _one_quota_window():
    left = seconds_to_next_window(time.time())
    if left < WINDOW_MARGIN_S:
        time.sleep(left + 1.0)
    yield


@pytest.fixture
def unique_name():
    def make(label: str = "x") -> str:
        return f"test-{label}-{uuid.uuid4().hex[:12]}"

    return make


@pytest.fixture
async def kafka_admin(kafka_bootstrap):
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=ADMIN_REQUEST_TIMEOUT_MS)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


@pytest.fixture
async def fresh_topic(kafka_admin, unique_name):
    from aiokafka.admin import NewTopic

    from infra.runtime.kafka_admin import wait_topics_ready

    created: list[str] = []

    async def make(label: str = "topic", partitions: int = 1, **configs: str) -> str:
        name = unique_name(label)
        resp = await kafka_admin.create_topics(
            [NewTopic(name, partitions, 1, topic_configs={k.replace("_", "."): str(v) for k, v in configs.items()})],
            timeout_ms=ADMIN_REQUEST_TIMEOUT_MS,
        )
        for err in resp.topic_errors:
            if err[1] != 0:
                raise RuntimeError(f"creating topic {name}: {err}")
        created.append(name)
        await wait_topics_ready(kafka_admin, {name: partitions})
        return name

    yield make
    if created:
        await kafka_admin.delete_topics(created, timeout_ms=ADMIN_REQUEST_TIMEOUT_MS)


@pytest.fixture
async def fresh_keyspace(cassandra_session, unique_name):
    from infra.stores.cassandra import execute

    name = unique_name("ks").replace("-", "_")
    await execute(
        cassandra_session,
        f"CREATE KEYSPACE {name} WITH replication = {{'class': 'SimpleStrategy', 'replication_factor': 1}}",
        timeout_s=CQL_DDL_TIMEOUT_S,
    )
    try:
        yield name
    finally:
        await execute(cassandra_session, f"DROP KEYSPACE IF EXISTS {name}", timeout_s=CQL_DDL_TIMEOUT_S)
