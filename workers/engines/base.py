"""The engine protocol: what a worker needs from an inference engine, and nothing more.

Data flow: ``workers.worker`` owns Kafka and the attempt's lifecycle; an ``Engine`` only turns one
``EngineRequest`` (trusted system instructions + the client's messages, already fetched from the
edge) into a ``Generation``: an async iterator of ``TextChunk`` (incremental text) that always ends
with exactly one ``Finished`` (reason and actual usage). ``Generation.abort()`` asks the engine to stop;
the stop is *acknowledged* by the ``Finished(reason=ABORTED)`` item that iteration then yields, and
the worker frees the slot only after that item: until then the engine may still be computing.

Engines: ``sim`` (``workers.engines.sim``, a simulator), ``cpu`` (``workers.engines.cpu``, llama.cpp
running SmolLM2-135M-Instruct), ``sglang`` (``workers.engines.sglang``, GPU).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from schemas.codes import FinishReason


class EngineError(RuntimeError):
    """The engine failed mid-generation (crash, lost child process, protocol error).

    ``reason`` is safe to log: it never contains prompt or generated text.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # "system" (only from the registry), "user" or "assistant"
    content: str


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str  # fixed length (32 hex): SGLang matches abort rids by prefix
    messages: tuple[Message, ...]
    max_output_tokens: int
    temperature: float = 0.0


@dataclass(frozen=True, slots=True)
class TextChunk:
    text: str  # incremental, never half of a multi-byte character
    output_tokens: int  # cumulative tokens generated so far


@dataclass(frozen=True, slots=True)
class Finished:
    # How the engine ended the sequence: STOP, LENGTH or ABORTED only (the wire's own values; the
    # worker reports the others when it, not the engine, ended the attempt).
    reason: FinishReason
    input_tokens: int
    output_tokens: int


class Generation(Protocol):
    """One running request. Iterate it to the end; call ``abort`` (idempotent) to stop early."""

    def __aiter__(self) -> AsyncIterator[TextChunk | Finished]: ...

    async def abort(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    name: str  # "sim", "cpu", "sglang"
    max_concurrent: int  # the most generations it runs at once (the worker's slot ceiling)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request: EngineRequest) -> Generation: ...

    def kv_pressure(self) -> float:
        """0..1: how full the engine's KV cache (or its equivalent) is."""
        ...
