"""Cassandra stopped and restarted in the middle of a load: the projection loses and doubles nothing
(compared with the ledger), and GET answers a typed ``ReadModelUnavailable`` (the edge's 503) within
its deadline while Cassandra is down, then reads again once it is back.

The shared local Cassandra is not touched: this module starts its OWN Cassandra through the same
``infra/cassandra-start`` script on other ports (``OWN_CQL_PORT``/``OWN_STORAGE_PORT``) with its own
data and pid directories, stops and restarts it once, and stops it at the end. Kafka and the
processor are the shared ones. ``FakeWorker`` stands in for an inference worker.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from infra.stores.queries import GenerationReader, ReadModelUnavailable
from infra.stores.schema import ReadModelSettings, close_cluster, open_session
from infra.harness.processes import ProjectionProcess
from tests.integration.readmodel_load import ROOT, FakeWorker, expected_from_ledger, wait_caught_up

pytestmark = pytest.mark.integration

OWN_CQL_PORT = int(os.environ.get("CHATPLANE_TEST_OWN_CASSANDRA_PORT", "19642"))
OWN_STORAGE_PORT = int(os.environ.get("CHATPLANE_TEST_OWN_CASSANDRA_STORAGE_PORT", "17642"))
OWN_HEAP = "768M"
INFRA_SCRIPT_TIMEOUT_S = 300.0
KEYSPACE = "rm_restart"
READ_DEADLINE_S = 1.0
# "never hangs": a GET returns within its deadline; this is the slack for a loaded 2-core CI box.
GET_RETURN_SLACK_S = 4.0
PROBE_INTERVAL_S = 0.1
GENERATIONS_BEFORE_STOP = 15
GENERATIONS_WHILE_DOWN = 15
GENERATIONS_AFTER_RESTART = 10
USERS = 5


class OwnCassandra:
    def __init__(self, base: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if k not in ("CHATPLANE_CASSANDRA_HOSTS", "CHATPLANE_KAFKA_BOOTSTRAP")}
        self.env.update(
            CHATPLANE_CASSANDRA_PORT=str(OWN_CQL_PORT),
            CHATPLANE_CASSANDRA_STORAGE_PORT=str(OWN_STORAGE_PORT),
            CHATPLANE_CASSANDRA_HEAP=OWN_HEAP,
            CHATPLANE_VAR_DIR=str(base / "var"),
            CHATPLANE_RUN_DIR=str(base / "run"),
        )

    def _run(self, script: str) -> str:
        proc = subprocess.run(
            [str(ROOT / "infra" / script)], cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=INFRA_SCRIPT_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"infra/{script} failed rc={proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def start(self) -> None:
        self._run("cassandra-start")

    def stop(self) -> None:
        self._run("cassandra-stop")


@pytest.fixture(scope="module")
def own_cassandra(tmp_path_factory):
    c = OwnCassandra(tmp_path_factory.mktemp("own-cassandra"))
    c.start()
    try:
        yield c
    finally:
        c.stop()


async def test_cassandra_restart_mid_load_loses_and_doubles_nothing(
    own_cassandra, running_processor, client, kafka_bootstrap, topology, tmp_path
):
    settings = ReadModelSettings(hosts=("127.0.0.1",), port=OWN_CQL_PORT, keyspace=KEYSPACE, read_deadline_s=READ_DEADLINE_S)
    proj = ProjectionProcess(
        kafka_bootstrap, topology.namespace, tmp_path,
        CHATPLANE_CASSANDRA_HOSTS="127.0.0.1", CHATPLANE_CASSANDRA_PORT=OWN_CQL_PORT, CHATPLANE_CASSANDRA_KEYSPACE=KEYSPACE,
    )
    proj.start()
    cluster = session = reader = None
    try:
        worker = FakeWorker(client)
        users = [f"u-{uuid.uuid4().hex[:8]}" for _ in range(USERS)]
        done: list[tuple[str, str]] = []  # (generation_id, user)
        count = 0

        async def drive(n: int) -> None:
            nonlocal count
            for _ in range(n):
                user = users[count % USERS]
                d = await worker.run_one(user, f"k-{count}", output_tokens=3 + count % 17)
                done.append((d.generation_id, user))
                count += 1

        await drive(GENERATIONS_BEFORE_STOP)
        # the projection is up and has written the first rows before anything is stopped
        expected = await expected_from_ledger(kafka_bootstrap, topology)
        deadline = time.monotonic() + 120
        while True:
            try:
                cluster, session = await open_session(settings)
                break
            except Exception:  # noqa: BLE001 - the projection creates the keyspace
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)
        await wait_caught_up(session, KEYSPACE, expected)
        reader = await GenerationReader.open(settings)

        outcomes: list[tuple[str, str, float]] = []  # (phase, "ok"|"unavailable", seconds)
        phase = "up"
        probing = True

        projected = list(done)  # GET probes only rows known to be written before the stop

        async def probe() -> None:
            i = 0
            while probing:
                gid, user = projected[i % len(projected)]
                i += 1
                t0 = time.monotonic()
                try:
                    view = await reader.get(gid, owner=user)
                    assert view is not None and view.user_id == user
                    outcomes.append((phase, "ok", time.monotonic() - t0))
                except ReadModelUnavailable:
                    outcomes.append((phase, "unavailable", time.monotonic() - t0))
                await asyncio.sleep(PROBE_INTERVAL_S)

        prober = asyncio.create_task(probe())
        await asyncio.sleep(1)
        await asyncio.to_thread(own_cassandra.stop)
        phase = "down"
        await drive(GENERATIONS_WHILE_DOWN)
        await asyncio.sleep(3)  # a few probes against a stopped Cassandra for sure
        phase = "restarting"
        await asyncio.to_thread(own_cassandra.start)
        phase = "back"
        await drive(GENERATIONS_AFTER_RESTART)
        # GET reads again once Cassandra is back (the driver reconnects on its own)
        deadline = time.monotonic() + 60
        while not any(p == "back" and o == "ok" for p, o, _ in outcomes):
            assert not prober.done(), prober.exception()
            assert time.monotonic() < deadline, "GET never recovered after the restart"
            await asyncio.sleep(0.5)
        probing = False
        await prober

        down = [o for p, o, _ in outcomes if p == "down"]
        assert down and "unavailable" in down, f"no typed unavailability seen while down: {down}"
        slowest = max(s for _, _, s in outcomes)
        assert slowest < READ_DEADLINE_S + GET_RETURN_SLACK_S, f"a GET took {slowest:.1f}s"

        # no lost and no doubled rows: the table equals the ledger, row for row, usage included
        expected = await expected_from_ledger(kafka_bootstrap, topology)
        assert len(expected) == GENERATIONS_BEFORE_STOP + GENERATIONS_WHILE_DOWN + GENERATIONS_AFTER_RESTART
        rows = await wait_caught_up(session, KEYSPACE, expected)
        assert set(rows) == set(expected)
        for gid, x in expected.items():
            r = rows[gid]
            assert (r.user_id, r.status, r.epoch, r.model_version, r.input_tokens, r.output_tokens, r.revision) == (
                x.user_id, x.status, x.epoch, x.model_version, x.input_tokens, x.output_tokens, x.revision
            ), gid
        assert proj.alive(), proj.log_text()
        assert "read-model write failed" in proj.log_text(), "the projection never saw the outage"
    finally:
        if reader is not None:
            await reader.close()
        if cluster is not None:
            await close_cluster(cluster)
        proj.stop()
