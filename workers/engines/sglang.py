"""``sglang``: SGLang's offline ``Engine`` on a GPU, in its own process.

Why a separate process: ``sglang.Engine.shutdown()`` kills every child process of the process that
created it (``kill_process_tree(os.getpid(), include_parent=False)``), which would take the worker's
other children with it. So the worker starts ``python -m workers.engines.sglang`` (the *engine host*),
which creates ``sglang.Engine(**engine_args)`` and serves one Unix socket; the worker's
``SGLangEngine`` talks to it with length-prefixed orjson frames.

The contract followed (SGLang 0.5.x source: ``python/sglang/srt/entrypoints/engine.py``
``Engine.async_generate``; ``python/sglang/srt/managers/tokenizer_manager.py`` ``abort_request`` and
the per-request output dicts; ``python/sglang/srt/managers/schedule_batch.py`` ``FINISH_*.to_json``):
- ``await engine.async_generate(input_ids=[...], sampling_params={...}, stream=True, rid=<32 hex>)``
  (ids, not text: the host builds them so that no content can hold a control token) returns an
  async iterator of dicts ``{"text": str, "output_ids": [...], "meta_info": {"id": rid,
  "finish_reason": None | {"type": "stop"|"length"|"abort", ...}, "prompt_tokens": int,
  "completion_tokens": int, ...}}``. ``text`` is cumulative unless the engine was started with
  ``incremental_streaming_output=True``; the adapter turns it into deltas.
- ``engine.tokenizer_manager.abort_request(rid)`` sends ``AbortReq``; the scheduler matches rids by
  *prefix*, so every rid here is exactly 32 hex characters (``uuid4().hex``): no rid is a prefix of
  another. The stream then ends with a chunk whose ``finish_reason.type == "abort"``: that chunk is
  the stop acknowledgement. An abort with ``status_code`` 400 is raised by SGLang as ``ValueError``.
- Usage comes from ``meta_info``: ``prompt_tokens`` and ``completion_tokens``.

Frames, worker -> host: ``{"op": "generate", "rid", "messages", "sampling_params"}``,
``{"op": "abort", "rid"}``; host -> worker: ``{"rid", "chunk": <SGLang output dict>}``,
``{"rid", "error": <reason>}``, ``{"op": "ready", "incremental": bool}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from infra.models.prompt_framing import check_content_tokenizer, framed_prompt_ids
from schemas.codes import FinishReason
from workers.engines.base import EngineError, EngineRequest, Finished, TextChunk

log = logging.getLogger("chatplane.workers.sglang")

SGLANG_ENGINE_NAME = "sglang"
RID_HEX_CHARS = 32
FRAME_BYTES_MAX = 8 * 1024 * 1024
CHUNK_QUEUE_MAX = 4096  # chunks buffered per generation before the host read loop waits
HOST_READY_TIMEOUT_S = 900.0  # model load on a cold GPU host
HOST_STOP_TIMEOUT_S = 30.0
SGLANG_MAX_CONCURRENT = 64
_LEN = struct.Struct(">I")
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}


async def write_frame(writer: asyncio.StreamWriter, doc: dict[str, Any]) -> None:
    data = orjson.dumps(doc)
    writer.write(_LEN.pack(len(data)) + data)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > FRAME_BYTES_MAX:
        raise EngineError(f"frame of {size} bytes exceeds {FRAME_BYTES_MAX}")
    return orjson.loads(await reader.readexactly(size))


def new_rid() -> str:
    rid = uuid.uuid4().hex
    assert len(rid) == RID_HEX_CHARS
    return rid


# --- the adapter: SGLang chunks -> TextChunk / Finished ------------------------------------------


class ChunkAdapter:
    """Turns SGLang's output dicts for one rid into incremental text and a final ``Finished``."""

    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental
        self.emitted = ""  # cumulative text already turned into deltas
        self.held = ""  # a trailing U+FFFD (half a character) held back until the next chunk

    def feed(self, chunk: dict[str, Any]) -> list[TextChunk | Finished]:
        meta = chunk.get("meta_info") or {}
        tokens = int(meta.get("completion_tokens") or 0)
        text = chunk.get("text") or ""
        finish = meta.get("finish_reason")
        if self.incremental:
            delta = self.held + text
        else:
            if not text.startswith(self.emitted):
                raise EngineError("cumulative text did not extend the previous chunk")
            delta = text[len(self.emitted) :]
        out: list[TextChunk | Finished] = []
        if finish is None and delta.endswith("\ufffd"):
            self.held = "\ufffd" if self.incremental else ""
            delta = delta[:-1]
        else:
            self.held = ""
        if delta:
            self.emitted += delta
            out.append(TextChunk(delta, tokens))
        if finish is not None:
            kind = finish.get("type") if isinstance(finish, dict) else None
            if kind not in _FINISH:
                raise EngineError(f"unknown finish_reason type {kind!r}"[:80])
            out.append(Finished(_FINISH[kind], int(meta.get("prompt_tokens") or 0), tokens))
        return out


class SGLangGeneration:
    def __init__(self, engine: SGLangEngine, request: EngineRequest) -> None:
        self.engine = engine
        self.request = request
        self.rid = request.request_id if len(request.request_id) == RID_HEX_CHARS else new_rid()
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(CHUNK_QUEUE_MAX)
        self._aborted = False
        self.first_token_at: float | None = None

    async def abort(self) -> None:
        if not self._aborted:
            self._aborted = True
            await self.engine.send({"op": "abort", "rid": self.rid})

    async def __aiter__(self) -> AsyncIterator[TextChunk | Finished]:
        adapter = ChunkAdapter(self.engine.incremental)
        self.engine.streams[self.rid] = self
        try:
            await self.engine.send(
                {
                    "op": "generate",
                    "rid": self.rid,
                    "messages": [{"role": m.role, "content": m.content} for m in self.request.messages],
                    "sampling_params": {"max_new_tokens": self.request.max_output_tokens, "temperature": self.request.temperature},
                }
            )
            while True:
                frame = await self.queue.get()
                if "error" in frame:
                    raise EngineError(f"sglang: {frame['error']}"[:200])
                for item in adapter.feed(frame["chunk"]):
                    if isinstance(item, TextChunk) and self.first_token_at is None:
                        self.first_token_at = time.monotonic()
                    yield item
                    if isinstance(item, Finished):
                        return
        finally:
            self.engine.streams.pop(self.rid, None)


class SGLangEngine:
    """The worker side: starts (or connects to) an engine host and multiplexes generations by rid."""

    name = SGLANG_ENGINE_NAME

    def __init__(self, engine_args: dict[str, Any] | None = None, socket_path: str | None = None, spawn: bool = True,
                 max_concurrent: int = SGLANG_MAX_CONCURRENT) -> None:
        self.engine_args = engine_args or {}
        self.socket_path = socket_path or os.path.join(tempfile.mkdtemp(prefix="chatplane-sglang-"), "engine.sock")
        self.spawn = spawn
        self.max_concurrent = max_concurrent
        self.incremental = bool(self.engine_args.get("incremental_streaming_output", False))
        self.streams: dict[str, SGLangGeneration] = {}
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._read_task: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()

    async def start(self) -> None:
        if self.spawn:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "workers.engines.sglang", "--socket", self.socket_path,
                "--engine-args", orjson.dumps(self.engine_args).decode(),
            )
        deadline = time.monotonic() + HOST_READY_TIMEOUT_S
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path, limit=FRAME_BYTES_MAX)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if self.proc is not None and self.proc.returncode is not None:
                    raise EngineError(f"sglang engine host exited with {self.proc.returncode}") from None
                if time.monotonic() > deadline:
                    raise EngineError("sglang engine host did not become ready") from None
                await asyncio.sleep(0.5)
        hello = await read_frame(self._reader)
        self.incremental = bool(hello.get("incremental", self.incremental))
        self._read_task = asyncio.create_task(self._read(), name="sglang-host-reader")

    async def _read(self) -> None:
        assert self._reader is not None
        try:
            while True:
                frame = await read_frame(self._reader)
                stream = self.streams.get(frame.get("rid", ""))
                if stream is not None:
                    await stream.queue.put(frame)
        except (asyncio.IncompleteReadError, ConnectionError, EngineError) as exc:
            reason = f"engine host connection lost: {type(exc).__name__}"
            for stream in list(self.streams.values()):
                with contextlib.suppress(asyncio.QueueFull):
                    stream.queue.put_nowait({"rid": stream.rid, "error": reason})

    async def send(self, doc: dict[str, Any]) -> None:
        if self._writer is None:
            raise EngineError("sglang engine host not connected")
        async with self._send_lock:
            try:
                await write_frame(self._writer, doc)
            except ConnectionError as exc:
                raise EngineError(f"engine host connection lost: {type(exc).__name__}") from None

    async def close(self) -> None:
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._read_task
        if self._writer is not None:
            self._writer.close()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), HOST_STOP_TIMEOUT_S)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    def generate(self, request: EngineRequest) -> SGLangGeneration:
        return SGLangGeneration(self, request)

    def kv_pressure(self) -> float:
        return min(1.0, len(self.streams) / max(1, self.max_concurrent))


# --- the engine host (runs in its own process, next to sglang.Engine) ----------------------------


class EngineHost:
    """Serves one ``sglang.Engine``-shaped object (``async_generate``, ``tokenizer_manager``) on a socket.

    ``prompt_ids`` turns a request's messages into the token ids the engine runs; the host sends ids,
    never text, so SGLang does not tokenize (and parse control markers in) anything a client wrote:
    ``hf_prompt_ids`` builds them from the chat template's framing and the contents as plain text.
    """

    def __init__(self, engine: Any, incremental: bool, prompt_ids: Any) -> None:
        self.engine = engine
        self.incremental = incremental
        self.prompt_ids = prompt_ids
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def serve(self, socket_path: str) -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(self._client, path=socket_path, limit=FRAME_BYTES_MAX)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()

        async def send(doc: dict[str, Any]) -> None:
            async with lock:
                await write_frame(writer, doc)

        await send({"op": "ready", "incremental": self.incremental})
        try:
            while True:
                frame = await read_frame(reader)
                if frame.get("op") == "generate":
                    rid = frame["rid"]
                    self.tasks[rid] = asyncio.create_task(self._generate(rid, frame, send))
                elif frame.get("op") == "abort":
                    # Abort by the exact 32-hex rid (SGLang matches by prefix; all rids have one length).
                    self.engine.tokenizer_manager.abort_request(frame["rid"])
        except (asyncio.IncompleteReadError, ConnectionError):
            for rid in list(self.tasks):
                self.engine.tokenizer_manager.abort_request(rid)
        finally:
            writer.close()

    async def _generate(self, rid: str, frame: dict[str, Any], send: Any) -> None:
        try:
            ids = self.prompt_ids([(m["role"], m["content"]) for m in frame["messages"]])
            stream = await self.engine.async_generate(
                input_ids=ids, sampling_params=frame["sampling_params"], stream=True, rid=rid
            )
            async for chunk in stream:
                await send({"rid": rid, "chunk": {"text": chunk.get("text", ""), "meta_info": _meta(chunk)}})
        except Exception as exc:  # SGLang raises ValueError for aborts with status 400, and others
            await send({"rid": rid, "error": type(exc).__name__})
        finally:
            self.tasks.pop(rid, None)


def _meta(chunk: dict[str, Any]) -> dict[str, Any]:
    meta = chunk.get("meta_info") or {}
    return {k: meta.get(k) for k in ("id", "finish_reason", "prompt_tokens", "completion_tokens")}


def hf_prompt_ids(tokenizer: Any) -> Any:
    """The prompt builder for a Hugging Face tokenizer (the one ``sglang.Engine`` loaded).

    The chat template's own text is encoded with added tokens matched (``<|im_start|>`` -> its id);
    every content with ``split_special_tokens=True``, so a marker a client typed stays characters.
    ``check_content_tokenizer`` proves the second at start over every special token of the
    vocabulary, and refuses to serve when an installed ``transformers`` ignores the option.
    """

    def render(messages: list[dict[str, str]]) -> str:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def trusted(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def content(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    specials = {t.content if hasattr(t, "content") else str(t): i for i, t in tokenizer.added_tokens_decoder.items()}
    check_content_tokenizer(content, specials)

    def prompt_ids(messages: list[tuple[str, str]]) -> list[int]:
        return framed_prompt_ids(render, trusted, content, messages)

    return prompt_ids


def _host_main() -> None:  # pragma: no cover - needs a GPU and sglang
    parser = argparse.ArgumentParser(description="chatplane: SGLang engine host (one sglang.Engine, one socket)")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--engine-args", default="{}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    import sglang

    engine_args = orjson.loads(args.engine_args)
    engine = sglang.Engine(**engine_args)
    host = EngineHost(
        engine, bool(engine_args.get("incremental_streaming_output", False)), hf_prompt_ids(engine.tokenizer_manager.tokenizer)
    )

    async def run() -> None:
        with contextlib.suppress(FileNotFoundError):
            Path(args.socket).unlink()
        server = await host.serve(args.socket)
        stop = asyncio.Event()
        import signal

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with server:
            await stop.wait()

    # sglang.Engine creates (or adopts) an event loop for its tokenizer manager; run on that one.
    loop = getattr(engine, "loop", None) or asyncio.new_event_loop()
    try:
        loop.run_until_complete(run())
    finally:
        engine.shutdown()


if __name__ == "__main__":  # pragma: no cover
    _host_main()
