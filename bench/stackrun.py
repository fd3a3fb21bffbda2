"""A whole chatplane stack on this machine, started the way ``make up`` starts it, for the chaos run
(tests/chaos), the soak (bench/soak.py) and whole-stack measurements.

Its own Kafka broker and Cassandra node (``infra/kafka-start``, ``infra/cassandra-start`` on private
ports, data and pids under ``work_dir``, so the stack ``make up`` or the test session runs is never
touched), its own topic namespace and keyspace (``infra/create-topics``), then each component as a
process of its real entry point: ``python -m projections`` (admission processor),
``python -m projections.readmodel``, ``python -m projections.history``, ``python -m workers --engine sim``,
``python -m edge``; several
instances of each where asked. Every process can be killed (any signal), paused (SIGSTOP: a worker
that stalls), restarted; the servers can be restarted.

    stack = Stack(Path("/tmp/run"), processors=2, workers=2, edges=2)
    await stack.start()
    stack.kill("edge-1"); stack.restart("edge-1"); await stack.wait_ready("edge-1")
    stack.restart_server("kafka", down_s=5)
    stack.stop()

Development mode is on for its processes (built-in JWT secret and fingerprint key, docs/edge.md):
this is a test stack, never a deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge.auth import mint  # noqa: E402
from edge.settings import EdgeSettings  # noqa: E402
from schemas.codes import Tier  # noqa: E402
from schemas.topics import Topology  # noqa: E402

SIM_CATALOG = ROOT / "tests" / "fixtures" / "catalog.toml"
SIM_ALIAS = "simulated-text-model"
SERVER_SCRIPT_TIMEOUT_S = 600.0
COMPONENT_READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
POLL_S = 0.2
HTTP_PROBE_TIMEOUT_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` from /proc (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` so far (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Component:
    """One process of the stack: its module, arguments and environment; restartable."""

    name: str
    module: str
    args: list[str]
    env: dict[str, str]
    log_dir: Path
    url: str | None = None  # edges: where they serve HTTP
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    paused: bool = False

    def start(self) -> None:
        self.starts += 1
        self.paused = False
        log = open(self.log_dir / f"{self.name}.log", "ab")  # noqa: SIM115 - the child owns it
        log.write(f"\n==== start {self.starts} at {time.strftime('%H:%M:%S')} ====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args], cwd=ROOT, env=self.env,
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def alive(self) -> bool:
        return self.pid is not None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.paused and sig not in (signal.SIGCONT, signal.SIGSTOP):
                self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(sig)
            self.paused = sig == signal.SIGSTOP  # any other signal left it running (SIGCONT first)

    def kill(self) -> None:
        """kill -9 and reap (no zombie is left for a pid check to mistake for a live process)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self.paused = False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_text(self) -> str:
        path = self.log_dir / f"{self.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class Stack:
    work_dir: Path
    namespace: str = "chaos"
    processors: int = 2
    workers: int = 2
    edges: int = 2
    readmodels: int = 1
    histories: int = 1  # history writers (python -m projections.history): conversation turns need one
    # Private server ports: free ones unless given (never the ports `make up` and the tests use).
    kafka_port: int = 0
    kafka_controller_port: int = 0
    cassandra_port: int = 0
    cassandra_storage_port: int = 0
    env: dict[str, Any] = field(default_factory=dict)  # for every component (e.g. sim speed, grace)
    component_env: dict[str, dict[str, Any]] = field(default_factory=dict)  # by component kind
    components: dict[str, Component] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work_dir = self.work_dir.resolve()
        for name in ("kafka_port", "kafka_controller_port", "cassandra_port", "cassandra_storage_port"):
            if not getattr(self, name):
                setattr(self, name, free_port())
        self.log_dir = self.work_dir / "log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.topology = Topology(self.namespace)
        self.bootstrap = f"127.0.0.1:{self.kafka_port}"
        self.keyspace = f"chatplane_{self.namespace}".replace("-", "_")
        self.edge_settings = EdgeSettings(kafka_bootstrap=self.bootstrap, topology=self.topology, dev_mode=True)
        if self.edges > self.topology.edge_inbox.partitions:
            raise ValueError(f"{self.edges} edges but {self.topology.edge_inbox.partitions} inbox partitions")
        self._build()

    # -- environment -----------------------------------------------------------------------------

    def server_env(self) -> dict[str, str]:
        """What the infra scripts and every component read: private ports, dirs, namespace, catalog."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPLANE_")}
        env.update(
            CHATPLANE_KAFKA_PORT=str(self.kafka_port),
            CHATPLANE_KAFKA_CONTROLLER_PORT=str(self.kafka_controller_port),
            CHATPLANE_KAFKA_BOOTSTRAP=self.bootstrap,
            CHATPLANE_CASSANDRA_PORT=str(self.cassandra_port),
            CHATPLANE_CASSANDRA_STORAGE_PORT=str(self.cassandra_storage_port),
            CHATPLANE_CASSANDRA_HOSTS="127.0.0.1",
            CHATPLANE_CASSANDRA_KEYSPACE=self.keyspace,
            CHATPLANE_VAR_DIR=str(self.work_dir / "var"),
            CHATPLANE_RUN_DIR=str(self.work_dir / "run"),
            CHATPLANE_LIB_DIR=os.environ.get("CHATPLANE_LIB_DIR", str(ROOT / "infra" / "lib")),
            CHATPLANE_NAMESPACE=self.namespace,
            CHATPLANE_MODEL_CATALOG=str(SIM_CATALOG),
            CHATPLANE_DEV_MODE="1",
            PYTHONUNBUFFERED="1",
        )
        for k in ("CHATPLANE_JAVA", "CHATPLANE_JAVA_HOME", "CHATPLANE_KAFKA_HEAP", "CHATPLANE_CASSANDRA_HEAP"):
            if k in os.environ:
                env[k] = os.environ[k]
        return env

    def _build(self) -> None:
        base = self.server_env()
        shared = {k: str(v) for k, v in self.env.items()}

        def add(kind: str, i: int, module: str, args: list[str], own: dict[str, str], url: str | None = None) -> None:
            name = f"{kind}-{i}"
            env = {**base, **own, **shared, **{k: str(v) for k, v in self.component_env.get(kind, {}).items()}}
            self.components[name] = Component(name, module, args, env, self.log_dir, url)

        for i in range(1, self.processors + 1):
            add("processor", i, "projections", [], {
                "CHATPLANE_PROCESSOR_ID": f"p{i}", "CHATPLANE_DATA_DIR": str(self.work_dir / "data" / f"processor-{i}")})
        for i in range(1, self.readmodels + 1):
            add("readmodel", i, "projections.readmodel", [], {})
        for i in range(1, self.histories + 1):
            add("history", i, "projections.history", [], {})
        for i in range(1, self.workers + 1):
            add("worker", i, "workers", ["--engine", "sim"], {
                "CHATPLANE_WORKER_ID": f"w{i}", "CHATPLANE_WORKER_MODEL_ALIAS": SIM_ALIAS})
        for i in range(1, self.edges + 1):
            port = free_port()
            add("edge", i, "edge", [], {
                "CHATPLANE_EDGE_PORT": str(port), "CHATPLANE_EDGE_INBOX_PARTITION": str(i - 1),
                "CHATPLANE_EDGE_REPLICAS": str(self.edges),
                # The load generator is one address standing for many users: no per-address bucket.
                "CHATPLANE_EDGE_IP_BURST": "0"}, url=f"http://127.0.0.1:{port}")

    # -- servers -----------------------------------------------------------------------------------

    def infra(self, script: str) -> str:
        proc = subprocess.run(
            [str(ROOT / "infra" / script)], cwd=ROOT, env=self.server_env(), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=SERVER_SCRIPT_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"infra/{script} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc.stdout

    def start_servers(self) -> None:
        self.infra("kafka-start")
        self.infra("cassandra-start")
        self.infra("create-topics")

    def stop_server(self, server: str) -> None:
        self.infra(f"{server}-stop")

    def start_server(self, server: str) -> None:
        self.infra(f"{server}-start")

    def server_pid(self, server: str) -> int | None:
        path = self.work_dir / "run" / f"{server}.pid"
        try:
            pid = int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if Path(f"/proc/{pid}").exists() else None

    # -- components --------------------------------------------------------------------------------

    def of_kind(self, kind: str) -> list[Component]:
        return [c for name, c in self.components.items() if name.startswith(kind + "-")]

    @property
    def edge_urls(self) -> list[str]:
        return [c.url for c in self.of_kind("edge") if c.url]

    async def start(self) -> None:
        """Servers, then every component; returns once every edge is ready and admission answers.
        A start that fails stops what it started."""
        try:
            await asyncio.to_thread(self.start_servers)
            (self.work_dir / "data").mkdir(exist_ok=True)
            for c in self.components.values():
                c.start()
            for c in self.components.values():
                await self.wait_ready(c.name)
            await self.wait_admission()
        except BaseException:
            self.stop()
            raise

    def kill(self, name: str) -> None:
        self.components[name].kill()

    def pause(self, name: str) -> None:
        self.components[name].signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.components[name].signal(signal.SIGCONT)

    def restart(self, name: str) -> None:
        c = self.components[name]
        if c.alive():
            c.kill()
        c.start()

    async def wait_ready(self, name: str, timeout_s: float = COMPONENT_READY_TIMEOUT_S) -> None:
        """An edge: until its /readyz answers 200. Another component: until it runs (it has no port)."""
        c = self.components[name]
        deadline = time.monotonic() + timeout_s
        if c.url is None:
            await asyncio.sleep(0.5)
            if not c.alive():
                raise RuntimeError(f"{name} exited at start: {c.log_text()[-3000:]}")
            return
        async with httpx.AsyncClient(base_url=c.url, timeout=HTTP_PROBE_TIMEOUT_S) as http:
            while True:
                if not c.alive():
                    raise RuntimeError(f"{name} exited at start: {c.log_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("/readyz")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not ready after {timeout_s} s")
                await asyncio.sleep(POLL_S)

    async def wait_admission(self, timeout_s: float = COMPONENT_READY_TIMEOUT_S) -> None:
        """Until every live edge reports admission up (a probe command decided by a processor)."""
        deadline = time.monotonic() + timeout_s
        for c in self.of_kind("edge"):
            if not c.alive():
                continue
            async with httpx.AsyncClient(base_url=c.url, timeout=HTTP_PROBE_TIMEOUT_S) as http:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get("/healthz/admission")).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{c.name}: admission not up after {timeout_s} s")
                    await asyncio.sleep(POLL_S)

    def stop(self, servers: bool = True) -> None:
        """Edges first (they drain), then workers, read models, history writers, processors; then the servers."""
        for kind in ("edge", "worker", "readmodel", "history", "processor"):
            for c in self.of_kind(kind):
                c.stop()
        if servers:
            for server in ("cassandra", "kafka"):
                with contextlib.suppress(Exception):
                    self.stop_server(server)

    def pids(self) -> dict[str, int]:
        """Every running process of the stack by name, the servers included."""
        out = {name: c.pid for name, c in self.components.items() if c.pid is not None}
        for server in ("kafka", "cassandra"):
            pid = self.server_pid(server)
            if pid is not None:
                out[server] = pid
        return out

    # -- clients -----------------------------------------------------------------------------------

    def token(self, user: str, tier: Tier = Tier.FREE) -> str:
        return mint(self.edge_settings, user, tier)
