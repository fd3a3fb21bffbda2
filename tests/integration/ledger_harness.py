"""Run the real admission processor (``python -m projections``) as a subprocess against real Kafka.

A fresh ``Topology`` namespace per test keeps tests from sharing topics, consumer groups or
changelogs; its topics are created explicitly and deleted afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from infra.runtime.command_client import CommandClient, DecisionTimeout
from schemas.commands import ReconcileDue
from schemas.messages import Outcome

ROOT = Path(__file__).resolve().parents[2]
PROCESSOR_READY_TIMEOUT_S = 90.0
PROBE_DECISION_TIMEOUT_S = 2.0


class ProcessorProcess:
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

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def log_text(self) -> str:
        """Everything the processor's runs so far wrote to their logs."""
        return "".join(f.read_text(errors="replace") for f in sorted(self.log_dir.glob("processor-*.log")))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


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
