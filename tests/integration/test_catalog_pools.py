"""One catalog, one pool per model version: workers of different models share nothing.

Real processor, real edge, real ``python -m workers`` processes on the real broker. Two models served
side by side: every request is answered by its own model's worker, none is declined for a version
mismatch (before the catalog, both models sat in pool ``default`` and declined each other's
dispatches: 5 of 6 requests ended ``capacity_exhausted`` on a ``make up`` stack).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from infra.models.catalog import load_catalog
from infra.runtime.command_client import CommandClient
from infra.runtime.kafka_admin import deployment_topics, ensure_topics
from schemas import events as ev
from schemas.codes import RequestStatus
from infra.harness.models import CPU_ALIAS, SIM_ALIAS, TEST_CATALOG_PATH
from infra.harness.processes import ProcessorProcess, WorkerProcess, wait_until_deciding
from tests.integration.test_edge_harness import edge_settings, serve_edge
from tests.integration.workers_harness import ledger_events
from workers.engines.cpu import cpu_runtime_missing_reason

pytestmark = pytest.mark.integration

CPU_MISSING = cpu_runtime_missing_reason()
SECOND_SIM = """
[models.simulated-other-model]
version = "simulated-other-model-v2"
engine = "sim"
context_tokens = 100000
tokenizer = "estimate"
system_instructions = "(simulator)"
"""
REQUESTS_PER_MODEL = 3


async def _serve_both(kafka_bootstrap, topology, tmp_path: Path, monkeypatch, aliases: tuple[str, str],
                      engines: tuple[str, str], catalog_text: str) -> None:
    catalog_path = tmp_path / "models.toml"
    catalog_path.write_text(catalog_text)
    # Every process of this test (the edge here, the processor and workers as subprocesses) reads it.
    monkeypatch.setenv("CHATPLANE_MODEL_CATALOG", str(catalog_path))
    catalog = load_catalog(catalog_path)
    assert catalog.get(aliases[0]).pool != catalog.get(aliases[1]).pool
    await ensure_topics(kafka_bootstrap, deployment_topics(topology, catalog))
    processor = ProcessorProcess(kafka_bootstrap, topology.namespace, tmp_path)
    workers = [
        WorkerProcess(kafka_bootstrap, topology, tmp_path, engine=engine, CHATPLANE_WORKER_MODEL_ALIAS=alias)
        for alias, engine in zip(aliases, engines, strict=True)
    ]
    processor.start()
    for w in workers:
        w.start()
    try:
        async with CommandClient(kafka_bootstrap, topology, inbox_partition=0, decision_timeout_s=15.0) as client:
            await wait_until_deciding(client)
        async with serve_edge(edge_settings(kafka_bootstrap, topology)) as e, e.http() as http:
            served: dict[str, str] = {}
            for i in range(REQUESTS_PER_MODEL):
                for alias in aliases:
                    user = f"u-{alias[:6]}-{i}-{uuid.uuid4().hex[:6]}"
                    body = {"model": alias, "messages": [{"role": "user", "content": "Name three colors."}],
                            "stream": False, "max_output_tokens": 16}
                    r = await http.post("/v1/generations", json=body, headers=e.headers(user, uuid.uuid4().hex), timeout=120)
                    assert r.status_code == 200, (r.text, [w.log() for w in workers])
                    doc = r.json()
                    assert doc["status"] == RequestStatus.COMPLETED.value, doc
                    assert doc["model_version"] == catalog.get(alias).version, doc
                    served[doc["id"]] = alias
        events = await ledger_events(kafka_bootstrap, topology)
        declined = [e for e in events if isinstance(e, ev.AttemptDeclined)]
        assert declined == [], declined
        accepted = {e.generation_id: e.worker_id for e in events if isinstance(e, ev.AttemptAccepted)}
        by_alias = {alias: {accepted[g] for g, a in served.items() if a == alias} for alias in aliases}
        # Each model's generations ran on its own worker only.
        for alias, worker in zip(aliases, workers, strict=True):
            assert by_alias[alias] == {worker.worker_id}, by_alias
    finally:
        for w in workers:
            w.stop()
        processor.stop()


async def test_two_simulated_models_in_their_own_pools_never_decline_each_other(kafka_bootstrap, topology, tmp_path, monkeypatch):
    await _serve_both(kafka_bootstrap, topology, tmp_path, monkeypatch, (SIM_ALIAS, "simulated-other-model"),
                      ("sim", "sim"), TEST_CATALOG_PATH.read_text() + SECOND_SIM)


@pytest.mark.skipif(CPU_MISSING is not None, reason=f"cpu runtime not installed: {CPU_MISSING}")
async def test_the_real_model_and_the_simulator_served_side_by_side(kafka_bootstrap, topology, tmp_path, monkeypatch):
    await _serve_both(kafka_bootstrap, topology, tmp_path, monkeypatch, (CPU_ALIAS, SIM_ALIAS), ("cpu", "sim"),
                      TEST_CATALOG_PATH.read_text())
