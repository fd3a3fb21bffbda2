"""``sim``: a deterministic SIMULATED engine for load and fault tests. It runs no model.

Data flow: the worker calls ``SimulatedEngine.generate(request)``; the simulator sleeps a time to
first token, then emits one simulated token per inter-token interval (plus seeded jitter) and ends
with ``Finished``. Everything is a function of ``SimConfig`` and the request id, so a run repeats.

Fault injection (for the fault tests; all off by default):
    crash_after_tokens   raise ``EngineError`` after this many tokens (an engine that dies mid-stream)
    stall_after_tokens   stop producing for ``stall_s`` after this many tokens (a hung decode)
    slow_start_factor    multiply the time to first token (a cold or overloaded engine)

Abort is checked between decode steps: ``abort()`` wakes the current inter-token wait, the simulator
finishes that step and yields ``Finished(ABORTED)`` (the acknowledgement). The text is plainly marked
as simulated ("sim-token-1 sim-token-2 ..."): nothing can mistake it for a model's answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from infra.runtime.settings import env_value
from schemas.codes import FinishReason
from workers.engines.base import EngineError, EngineRequest, Finished, TextChunk

SIM_ENGINE_NAME = "sim"


@dataclass(frozen=True, slots=True)
class SimConfig:
    ttft_ms: float = 50.0
    inter_token_ms: float = 10.0
    jitter_ms: float = 2.0  # uniform +- on every wait, seeded per request
    output_tokens: int = 64  # tokens of a full answer (before max_output_tokens)
    max_concurrent: int = 128
    crash_after_tokens: int | None = None
    stall_after_tokens: int | None = None
    stall_s: float = 30.0
    slow_start_factor: float = 1.0
    seed: int = 0

    @classmethod
    def from_env(cls) -> SimConfig:
        """Every field from ``CHATPLANE_SIM_*`` (the shared loader: a bad value is one line naming it)."""
        base = cls()
        return cls(
            ttft_ms=env_value("CHATPLANE_SIM_TTFT_MS", base.ttft_ms, ge=0),
            inter_token_ms=env_value("CHATPLANE_SIM_INTER_TOKEN_MS", base.inter_token_ms, ge=0),
            jitter_ms=env_value("CHATPLANE_SIM_JITTER_MS", base.jitter_ms, ge=0),
            output_tokens=env_value("CHATPLANE_SIM_OUTPUT_TOKENS", base.output_tokens, ge=0),
            max_concurrent=env_value("CHATPLANE_SIM_MAX_CONCURRENT", base.max_concurrent, ge=1),
            crash_after_tokens=env_value("CHATPLANE_SIM_CRASH_AFTER_TOKENS", None, kind=int, ge=0),
            stall_after_tokens=env_value("CHATPLANE_SIM_STALL_AFTER_TOKENS", None, kind=int, ge=0),
            stall_s=env_value("CHATPLANE_SIM_STALL_S", base.stall_s, ge=0),
            slow_start_factor=env_value("CHATPLANE_SIM_SLOW_START_FACTOR", base.slow_start_factor, gt=0),
            seed=env_value("CHATPLANE_SIM_SEED", base.seed),
        )


def simulated_input_tokens(request: EngineRequest) -> int:
    """The simulator's input count: whitespace-separated words plus 4 per message (template tokens)."""
    return sum(len(m.content.split()) + 4 for m in request.messages)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class SimulatedGeneration:
    def __init__(self, engine: SimulatedEngine, request: EngineRequest) -> None:
        self.engine = engine
        self.request = request
        self._abort = asyncio.Event()
        self._waiter: asyncio.Future[None] | None = None  # the current decode step's wake-up
        seed = int.from_bytes(hashlib.blake2b(f"{engine.config.seed}/{request.request_id}".encode(), digest_size=8).digest(), "big")
        self._rng = random.Random(seed)
        self.first_token_at: float | None = None  # monotonic; for benchmarks (engine-side TTFT)
        self.started_at = time.monotonic()

    async def abort(self) -> None:
        self._abort.set()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _wait_ms(self, base_ms: float) -> float:
        jitter = self.engine.config.jitter_ms
        return max(0.0, base_ms + (self._rng.uniform(-jitter, jitter) if jitter else 0.0)) / 1000.0

    async def _step(self, seconds: float) -> None:
        """One decode step: wait, but an abort ends the step early (the step boundary)."""
        if self._abort.is_set():
            return
        # A bare future and a timer (not wait_for, which makes a task per step): 100 streams at 10 ms
        # per token are 10,000 steps/s, and the simulator shares its process with the worker.
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(seconds, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def __aiter__(self) -> AsyncIterator[TextChunk | Finished]:
        cfg = self.engine.config
        inputs = simulated_input_tokens(self.request)
        self.engine.active += 1
        try:
            await self._step(self._wait_ms(cfg.ttft_ms * cfg.slow_start_factor))
            produced = 0
            while True:
                if self._abort.is_set():
                    yield Finished(FinishReason.ABORTED, inputs, produced)
                    return
                if produced >= cfg.output_tokens:
                    yield Finished(FinishReason.STOP, inputs, produced)
                    return
                if produced >= self.request.max_output_tokens:
                    yield Finished(FinishReason.LENGTH, inputs, produced)
                    return
                if cfg.crash_after_tokens is not None and produced >= cfg.crash_after_tokens:
                    raise EngineError(f"simulated crash after {produced} tokens")
                if cfg.stall_after_tokens is not None and produced == cfg.stall_after_tokens:
                    await self._step(cfg.stall_s)
                    if self._abort.is_set():
                        continue
                produced += 1
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                yield TextChunk(("" if produced == 1 else " ") + f"sim-token-{produced}", produced)
                await self._step(self._wait_ms(cfg.inter_token_ms))
        finally:
            self.engine.active -= 1


class SimulatedEngine:
    """The simulator behind the ``Engine`` protocol (``name = "sim"``)."""

    name = SIM_ENGINE_NAME

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.max_concurrent = self.config.max_concurrent
        self.active = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def generate(self, request: EngineRequest) -> SimulatedGeneration:
        return SimulatedGeneration(self, request)

    def kv_pressure(self) -> float:
        return min(1.0, self.active / max(1, self.max_concurrent))
