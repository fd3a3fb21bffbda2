"""Contract tests: what ``edge/uvicorn_adapter.py`` relies on in uvicorn's h11 protocol (and h11).

Each test checks one reliance named in the adapter's docstring against the installed uvicorn, on
in-memory objects (a protocol instance over ``FakeTransport``, no socket). When an upgrade fails one
of these, read the adapter before changing either. The same bounds on a real socket:
``tests/unit/test_edge_connections.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import tomllib
from pathlib import Path
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from edge.uvicorn_adapter import CONNECTIONS_MAX, HEAD_BYTES, HEAD_TIMEOUT, MALFORMED, BoundedH11Protocol, bounded_h11_protocol

ROOT = Path(__file__).resolve().parents[2]
HEAD = b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n"


class FakeTransport(asyncio.Transport):
    """Stands in for a socket transport: records writes and the close."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def protocol(cls: type[H11Protocol], state: ServerState | None = None) -> H11Protocol:
    config = uvicorn.Config(app, http=cls, lifespan="off", log_level="warning")
    config.load()
    return config.http_protocol_class(config=config, server_state=state or ServerState(), app_state={})  # type: ignore[call-arg]


def test_uvicorn_is_at_the_pin_the_adapter_was_checked_against():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if re.match(r"uvicorn\b", d)]
    assert pin == f"uvicorn=={uvicorn.__version__}", "the venv is not at the pin"


def test_config_uses_a_protocol_class_given_as_http_as_it_is():
    cls = bounded_h11_protocol(head_timeout_s=1.0, connections_max=None)
    config = uvicorn.Config(app, http=cls)
    config.load()
    assert config.http_protocol_class is cls


def test_the_protocol_is_built_with_config_server_state_and_app_state():
    params = list(inspect.signature(H11Protocol.__init__).parameters)
    assert params[:4] == ["self", "config", "server_state", "app_state"]


async def test_connection_made_and_lost_maintain_the_server_wide_connection_set():
    state = ServerState()
    proto = protocol(H11Protocol, state)
    assert proto.connections is state.connections
    assert proto.loop is asyncio.get_running_loop()
    transport = FakeTransport()
    proto.connection_made(transport)
    assert proto.transport is transport and proto in state.connections
    proto.connection_lost(None)
    assert proto not in state.connections


async def test_h11_stays_idle_until_data_received_completes_a_head_and_handles_it_at_once():
    proto = protocol(H11Protocol)
    proto.connection_made(FakeTransport())
    assert isinstance(proto.conn, h11.Connection) and proto.conn.their_state is h11.IDLE
    proto.data_received(HEAD[:20])
    assert proto.conn.their_state is h11.IDLE
    proto.data_received(HEAD[20:])
    assert proto.conn.their_state in (h11.SEND_BODY, h11.DONE), "the head is handled before data_received returns"
    assert len(proto.tasks) == 1  # the app runs for it
    await asyncio.gather(*proto.tasks)
    proto.connection_lost(None)


async def test_the_idle_close_records_connection_closed_then_closes_the_transport():
    proto = protocol(H11Protocol)
    transport = FakeTransport()
    proto.connection_made(transport)
    proto.data_received(HEAD[:10])
    proto.conn.send(h11.ConnectionClosed())  # allowed while no request was read (uvicorn's keep-alive close)
    transport.close()
    proto.connection_lost(None)  # and uvicorn's connection_lost copes with it
    assert proto.conn.our_state is h11.CLOSED


async def test_the_adapter_arms_at_accept_cancels_on_a_whole_head_and_closes_a_late_one():
    closes: list[str] = []
    cls = bounded_h11_protocol(head_timeout_s=0.05, connections_max=None, on_close=closes.append)
    assert issubclass(cls, BoundedH11Protocol) and issubclass(cls, H11Protocol)
    on_time, late = protocol(cls), protocol(cls)
    on_time_transport, late_transport = FakeTransport(), FakeTransport()
    on_time.connection_made(on_time_transport)
    late.connection_made(late_transport)
    on_time.data_received(HEAD)
    late.data_received(HEAD[:20])
    await asyncio.sleep(0.2)
    await asyncio.gather(*on_time.tasks)
    assert late_transport.closed and late_transport.written == b"" and closes == [HEAD_TIMEOUT]
    assert on_time_transport.written.startswith(b"HTTP/1.1 204")  # answered, not timed out
    on_time.connection_lost(None)
    late.connection_lost(None)


async def test_the_adapter_refuses_a_connection_over_the_bound_with_its_refusal():
    closes: list[str] = []
    state = ServerState()
    cls = bounded_h11_protocol(head_timeout_s=5.0, connections_max=1, refusal=lambda: b"REFUSED", on_close=closes.append)
    first, second = protocol(cls, state), protocol(cls, state)
    first_transport, second_transport = FakeTransport(), FakeTransport()
    first.connection_made(first_transport)
    second.connection_made(second_transport)
    assert not first_transport.closed
    assert second_transport.closed and second_transport.written == b"REFUSED" and closes == [CONNECTIONS_MAX]
    second.connection_lost(None)
    first.connection_lost(None)
    assert not state.connections


class EofTransport(FakeTransport):
    """A ``FakeTransport`` that can half-close, as a socket transport can."""

    eof = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True


async def test_h11_keeps_an_unfinished_head_in_trailing_data_and_uvicorn_answers_bad_bytes_through_send_400_response():
    proto = protocol(H11Protocol)
    proto.connection_made(FakeTransport())
    proto.data_received(HEAD[:20])
    assert proto.conn.trailing_data[0] == HEAD[:20]  # the adapter measures a split head by it
    proto.connection_lost(None)
    called: list[str] = []
    cls = type("Spy", (H11Protocol,), {"send_400_response": lambda self, msg: called.append(msg)})
    spy = protocol(cls)
    spy.connection_made(FakeTransport())
    spy.data_received(b"NOT HTTP\x00\r\n\r\n")
    assert called, "uvicorn no longer answers a protocol error through send_400_response"
    spy.connection_lost(None)


async def test_h11_max_incomplete_event_size_reaches_the_h11_connection():
    # Async so that the protocol finds the running loop whatever an earlier test left as the current one.
    config = uvicorn.Config(app, http=H11Protocol, lifespan="off", h11_max_incomplete_event_size=12_345)
    config.load()
    proto = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})  # type: ignore[call-arg]
    assert proto.conn._max_incomplete_event_size == 12_345


async def test_the_adapter_answers_a_head_over_its_bound_and_bad_bytes_with_its_typed_answer_then_lingers():
    closes: list[str] = []
    cls = bounded_h11_protocol(
        head_timeout_s=5.0, connections_max=None, on_close=closes.append, head_bytes_max=1024,
        bad_request=lambda reason: f"TYPED {reason}".encode(),
    )
    for data, reason in ((b"GET / HTTP/1.1\r\nX: " + b"a" * 2000 + b"\r\n\r\n", HEAD_BYTES), (b"NOT HTTP\x00\r\n\r\n", MALFORMED)):
        proto = protocol(cls)
        transport = EofTransport()
        proto.connection_made(transport)
        proto.data_received(data)
        assert transport.written == f"TYPED {reason}".encode() and transport.eof and closes[-1] == reason
        proto.data_received(b"more the client still sends")  # read and dropped, never parsed
        assert transport.written == f"TYPED {reason}".encode() and not proto.tasks
        proto.connection_lost(None)
