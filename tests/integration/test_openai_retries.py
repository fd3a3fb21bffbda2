"""The official ``openai`` client's own retries, without an ``Idempotency-Key``, spend one message.

A real edge, the real processor and the real worker with the sim engine, over HTTP. The client marks
its retries with ``x-stainless-retry-count``; the processor attaches such a retry to the running or
completed generation of the same request (``RetryAttach``, docs/edge.md "Retries without a key"):

- ``timeout=0.5, max_retries=2`` against a generation that takes longer than one try's timeout: the
  client retries, one generation is admitted and accepted, one message is spent, one answer returned;
- two identical calls that are not retries are two generations;
- a retry sent before its first try's decision (the processor paused) still makes one generation,
  whichever of the two the edge appended first.
"""

from __future__ import annotations

import asyncio
import signal
import uuid

import openai
import pytest

from edge.auth import mint
from schemas import events as ev
from schemas.codes import RetryAttach, Tier
from tests.integration.test_edge_harness import edge_settings, serve_edge
from tests.integration.test_openai_compat import Counted
from tests.integration.test_workers import sim_worker
from tests.integration.workers_harness import ledger_events

pytestmark = pytest.mark.integration

MODEL = "simulated-text-model"
PROMPT = [{"role": "user", "content": "Name three colors."}]
SIM_TEXT = " ".join(f"sim-token-{i}" for i in range(1, 13))
# About 1.1 s of generation: longer than one try's 0.5 s timeout, far shorter than three tries.
SLOW = {"ttft_ms": 100, "inter_token_ms": 80, "output_tokens": 12}

def user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


async def spent_by(kafka_bootstrap, topology, who: str) -> tuple[list, list, list]:
    """This user's admissions, attaches and consumed reservations on the ledger."""
    events = [e for e in await ledger_events(kafka_bootstrap, topology) if e.user_id == who]
    return (
        [e for e in events if isinstance(e, ev.GenerationAdmitted)],
        [e for e in events if isinstance(e, ev.RequestAttached)],
        [e for e in events if isinstance(e, ev.ReservationConsumed)],
    )


async def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_the_clients_retries_after_timeouts_spend_one_message_and_return_one_answer(
    kafka_bootstrap, topology, running_processor
):
    who = user()
    counted = Counted()
    async with sim_worker(kafka_bootstrap, topology, **SLOW) as worker, serve_edge(edge_settings(kafka_bootstrap, topology)) as e:
        client = openai.AsyncOpenAI(
            base_url=e.url + "/v1", api_key=mint(e.settings, who, Tier.FREE), http_client=counted.http,
            timeout=0.5, max_retries=2,
        )
        r = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12)
        assert r.choices[0].message.content == SIM_TEXT and r.choices[0].finish_reason in ("stop", "length")
        tries = [req.headers.get("x-stainless-retry-count") for req in counted.requests]
        assert len(tries) >= 2 and tries[0] == "0" and tries[1] == "1", f"the client did not retry: {tries}"
        assert all("idempotency-key" not in req.headers for req in counted.requests)
        generation_id = r.id.removeprefix("chatcmpl-")
        assert sum(1 for t in worker.traces.values() if t.accepted) == 1
        assert [k for k in worker.traces if k[0] == generation_id] == [(generation_id, 1)]

        async def settled() -> bool:
            events = await ledger_events(kafka_bootstrap, topology, generation_id)
            return any(isinstance(x, ev.GenerationCompleted) for x in events)

        await wait_for(settled, "the generation's completion on the ledger")
        # Each try that reached the processor was admitted (the first) or attached; a try whose
        # client gave up before the edge appended it reaches nobody (the next one is then admitted).
        admitted, attached, consumed = await spent_by(kafka_bootstrap, topology, who)
        assert [a.generation_id for a in admitted] == [generation_id], "one admission: one message"
        assert len(consumed) == 1 and 1 <= len(attached) <= len(tries) - 1
        assert {a.generation_id for a in attached} == {generation_id}
        async with e.http() as http:
            quota = (await http.get("/v1/usage", headers=e.headers(who))).json()["quota"]
        assert (quota["used"], quota["reserved"]) == (1, 0), quota


async def test_two_identical_calls_that_are_not_retries_are_two_generations(kafka_bootstrap, topology, running_processor):
    who = user()
    async with sim_worker(kafka_bootstrap, topology) as worker, serve_edge(edge_settings(kafka_bootstrap, topology)) as e:
        client = openai.AsyncOpenAI(base_url=e.url + "/v1", api_key=mint(e.settings, who, Tier.FREE), max_retries=3)
        first = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12)
        second = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12)
        assert first.id != second.id
        assert first.choices[0].message.content == second.choices[0].message.content == SIM_TEXT
        assert sum(1 for t in worker.traces.values() if t.accepted) == 2
        admitted, attached, _ = await spent_by(kafka_bootstrap, topology, who)
        assert len(admitted) == 2 and attached == []


@pytest.mark.parametrize("retry_first", [False, True], ids=["first-try-appended-first", "retry-appended-first"])
async def test_a_retry_sent_before_its_first_tries_decision_makes_one_generation(
    kafka_bootstrap, topology, running_processor, retry_first
):
    """The processor is paused (SIGSTOP) while both tries are appended, so neither is decided before
    the other is sent; whichever the edge appended first, both answer with one generation."""
    who = user()
    async with sim_worker(kafka_bootstrap, topology) as worker, serve_edge(edge_settings(kafka_bootstrap, topology)) as e:
        edge = e.app.state.edge
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 12}
        first = {"Authorization": f"Bearer {mint(e.settings, who, Tier.FREE)}", "x-stainless-retry-count": "0"}
        retry = {**first, "x-stainless-retry-count": "1"}
        async with e.http() as http:
            # A first call (another user) warms the edge, so the paused window below stays short.
            warm = await http.post("/v1/chat/completions", json=body, headers=e.headers(user()))
            assert warm.status_code == 200, warm.text
            running_processor.proc.send_signal(signal.SIGSTOP)
            try:
                calls = []
                for headers in ([retry, first] if retry_first else [first, retry]):
                    calls.append(asyncio.create_task(http.post("/v1/chat/completions", json=body, headers=headers)))
                    appended = len(calls)

                    async def pending(n: int = appended) -> bool:
                        for call in calls:
                            assert not call.done(), call.result().text
                        return edge.shedder.deciding >= n  # appended, waiting for its decision

                    await wait_for(pending, f"submit {appended} appended", timeout_s=8.0)
            finally:
                running_processor.proc.send_signal(signal.SIGCONT)
            answers = await asyncio.gather(*calls)
        for a in answers:
            assert a.status_code == 200, a.text
        ids = {a.json()["id"] for a in answers}
        assert len(ids) == 1, ids
        assert [a.json()["choices"][0]["message"]["content"] for a in answers] == [SIM_TEXT, SIM_TEXT]
        assert sum(1 for t in worker.traces.values() if t.accepted) == 2, "the warm-up's and this one's"
        admitted, attached, _ = await spent_by(kafka_bootstrap, topology, who)
        assert len(admitted) == 1 and len(attached) == 1
        assert attached[0].retry_attach is (RetryAttach.ORIGINAL if retry_first else RetryAttach.RETRY)
