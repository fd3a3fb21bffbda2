"""The chaos run's client load (tests/chaos/chaos.py), also the soak's (bench/soak.py): client loops
over HTTP against a stack's edges (streams read to the end, non-streams, cancels after the first
words, same-key retries from a second client on the other edge, client disconnects mid-stream, slow
SSE readers, users that exhaust their quota), each call recorded as an ``Outcome``.

``SIM_ENV`` is the simulator's timing those runs give every component of the stack.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from schemas.codes import Tier

MODEL = "simulated-text-model"
SIM_ENV = {"CHATPLANE_SIM_TTFT_MS": 60, "CHATPLANE_SIM_INTER_TOKEN_MS": 20, "CHATPLANE_SIM_JITTER_MS": 5,
           "CHATPLANE_SIM_OUTPUT_TOKENS": 5_000}
OUTPUT_TOKENS = (8, 16, 32, 64, 128, 300)  # 20 ms a token: up to 6 s of output
# Streams that outlive an edge kill or a hang-up: 30 s of output, longer than any grace plus the chaos
# run's ORPHAN_BOUND_MS, so an orphan left running shows as one that ended too late.
LONG_OUTPUT_TOKENS = 1_500
HTTP_TIMEOUT_S = 170.0  # over the edge's longest non-stream wait (CHATPLANE_EDGE_GENERATION_WAIT_S_MAX, 160 s)
CONNECT_TIMEOUT_S = 3.0
THINK_S = (0.1, 0.8)
REQUESTS_PER_USER = 12  # a loop moves to a fresh user before the burst bucket or the quota binds
HEAVY_USER_REQUESTS = 48  # > the free tier's 40 messages: the last ones are quota_exhausted
SLOW_READ_PAUSE_S = 0.3  # a slow SSE reader pauses this long after each chunk it reads
SLOW_READER_TOKENS = 128  # about 50 deltas: some 15 s of slow reading
TOKENS_KEPT_MAX = 100_000  # the load's own memory of minted tokens
LOAD_DRAIN_S = 60.0  # after the load stops, for the calls in flight to end
TERMINAL_SSE = ("generation.completed", "generation.cancelled", "generation.error")


def now_ms() -> int:
    return int(time.time() * 1000)


class LoadTarget(Protocol):
    """What the load needs of a stack (bench/stackrun.py's ``Stack``): its edges, and a token per user."""

    @property
    def edge_urls(self) -> list[str]: ...

    def token(self, user: str, tier: Tier = Tier.FREE) -> str: ...


@dataclass
class Outcome:
    kind: str  # stream | nonstream | cancel | disconnect | slow | retry_a | retry_b | heavy
    user: str
    key: str
    edge: str
    started_ms: int
    ended_ms: int = 0
    status: int = 0
    code: str = ""  # typed error code, or "" for 2xx
    generation_id: str = ""
    events: list[str] = field(default_factory=list)  # SSE event names in order
    ending: str = ""  # stream: terminal event name | eof | hung_up | -; transport failure: connect | broken
    hung_up_ms: int = 0  # when the client closed its stream on purpose


def sse_events(raw: bytes) -> list[str]:
    return [line[7:].strip() for line in raw.decode(errors="replace").split("\n") if line.startswith("event: ")]


def stream_error_code(raw: bytes) -> str:
    """The code of a stream's ``generation.error`` event ("" when it has none)."""
    marker = b"event: generation.error\ndata: "
    if marker not in raw:
        return ""
    line = raw.split(marker, 1)[1].split(b"\n", 1)[0]
    try:
        data = json.loads(line)
        return str(data.get("code") or (data.get("error") or {}).get("code") or "<untyped>")
    except (ValueError, AttributeError):
        return "<untyped>"


def generation_of(raw: bytes) -> str:
    marker = b'"generation_id":"'
    if marker in raw:
        return raw.split(marker, 1)[1].split(b'"', 1)[0].decode()
    return ""


class Load:
    def __init__(self, stack: LoadTarget, seed: int, loops: int, heavy_loops: int) -> None:
        self.stack, self.seed = stack, seed
        self.loops, self.heavy_loops = loops, heavy_loops
        self.outcomes: list[Outcome] = []
        self.side_tasks: set[asyncio.Task[None]] = set()
        self._tokens: dict[str, str] = {}
        self.stopping = asyncio.Event()
        self.run_id = uuid.uuid4().hex[:6]
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        timeout = httpx.Timeout(HTTP_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self.http = [httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) for url in stack.edge_urls]
        self.edges = [f"edge-{i + 1}" for i in range(len(self.http))]

    async def close(self) -> None:
        for h in self.http:
            await h.aclose()

    def headers(self, user: str, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(user)}", "Idempotency-Key": key}

    def token(self, user: str, tier: Tier = Tier.FREE) -> str:
        """One token per user for the run, as a real client keeps its token until it expires."""
        if user not in self._tokens:
            if len(self._tokens) >= TOKENS_KEPT_MAX:
                self._tokens.clear()
            self._tokens[user] = self.stack.token(user, tier)
        return self._tokens[user]

    def body(self, rng: random.Random, stream: bool, tokens: int | None = None) -> dict[str, Any]:
        return {"model": MODEL, "stream": stream, "max_output_tokens": tokens or rng.choice(OUTPUT_TOKENS),
                "messages": [{"role": "user", "content": f"Chaos prompt {rng.randrange(10**6)}."}]}

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._loop(i)) for i in range(self.loops)]
        tasks += [asyncio.create_task(self._heavy(i)) for i in range(self.heavy_loops)]
        await self.stopping.wait()
        # Each loop ends after its call in flight; a call still running after LOAD_DRAIN_S is given
        # up (a stream: recorded as the client hanging up, and checked like one).
        _, late = await asyncio.wait(tasks, timeout=LOAD_DRAIN_S)
        for t in late:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self.side_tasks, return_exceptions=True)

    async def _loop(self, n: int) -> None:
        rng = random.Random(self.seed * 1_000 + n)
        count = 0
        user = ""
        while not self.stopping.is_set():
            if count % REQUESTS_PER_USER == 0:
                user = f"u{self.run_id}-{n}-{count // REQUESTS_PER_USER}"
            count += 1
            key = uuid.uuid4().hex
            e = rng.randrange(len(self.http))
            r = rng.random()
            if r < 0.30:
                await self._stream(rng, "stream", user, key, e)
            elif r < 0.50:
                await self._nonstream(rng, "nonstream", user, key, e, self.body(rng, False))
            elif r < 0.62:
                await self._stream(rng, "cancel", user, key, e)
            elif r < 0.72:
                await self._stream(rng, "disconnect", user, key, e)
            elif r < 0.80:
                await self._stream(rng, "slow", user, key, e)
            elif r < 0.90:
                await self._stream(rng, "long", user, key, e, tokens=LONG_OUTPUT_TOKENS)
            else:
                body = self.body(rng, False)
                other = (e + 1) % len(self.http)
                await asyncio.gather(self._nonstream(rng, "retry_a", user, key, e, body),
                                     self._nonstream(rng, "retry_b", user, key, other, body, delay_s=0.3))
            await asyncio.sleep(rng.uniform(*THINK_S))

    async def _heavy(self, n: int) -> None:
        """A user that spends its whole quota and then some: the last requests are quota_exhausted."""
        rng = random.Random(self.seed * 1_000 + 500 + n)
        round_ = 0
        while not self.stopping.is_set():
            user = f"h{self.run_id}-{n}-{round_}"
            round_ += 1
            for _ in range(HEAVY_USER_REQUESTS):
                if self.stopping.is_set():
                    return
                await self._nonstream(rng, "heavy", user, uuid.uuid4().hex, rng.randrange(len(self.http)),
                                      self.body(rng, False, tokens=8))
                await asyncio.sleep(rng.uniform(0.0, 0.2))

    def _record(self, o: Outcome, resp: httpx.Response | None, raw: bytes) -> None:
        o.ended_ms = now_ms()
        if resp is not None:
            o.status = resp.status_code
            if resp.status_code >= 400:
                try:
                    o.code = str(json.loads(raw)["error"]["code"])
                except (ValueError, KeyError, TypeError):
                    o.code = "<untyped>"
            o.generation_id = o.generation_id or generation_of(raw) or self._doc_id(raw)
        self.outcomes.append(o)

    @staticmethod
    def _doc_id(raw: bytes) -> str:
        try:
            doc = json.loads(raw)
        except ValueError:
            return ""
        return str(doc.get("id", "")) if isinstance(doc, dict) else ""

    async def _nonstream(self, rng: random.Random, kind: str, user: str, key: str, e: int, body: dict[str, Any],
                         delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        o = Outcome(kind, user, key, self.edges[e], now_ms())
        try:
            resp = await self.http[e].post("/v1/generations", json=body, headers=self.headers(user, key))
        except httpx.ConnectError:
            o.ending = "connect"
            self._record(o, None, b"")
            return
        except httpx.TransportError:
            o.ending = "broken"
            self._record(o, None, b"")
            return
        self._record(o, resp, resp.content)

    async def _stream(self, rng: random.Random, kind: str, user: str, key: str, e: int, tokens: int | None = None) -> None:
        o = Outcome(kind, user, key, self.edges[e], now_ms())
        http = self.http[e]
        if kind == "disconnect":
            tokens = LONG_OUTPUT_TOKENS
        elif kind == "slow":
            tokens = SLOW_READER_TOKENS
        body = self.body(rng, True, tokens)
        raw = b""
        resp = None
        try:
            req = http.build_request("POST", "/v1/generations", json=body, headers=self.headers(user, key))
            resp = await http.send(req, stream=True)
            try:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    self._record(o, resp, raw)
                    return
                async for chunk in resp.aiter_raw():
                    raw += chunk
                    if b"generation.text.delta" in raw and not o.generation_id:
                        o.generation_id = generation_of(raw)
                        if kind == "disconnect":
                            o.hung_up_ms = now_ms()
                            o.ending = "hung_up"
                            break
                        if kind == "cancel":
                            task = asyncio.create_task(self._cancel(http, user, key, o.generation_id))
                            self.side_tasks.add(task)
                            task.add_done_callback(self.side_tasks.discard)
                    if kind == "slow":
                        await asyncio.sleep(SLOW_READ_PAUSE_S)
            finally:
                await resp.aclose()
        except httpx.ConnectError:
            o.ending = "connect"
            self._record(o, None, b"")
            return
        except httpx.TransportError:
            o.ending = o.ending or "eof"
        except asyncio.CancelledError:
            if o.generation_id and not o.ending:
                o.hung_up_ms, o.ending = now_ms(), "hung_up"
                o.events = sse_events(raw)
                self._record(o, resp, raw)
            raise
        o.events = sse_events(raw)
        o.code = o.code or stream_error_code(raw)
        if not o.ending:
            o.ending = o.events[-1] if o.events and o.events[-1] in TERMINAL_SSE else "eof"
        self._record(o, resp, raw)

    async def _cancel(self, http: httpx.AsyncClient, user: str, key: str, gid: str) -> None:
        o = Outcome("cancel_call", user, key, "", now_ms(), generation_id=gid)
        try:
            resp = await http.post(f"/v1/generations/{gid}/cancel", headers=self.headers(user, key))
        except httpx.TransportError:
            o.ending = "broken"
            self._record(o, None, b"")
            return
        self._record(o, resp, resp.content)
        o.generation_id = gid

