"""The edge's connection bounds on a real socket, no broker: the real app under a real uvicorn server
built by ``edge.__main__.uvicorn_config`` (the lifespan off, so no Kafka client starts; ``/healthz``
answers without one).

Slow request heads were never dropped: a client that sent half a request head kept its
socket for ever, and nothing bounded the open connections. Each test polls the socket with a bound
well above the setting and checks that the server closed it, never how fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import uvicorn

from edge.__main__ import uvicorn_config
from edge.app import create_app
from edge.settings import EdgeSettings

HEAD_TIMEOUT_S = 0.5
# How long a test waits for the server to close a socket: well above the head timeout, far below the
# 70 s a half-sent head survived before.
CLOSE_WAIT_S = 10.0
SERVER_START_WAIT_S = 30.0
HALF_HEAD = b"GET /healthz HTTP/1.1\r\nHost: edge\r\nX-Slow: "
FULL_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n"


@contextlib.asynccontextmanager
async def serve(**over) -> AsyncIterator[tuple[int, object]]:
    settings = EdgeSettings(capacity_check=False, read_model=False, **over)
    app = create_app(settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn_config(app, settings, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + SERVER_START_WAIT_S
    while not server.started:
        if task.done():
            task.result()
        assert time.monotonic() < deadline, "server did not start"
        await asyncio.sleep(0.02)
    try:
        yield sock.getsockname()[1], app.state.edge.metrics
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def closed_by_server(reader: asyncio.StreamReader, within_s: float = CLOSE_WAIT_S) -> bytes:
    """Everything the server sent until it closed the connection; fails if it is still open after ``within_s``."""
    received = b""
    try:
        async with asyncio.timeout(within_s):
            while chunk := await reader.read(65536):
                received += chunk
    except ConnectionResetError:
        pass  # closed with our bytes unread: a reset is a close too
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open for {within_s} s (received {received[:80]!r})") from None
    return received


async def get_healthz(port: int) -> bytes:
    reader, writer = await connect(port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: edge\r\nConnection: close\r\n\r\n")
    answer = await closed_by_server(reader)
    writer.close()
    return answer


def closed_count(metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("chatplane_edge_connections_closed_total", {"reason": reason}) or 0.0


async def test_a_half_sent_request_head_is_closed_at_the_head_timeout():
    async with serve(request_head_timeout_s=HEAD_TIMEOUT_S) as (port, metrics):
        reader, writer = await connect(port)
        writer.write(HALF_HEAD)
        await writer.drain()
        assert await closed_by_server(reader) == b"", "closed without an answer"
        writer.close()
        assert closed_count(metrics, "head_timeout") == 1
        # The server still answers complete requests.
        assert (await get_healthz(port)).startswith(b"HTTP/1.1 200")


async def test_a_silent_connection_and_a_trickled_head_are_closed_too():
    async with serve(request_head_timeout_s=HEAD_TIMEOUT_S) as (port, metrics):
        silent_reader, silent_writer = await connect(port)
        trickle_reader, trickle_writer = await connect(port)

        async def trickle() -> None:
            # One byte every 0.1 s, a head that would take 10 s: more bytes do not extend the deadline.
            with contextlib.suppress(ConnectionError):
                for byte in FULL_REQUEST.replace(b"\r\n\r\n", b"\r\nX-Pad: " + b"a" * 100 + b"\r\n\r\n"):
                    trickle_writer.write(bytes([byte]))
                    await trickle_writer.drain()
                    await asyncio.sleep(0.1)

        sender = asyncio.create_task(trickle())
        assert await closed_by_server(silent_reader) == b""
        assert await closed_by_server(trickle_reader) == b""
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        silent_writer.close()
        trickle_writer.close()
        assert closed_count(metrics, "head_timeout") == 2


async def test_a_head_completed_in_time_is_answered_and_a_kept_alive_connection_gets_the_same_bound():
    async with serve(request_head_timeout_s=2.0) as (port, _):
        reader, writer = await connect(port)
        writer.write(FULL_REQUEST[:20])
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(FULL_REQUEST[20:])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSE_WAIT_S)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1])
        await reader.readexactly(length)
        # The next request on the kept-alive connection: half a head is closed at the head timeout
        # (2 s), long before uvicorn's keep-alive timeout (15 s) would apply.
        writer.write(HALF_HEAD)
        await writer.drain()
        started = time.monotonic()
        assert await closed_by_server(reader) == b""
        assert time.monotonic() - started < 15, "closed by the keep-alive timeout, not the head timeout"
        writer.close()


async def test_a_connection_beyond_connections_max_is_refused_with_a_typed_503():
    connections_max = 4
    async with serve(request_head_timeout_s=60.0, connections_max=connections_max) as (port, metrics):
        held = [await connect(port) for _ in range(connections_max)]
        for _, writer in held:
            writer.write(HALF_HEAD)  # never finished: only the bound refuses the next one
            await writer.drain()
        reader, writer = await connect(port)
        answer = await closed_by_server(reader)
        writer.close()
        # The refusal is written at accept; a reset before it is read would also be a refusal, but
        # nothing was sent here, so the answer arrives.
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b'"code":"capacity_exhausted"' in answer and b"retry-after: 1" in answer.lower()
        assert closed_count(metrics, "connections_max") == 1
        # The held ones are still open; one closes, and a new connection is served.
        _, first_writer = held.pop()
        first_writer.close()
        await first_writer.wait_closed()
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not (answer := await get_healthz(port)).startswith(b"HTTP/1.1 200"):
            assert time.monotonic() < deadline, answer[:200]  # the server may see the close a moment later
            await asyncio.sleep(0.05)
        for _, w in held:
            w.close()


def typed_400(answer: bytes) -> dict:
    """The edge's typed 400 from a raw HTTP answer: a JSON error body, never uvicorn's plain text."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"content-type: application/json" in head.lower(), head
    import json

    err = json.loads(body)["error"]
    assert err["code"] == "invalid_request" and err["request_id"].startswith("req_"), err
    return err


async def test_a_request_head_over_its_bound_gets_the_typed_400_however_it_arrives():
    limit = 64 * 1024
    async with serve(request_head_bytes_max=limit) as (port, metrics):
        for pad_bytes, pieces in ((100_000, 1), (200_000, 1), (200_000, 50)):
            reader, writer = await connect(port)
            request = b"GET /healthz HTTP/1.1\r\nHost: edge\r\nX-Pad: " + b"a" * pad_bytes + b"\r\n\r\n"
            step = -(-len(request) // pieces)
            for i in range(0, len(request), step):
                writer.write(request[i : i + step])
                await writer.drain()
            err = typed_400(await closed_by_server(reader))
            writer.close()
            assert err["details"] == {"field": "headers", "limit": limit} and str(limit) in err["message"], err
        assert closed_count(metrics, "head_bytes") == 3
        # Bytes that are not HTTP/1.1 get the typed answer too.
        reader, writer = await connect(port)
        writer.write(b"NOT HTTP\x00\r\n\r\n")
        assert typed_400(await closed_by_server(reader))["details"] == {"field": "request"}
        writer.close()
        assert closed_count(metrics, "malformed") == 1
        # A head within the bound is served.
        reader, writer = await connect(port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: edge\r\nConnection: close\r\nX-Pad: " + b"a" * (limit - 200) + b"\r\n\r\n")
        assert (await closed_by_server(reader)).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_a_body_over_the_cap_is_refused_before_the_client_sent_the_rest():
    """Declared one byte over the cap, with no body byte sent, or chunked up to one byte over it with
    the body never ended: either way the answer comes, so the edge did not wait to read past the cap."""
    from edge.auth import mint
    from schemas.codes import Tier

    async with serve() as (port, _):
        settings = EdgeSettings(capacity_check=False, read_model=False)
        cap = settings.request_body_bytes_max
        auth = f"Authorization: Bearer {mint(settings, 'frank', Tier.FREE)}\r\nIdempotency-Key: k1\r\n".encode()
        for method, path in ((b"POST", b"/v1/generations"), (b"POST", b"/v1/client-metrics"), (b"GET", b"/v1/usage")):
            reader, writer = await connect(port)
            writer.write(method + b" " + path + b" HTTP/1.1\r\nHost: edge\r\n" + auth + b"Content-Length: %d\r\n\r\n" % (cap + 1))
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSE_WAIT_S)
            assert head.startswith(b"HTTP/1.1 400"), (path, head)
            writer.close()
            reader, writer = await connect(port)
            writer.write(method + b" " + path + b" HTTP/1.1\r\nHost: edge\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n")
            writer.write(b"%x\r\n" % (cap + 1) + b"x" * (cap + 1) + b"\r\n")  # never the last, empty chunk
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSE_WAIT_S)
            assert head.startswith(b"HTTP/1.1 400"), (path, head)
            writer.close()
