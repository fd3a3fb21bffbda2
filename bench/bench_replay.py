"""The resumable-streams benchmark: reconnect and replay over HTTP, and what storing the
deltas costs. A script, not a test.

    .venv/bin/python bench/bench_replay.py                 # 40 reconnects, a 2,000-event replay, cost at 20/s
    .venv/bin/python bench/bench_replay.py --quick

One bench/stackrun.py stack (its own broker and Cassandra; one processor, one read model, one sim
worker, two edges), then, in the same run:

1. reconnects: ``--reconnects`` streaming requests on edge 1; after 5 deltas the client drops the
   connection and reconnects to edge 2's ``GET /v1/generations/{id}/events`` with ``Last-Event-ID``.
   Printed: POST -> first live delta (edge 1) and reconnect -> first replayed event (edge 2),
   p50/p99, and whether every assembled stream was contiguous with one terminal event;
2. replay throughput: one finished generation of ``--events`` deltas (the worker sends one delta a
   token here), replayed whole from edge 2: events/s and time to the first and last event;
3. the cost of durable deltas: ``--rate`` streaming requests/s for ``--seconds`` with the deltas
   stored (the default) and again after restarting the worker with
   ``CHATPLANE_WORKER_REPLAY_STORE=none``: first token p50/p95 and worker and Cassandra CPU per
   generation and per delta.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_stack import SIM_ENV, pct  # noqa: E402
from bench.stackrun import Stack, cpu_seconds  # noqa: E402
from schemas.codes import Tier  # noqa: E402

MODEL = "simulated-text-model"
HTTP_TIMEOUT_S = 120.0


def headers(stack: Stack, user: str, key: str | None = None) -> dict[str, str]:
    h = {"Authorization": f"Bearer {stack.token(user, Tier.PAID)}"}
    if key is not None:
        h["Idempotency-Key"] = key
    return h


def events_of(text: str) -> list[tuple[int | None, str, dict]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((int(fields["id"]) if "id" in fields else None, fields["event"], json.loads(fields["data"])))
    return out


def body(tokens: int, stream: bool = True) -> dict:
    return {"model": MODEL, "stream": stream, "max_output_tokens": tokens, "messages": [{"role": "user", "content": "Go on."}]}


async def reconnect_once(stack: Stack, h1: httpx.AsyncClient, h2: httpx.AsyncClient, tokens: int) -> dict:
    user = f"r-{uuid.uuid4().hex[:10]}"
    t0 = time.monotonic()
    first_delta = None
    seen = ""
    async with h1.stream("POST", "/v1/generations", headers=headers(stack, user, uuid.uuid4().hex), json=body(tokens)) as r:
        async for chunk in r.aiter_text():
            seen += chunk
            deltas = [e for e in events_of(seen) if e[1] == "generation.text.delta"]
            if deltas and first_delta is None:
                first_delta = time.monotonic() - t0
            if len(deltas) >= 5:
                break
    head = events_of(seen)
    gid, last = head[0][2]["generation_id"], head[-1][0]
    t1 = time.monotonic()
    first_replayed = None
    text = ""
    async with h2.stream("GET", f"/v1/generations/{gid}/events", headers={**headers(stack, user), "Last-Event-ID": str(last)}) as r:
        async for chunk in r.aiter_text():
            if first_replayed is None and "event: " in chunk:
                first_replayed = time.monotonic() - t1
            text += chunk
    tail = events_of(text)
    ids = [i for i, _, _ in head + tail]
    terminal = sum(1 for _, n, _ in head + tail if n in ("generation.completed", "generation.cancelled", "generation.error"))
    return {"first_delta": first_delta, "first_replayed": first_replayed,
            "contiguous": ids == list(range(ids[0], ids[0] + len(ids))) and terminal == 1}


async def streamed(stack: Stack, http: httpx.AsyncClient, tokens: int) -> tuple[float | None, int]:
    user = f"c-{uuid.uuid4().hex[:10]}"
    t0 = time.monotonic()
    first = None
    text = ""
    async with http.stream("POST", "/v1/generations", headers=headers(stack, user, uuid.uuid4().hex), json=body(tokens)) as r:
        async for chunk in r.aiter_text():
            if first is None and "generation.text.delta" in chunk:
                first = time.monotonic() - t0
            text += chunk
    return first, sum(1 for e in events_of(text) if e[1] == "generation.text.delta")


async def cost_phase(stack: Stack, rate: float, seconds: float, tokens: int) -> dict:
    names = ("worker-1", "cassandra")
    pids = stack.pids()
    cpu0 = {n: cpu_seconds(pids[n]) or 0.0 for n in names}
    async with httpx.AsyncClient(base_url=stack.edge_urls[0], timeout=HTTP_TIMEOUT_S) as http:
        t0 = time.monotonic()
        tasks = []
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(streamed(stack, http, tokens)))
        results = await asyncio.gather(*tasks)
    await asyncio.sleep(2)
    pids = stack.pids()
    cpu1 = {n: cpu_seconds(pids[n]) or 0.0 for n in names}
    firsts = [f * 1000 for f, _ in results if f is not None]
    deltas = sum(d for _, d in results)
    done = max(1, len(firsts))
    return {
        "first_p50": pct(firsts, 0.5), "first_p95": pct(firsts, 0.95), "n": len(firsts), "deltas": deltas / done,
        **{f"{n}_ms_per_gen": (cpu1[n] - cpu0[n]) * 1000 / done for n in names},
        **{f"{n}_us_per_delta": (cpu1[n] - cpu0[n]) * 1e6 / max(1, deltas) for n in names},
    }


async def bench(args: argparse.Namespace, work: Path) -> None:
    env = {**SIM_ENV, "CHATPLANE_SIM_OUTPUT_TOKENS": max(args.events, 4000), **dict(kv.split("=", 1) for kv in args.env)}
    stack = Stack(work, namespace=f"replay{uuid.uuid4().hex[:6]}", processors=1, workers=1, edges=2, readmodels=1, histories=0,
                  env=env)
    await stack.start()
    try:
        async with httpx.AsyncClient(base_url=stack.edge_urls[0], timeout=HTTP_TIMEOUT_S) as h1, \
                httpx.AsyncClient(base_url=stack.edge_urls[1], timeout=HTTP_TIMEOUT_S) as h2:
            for _ in range(3):  # warm-up, not reported
                await reconnect_once(stack, h1, h2, 30)
            rows = []
            for _ in range(args.reconnects):
                rows.append(await reconnect_once(stack, h1, h2, 30))
            live = [r["first_delta"] * 1000 for r in rows if r["first_delta"] is not None]
            replayed = [r["first_replayed"] * 1000 for r in rows if r["first_replayed"] is not None]
            print(f"1. reconnects ({len(rows)}, sequential; drop after 5 deltas on edge 1, resume on edge 2):")
            print(f"   POST -> first live delta (edge 1)          p50 {pct(live, .5):7.1f} ms  p99 {pct(live, .99):7.1f} ms")
            print(f"   reconnect -> first replayed event (edge 2)  p50 {pct(replayed, .5):7.1f} ms  p99 {pct(replayed, .99):7.1f} ms")
            print(f"   assembled streams contiguous with one terminal event: {sum(r['contiguous'] for r in rows)}/{len(rows)}", flush=True)

            user = f"t-{uuid.uuid4().hex[:10]}"
            r = await h1.post("/v1/generations", headers=headers(stack, user, uuid.uuid4().hex), json=body(args.events, False))
            gid = r.json()["id"]
            t0 = time.monotonic()
            first = None
            text = ""
            async with h2.stream("GET", f"/v1/generations/{gid}/events", headers=headers(stack, user)) as resp:
                async for chunk in resp.aiter_text():
                    if first is None:
                        first = time.monotonic() - t0
                    text += chunk
            wall = time.monotonic() - t0
            n = len(events_of(text))
            print(f"2. replay of a finished generation of {n} events (edge 2): first event {first * 1000:.1f} ms, "
                  f"all in {wall * 1000:.0f} ms = {n / wall:,.0f} events/s", flush=True)

        on = await cost_phase(stack, args.rate, args.seconds, args.tokens)
        worker = stack.components["worker-1"]
        worker.env["CHATPLANE_WORKER_REPLAY_STORE"] = "none"
        stack.restart("worker-1")
        await asyncio.sleep(8)
        off = await cost_phase(stack, args.rate, args.seconds, args.tokens)
        print(f"3. cost of durable deltas, {args.rate:g}/s for {args.seconds:g} s, {args.tokens} tokens a request "
              f"(the worker sends one delta a token here):")
        print("   deltas         n  deltas/gen  first token p50/p95 ms  worker ms/gen  worker us/delta  cassandra ms/gen  cassandra us/delta")
        for name, x in (("stored", on), ("not stored", off)):
            print(f"   {name:<12} {x['n']:4d}  {x['deltas']:10.1f}  {x['first_p50']:8.1f} / {x['first_p95']:7.1f}"
                  f"  {x['worker-1_ms_per_gen']:13.1f}  {x['worker-1_us_per_delta']:15.0f}  {x['cassandra_ms_per_gen']:16.1f}"
                  f"  {x['cassandra_us_per_delta']:18.0f}", flush=True)
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reconnects", type=int, default=40)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--env", action="append", default=["CHATPLANE_WORKER_DELTA_COALESCE_CHARS_MAX=0",
                                                           "CHATPLANE_WORKER_DELTA_INTERVAL_MS=0"])
    args = parser.parse_args(argv)
    if args.quick:
        args.reconnects, args.events, args.seconds = 5, 300, 5
    with tempfile.TemporaryDirectory(prefix="chatplane-bench-replay-") as work:
        asyncio.run(bench(args, Path(work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
