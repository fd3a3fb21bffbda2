"""SSE wire format as a foreign reader sees it, and bounded buffers under a slow reader.

- ``httpx-sse`` (not ours) parses every stream, through a TCP proxy that splits the edge's bytes
  into 1-3 byte network chunks, so multi-byte UTF-8 characters arrive split across chunks.
- A reader that stops reading is cancelled at its buffer limit (``slow_consumer``, counted, reason
  in the ledger) while 50 other streams receive every delta; the edge's buffered bytes never pass
  the per-stream and aggregate ceilings.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid

import httpx
import httpx_sse
import pytest

from schemas import events as ev
from schemas.codes import CancelReason
from infra.runtime.topic_reader import read_topic
from schemas.wire import decode_ledger_entry
from tests.integration.test_edge_harness import FakeSimWorker, edge_settings, serve_edge

pytestmark = pytest.mark.integration

MULTIBYTE = ["h\u00e9", "\u4e16\u754c", " \U0001f642", "\u00e9\u00e8", "\n\u0394\n", "ok", "\u20ac", "\U0001f468\u200d\U0001f469"]
TERMINALS = ("generation.completed", "generation.cancelled", "generation.error")


@contextlib.asynccontextmanager
async def splitting_proxy(target_port: int):
    """A TCP proxy that forwards the server's bytes in 1-3 byte writes, each flushed on its own."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, split: bool) -> None:
        try:
            n = 0
            while data := await reader.read(65536):
                if not split:
                    writer.write(data)
                    await writer.drain()
                    continue
                i = 0
                while i < len(data):
                    step = 1 + n % 3
                    n += 1
                    writer.write(data[i : i + step])
                    await writer.drain()
                    await asyncio.sleep(0)
                    i += step
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        sock = client_w.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pipe(client_r, server_w, False), pipe(server_r, client_w, True))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def test_foreign_sse_reader_parses_multibyte_text_split_across_network_chunks(kafka_bootstrap, topology, running_processor):
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens=MULTIBYTE, token_interval_s=0.01) as worker,
        serve_edge(edge_settings(kafka_bootstrap, topology)) as e,
    ):
        port = int(e.url.rsplit(":", 1)[1])
        async with splitting_proxy(port) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            for n in range(2):
                events = []
                body = {"model": "simulated-text-model", "messages": [{"role": "user", "content": "\u00e9crire \u4e16"}], "stream": True, "max_output_tokens": 32}
                async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=body, headers=e.headers(f"u{n}", "k")) as es:
                    assert es.response.status_code == 200
                    async for sse in es.aiter_sse():
                        events.append((sse.event, sse.json()))
                names = [name for name, _ in events]
                assert names[0] == "generation.created" and names[-1] == "generation.completed"
                deltas = [d for name, d in events if name == "generation.text.delta"]
                assert "".join(d["delta"] for d in deltas) == "".join(MULTIBYTE)
                assert [d["sequence"] for d in deltas] == list(range(1, len(MULTIBYTE) + 1))
                assert events[-1][1]["usage"]["output_tokens"] == len(MULTIBYTE)
        assert worker.accepted == 2


async def test_slow_reader_is_cancelled_at_its_buffer_limit_while_50_streams_keep_pace(kafka_bootstrap, topology, running_processor):
    big = "x" * 8000
    small = [f"s{i} " for i in range(20)]

    def tokens_for(payload):
        return [big] * 1500 if payload.messages[0].content == "BIG" else small

    settings = edge_settings(kafka_bootstrap, topology, stream_buffer_bytes_max=64 * 1024, aggregate_buffer_bytes_max=8 * 1024 * 1024)
    async with (
        FakeSimWorker(kafka_bootstrap, topology, tokens_for=tokens_for, token_interval_s=0.02, renew_every_tokens=5) as worker,
        serve_edge(settings) as e,
        e.http() as http,
    ):
        hub = e.app.state.edge.hub
        peak = {"stream": 0, "aggregate": 0}

        async def watch() -> None:
            while True:
                peak["aggregate"] = max(peak["aggregate"], hub.aggregate_bytes)
                for s in list(hub.streams.values()):
                    peak["stream"] = max(peak["stream"], s.buffered_bytes)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        # The slow reader: a raw socket with a tiny receive buffer that reads the headers, then stops.
        port = int(e.url.rsplit(":", 1)[1])
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.connect(("127.0.0.1", port))
        raw.setblocking(False)
        payload = b'{"model":"simulated-text-model","messages":[{"role":"user","content":"BIG"}],"stream":true,"max_output_tokens":4096}'
        auth = e.headers("slow-user", "k")
        request = (
            b"POST /v1/generations HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
            + f"Authorization: {auth['Authorization']}\r\nIdempotency-Key: k\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(raw, request)
        head = await asyncio.wait_for(loop.sock_recv(raw, 1024), 30)
        assert head.startswith(b"HTTP/1.1 200")

        async def one(i: int) -> list[tuple[str, dict]]:
            body = {"model": "simulated-text-model", "messages": [{"role": "user", "content": f"n{i}"}], "stream": True, "max_output_tokens": 32}
            events = []
            async with httpx_sse.aconnect_sse(http, "POST", "/v1/generations", json=body, headers=e.headers(f"n{i}-{uuid.uuid4().hex[:4]}", "k")) as es:
                assert es.response.status_code == 200
                async for sse in es.aiter_sse():
                    events.append((sse.event, sse.json()))
            return events

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(50))), 90)
        for events in results:
            names = [n for n, _ in events]
            assert names[-1] == "generation.completed", names[-3:]
            assert "".join(d["delta"] for n, d in events if n == "generation.text.delta") == "".join(small)
        # The slow one is cancelled at its limit, with the reason recorded.
        for _ in range(300):
            if hub.metrics.slow_consumer_cancels.labels("stream_bytes")._value.get() >= 1:
                break
            await asyncio.sleep(0.1)
        assert hub.metrics.slow_consumer_cancels.labels("stream_bytes")._value.get() == 1
        watcher.cancel()
        raw.close()
        # The slow stream's buffer did fill towards its limit, and never past it.
        assert settings.stream_buffer_bytes_max // 2 < peak["stream"] <= settings.stream_buffer_bytes_max
        assert peak["aggregate"] <= settings.aggregate_buffer_bytes_max
        for _ in range(300):
            if len(worker.finished) == 51:
                break
            await asyncio.sleep(0.1)
    reasons = []
    for _p, _o, _k, value in await read_topic(kafka_bootstrap, topology.ledger):
        for x in decode_ledger_entry(value).events:
            if isinstance(x, ev.CancelRequested):
                reasons.append(x.reason)
    assert reasons == [CancelReason.SLOW_CONSUMER]
