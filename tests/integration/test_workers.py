"""Workers on the real broker and the real processor (``python -m projections``), with the ``sim`` engine.

What workers must show: acceptance racing cancel, cancel while running (tokens after the stop, slot
freed after the acknowledgement), kill -9 mid-stream (model_backend_error, partial, no second
attempt, lease fencing; also through the real HTTP edge to the SSE client), a late report from a
fenced epoch dropped and recorded, and the report appended with no reply (decided from the log, no
``Outcome`` on the worker-control topic).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx_sse
import pytest

from infra.runtime.topic_reader import read_topic
from schemas import events as ev
from schemas.codes import FinishOutcome, RejectionCode, RequestStatus
from schemas import commands as cmd
from schemas.messages import Outcome, OutcomeKind, WorkerHeartbeat
from schemas.topics import Topology
from schemas.wire import decode_ledger_entry, decode_message
from tests.doubles import MemoryResultSink
from infra.harness.models import SIM_POOL
from infra.harness.processes import WorkerProcess, wait_until_deciding
from infra.harness.worker_edge import WAIT_S, TestEdge, now_ms, served, worker_settings
from tests.integration.test_edge_harness import edge_settings, serve_edge
from tests.integration.workers_harness import ledger_events
from workers.engines.sim import SimConfig, SimulatedEngine
from workers.worker import MissingTopics, Worker

pytestmark = pytest.mark.integration

LEASE_MS = 3000
TERMINAL_EVENTS = ("generation.completed", "generation.cancelled", "generation.error")


@pytest.fixture
async def processor(processor_factory, client):
    p = processor_factory(CHATPLANE_LEASE_MS=LEASE_MS, CHATPLANE_RECONCILE_TICK_S=0.2)
    p.start()
    await wait_until_deciding(client)
    return p


@pytest.fixture
async def edge(kafka_bootstrap, topology, processor):
    async with TestEdge(kafka_bootstrap, topology, partition=1) as e:
        yield e


def sim_worker(kafka_bootstrap, topology, sink=None, **sim) -> Worker:
    cfg = SimConfig(**{"ttft_ms": 20, "inter_token_ms": 10, "jitter_ms": 1, "output_tokens": 12, **sim})
    return Worker(worker_settings(kafka_bootstrap, topology), SimulatedEngine(cfg), served(), result_sink=sink)


def user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


async def failed_with_report(edge, worker: Worker, max_output_tokens: int, code: RejectionCode):
    """Submit for a new user; the generation must end failed with ``code``. Returns (final, trace)
    once Kafka acknowledged the worker's own report (the processor's decision of it is in the ledger:
    ``ledger_entry``)."""
    gid = await edge.submit(user(), max_output_tokens=max_output_tokens)
    final = await edge.wait_finalized(gid)
    assert final.status is RequestStatus.FAILED and final.code is code, final
    await edge.wait_for(lambda: worker.traces[(gid, 1)].report_appended, what="the worker's report")
    return final, worker.traces[(gid, 1)]


async def ledger_entry(kafka_bootstrap, topology, gid: str, command_type: str) -> ev.LedgerEntry:
    """The ledger entry of the first ``command_type`` command about ``gid``, waiting (bounded) for the
    processor to decide it: the worker waits only for Kafka to hold its report, not for its decision."""
    deadline = time.monotonic() + WAIT_S
    while True:
        for _, _, _, value in await read_topic(kafka_bootstrap, topology.ledger):
            entry = decode_ledger_entry(value or b"")
            if entry.command_type == command_type and any(e.generation_id == gid for e in entry.events):
                return entry
        assert time.monotonic() < deadline, f"no {command_type} of {gid} in the ledger within {WAIT_S:.0f} s"
        await asyncio.sleep(0.2)


async def test_a_generation_streams_from_the_sim_worker_with_usage_heartbeats_and_result(kafka_bootstrap, topology, edge):
    sink = MemoryResultSink()
    async with sim_worker(kafka_bootstrap, topology, sink) as worker:
        u = user()
        gid = await edge.submit(u)
        final = await edge.wait_finalized(gid)
        assert final.status is RequestStatus.COMPLETED and final.code is None
        deltas = edge.deltas[gid]
        # 12 engine chunks; chunks that came while a delta was in flight share the next one.
        assert 1 <= len(deltas) <= 12 and [d.sequence for d in deltas] == list(range(1, len(deltas) + 1))
        assert {d.epoch for d in deltas} == {1}
        assert edge.text(gid) == " ".join(f"sim-token-{i}" for i in range(1, 13))
        assert final.output_tokens == 12
        assert sink.items[(gid, 1)] == (edge.text(gid), (final.input_tokens, 12))
        trace = worker.traces[(gid, 1)]
        assert trace.accepted and trace.outcome is FinishOutcome.COMPLETED and trace.slot_freed_at is not None
        await asyncio.sleep(0.6)
        beats = [decode_message(r[3]) for r in await read_topic(kafka_bootstrap, topology.capacity)]
        mine = [b for b in beats if isinstance(b, WorkerHeartbeat) and b.worker_id == worker.settings.worker_id]
        assert mine and mine[-1].free_slots == worker.slots and mine[-1].pool == SIM_POOL
        assert max(b.tokens_per_s for b in mine) > 0
    accepted = [e for e in await ledger_events(kafka_bootstrap, topology, gid) if isinstance(e, ev.AttemptAccepted)]
    assert len(accepted) == 1


async def test_a_prompt_published_beside_the_submit_spares_the_round_trip_to_the_edge(kafka_bootstrap, topology, edge):
    """The worker reads the prompt from prompts.<pool> (workers/prompts.py) and asks
    the edge only for one it did not find there."""
    # The prompt is on the topic before the submit is sent; a wait of 500 ms (25 by default) keeps a
    # loaded CI machine's scheduling out of what this test checks.
    settings = worker_settings(kafka_bootstrap, topology, prompt_topic_wait_ms=500.0)
    cfg = SimConfig(ttft_ms=20, inter_token_ms=10, jitter_ms=1, output_tokens=12)
    async with Worker(settings, SimulatedEngine(cfg), served()) as worker:
        # A worker follows the prompt partitions of the dispatch partitions its group gave it; a
        # dispatch taken before that (right after a start or a rebalance) asks the edge instead.
        await edge.wait_for(lambda: len(worker.prompt_reader.following) == 4, what="the prompt partitions followed")
        text = "Name three colors, then three more, then stop."
        published = await edge.submit(user(), text=text, publish=True)
        first = await edge.wait_finalized(published)
        assert first.status is RequestStatus.COMPLETED
        trace = worker.traces[(published, 1)]
        assert trace.prompt_published and trace.accepted and edge.prompt_requests[published] == 0
        asked = await edge.submit(user(), text=text)  # nothing published: the worker asks the edge
        second = await edge.wait_finalized(asked)
        assert second.status is RequestStatus.COMPLETED
        assert not worker.traces[(asked, 1)].prompt_published and edge.prompt_requests[asked] == 1
        # The engine saw the same prompt both ways (the sim engine counts its words as input tokens;
        # the ledger's usage names the admission's count, docs/core.md "Token budget").
        assert worker.traces[(published, 1)].input_tokens == worker.traces[(asked, 1)].input_tokens > 10
        assert first.input_tokens == second.input_tokens == 10
        assert worker.prompt_reader.found >= 1 and worker.prompt_reader.missed >= 1


async def test_the_report_is_decided_from_the_log_and_answered_on_no_topic(kafka_bootstrap, topology, edge):
    """The worker acts on nothing the processor would answer to its ``ReportAttemptFinished``, so it
    appends the report with no ``reply_to``: the processor decides it from the log (its ledger entry
    settles the generation) and writes no ``Outcome`` for it on the worker-control topic, while the
    acceptance, which the worker waits for, is answered there."""
    async with sim_worker(kafka_bootstrap, topology):
        gid = await edge.submit(user())
        final = await edge.wait_finalized(gid)
        assert final.status is RequestStatus.COMPLETED
        report = await ledger_entry(kafka_bootstrap, topology, gid, "ReportAttemptFinished")
    # The worker has stopped: its attempt has ended, and with it any wait for an answer to the report.
    kinds = [type(e) for e in report.events]
    assert ev.UsageRecorded in kinds and ev.GenerationCompleted in kinds, kinds
    accept = await ledger_entry(kafka_bootstrap, topology, gid, "AcceptAttempt")
    answered = set()
    for _, _, _, value in await read_topic(kafka_bootstrap, topology.worker_control):
        message = decode_message(value or b"")
        if isinstance(message, Outcome):
            answered.add(message.command_id)
    assert accept.command_id in answered  # the topic read is the one the worker is answered on
    assert report.command_id not in answered


async def test_cancel_ordered_before_acceptance_means_no_inference_starts(kafka_bootstrap, topology, edge):
    async with sim_worker(kafka_bootstrap, topology) as worker:
        u = user()
        gid = await edge.submit(u, hold=True)  # the worker waits for its prompt: the dispatch is queued
        await edge.wait_for(lambda: edge.prompt_requests[gid] > 0, what="the worker's PromptRequest")
        cancelled = await edge.cancel(u, gid)
        assert cancelled.kind is OutcomeKind.APPLIED and cancelled.status is RequestStatus.CANCELLED
        edge.hold[gid].set()  # now the worker gets its prompt and tries to accept: the cancel won
        await edge.wait_for(lambda: (gid, 1) in worker.traces and worker.traces[(gid, 1)].declined is not None,
                            what="the worker to give up")
        trace = worker.traces[(gid, 1)]
        assert trace.declined == "not_accepted:stale_attempt"
        assert not trace.accepted and trace.engine_started_at is None and edge.deltas[gid] == []
        assert (await edge.wait_finalized(gid)).status is RequestStatus.CANCELLED
    events = await ledger_events(kafka_bootstrap, topology, gid)
    assert not any(isinstance(e, ev.AttemptAccepted) for e in events)
    assert any(isinstance(e, ev.LateReportIgnored) and e.command_type == "AcceptAttempt" for e in events)


async def test_acceptance_racing_cancel_whichever_the_processor_orders_first_wins(kafka_bootstrap, topology, edge):
    """Cancel and the prompt are released together; per generation the ledger's order decides."""
    async with sim_worker(kafka_bootstrap, topology, output_tokens=200, inter_token_ms=10) as worker:
        users = [user() for _ in range(8)]
        gids = [await edge.submit(u, hold=True) for u in users]
        await edge.wait_for(lambda: all(edge.prompt_requests[g] > 0 for g in gids), what="prompt requests")
        for i, (u, g) in enumerate(zip(users, gids)):
            edge.hold[g].set()
            if i % 2:
                await asyncio.sleep(0.05)  # let some acceptances win
            await edge.cancel(u, g)
        for g in gids:
            assert (await edge.wait_finalized(g)).status is RequestStatus.CANCELLED
        for g in gids:
            events = await ledger_events(kafka_bootstrap, topology, g)
            kinds = [type(e) for e in events]
            accepted_in_ledger = ev.AttemptAccepted in kinds
            trace = worker.traces[(g, 1)]
            assert trace.accepted is accepted_in_ledger
            assert (trace.engine_started_at is not None) is accepted_in_ledger
            if not accepted_in_ledger:
                assert edge.deltas[g] == []
                assert kinds.index(ev.GenerationCancelled) < len(kinds)
            else:
                # Accepted first: the cancel came after, the engine was stopped and the stop reported.
                assert kinds.index(ev.AttemptAccepted) < kinds.index(ev.CancelRequested)
                assert trace.outcome is FinishOutcome.STOPPED


async def test_cancel_while_running_stops_the_engine_within_two_decode_steps(kafka_bootstrap, topology, edge):
    async with sim_worker(kafka_bootstrap, topology, output_tokens=2000, inter_token_ms=20, jitter_ms=0) as worker:
        u = user()
        gid = await edge.submit(u, max_output_tokens=2000)
        await edge.wait_for(lambda: len(edge.deltas[gid]) >= 5, what="5 deltas")
        outcome = await edge.cancel(u, gid)
        assert outcome.kind is OutcomeKind.CANCEL_REQUESTED
        final = await edge.wait_finalized(gid)
        assert final.status is RequestStatus.CANCELLED and final.partial is True
        trace = worker.traces[(gid, 1)]
        assert trace.stop_reason == "cancel" and trace.outcome is FinishOutcome.STOPPED
        assert trace.tokens_after_stop is not None and trace.tokens_after_stop <= 2, trace
        assert trace.stopped_at is not None and trace.slot_freed_at is not None
        assert trace.slot_freed_at >= trace.stopped_at  # freed only after the acknowledgement
        assert final.output_tokens == trace.output_tokens  # usage also on cancel
        assert len(edge.deltas[gid]) <= trace.output_tokens < 2000


async def test_lease_expiry_fences_a_silent_worker_and_its_late_report_is_dropped_and_recorded(
    kafka_bootstrap, topology, edge
):
    cfg = SimConfig(ttft_ms=10, inter_token_ms=20, jitter_ms=0, output_tokens=2000)
    # A worker that stops renewing (renewals every 60 s, the lease is 3 s): the processor fences it.
    settings = worker_settings(kafka_bootstrap, topology, renew_interval_s=60.0)
    async with Worker(settings, SimulatedEngine(cfg), served()) as worker:
        # (partial is the processor's view: this worker never renewed, so it never reported a token.)
        _, trace = await failed_with_report(edge, worker, 2000, RejectionCode.MODEL_BACKEND_ERROR)
        gid = trace.generation_id
        assert trace.stop_reason == "fenced"
        # The worker's own report, decided from the log: dropped as from a fenced epoch.
        report = await ledger_entry(kafka_bootstrap, topology, gid, "ReportAttemptFinished")
        assert [type(e) for e in report.events] == [ev.LateReportIgnored], report
        assert report.events[0].reason == "fenced_epoch" and report.events[0].worker_id == settings.worker_id
        received = len(edge.deltas[gid])
        await asyncio.sleep(0.3)
        assert len(edge.deltas[gid]) == received  # nothing more from the fenced epoch
    events = await ledger_events(kafka_bootstrap, topology, gid)
    assert any(isinstance(e, ev.AttemptFenced) and e.epoch == 1 for e in events)
    late = [e for e in events if isinstance(e, ev.LateReportIgnored) and e.command_type == "ReportAttemptFinished"]
    assert late and late[0].reason == "fenced_epoch" and late[0].worker_id == settings.worker_id
    assert not any(isinstance(e, ev.UsageRecorded) and e.output_tokens == trace.output_tokens for e in events if trace.output_tokens)


async def test_a_worker_that_cannot_renew_its_lease_stops_its_engine_by_itself(
    kafka_bootstrap, topology, processor, edge, client
):
    """The processor dies mid-generation: no renewal is confirmed, so at the end of the confirmed
    lease the worker aborts the engine itself ("lease_lost") instead of computing for nobody. After a
    restart the processor settles the attempt as failed (its fence or the worker's report)."""
    cfg = SimConfig(ttft_ms=10, inter_token_ms=20, jitter_ms=0, output_tokens=100_000)
    settings = worker_settings(kafka_bootstrap, topology, lease_ms=LEASE_MS, decision_timeout_s=0.5)
    async with Worker(settings, SimulatedEngine(cfg), served()) as worker:
        u = user()
        gid = await edge.submit(u, max_output_tokens=4000)
        await edge.wait_for(lambda: len(edge.deltas[gid]) >= 5, what="5 deltas")
        processor.kill9()
        trace = worker.traces[(gid, 1)]
        await edge.wait_for(lambda: trace.stopped_at is not None, timeout_s=60, what="the worker to stop its engine")
        assert trace.stop_reason == "lease_lost", trace
        assert trace.tokens_after_stop is not None and trace.tokens_after_stop <= 2, trace
        # The outcome is set once the engine's last text has gone out (the report begins after it).
        await edge.wait_for(lambda: trace.outcome is not None, timeout_s=30, what="the worker's report")
        assert trace.outcome is FinishOutcome.FAILED
        # Stopped at the lease it had confirmed, not at the end of the 100,000-token generation.
        assert trace.output_tokens < 4000
        processor.start()
        await wait_until_deciding(client)
        final = await edge.wait_finalized(gid, timeout_s=60)
        assert final.status is RequestStatus.FAILED and final.code is RejectionCode.MODEL_BACKEND_ERROR


async def test_kill9_mid_stream_ends_in_model_backend_error_partial_with_no_second_attempt(
    kafka_bootstrap, topology, edge, tmp_path
):
    proc = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_SIM_TTFT_MS=10,
                         CHATPLANE_SIM_INTER_TOKEN_MS=50, CHATPLANE_SIM_OUTPUT_TOKENS=2000)
    proc.start()
    try:
        u = user()
        gid = await edge.submit(u, max_output_tokens=2000)
        await edge.wait_for(lambda: len(edge.deltas[gid]) >= 25, what=f"25 deltas; worker log: {proc.log()}")
        proc.kill9()
        received = list(edge.deltas[gid])
        final = await edge.wait_finalized(gid)
        assert final.status is RequestStatus.FAILED and final.code is RejectionCode.MODEL_BACKEND_ERROR
        assert final.partial is True and final.output_tokens > 0
        # The partial text the client got is kept: contiguous sequences 1..n of epoch 1.
        assert [d.sequence for d in received] == list(range(1, len(received) + 1))
        assert edge.deltas[gid][: len(received)] == received
        events = await ledger_events(kafka_bootstrap, topology, gid)
        assert any(isinstance(e, ev.AttemptFenced) and e.epoch == 1 for e in events)
        assert sum(isinstance(e, ev.AttemptAccepted) for e in events) == 1
        assert sum(isinstance(e, ev.GenerationAdmitted) for e in events) == 1  # no second attempt
        # The dead worker's report arrives late (say, from a retry buffer): dropped and recorded.
        late = await edge.client.decide(cmd.ReportAttemptFinished(
            command_id=uuid.uuid4().hex, user_id=u, issued_at_ms=now_ms(), generation_id=gid, epoch=1,
            worker_id=proc.worker_id, outcome=FinishOutcome.COMPLETED, input_tokens=10, output_tokens=999,
            reply_to=edge.client.reply_to()))
        assert late.kind is OutcomeKind.REJECTED and late.code is RejectionCode.STALE_ATTEMPT
        events = await ledger_events(kafka_bootstrap, topology, gid)
        ignored = [e for e in events if isinstance(e, ev.LateReportIgnored) and e.worker_id == proc.worker_id]
        assert ignored and ignored[-1].reason == "fenced_epoch"
        assert not any(isinstance(e, ev.UsageRecorded) and e.output_tokens == 999 for e in events)
    finally:
        proc.stop()


async def test_kill9_mid_stream_reaches_the_http_client_as_generation_error_partial(
    kafka_bootstrap, topology, processor, tmp_path
):
    """Must-show 3 at the client: the SSE stream of the real edge ends in ``generation.error``
    (``model_backend_error``, ``partial: true``, ``manual_regenerate``) after the deltas it already had.

    The kill comes ~1 s in, before the first periodic renewal (every 2.5 s, the lease is 3 s): the
    processor knows output existed only because the worker renews once at its first token."""
    proc = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_SIM_TTFT_MS=10,
                         CHATPLANE_SIM_INTER_TOKEN_MS=50, CHATPLANE_SIM_OUTPUT_TOKENS=2000,
                         CHATPLANE_WORKER_RENEW_INTERVAL_S=2.5)
    proc.start()
    body = {"model": "simulated-text-model", "messages": [{"role": "user", "content": "Name three colors."}],
            "stream": True, "max_output_tokens": 2000}
    u = user()
    try:
        async with serve_edge(edge_settings(kafka_bootstrap, topology)) as e, e.http() as http:
            events: list[tuple[str, dict]] = []
            async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=body,
                                              headers=e.headers(u, uuid.uuid4().hex)) as es:
                assert es.response.status_code == 200, await es.response.aread()
                async for sse in es.aiter_sse():
                    events.append((sse.event, sse.json()))
                    if sse.event == "generation.text.delta" and len(events) == 11:
                        proc.kill9()  # 10 deltas (10 to 20 tokens) in: the worker dies mid-stream
            names = [n for n, _ in events]
            assert names[0] == "generation.created" and names[-1] == "generation.error", (names[-3:], proc.log())
            assert sum(n in TERMINAL_EVENTS for n in names) == 1
            err = events[-1][1]
            assert err["code"] == "model_backend_error" and err["partial"] is True, err
            assert err["action"] == "manual_regenerate", err
            deltas = [d for n, d in events if n == "generation.text.delta"]
            # The partial text the client had stays as it was: contiguous sequences, nothing retracted or redone.
            assert len(deltas) >= 10 and [d["sequence"] for d in deltas] == list(range(1, len(deltas) + 1))
            assert "".join(d["delta"] for d in deltas).startswith("sim-token-1 sim-token-2")
            gid = events[0][1]["generation_id"]
            got = await http.get(f"/v1/generations/{gid}", headers=e.headers(u))
            assert got.status_code == 200, got.text
            doc = got.json()
            assert doc["status"] == "failed" and doc["partial"] is True, doc
        events_ = await ledger_events(kafka_bootstrap, topology, gid)
        assert any(isinstance(x, ev.AttemptFenced) and x.epoch == 1 for x in events_)
        assert sum(isinstance(x, ev.AttemptAccepted) for x in events_) == 1  # no second attempt
    finally:
        proc.stop()


async def test_settled_dispatches_are_committed_so_the_next_worker_of_the_group_does_not_see_them(
    kafka_bootstrap, topology, edge
):
    settings = worker_settings(kafka_bootstrap, topology)
    async with sim_worker(kafka_bootstrap, topology) as first:
        gids = [await edge.submit(user()) for _ in range(3)]
        for g in gids:
            assert (await edge.wait_finalized(g)).status is RequestStatus.COMPLETED
        assert {k[0] for k in first.traces} == set(gids)
    # Same consumer group, fresh process state: only a new dispatch reaches it.
    cfg = SimConfig(ttft_ms=20, inter_token_ms=10, jitter_ms=1, output_tokens=12)
    async with Worker(settings, SimulatedEngine(cfg), served()) as second:
        fresh = await edge.submit(user())
        assert (await edge.wait_finalized(fresh)).status is RequestStatus.COMPLETED
        await asyncio.sleep(1.0)
        assert {k[0] for k in second.traces} == {fresh}


async def test_an_engine_crash_mid_stream_fails_the_attempt_with_model_backend_error_and_partial(
    kafka_bootstrap, topology, edge
):
    async with sim_worker(kafka_bootstrap, topology, output_tokens=200, crash_after_tokens=5) as worker:
        final, trace = await failed_with_report(edge, worker, 200, RejectionCode.MODEL_BACKEND_ERROR)
        gid = trace.generation_id
        assert trace.outcome is FinishOutcome.FAILED and trace.output_tokens == 5
        assert final.output_tokens == 5 and final.partial is True  # usage of what ran, also on failure
        deltas = edge.deltas[gid]
        assert [d.sequence for d in deltas] == list(range(1, len(deltas) + 1)) and len(deltas) <= 5
        assert edge.text(gid) == " ".join(f"sim-token-{i}" for i in range(1, 6))  # the 5 tokens before the crash
    events = await ledger_events(kafka_bootstrap, topology, gid)
    assert sum(isinstance(e, ev.AttemptAccepted) for e in events) == 1  # no automatic second attempt


async def test_max_generation_duration_and_a_stalled_engine_end_the_attempt(kafka_bootstrap, topology, edge):
    long = SimConfig(ttft_ms=10, inter_token_ms=20, jitter_ms=0, output_tokens=5000)
    settings = worker_settings(kafka_bootstrap, topology, generation_duration_max_s=1.0)
    async with Worker(settings, SimulatedEngine(long), served()) as worker:
        u = user()
        gid = await edge.submit(u, max_output_tokens=4000)
        final = await edge.wait_finalized(gid)
        assert final.status is RequestStatus.FAILED and final.code is RejectionCode.GENERATION_TIMEOUT, final
        trace = worker.traces[(gid, 1)]
        assert 0 < trace.output_tokens < 4000 and final.output_tokens == trace.output_tokens
    stalls = SimConfig(ttft_ms=10, inter_token_ms=10, jitter_ms=0, output_tokens=200, stall_after_tokens=3, stall_s=60)
    settings = worker_settings(kafka_bootstrap, topology, engine_stall_max_s=1.0)
    async with Worker(settings, SimulatedEngine(stalls), served()) as worker:
        _, trace = await failed_with_report(edge, worker, 200, RejectionCode.MODEL_BACKEND_ERROR)
        # The worker's report was applied: it settled the generation with the usage of what ran.
        report = await ledger_entry(kafka_bootstrap, topology, trace.generation_id, "ReportAttemptFinished")
        kinds = [type(e) for e in report.events]
        assert ev.GenerationFailed in kinds and ev.LateReportIgnored not in kinds, kinds
        assert [e.output_tokens for e in report.events if isinstance(e, ev.UsageRecorded)] == [3]
        assert trace.output_tokens == 3 and worker.free_slots == worker.slots


async def test_a_worker_whose_topics_do_not_exist_fails_at_start_and_names_them(kafka_bootstrap):
    topo = Topology(f"absent{uuid.uuid4().hex[:8]}")
    worker = Worker(worker_settings(kafka_bootstrap, topo), SimulatedEngine(SimConfig()), served())
    with pytest.raises(MissingTopics) as exc:
        await asyncio.wait_for(worker.start(), 30)  # (the bound only keeps a regression from hanging CI)
    assert topo.worker_control.name in str(exc.value) and topo.dispatch(SIM_POOL, "free").name in str(exc.value)


async def test_chunks_that_come_while_a_delta_is_in_flight_share_the_next_delta(kafka_bootstrap, topology, edge):
    """An engine faster than Kafka's acknowledgements: fewer deltas than chunks, the same text, in
    order; with coalescing off (0) every chunk is its own delta."""
    tokens = 300
    want = " ".join(f"sim-token-{i}" for i in range(1, tokens + 1))
    counts = {}
    for coalesce in (4096, 0):
        settings = worker_settings(kafka_bootstrap, topology, delta_coalesce_chars_max=coalesce)
        cfg = SimConfig(ttft_ms=20, inter_token_ms=0, jitter_ms=0, output_tokens=tokens)
        async with Worker(settings, SimulatedEngine(cfg), served()) as worker:
            gid = await edge.submit(user(), max_output_tokens=tokens + 10)
            final = await edge.wait_finalized(gid)
            assert final.status is RequestStatus.COMPLETED and final.output_tokens == tokens, final
            await edge.wait_for(lambda: worker.traces[(gid, 1)].report_appended, what="the worker's report")
            deltas = edge.deltas[gid]
            assert [d.sequence for d in deltas] == list(range(1, len(deltas) + 1))
            assert edge.text(gid) == want
            assert worker.traces[(gid, 1)].deltas_sent == len(deltas)
            counts[coalesce] = len(deltas)
    assert counts[0] == tokens, counts
    assert counts[4096] < tokens // 2, counts


async def test_the_worker_keeps_no_trace_per_attempt_beyond_its_bound(kafka_bootstrap, topology, edge):
    """One AttemptTrace per attempt, kept forever, once grew without end; ``Worker.traces`` keeps
    at most ``attempt_traces_max`` (0, none, in ``python -m workers``) while every attempt completes
    and ``on_trace`` still sees each one."""
    generations = 6
    cfg = SimConfig(ttft_ms=5, inter_token_ms=2, jitter_ms=0, output_tokens=4)
    for kept_max in (0, 2):
        seen: list = []
        settings = worker_settings(kafka_bootstrap, topology, attempt_traces_max=kept_max)
        async with Worker(settings, SimulatedEngine(cfg), served(), on_trace=seen.append) as worker:
            gids = [await edge.submit(user()) for _ in range(generations)]
            for g in gids:
                assert (await edge.wait_finalized(g)).status is RequestStatus.COMPLETED
            await edge.wait_for(lambda: len(seen) == generations, what="every attempt's trace handed to on_trace")
            assert {t.generation_id for t in seen} == set(gids)
            assert len(worker.traces) == kept_max and set(worker.traces) <= {(g, 1) for g in gids}
