"""Fixtures for tests that run chatplane's own processes on the real broker.

    topology           (function) a fresh ``Topology`` namespace; its topics are created and deleted
    processor_factory  (function) ``p = processor_factory(**env); p.start()`` runs ``python -m projections``
    running_processor  (function) one started processor, already deciding
    client             (function) a started ``CommandClient`` on inbox partition 0 of ``topology``
"""

from __future__ import annotations

import uuid

import pytest

from infra.runtime.command_client import CommandClient
from infra.runtime.kafka_admin import delete_topics, deployment_topics, ensure_topics
from schemas.topics import Topology
from infra.harness.processes import ProcessorProcess, wait_until_deciding

LOAD_DECISION_TIMEOUT_S = 15.0


@pytest.fixture
async def topology(kafka_bootstrap):
    topo = Topology(f"t{uuid.uuid4().hex[:10]}")
    await ensure_topics(kafka_bootstrap, deployment_topics(topo))
    yield topo
    await delete_topics(kafka_bootstrap, [s.name for s in deployment_topics(topo)])


@pytest.fixture
def processor_factory(kafka_bootstrap, topology, tmp_path):
    started: list[ProcessorProcess] = []

    def make(**env) -> ProcessorProcess:
        p = ProcessorProcess(kafka_bootstrap, topology.namespace, tmp_path, **env)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


@pytest.fixture
async def client(kafka_bootstrap, topology):
    async with CommandClient(kafka_bootstrap, topology, inbox_partition=0, decision_timeout_s=LOAD_DECISION_TIMEOUT_S) as c:
        yield c



@pytest.fixture
async def running_processor(processor_factory, client):
    p = processor_factory()
    p.start()
    await wait_until_deciding(client)
    return p
