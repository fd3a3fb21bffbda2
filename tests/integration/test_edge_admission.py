"""Admission health against the real processor (never "up" before it can decide).

An edge started before the processor is ready (``/readyz`` 200) but cannot decide:
``/healthz/admission`` answers 503, a submit gets the typed 503 and GET still answers. Once the real
processor (``python -m projections``) has joined its group, the edge's background probe turns the
endpoint to 200 within a bound; the probes leave no ledger entry and no request in the table.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from edge.admission import probe_user_id
from projections.ledger.audit import audit, read_table
from schemas.codes import REJECTIONS, RejectionCode
from infra.harness.processes import EDGE_INBOX_PARTITION, PROCESSOR_READY_TIMEOUT_S
from tests.integration.test_edge_harness import edge_settings, serve_edge

pytestmark = pytest.mark.integration

PROBE_INTERVAL_S = 0.2
PROBE_TIMEOUT_S = 1.0
POLL_S = 0.1


async def admission(http) -> tuple[int, dict]:
    r = await http.get("/healthz/admission")
    return r.status_code, r.json()


async def test_admission_health_is_503_until_the_processor_decides_then_200(kafka_bootstrap, topology, processor_factory):
    settings = edge_settings(
        kafka_bootstrap, topology, decision_timeout_s=1.0,
        admission_probe_interval_s=PROBE_INTERVAL_S, admission_probe_timeout_s=PROBE_TIMEOUT_S,
    )
    async with serve_edge(settings) as edge, edge.http() as http:
        # No processor: the probes time out. The edge itself is ready and answers with typed errors.
        deadline = time.monotonic() + 30
        while (answer := await admission(http))[1]["result"] != "timeout":
            assert answer[0] == 503, answer
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(POLL_S)
        assert answer[0] == 503 and answer[1]["admission"] == "down"
        assert (await http.get("/readyz")).status_code == 200
        submit = await http.post(
            "/v1/generations", headers=edge.headers("alice", key="k1"),
            json={"model": "simulated-text-model", "messages": [{"role": "user", "content": "hi"}], "max_output_tokens": 8},
        )
        assert submit.status_code == 503 and submit.json()["error"]["code"] == RejectionCode.QUOTA_SERVICE_UNAVAILABLE.value
        unknown = await http.get("/v1/generations/gen_unknown", headers=edge.headers("alice"))
        assert unknown.status_code == REJECTIONS[RejectionCode.NOT_FOUND].http_status
        assert "chatplane_edge_admission_up 0.0" in (await http.get("/metrics")).text

        processor = processor_factory()
        processor.start()
        started = time.monotonic()
        while (answer := await admission(http))[0] != 200:
            assert time.monotonic() - started < PROCESSOR_READY_TIMEOUT_S, f"admission still down: {answer}"
            await asyncio.sleep(POLL_S)
        assert answer[1]["admission"] == "up" and answer[1]["round_trip_ms"] >= 0
        assert "chatplane_edge_admission_up 1.0" in (await http.get("/metrics")).text
        assert (await http.get("/readyz")).status_code == 200

    # The probes wrote no ledger entry; the probe user's table entry holds no request. The processor
    # stops first, so its table is final (alice's submit is not compared: its fate is the core's).
    processor.stop()
    report = await audit(kafka_bootstrap, topology, compare_table=False)
    probe_user = probe_user_id(EDGE_INBOX_PARTITION)
    assert probe_user not in report.states, "a probe put an entry on the ledger"
    table = await read_table(kafka_bootstrap, topology)
    assert probe_user in table, sorted(table)
    assert not table[probe_user].requests and not table[probe_user].reservations
