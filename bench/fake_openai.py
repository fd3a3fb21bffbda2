"""A FAKE OpenAI-compatible model server for the LiteLLM side of bench/bench_stack.py (``--peer litellm``).

    .venv/bin/python bench/fake_openai.py --port 9100 --ttft-ms 50 --inter-token-ms 10

It answers ``POST /v1/chat/completions`` (stream or not) with ``max_tokens`` words (default 8), the
first after ``--ttft-ms`` and each next one ``--inter-token-ms`` later: the timing of chatplane's
``sim`` engine in that benchmark, so both stacks wait for the same model. It is a fake of a model
server, not of anything chatplane runs; it validates nothing beyond what the benchmark sends.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
TOKENS_MAX = 4_096  # the most words one answer has, whatever max_tokens asks


def make_app(ttft_ms: float, inter_token_ms: float) -> Starlette:
    async def completions(request: Request) -> Response:
        body: dict[str, Any] = orjson.loads(await request.body())
        n = max(1, min(TOKENS_MAX, int(body.get("max_tokens") or body.get("max_completion_tokens") or 8)))
        model = str(body.get("model", "fake"))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not body.get("stream"):
            await asyncio.sleep((ttft_ms + (n - 1) * inter_token_ms) / 1000)
            text = " ".join(WORDS[i % len(WORDS)] for i in range(n))
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
            })

        async def events():
            def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
                doc = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                return b"data: " + orjson.dumps(doc) + b"\n\n"

            start = time.monotonic()
            for i in range(n):
                due = start + (ttft_ms + i * inter_token_ms) / 1000
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                delta = {"role": "assistant", "content": WORDS[i % len(WORDS)]} if i == 0 else {"content": " " + WORDS[i % len(WORDS)]}
                yield chunk(delta, None)
            yield chunk({}, "length")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"]),
                             Route("/chat/completions", completions, methods=["POST"]),
                             Route("/v1/models", models)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--inter-token-ms", type=float, default=10.0)
    args = p.parse_args()
    uvicorn.run(make_app(args.ttft_ms, args.inter_token_ms), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
