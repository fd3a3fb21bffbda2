#!/usr/bin/env python3
"""Run a real single-node Kafka (KRaft, broker+controller in one JVM) and a real Cassandra on this
machine, from the jars ``infra/fetch`` resolved into ``infra/lib/``.

Usage (normally through the wrappers beside this file)::

    stack.py kafka-start | kafka-stop | cassandra-start | cassandra-stop
    stack.py wait kafka|cassandra [--timeout S]
    stack.py create-topics            # every topic (catalog pools included) + the keyspace and tables
                                      # (CHATPLANE_NAMESPACE=ns: the topics of Topology(ns) instead)
    stack.py status

Start commands run the server in the background (own session, pid in ``.run/``), and return only
once a real client call succeeds: an aiokafka admin metadata request for Kafka, a CQL
``SELECT release_version FROM system.local`` for Cassandra. They are idempotent: a server already
answering on the configured port is left alone. The last line a start prints is
``chatplane-infra: <name> started pid=N`` or ``chatplane-infra: <name> already running``
(tests/conftest.py reads it to know whether it must stop the server again).

Every knob is an environment variable (see ``Config`` and docs/infra.md).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

INFRA = Path(__file__).resolve().parent
ROOT = INFRA.parent
# The one settings loader of every process; it needs only the standard library, ``schemas`` and
# ``control_plane``, so it imports from the source tree before the package is installed.
sys.path.insert(0, str(ROOT))
from infra.runtime.settings import SettingsError, comma_list, env_value  # noqa: E402

LIB = Path(env_value("CHATPLANE_LIB_DIR", str(INFRA / "lib")))
PORT_MAX = 65_535
MARKER = ".complete"

# Named waits and timeouts (seconds). The ready timeouts can be overridden by environment.
KAFKA_READY_TIMEOUT_S = 90.0
CASSANDRA_READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 45.0
POLL_INTERVAL_S = 0.5
PROBE_REQUEST_TIMEOUT_S = 5.0
ALREADY_RUNNING_PROBE_TIMEOUT_S = 3.0
STORAGE_FORMAT_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class Config:
    kafka_port: int
    kafka_controller_port: int
    kafka_bootstrap: str
    kafka_heap: str
    kafka_replication: int
    cassandra_port: int
    cassandra_storage_port: int
    cassandra_hosts: tuple[str, ...]
    cassandra_heap: str
    cassandra_rf: int
    var_dir: Path
    run_dir: Path
    java: str
    kafka_ready_timeout_s: float
    cassandra_ready_timeout_s: float

    @staticmethod
    def from_env() -> "Config":
        kport = env_value("CHATPLANE_KAFKA_PORT", 9092, ge=1, le=PORT_MAX)
        cport = env_value("CHATPLANE_CASSANDRA_PORT", 9042, ge=1, le=PORT_MAX)
        java_home = env_value("CHATPLANE_JAVA_HOME", "") or os.environ.get("JAVA_HOME") or ""
        java = env_value("CHATPLANE_JAVA", str(Path(java_home) / "bin" / "java") if java_home else "java")
        return Config(
            kafka_port=kport,
            kafka_controller_port=env_value("CHATPLANE_KAFKA_CONTROLLER_PORT", 9093, ge=1, le=PORT_MAX),
            kafka_bootstrap=env_value("CHATPLANE_KAFKA_BOOTSTRAP", f"127.0.0.1:{kport}"),
            kafka_heap=env_value("CHATPLANE_KAFKA_HEAP", "512m"),
            kafka_replication=env_value("CHATPLANE_KAFKA_REPLICATION", 1, ge=1),
            cassandra_port=cport,
            cassandra_storage_port=env_value("CHATPLANE_CASSANDRA_STORAGE_PORT", 7000, ge=1, le=PORT_MAX),
            cassandra_hosts=env_value(
                "CHATPLANE_CASSANDRA_HOSTS", ("127.0.0.1",), parse=comma_list, expected="comma-separated host names"
            ),
            cassandra_heap=env_value("CHATPLANE_CASSANDRA_HEAP", "1G"),
            cassandra_rf=env_value("CHATPLANE_CASSANDRA_RF", 1, ge=1),
            var_dir=Path(env_value("CHATPLANE_VAR_DIR", str(ROOT / "var"))).resolve(),
            run_dir=Path(env_value("CHATPLANE_RUN_DIR", str(ROOT / ".run"))).resolve(),
            java=java,
            kafka_ready_timeout_s=env_value("CHATPLANE_KAFKA_READY_TIMEOUT_S", KAFKA_READY_TIMEOUT_S, gt=0),
            cassandra_ready_timeout_s=env_value("CHATPLANE_CASSANDRA_READY_TIMEOUT_S", CASSANDRA_READY_TIMEOUT_S, gt=0),
        )


class InfraError(Exception):
    """A one-line, user-facing failure."""


def say(msg: str) -> None:
    print(f"chatplane-infra: {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# prerequisites


def require_java(cfg: Config) -> str:
    java = shutil.which(cfg.java) if os.sep not in cfg.java else (cfg.java if os.access(cfg.java, os.X_OK) else None)
    if not java:
        raise InfraError(
            f"'{cfg.java}' not found: install a JDK 17 (e.g. apt-get install openjdk-17-jdk-headless) "
            "or set CHATPLANE_JAVA / JAVA_HOME"
        )
    return java


JAVA_VERSION_PROBE_TIMEOUT_S = 30.0
KAFKA_JAVA_VERSIONS = range(17, 100)  # Kafka 4.x brokers need Java 17+
CASSANDRA_JAVA_VERSIONS = (11, 17)  # Cassandra 5.0 supports exactly these


def java_major(java: str) -> int:
    out = subprocess.run(
        [java, "-XshowSettings:properties", "-version"],
        capture_output=True, text=True, timeout=JAVA_VERSION_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL,
    ).stderr
    for line in out.splitlines():
        if "java.specification.version" in line:
            version = line.split("=", 1)[1].strip()  # "17", or "1.8" for Java 8
            return int(version[2:] if version.startswith("1.") else version.split(".")[0])
    raise InfraError(f"could not tell the version of {java}:\n{out[-500:]}")


def require_java_version(java: str, allowed, server: str) -> None:
    major = java_major(java)
    needs = "/".join(map(str, allowed)) if isinstance(allowed, tuple) else f"{allowed.start}+"
    if major not in allowed:
        raise InfraError(
            f"{server} cannot run on Java {major} ({java}): it needs {needs}; "
            "set CHATPLANE_JAVA (or CHATPLANE_JAVA_HOME) to a JDK 17, e.g. /usr/lib/jvm/java-17-openjdk-amd64/bin/java"
        )


def require_jars(component: str) -> Path:
    lib = LIB / component
    if not (lib / MARKER).exists():
        if not shutil.which("mvn"):
            raise InfraError("'mvn' not found: install Maven 3.8+ (e.g. apt-get install maven) to fetch the jars")
        say(f"{component} jars missing: running infra/fetch {component}")
        subprocess.run([str(INFRA / "fetch"), component], check=True)
    return lib


# --------------------------------------------------------------------------------------------
# process bookkeeping


def pid_file(cfg: Config, name: str) -> Path:
    return cfg.run_dir / f"{name}.pid"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# Process states (the third field of /proc/<pid>/stat) of a process that has exited: a zombie, whose
# parent has not reaped it yet, and a dead one. ``kill -0`` still succeeds on a zombie.
EXITED_STATES = frozenset({"Z", "X", "x"})


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a process that runs: it exists and has not exited (a zombie is dead).

    The same check as ``pid_alive`` in ``infra/_procs`` (the bash scripts'), from ``/proc/<pid>/stat``.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, so the state follows the last ")".
    fields = stat.rpartition(")")[2].split()
    return bool(fields) and fields[0] not in EXITED_STATES


def _running(pid: int, marker: str) -> bool:
    """Whether ``pid`` runs and its command line holds ``marker`` (a recycled pid runs something else)."""
    return process_alive(pid) and marker in _cmdline(pid)


def _read_pid(f: Path) -> int | None:
    try:
        return int(f.read_text().strip())
    except (OSError, ValueError):
        return None


def recorded_pid(cfg: Config, name: str, main_class: str) -> int | None:
    """The pid in .run/<name>.pid if that process is alive and is really our server."""
    pid = _read_pid(pid_file(cfg, name))
    if pid is not None and _running(pid, main_class):
        return pid
    return None


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def spawn(cmd: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives this script; stopped by pid
        )


def stop_pid(pid: int, name: str, main_class: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _running(pid, main_class):
            return
        time.sleep(POLL_INTERVAL_S)
    say(f"{name} pid={pid} did not stop within {timeout_s:.0f}s: SIGKILL")
    os.kill(pid, signal.SIGKILL)
    while _running(pid, main_class):
        time.sleep(POLL_INTERVAL_S)


def stop(cfg: Config, name: str, main_class: str) -> None:
    pid = recorded_pid(cfg, name, main_class)
    if pid is None:
        say(f"{name} not running (no live pid in {pid_file(cfg, name)})")
    else:
        stop_pid(pid, name, main_class)
        say(f"{name} stopped (pid={pid})")
    pid_file(cfg, name).unlink(missing_ok=True)


def wait_ready(name: str, probe, timeout_s: float, proc: subprocess.Popen | None, log: Path) -> float:
    """Poll ``probe()`` (True when a real request succeeded) until ready; return seconds waited."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    last_err = ""
    while True:
        if proc is not None and proc.poll() is not None:
            raise InfraError(f"{name} exited with code {proc.returncode} before it was ready; log {log}:\n{tail(log)}")
        try:
            if probe():
                return time.monotonic() - t0
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
            last_err = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise InfraError(f"{name} not ready after {timeout_s:.0f}s (last error: {last_err}); log {log}:\n{tail(log)}")
        time.sleep(POLL_INTERVAL_S)


# --------------------------------------------------------------------------------------------
# Kafka

KAFKA_MAIN = "kafka.Kafka"
KAFKA_STORAGE_TOOL = "kafka.tools.StorageTool"


def kafka_dirs(cfg: Config) -> tuple[Path, Path, Path]:
    base = cfg.var_dir / "kafka"
    return base / "data", base / "logs", base / "conf"


def kafka_probe(bootstrap: str) -> bool:
    try:
        from aiokafka.admin import AIOKafkaAdminClient
    except ImportError as exc:  # pragma: no cover
        raise InfraError("aiokafka not importable: create the venv first (make venv)") from exc

    async def go() -> bool:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=int(PROBE_REQUEST_TIMEOUT_S * 1000)
        )
        try:
            await asyncio.wait_for(admin.start(), PROBE_REQUEST_TIMEOUT_S)
            cluster = await asyncio.wait_for(admin.describe_cluster(), PROBE_REQUEST_TIMEOUT_S)
            await asyncio.wait_for(admin.list_topics(), PROBE_REQUEST_TIMEOUT_S)
            return bool(cluster.get("brokers")) and cluster.get("controller_id", -1) != -1
        finally:
            await admin.close()

    return asyncio.run(go())


def kafka_probe_quiet(bootstrap: str) -> bool:
    try:
        return kafka_probe(bootstrap)
    except Exception:  # noqa: BLE001
        return False


def write_kafka_config(cfg: Config) -> Path:
    data, logs, conf = kafka_dirs(cfg)
    for d in (data, logs, conf):
        d.mkdir(parents=True, exist_ok=True)
    props = conf / "server.properties"
    props.write_text(
        "\n".join(
            [
                "# Generated by infra/stack.py: single-node KRaft, broker and controller in one JVM.",
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.voters=1@127.0.0.1:{cfg.kafka_controller_port}",
                f"listeners=PLAINTEXT://127.0.0.1:{cfg.kafka_port},CONTROLLER://127.0.0.1:{cfg.kafka_controller_port}",
                f"advertised.listeners=PLAINTEXT://127.0.0.1:{cfg.kafka_port}",
                "controller.listener.names=CONTROLLER",
                "inter.broker.listener.name=PLAINTEXT",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                f"log.dirs={data}",
                "num.partitions=1",
                "default.replication.factor=1",
                "min.insync.replicas=1",
                "auto.create.topics.enable=false",
                "delete.topic.enable=true",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=8",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "transaction.state.log.num.partitions=4",
                "share.coordinator.state.topic.replication.factor=1",
                "share.coordinator.state.topic.min.isr=1",
                "group.initial.rebalance.delay.ms=0",
                # Lets tests use short consumer session timeouts (fast kill -9 failover); Kafka's
                # default minimum is 6000.
                "group.min.session.timeout.ms=1000",
                "num.network.threads=2",
                "num.io.threads=4",
                "num.recovery.threads.per.data.dir=1",
                "log.retention.check.interval.ms=60000",
                "log.segment.bytes=67108864",
                "",
            ]
        )
    )
    (conf / "log4j2.xml").write_text(
        f"""<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="warn">
  <Appenders>
    <RollingFile name="server" fileName="{logs}/server.log" filePattern="{logs}/server.log.%i">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
      <Policies><SizeBasedTriggeringPolicy size="50MB"/></Policies>
      <DefaultRolloverStrategy max="3"/>
    </RollingFile>
  </Appenders>
  <Loggers>
    <Logger name="kafka.request.logger" level="warn"/>
    <Logger name="org.apache.kafka.controller" level="info"/>
    <Logger name="state.change.logger" level="warn"/>
    <Root level="info"><AppenderRef ref="server"/></Root>
  </Loggers>
</Configuration>
"""
    )
    return props


def kafka_jvm(cfg: Config, java: str, lib: Path, conf: Path, logs: Path) -> list[str]:
    return [
        java,
        f"-Xms{cfg.kafka_heap}",
        f"-Xmx{cfg.kafka_heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:+ExplicitGCInvokesConcurrent",
        "-Djava.awt.headless=true",
        f"-Dkafka.logs.dir={logs}",
        f"-Dlog4j2.configurationFile=file:{conf / 'log4j2.xml'}",
        "-cp",
        f"{lib}/*",
    ]


def kafka_cluster_id() -> str:
    # Kafka's Uuid text form: URL-safe base64 of 16 random bytes, no padding, not starting with '-'.
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def kafka_start(cfg: Config) -> None:
    if cfg.kafka_bootstrap != f"127.0.0.1:{cfg.kafka_port}":
        say(f"CHATPLANE_KAFKA_BOOTSTRAP={cfg.kafka_bootstrap} is external: not starting a local Kafka")
        wait_ready("kafka", lambda: kafka_probe(cfg.kafka_bootstrap), cfg.kafka_ready_timeout_s, None, Path("-"))
        say("kafka already running")
        return
    _, logs, conf = kafka_dirs(cfg)
    log = logs / "stdout.log"
    pid = recorded_pid(cfg, "kafka", KAFKA_MAIN)
    if pid is not None:
        waited = wait_ready("kafka", lambda: kafka_probe(cfg.kafka_bootstrap), cfg.kafka_ready_timeout_s, None, log)
        say(f"kafka (pid={pid}) ready at {cfg.kafka_bootstrap} after {waited:.1f}s")
        say("kafka already running")
        return
    if kafka_probe_quiet(cfg.kafka_bootstrap):
        say(f"a Kafka not started by infra/ answers at {cfg.kafka_bootstrap}: using it")
        say("kafka already running")
        return
    java = require_java(cfg)
    require_java_version(java, KAFKA_JAVA_VERSIONS, "Kafka 4.1")
    lib = require_jars("kafka")
    props = write_kafka_config(cfg)
    data, logs, conf = kafka_dirs(cfg)
    t0 = time.monotonic()
    if not (data / "meta.properties").exists():
        cid = kafka_cluster_id()
        say(f"formatting Kafka storage in {data} (cluster id {cid})")
        fmt = subprocess.run(
            [*kafka_jvm(cfg, java, lib, conf, logs), KAFKA_STORAGE_TOOL, "format", "-t", cid, "-c", str(props)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=STORAGE_FORMAT_TIMEOUT_S,
        )
        if fmt.returncode != 0:
            raise InfraError(f"kafka storage format failed:\n{fmt.stdout}\n{fmt.stderr}")
    proc = spawn([*kafka_jvm(cfg, java, lib, conf, logs), KAFKA_MAIN, str(props)], log, ROOT)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    pid_file(cfg, "kafka").write_text(f"{proc.pid}\n")
    try:
        wait_ready("kafka", lambda: kafka_probe(cfg.kafka_bootstrap), cfg.kafka_ready_timeout_s, proc, logs / "server.log")
    except BaseException:
        if proc.poll() is None:
            stop_pid(proc.pid, "kafka", KAFKA_MAIN)
        pid_file(cfg, "kafka").unlink(missing_ok=True)
        raise
    say(f"kafka ready at {cfg.kafka_bootstrap} in {time.monotonic() - t0:.1f}s; data {data}, logs {logs}")
    say(f"kafka started pid={proc.pid}")


# --------------------------------------------------------------------------------------------
# Cassandra

CASSANDRA_MAIN = "org.apache.cassandra.service.CassandraDaemon"

# From Cassandra 5.0 conf/jvm17-server.options (JPMS exports/opens and Netty settings), plus the
# relevant parts of conf/jvm-server.options.
CASSANDRA_JVM17_OPTIONS = [
    "-XX:+UseG1GC",
    "-XX:+ParallelRefProcEnabled",
    "-XX:MaxTenuringThreshold=1",
    "-XX:G1HeapRegionSize=16m",
    "-XX:G1RSetUpdatingPauseTimePercent=5",
    "-XX:MaxGCPauseMillis=300",
    "-XX:InitiatingHeapOccupancyPercent=70",
    "-Djdk.attach.allowAttachSelf=true",
    "--add-exports", "java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-exports", "java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED",
    "--add-exports", "java.rmi/sun.rmi.registry=ALL-UNNAMED",
    "--add-exports", "java.rmi/sun.rmi.server=ALL-UNNAMED",
    "--add-exports", "java.sql/java.sql=ALL-UNNAMED",
    "--add-exports", "java.base/java.lang.ref=ALL-UNNAMED",
    "--add-exports", "jdk.unsupported/sun.misc=ALL-UNNAMED",
    "--add-exports", "jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED",
    "--add-exports", "jdk.attach/sun.tools.attach=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang.module=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.loader=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.reflect=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.math=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.module=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.util.jar=ALL-UNNAMED",
    "--add-opens", "jdk.management/com.sun.management.internal=ALL-UNNAMED",
    "--add-opens", "java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens", "java.base/java.io=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang.reflect=ALL-UNNAMED",
    "--add-opens", "jdk.compiler/com.sun.tools.javac=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang=ALL-UNNAMED",
    "--add-opens", "java.base/java.util=ALL-UNNAMED",
    "-Dio.netty.tryReflectionSetAccessible=true",
    "-Dio.netty.allocator.useCacheForAllThreads=true",
    "-Dio.netty.allocator.maxOrder=11",
    # jvm-server.options
    "-ea",
    "-da:net.openhft...",
    "-XX:+UseThreadPriorities",
    "-XX:+HeapDumpOnOutOfMemoryError",
    "-XX:+ExitOnOutOfMemoryError",
    "-Xss256k",
    # (-XX:+AlwaysPreTouch left out: touching the whole heap up front slows the cold start.)
    "-XX:+UseTLAB",
    "-XX:+ResizeTLAB",
    "-XX:+UseNUMA",
    "-XX:+PerfDisableSharedMem",
    "-Djava.net.preferIPv4Stack=true",
    "-XX:+UnlockDiagnosticVMOptions",
    "-XX:+DebugNonSafepoints",
    "-XX:+PreserveFramePointer",
    "-Dcassandra.max_queued_native_transport_requests=1024",
]


def cassandra_dirs(cfg: Config) -> dict[str, Path]:
    base = cfg.var_dir / "cassandra"
    return {
        "base": base,
        "data": base / "data",
        "commitlog": base / "commitlog",
        "saved_caches": base / "saved_caches",
        "hints": base / "hints",
        "cdc_raw": base / "cdc_raw",
        "logs": base / "logs",
        "conf": base / "conf",
    }


def cql_cluster(hosts: tuple[str, ...], port: int, **kw):
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import RoundRobinPolicy

    return Cluster(
        contact_points=list(hosts),
        port=port,
        execution_profiles={EXEC_PROFILE_DEFAULT: ExecutionProfile(load_balancing_policy=RoundRobinPolicy())},
        **kw,
    )


def cassandra_probe(hosts: tuple[str, ...], port: int) -> bool:
    try:
        from cassandra.cluster import Cluster
    except ImportError as exc:  # pragma: no cover
        raise InfraError("cassandra-driver not importable: create the venv first (make venv)") from exc
    cluster = cql_cluster(
        hosts,
        port,
        connect_timeout=PROBE_REQUEST_TIMEOUT_S,
        control_connection_timeout=PROBE_REQUEST_TIMEOUT_S,
    )
    try:
        session = cluster.connect()
        row = session.execute(
            "SELECT release_version FROM system.local", timeout=PROBE_REQUEST_TIMEOUT_S
        ).one()
        return bool(row and row.release_version)
    finally:
        cluster.shutdown()


def cassandra_probe_quiet(hosts: tuple[str, ...], port: int) -> bool:
    import logging

    logging.getLogger("cassandra").setLevel(logging.CRITICAL)
    try:
        return cassandra_probe(hosts, port)
    except Exception:  # noqa: BLE001
        return False


def write_cassandra_config(cfg: Config) -> dict[str, Path]:
    d = cassandra_dirs(cfg)
    for p in d.values():
        p.mkdir(parents=True, exist_ok=True)
    (d["conf"] / "cassandra.yaml").write_text(
        f"""# Generated by infra/stack.py: one local node, nothing durable that matters.
cluster_name: chatplane
num_tokens: 1
initial_token: 0
partitioner: org.apache.cassandra.dht.Murmur3Partitioner
endpoint_snitch: SimpleSnitch
seed_provider:
  - class_name: org.apache.cassandra.locator.SimpleSeedProvider
    parameters:
      - seeds: "127.0.0.1:{cfg.cassandra_storage_port}"
listen_address: 127.0.0.1
rpc_address: 127.0.0.1
storage_port: {cfg.cassandra_storage_port}
start_native_transport: true
native_transport_port: {cfg.cassandra_port}
authenticator: AllowAllAuthenticator
authorizer: AllowAllAuthorizer
role_manager: CassandraRoleManager
network_authorizer: AllowAllNetworkAuthorizer
data_file_directories:
  - {d["data"]}
commitlog_directory: {d["commitlog"]}
saved_caches_directory: {d["saved_caches"]}
hints_directory: {d["hints"]}
cdc_raw_directory: {d["cdc_raw"]}
commitlog_sync: periodic
commitlog_sync_period: 10000ms
commitlog_segment_size: 32MiB
disk_failure_policy: stop
commit_failure_policy: stop
hinted_handoff_enabled: false
auto_snapshot: false
snapshot_before_compaction: false
concurrent_reads: 8
concurrent_writes: 8
concurrent_counter_writes: 8
concurrent_compactors: 1
memtable_allocation_type: heap_buffers
dynamic_snitch: false
"""
    )
    (d["conf"] / "logback.xml").write_text(
        f"""<configuration scan="false">
  <appender name="SYSTEMLOG" class="ch.qos.logback.core.rolling.RollingFileAppender">
    <file>{d["logs"]}/system.log</file>
    <rollingPolicy class="ch.qos.logback.core.rolling.FixedWindowRollingPolicy">
      <fileNamePattern>{d["logs"]}/system.log.%i</fileNamePattern>
      <minIndex>1</minIndex><maxIndex>3</maxIndex>
    </rollingPolicy>
    <triggeringPolicy class="ch.qos.logback.core.rolling.SizeBasedTriggeringPolicy">
      <maxFileSize>50MB</maxFileSize>
    </triggeringPolicy>
    <encoder><pattern>%-5level [%thread] %date{{ISO8601}} %F:%L - %msg%n</pattern></encoder>
  </appender>
  <logger name="org.apache.cassandra" level="INFO"/>
  <root level="INFO"><appender-ref ref="SYSTEMLOG"/></root>
</configuration>
"""
    )
    return d


def cassandra_start(cfg: Config) -> None:
    local = cfg.cassandra_hosts == ("127.0.0.1",) or cfg.cassandra_hosts == ("localhost",)
    d = cassandra_dirs(cfg)
    log = d["logs"] / "system.log"
    if not local:
        say(f"CHATPLANE_CASSANDRA_HOSTS={','.join(cfg.cassandra_hosts)} is external: not starting a local Cassandra")
        wait_ready("cassandra", lambda: cassandra_probe(cfg.cassandra_hosts, cfg.cassandra_port),
                   cfg.cassandra_ready_timeout_s, None, Path("-"))
        say("cassandra already running")
        return
    pid = recorded_pid(cfg, "cassandra", CASSANDRA_MAIN)
    if pid is not None:
        waited = wait_ready("cassandra", lambda: cassandra_probe(cfg.cassandra_hosts, cfg.cassandra_port),
                            cfg.cassandra_ready_timeout_s, None, log)
        say(f"cassandra (pid={pid}) ready at {cfg.cassandra_hosts[0]}:{cfg.cassandra_port} after {waited:.1f}s")
        say("cassandra already running")
        return
    if cassandra_probe_quiet(cfg.cassandra_hosts, cfg.cassandra_port):
        say(f"a Cassandra not started by infra/ answers at {cfg.cassandra_hosts[0]}:{cfg.cassandra_port}: using it")
        say("cassandra already running")
        return
    java = require_java(cfg)
    require_java_version(java, CASSANDRA_JAVA_VERSIONS, "Cassandra 5.0")
    lib = require_jars("cassandra")
    d = write_cassandra_config(cfg)
    jamm = sorted(lib.glob("jamm-*.jar"))
    cmd = [
        java,
        f"-Xms{cfg.cassandra_heap}",
        f"-Xmx{cfg.cassandra_heap}",
        *CASSANDRA_JVM17_OPTIONS,
        *([f"-javaagent:{jamm[0]}"] if jamm else []),
        f"-Dcassandra.config=file://{d['conf'] / 'cassandra.yaml'}",
        f"-Dcassandra.storagedir={d['base']}",
        f"-Dcassandra.logdir={d['logs']}",
        f"-Dlogback.configurationFile=file://{d['conf'] / 'logback.xml'}",
        "-Dcassandra-foreground=yes",
        "-Dcassandra.skip_wait_for_gossip_to_settle=0",
        "-Dcassandra.ring_delay_ms=1000",
        "-Dcassandra.initial_token=0",
        "-cp",
        f"{lib}/*",
        CASSANDRA_MAIN,
    ]
    # No -Dcassandra.jmx.local.port: JMX stays off (no port 7199 to clash on; nodetool is not used).
    t0 = time.monotonic()
    proc = spawn(cmd, d["logs"] / "stdout.log", ROOT)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    pid_file(cfg, "cassandra").write_text(f"{proc.pid}\n")
    try:
        wait_ready("cassandra", lambda: cassandra_probe(cfg.cassandra_hosts, cfg.cassandra_port),
                   cfg.cassandra_ready_timeout_s, proc, log)
    except BaseException:
        if proc.poll() is None:
            stop_pid(proc.pid, "cassandra", CASSANDRA_MAIN)
        pid_file(cfg, "cassandra").unlink(missing_ok=True)
        raise
    say(
        f"cassandra ready at {cfg.cassandra_hosts[0]}:{cfg.cassandra_port} in {time.monotonic() - t0:.1f}s; "
        f"data {d['base']}, logs {d['logs']}"
    )
    say(f"cassandra started pid={proc.pid}")


# --------------------------------------------------------------------------------------------
# topics and keyspace

def create_topics(cfg: Config) -> None:
    """Every topic of the deployment (the catalog's pools included) and the keyspace with its tables,
    through the one path the processes and the tests use (``infra.runtime.kafka_admin.ensure_topics``,
    ``infra.stores.schema.ensure_schema``); idempotent."""
    sys.path.insert(0, str(ROOT))
    # deferred: the server commands (start, stop, status) run without loading the Kafka and Cassandra drivers
    from infra.stores.schema import ReadModelSettings, close_cluster, ensure_schema, open_session
    from infra.models.catalog import CatalogError
    from infra.runtime.kafka_admin import TopologyError, deployment_topics, ensure_topics
    from schemas import topics as T  # noqa: N812

    # CHATPLANE_NAMESPACE (as the processes read it) prefixes every topic: isolated deployments
    # (such as a test) share one cluster.
    try:
        specs = deployment_topics(T.Topology(os.environ.get("CHATPLANE_NAMESPACE", "")))
    except CatalogError as exc:
        raise InfraError(str(exc)) from None

    async def go() -> None:
        await ensure_topics(cfg.kafka_bootstrap, specs, cfg.kafka_replication, report=say)
        settings = ReadModelSettings(hosts=cfg.cassandra_hosts, port=cfg.cassandra_port, replication_factor=cfg.cassandra_rf)
        cluster, session = await open_session(settings)
        try:
            await ensure_schema(session, settings)
        finally:
            await close_cluster(cluster)
        say(f"keyspace {settings.keyspace}: present with its tables (SimpleStrategy, RF {cfg.cassandra_rf})")

    try:
        asyncio.run(go())
    except TopologyError as exc:
        raise InfraError(str(exc)) from None


# --------------------------------------------------------------------------------------------


# What infra/component-start runs (python -m <module>): the marker of a component's command line.
COMPONENT_MARKER = "-m "


def component_states(cfg: Config) -> dict[str, tuple[int | None, bool]]:
    """Every component infra/component-start recorded in the run directory: name -> (pid, running).

    A component whose recorded process exited (a zombie included) is not running, whatever
    ``kill -0`` says.
    """
    out: dict[str, tuple[int | None, bool]] = {}
    for f in sorted(cfg.run_dir.glob("*.pid")):
        if f.stem in ("kafka", "cassandra"):
            continue
        pid = _read_pid(f)
        out[f.stem] = (pid, pid is not None and _running(pid, COMPONENT_MARKER))
    return out


def status(cfg: Config) -> int:
    """The servers (answering a real request) and the recorded components: 0 when all are up."""
    k = kafka_probe_quiet(cfg.kafka_bootstrap)
    c = cassandra_probe_quiet(cfg.cassandra_hosts, cfg.cassandra_port)
    kp = recorded_pid(cfg, "kafka", KAFKA_MAIN)
    cp = recorded_pid(cfg, "cassandra", CASSANDRA_MAIN)
    say(f"kafka     {cfg.kafka_bootstrap:<22} {'ready' if k else 'DOWN'}{f' pid={kp}' if kp else ''}")
    hp = f"{cfg.cassandra_hosts[0]}:{cfg.cassandra_port}"
    say(f"cassandra {hp:<22} {'ready' if c else 'DOWN'}{f' pid={cp}' if cp else ''}")
    components = component_states(cfg)
    for name, (pid, running) in components.items():
        say(f"{name:<9} {'running' if running else 'DEAD':<22} pid={pid} ({pid_file(cfg, name)})")
    return 0 if (k and c and all(running for _, running in components.values())) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="infra/stack.py", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "command",
        choices=["kafka-start", "kafka-stop", "cassandra-start", "cassandra-stop", "wait", "create-topics", "status"],
    )
    ap.add_argument("component", nargs="?", choices=["kafka", "cassandra"])
    ap.add_argument("--timeout", type=float, default=None, help="seconds (wait only)")
    args = ap.parse_args(argv)
    import logging

    # The probes fail on purpose until the server is up: keep the clients' own retry chatter quiet.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    for noisy in ("aiokafka", "cassandra"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    try:
        cfg = Config.from_env()
    except SettingsError as exc:
        print(f"chatplane-infra: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        if args.command == "kafka-start":
            kafka_start(cfg)
        elif args.command == "kafka-stop":
            stop(cfg, "kafka", KAFKA_MAIN)
        elif args.command == "cassandra-start":
            cassandra_start(cfg)
        elif args.command == "cassandra-stop":
            stop(cfg, "cassandra", CASSANDRA_MAIN)
        elif args.command == "wait":
            if args.component == "kafka":
                t = args.timeout or cfg.kafka_ready_timeout_s
                w = wait_ready("kafka", lambda: kafka_probe(cfg.kafka_bootstrap), t, None, kafka_dirs(cfg)[1] / "server.log")
            elif args.component == "cassandra":
                t = args.timeout or cfg.cassandra_ready_timeout_s
                w = wait_ready("cassandra", lambda: cassandra_probe(cfg.cassandra_hosts, cfg.cassandra_port), t, None,
                               cassandra_dirs(cfg)["logs"] / "system.log")
            else:
                ap.error("wait needs kafka or cassandra")
            say(f"{args.component} ready after {w:.1f}s")
        elif args.command == "create-topics":
            create_topics(cfg)
        elif args.command == "status":
            return status(cfg)
    except InfraError as exc:
        print(f"chatplane-infra: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
