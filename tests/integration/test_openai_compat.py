"""The OpenAI-compatible endpoint with the official ``openai`` client: a real edge,
the real processor, a real ``workers`` sim worker (or the edge harness's fake where a test needs
exact tokens), over HTTP.

- non-stream and stream with ``include_usage``: the text, ``finish_reason``, usage, ``[DONE]``;
- ``quota_exhausted`` is raised at once, not retried (``x-should-retry: false``);
- ``capacity_exhausted`` is retried by the client, and with one ``Idempotency-Key`` passed in
  ``extra_headers`` its retries make one generation once capacity appears;
- a cancel mid-stream ends the stream with an error chunk, never ``[DONE]``; system messages are
  refused; ``/v1/models`` lists the tier's aliases.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import openai
import pytest

from edge.auth import mint
from schemas.codes import Tier
from tests.integration.test_edge_harness import FakeSimWorker, edge_settings, serve_edge
from tests.integration.test_workers import sim_worker

pytestmark = pytest.mark.integration

MODEL = "simulated-text-model"
PROMPT = [{"role": "user", "content": "Name three colors."}]


class Counted:
    """An ``httpx.AsyncClient`` for the ``openai`` client that counts the requests it sends."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.http = httpx.AsyncClient(event_hooks={"request": [self._count]}, timeout=30.0)

    async def _count(self, request: httpx.Request) -> None:
        self.requests.append(request)


def client_for(e, user: str, counted: Counted | None = None, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=e.url + "/v1", api_key=mint(e.settings, user, Tier.FREE),
        http_client=counted.http if counted else None, **kw,
    )


def user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


async def test_non_stream_and_stream_with_usage_through_the_official_client(kafka_bootstrap, topology, running_processor):
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=["Red", ", green", ", blue."], token_interval_s=0.01),
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
    ):
        client = client_for(e, user())
        r = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=16)
        assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-gen_")
        (choice,) = r.choices
        assert choice.message.role == "assistant" and choice.message.content == "Red, green, blue."
        assert choice.finish_reason == "stop"
        assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens > 0
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

        stream = await client.chat.completions.create(
            model=MODEL, messages=PROMPT, max_completion_tokens=16, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "Red, green, blue."
        finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishing == ["stop"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
        assert len({c.id for c in chunks}) == 1

        models = await client.models.list()
        assert MODEL in [m.id for m in models.data]


async def test_the_raw_stream_ends_with_done_and_a_budget_used_up_is_length(kafka_bootstrap, topology, running_processor):
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=["a", "b", "c"], token_interval_s=0.0),
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
        httpx.AsyncClient(base_url=e.url, timeout=30.0) as http,
    ):
        headers = {"Authorization": f"Bearer {mint(e.settings, user(), Tier.FREE)}"}
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 3, "stream": True}
        r = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [block for block in r.text.split("\n\n") if block.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in events[-2]  # three tokens of a three-token budget
        # A system message is refused (the instructions are the server's), in OpenAI's error shape.
        bad = await http.post("/v1/chat/completions", json={**body, "messages": [{"role": "system", "content": "x"}, *PROMPT]},
                              headers=headers)
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert (err["code"], err["type"], err["param"]) == ("invalid_request", "invalid_request_error", "messages.0.role")
        unknown = await http.post("/v1/chat/completions", json={**body, "tools": []}, headers=headers)
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tools"
        anonymous = await http.post("/v1/chat/completions", json=body)
        assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"


async def test_quota_exhausted_is_not_retried_by_the_client(kafka_bootstrap, topology, running_processor):
    who = user()
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=["ok"], token_interval_s=0.0) as worker,
        serve_edge(edge_settings(kafka_bootstrap, topology, bucket_capacity_tokens=100.0)) as e,
    ):
        counted = Counted()
        client = client_for(e, who, counted, max_retries=3)
        for _ in range(40):
            r = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)
            assert r.choices[0].message.content == "ok"
        assert worker.accepted == 40
        sent = len(counted.requests)
        with pytest.raises(openai.RateLimitError) as raised:
            await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)
        assert len(counted.requests) == sent + 1, "the client retried a quota_exhausted"
        assert raised.value.code == "quota_exhausted" and raised.value.type == "insufficient_quota"
        assert raised.value.response.headers["x-should-retry"] == "false"
        assert int(raised.value.response.headers["retry-after"]) >= 1


async def test_capacity_exhausted_is_retried_and_one_key_makes_one_generation(kafka_bootstrap, topology, running_processor):
    """No worker yet: the edge's capacity view refuses (503 capacity_exhausted, Retry-After 1 s) and the
    client retries with the same Idempotency-Key; a worker starts meanwhile, a retry is admitted."""
    counted = Counted()
    async with serve_edge(edge_settings(kafka_bootstrap, topology, capacity_check=True)) as e:
        client = client_for(e, user(), counted, max_retries=10)
        key = f"oai-{uuid.uuid4().hex}"
        call = asyncio.create_task(client.chat.completions.create(
            model=MODEL, messages=PROMPT, max_tokens=12, extra_headers={"Idempotency-Key": key},
        ))
        while len(counted.requests) < 2:  # refused once and retried: capacity_exhausted is retryable
            assert not call.done(), call
            await asyncio.sleep(0.05)
        async with sim_worker(kafka_bootstrap, topology) as worker:
            r = await asyncio.wait_for(call, 60)
            assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
            assert {req.headers["idempotency-key"] for req in counted.requests} == {key}
            generation_id = r.id.removeprefix("chatcmpl-")
            assert [k for k in worker.traces if k[0] == generation_id] == [(generation_id, 1)]
            assert sum(1 for t in worker.traces.values() if t.accepted) == 1
            # The same key again: the same generation's answer, no new one.
            again = await client.chat.completions.create(
                model=MODEL, messages=PROMPT, max_tokens=12, extra_headers={"Idempotency-Key": key}
            )
            assert again.id == r.id and again.choices[0].message.content == r.choices[0].message.content
            assert sum(1 for t in worker.traces.values() if t.accepted) == 1


async def test_a_cancel_mid_stream_ends_with_an_error_chunk_not_done(kafka_bootstrap, topology, running_processor):
    who = user()
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=[f"w{i} " for i in range(200)], token_interval_s=0.02),
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
        httpx.AsyncClient(base_url=e.url, timeout=30.0) as http,
    ):
        client = client_for(e, who)
        stream = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=400, stream=True)
        seen = []
        with pytest.raises(openai.APIError) as raised:
            async for chunk in stream:
                seen.append(chunk)
                if len(seen) == 3:
                    generation_id = chunk.id.removeprefix("chatcmpl-")
                    headers = {"Authorization": f"Bearer {mint(e.settings, who, Tier.FREE)}"}
                    cancel = await http.post(f"/v1/generations/{generation_id}/cancel", headers=headers)
                    assert cancel.status_code in (200, 202), cancel.text
        assert "cancelled" in str(raised.value.body) and raised.value.body["code"] == "cancelled"
        assert raised.value.body["partial"] is True
