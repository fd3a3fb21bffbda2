"""Our components as real subprocesses, each its own entry point (``python -m projections``,
``python -m edge``, ``python -m projections.readmodel`` or another projection, ``python -m workers``),
against a real Kafka (and Cassandra where the component needs it), with their logs in a directory the
caller names; and the readiness waits that go with them.

A fresh ``Topology`` namespace per caller keeps callers from sharing topics, consumer groups or
changelogs; the caller creates its topics and deletes them afterwards.
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
import uuid
from pathlib import Path
from typing import Any

import httpx

from edge.auth import mint
from edge.settings import EdgeSettings
from infra.harness.models import CPU_ALIAS, SIM_ALIAS
from infra.runtime.command_client import CommandClient, DecisionTimeout
from schemas.codes import Tier
from schemas.commands import ReconcileDue
from schemas.messages import Outcome
from schemas.topics import Topology

ROOT = Path(__file__).resolve().parents[2]
PROCESSOR_READY_TIMEOUT_S = 90.0
PROBE_DECISION_TIMEOUT_S = 2.0
EDGE_INBOX_PARTITION = 1
HTTP_TIMEOUT_S = 30.0
EDGE_START_TIMEOUT_S = 60.0
PROJECTION_STOP_TIMEOUT_S = 30.0


class _Subprocess:
    """One component run as a subprocess: ``proc`` is set by the subclass's ``start``."""

    proc: subprocess.Popen[bytes] | None = None
    stop_timeout_s: float = 30.0

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=self.stop_timeout_s)

    def stop(self) -> None:
        """SIGTERM (a graceful stop), then SIGKILL after ``stop_timeout_s``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=self.stop_timeout_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ProcessorProcess(_Subprocess):
    """``python -m projections`` (the admission processor) as a subprocess (logs in ``log_dir``)."""

    def __init__(self, bootstrap: str, namespace: str, log_dir: Path, **env: Any) -> None:
        self.bootstrap = bootstrap
        self.namespace = namespace
        self.log_dir = log_dir
        self.env = {k: str(v) for k, v in env.items()}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, instance: str = "p1") -> None:
        self.starts += 1
        env = dict(os.environ)
        env.update(
            CHATPLANE_KAFKA_BOOTSTRAP=self.bootstrap,
            CHATPLANE_NAMESPACE=self.namespace,
            CHATPLANE_PROCESSOR_ID=instance,
            CHATPLANE_DATA_DIR=str(self.log_dir / f"data-{instance}-{self.starts}"),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env)
        log = open(self.log_dir / f"processor-{instance}-{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "projections"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def log_text(self) -> str:
        """Everything the processor's runs so far wrote to their logs."""
        return "".join(f.read_text(errors="replace") for f in sorted(self.log_dir.glob("processor-*.log")))


async def wait_until_committed(bootstrap: str, topology: Any, timeout_s: float = PROCESSOR_READY_TIMEOUT_S) -> None:
    """Until the processor committed every command appended so far: its table (changelog) then
    holds the state of each of them (a command is committable only after its state was sent)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    tps = [TopicPartition(topology.commands.name, p) for p in range(topology.commands.partitions)]
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await consumer.start()
    await admin.start()
    try:
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while True:
            committed = await admin.list_consumer_group_offsets(topology.processor_app_id, partitions=tps)
            behind = {tp: end for tp, end in ends.items() if end > 0 and (tp not in committed or committed[tp].offset < end)}
            if not behind:
                return
            if time.monotonic() > deadline:
                got = {tp.partition: (committed[tp].offset if tp in committed else None) for tp in behind}
                raise TimeoutError(
                    f"processor has not committed {behind} after {timeout_s} s (committed: {got})"
                )
            await asyncio.sleep(0.25)
    finally:
        await consumer.stop()
        await admin.close()


async def wait_until_deciding(client: CommandClient, user_id: str = "probe", timeout_s: float = PROCESSOR_READY_TIMEOUT_S) -> Outcome:
    """Ready means a real decision comes back: a ReconcileDue probe answered through the inbox."""
    deadline = time.monotonic() + timeout_s
    while True:
        probe = ReconcileDue(
            command_id=f"probe-{uuid.uuid4().hex}",
            user_id=user_id,
            issued_at_ms=int(time.time() * 1000),
            as_of_ms=int(time.time() * 1000),
            reply_to=client.reply_to(),
        )
        try:
            return await client.decide(probe, timeout_s=PROBE_DECISION_TIMEOUT_S)
        except DecisionTimeout:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


class EdgeProcess:
    """``python -m edge`` as a subprocess on a free port (logs in ``log_dir``)."""

    def __init__(self, bootstrap: str, topology: Topology, log_dir: Path, **env: Any) -> None:
        self.bootstrap, self.topology, self.log_dir = bootstrap, topology, log_dir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "CHATPLANE_KAFKA_BOOTSTRAP": bootstrap,
            "CHATPLANE_NAMESPACE": topology.namespace,
            "CHATPLANE_EDGE_INBOX_PARTITION": str(EDGE_INBOX_PARTITION),
            "CHATPLANE_EDGE_PORT": str(self.port),
            "CHATPLANE_EDGE_CAPACITY_CHECK": "0",
            "CHATPLANE_EDGE_READ_MODEL": "0",
            "CHATPLANE_EDGE_DECISION_TIMEOUT_S": "10",
            # 127.0.0.1 stands for many users here: no per-address bucket unless the caller sets one.
            "CHATPLANE_EDGE_IP_BURST": "0",
            "CHATPLANE_DEV_MODE": "1",  # also when a bench script starts it without tests/conftest.py
            "PYTHONUNBUFFERED": "1",
            **{k: str(v) for k, v in env.items()},
        }
        self.settings = EdgeSettings(kafka_bootstrap=bootstrap, topology=topology, dev_mode=True)
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        log = open(self.log_dir / f"edge-{self.port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge"], cwd=ROOT, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + EDGE_START_TIMEOUT_S
        async with httpx.AsyncClient(base_url=self.url, timeout=2) as http:
            while True:
                assert self.proc.poll() is None, f"edge exited: {(self.log_dir / f'edge-{self.port}.log').read_text()[-2000:]}"
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("/readyz")).status_code == 200:
                        return
                assert time.monotonic() < deadline, "edge did not become ready"
                await asyncio.sleep(0.1)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, "edge did not exit"
            await asyncio.sleep(0.1)
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def headers(self, user: str, key: str | None = None, tier: Tier = Tier.FREE) -> dict[str, str]:
        h = {"Authorization": f"Bearer {mint(self.settings, user, tier)}"}
        if key is not None:
            h["Idempotency-Key"] = key
        return h

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=HTTP_TIMEOUT_S)


class ProjectionProcess(_Subprocess):
    """``python -m projections.readmodel`` (or another ``module``, e.g. the history writer
    ``projections.history``) as a subprocess (SIGTERM to stop, SIGKILL to crash)."""

    stop_timeout_s = PROJECTION_STOP_TIMEOUT_S

    def __init__(self, bootstrap: str, namespace: str, log_dir: Path, module: str = "projections.readmodel", **env: Any) -> None:
        self.module = module
        self.bootstrap = bootstrap
        self.namespace = namespace
        self.log_dir = log_dir
        self.env = {k: str(v) for k, v in env.items()}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        env = dict(os.environ)
        env.update(CHATPLANE_KAFKA_BOOTSTRAP=self.bootstrap, CHATPLANE_NAMESPACE=self.namespace, PYTHONUNBUFFERED="1")
        env.update(self.env)
        self.log_path = self.log_dir / f"{self.module.rsplit('.', 1)[-1]}-{self.starts}.log"
        log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def kill(self) -> None:
        """kill -9: no shutdown path runs (offsets stay where the last commit left them)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=PROJECTION_STOP_TIMEOUT_S)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.starts else ""



class WorkerProcess(_Subprocess):
    """``python -m workers --engine ...`` as a subprocess (logs in ``log_dir``)."""

    def __init__(self, bootstrap: str, topology: Topology, log_dir: Path, engine: str = "sim", **env: Any) -> None:
        self.worker_id = f"wp-{uuid.uuid4().hex[:8]}"
        self.log_path = log_dir / f"worker-{self.worker_id}.log"
        self.engine = engine
        self.env = {
            "CHATPLANE_KAFKA_BOOTSTRAP": bootstrap, "CHATPLANE_NAMESPACE": topology.namespace,
            "CHATPLANE_WORKER_ID": self.worker_id, "CHATPLANE_WORKER_RENEW_INTERVAL_S": "0.5",
            "CHATPLANE_WORKER_HEARTBEAT_INTERVAL_S": "0.5", "CHATPLANE_WORKER_SESSION_TIMEOUT_MS": "6000",
            # No result store unless a test asks (CHATPLANE_WORKER_RESULT_STORE=cassandra + CHATPLANE_CASSANDRA_*):
            # the default would write to the shared Cassandra's default keyspace.
            "CHATPLANE_WORKER_RESULT_STORE": "none",
            # The alias its engine serves in the tests' catalog (a sim worker never serves the real model).
            "CHATPLANE_WORKER_MODEL_ALIAS": SIM_ALIAS if engine == "sim" else CPU_ALIAS,
            "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in env.items()},
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "workers", "--engine", self.engine], cwd=ROOT,
                                     env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]
