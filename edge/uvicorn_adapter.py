"""uvicorn internals the edge relies on, in one place: the HTTP/1.1 protocol with two bounds added.

Where this sits: ``python -m edge`` (``edge.__main__.uvicorn_config``) hands ``bounded_h11_protocol(...)``
to ``uvicorn.Config(http=...)``; uvicorn builds one instance per accepted TCP connection, and the
instance parses requests with h11 and runs the FastAPI app (``edge.app``) for each.

What uvicorn 0.54 does, and why the edge extends it (slow request heads were never dropped):

- **No bound on reading a request head.** ``H11Protocol`` arms a timer only after a response
  (``timeout_keep_alive``, on an idle kept-alive connection) and cancels it at the next byte. A client
  that connects and sends nothing, or half a head, or one byte a second, holds its socket (and a file
  descriptor, and a place in ``server_state.connections``) for ever: one such client per file
  descriptor is enough to stop the edge accepting. uvicorn has no option for it (``h11_max_incomplete_event_size``
  bounds the head's bytes, not its time). Here a timer of ``head_timeout_s`` is armed when a head is
  awaited (at ``connection_made``; on a kept-alive connection, at the first byte of the next request)
  and cancelled once h11 has read the whole head (its ``their_state`` leaves ``IDLE``). More bytes do
  not extend it, so trickling does not either. When it fires the connection is closed without an
  answer, the way uvicorn closes an idle kept-alive one. The time to read a body is not bounded here
  (the app reads the body and bounds its size).
- **The connection bound counts too late.** ``limit_concurrency`` compares the open connections and
  tasks with the limit only once a request head has been read, then answers that request 503 and keeps
  the connection; connections that never finish a head are never refused. Here a connection accepted
  while ``connections_max`` are already open is answered at once with ``refusal()`` (a complete HTTP
  response: the edge's typed 503) and closed, before anything is read. A client that had already sent
  its request may see a reset instead of the 503; either way it is refused.
- **A request head's size is bounded only by chance, and the refusal is plain text.** h11 checks
  ``max_incomplete_event_size`` only while a head is incomplete, so a 100 KB head that arrived in one
  read was served while a 200 KB one, read in two, got uvicorn's plain-text ``400 Invalid HTTP request
  received.``. Here a head (request line and headers, up to its blank line) longer than
  ``head_bytes_max`` is refused however it arrives, before h11 parses it, and every answer to a request
  that is not HTTP/1.1 (``send_400_response``) is ``bad_request(reason)``: the edge's typed JSON 400,
  then the close. The close lingers (up to ``LINGER_S`` and ``LINGER_BYTES_MAX`` of what the client
  still sends, read and dropped) so that the client reads the answer instead of a reset. A pipelined
  request read while the one before it is answered is bounded by h11's own check only
  (``h11_max_incomplete_event_size``, set to the same bound).

The subclass relies on these parts of ``uvicorn.protocols.http.h11_impl.H11Protocol`` (checked by
``tests/unit/test_uvicorn_contract.py``): ``self.connections`` is the server-wide set of open
connections (``server_state.connections``), which ``connection_made`` adds to and ``connection_lost``
discards from; ``self.loop`` is the running loop; ``self.transport`` is set by ``connection_made``;
``self.conn`` is the ``h11.Connection`` and ``data_received`` feeds it and handles every complete
event before returning; ``conn.trailing_data`` holds the bytes of a head not yet parsed whole;
``handle_events`` answers an ``h11.RemoteProtocolError`` by calling ``send_400_response``; the idle-close pattern ``conn.send(h11.ConnectionClosed())`` +
``transport.close()`` (``timeout_keep_alive_handler``). And on ``uvicorn.Config(http=<class>)``
using the class as given. The class is named explicitly, so installing httptools (which ``http="auto"``
would prefer) does not silently drop the bounds.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# Why the edge closed a connection itself (the label values of chatplane_edge_connections_closed_total).
HEAD_TIMEOUT = "head_timeout"
CONNECTIONS_MAX = "connections_max"
HEAD_BYTES = "head_bytes"  # a request head over head_bytes_max
MALFORMED = "malformed"  # bytes h11 could not read as an HTTP/1.1 request
CLOSE_REASONS = (HEAD_TIMEOUT, CONNECTIONS_MAX, HEAD_BYTES, MALFORMED)
# After a typed 400 of its own the edge reads and drops what the client still sends, at most this long
# and this much, before it closes: closing with unread bytes would send a reset, which can destroy the
# answer before the client reads it.
LINGER_S = 2.0
LINGER_BYTES_MAX = 1024 * 1024
# The blank line that ends a request head, as h11 finds it (a bare LF is accepted as a line end).
_HEAD_END = re.compile(rb"\n\r?\n")


def _ignore(reason: str) -> None:
    return None


class BoundedH11Protocol(H11Protocol):
    """``H11Protocol`` that drops a connection whose request head is not read in time, and refuses
    connections beyond a bound at accept. Configure it with ``bounded_h11_protocol``."""

    head_timeout_s: ClassVar[float] = 10.0
    connections_max: ClassVar[int | None] = None  # None: no bound
    refusal: ClassVar[Callable[[], bytes] | None] = None  # the bytes a refused connection gets
    head_bytes_max: ClassVar[int | None] = None  # None: h11's own check only
    bad_request: ClassVar[Callable[[str], bytes] | None] = None  # HEAD_BYTES / MALFORMED -> the typed 400
    on_close: ClassVar[Callable[[str], None]] = staticmethod(_ignore)  # with HEAD_TIMEOUT or CONNECTIONS_MAX

    _head_timer: asyncio.TimerHandle | None = None
    _lingering_bytes: int | None = None  # set once a typed 400 is sent: the bytes dropped since

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # Counted before uvicorn adds this one: the bound is on connections open besides it.
        over = self.connections_max is not None and len(self.connections) >= self.connections_max
        super().connection_made(transport)
        if over:
            self.on_close(CONNECTIONS_MAX)
            if self.refusal is not None:
                transport.write(self.refusal())
            transport.close()  # flushes the refusal first; connection_lost removes it from the set
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering_bytes is not None:
            self._lingering_bytes += len(data)
            if self._lingering_bytes > LINGER_BYTES_MAX:
                self.transport.close()
            return
        if self.head_bytes_max is not None and self.conn.their_state is h11.IDLE and self._head_too_large(data):
            self._answer_bad_request(HEAD_BYTES)
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            # Still waiting for a whole head: on a kept-alive connection the first byte of the next
            # request starts its clock. An armed timer is left as it is (more bytes do not extend it).
            if self._head_timer is None and not self.transport.is_closing():
                self._arm_head_timer()
        elif self._head_timer is not None:
            self._cancel_head_timer()

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the head these bytes continue (or start) passes ``head_bytes_max``: its end lies
        beyond the bound, or is not in sight while the bytes so far already pass it."""
        limit = self.head_bytes_max
        assert limit is not None
        buffered = self.conn.trailing_data[0]
        if buffered:
            data = buffered + data  # a head split across reads; h11 keeps at most the bound of it
        end = _HEAD_END.search(data, 0, limit + 2)
        return end.end() > limit if end is not None else len(data) > limit

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse, typed (the edge's JSON 400) when configured."""
        if self.bad_request is None:
            super().send_400_response(msg)
            return
        self._answer_bad_request(MALFORMED)

    def _answer_bad_request(self, reason: str) -> None:
        self.on_close(reason)
        self._cancel_head_timer()
        # Written only while no response has begun on this connection; either way it is closed.
        answered = self.bad_request is not None and self.conn.our_state is h11.IDLE and not self.transport.is_closing()
        if answered:
            assert self.bad_request is not None
            self.transport.write(self.bad_request(reason))
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass  # h11 is mid-message; the socket closes all the same
        if not answered or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()  # the answer, then the end: the client reads both, then we close
        self._lingering_bytes = 0
        self.loop.call_later(LINGER_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.on_close(HEAD_TIMEOUT)
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass  # h11 is in a state where it cannot record the close; the socket closes all the same
        self.transport.close()


def bounded_h11_protocol(
    *,
    head_timeout_s: float,
    connections_max: int | None,
    refusal: Callable[[], bytes] | None = None,
    on_close: Callable[[str], None] | None = None,
    head_bytes_max: int | None = None,
    bad_request: Callable[[str], bytes] | None = None,
) -> type[BoundedH11Protocol]:
    """A ``BoundedH11Protocol`` subclass with these bounds, for ``uvicorn.Config(http=...)``.

    Args:
        head_timeout_s: the time to read a whole request head, from the connection's accept (or, on a
            kept-alive connection, from the first byte of the next request).
        connections_max: connections open at once; the next one is refused at accept (None: no bound).
        refusal: the complete HTTP response a refused connection is sent before it is closed.
        on_close: called with the reason (``CLOSE_REASONS``) when the edge closes a connection.
        head_bytes_max: the most bytes a request head may have (None: h11's own check only).
        bad_request: the complete HTTP response to a head over the bound (``HEAD_BYTES``) or to bytes
            that are not an HTTP/1.1 request (``MALFORMED``), sent before the close (None: uvicorn's).
    """
    assert head_timeout_s > 0, head_timeout_s
    assert connections_max is None or connections_max >= 1, connections_max
    return type(
        "EdgeH11Protocol",
        (BoundedH11Protocol,),
        {
            "head_timeout_s": head_timeout_s,
            "connections_max": connections_max,
            "refusal": staticmethod(refusal) if refusal is not None else None,
            "on_close": staticmethod(on_close or _ignore),
            "head_bytes_max": head_bytes_max,
            "bad_request": staticmethod(bad_request) if bad_request is not None else None,
        },
    )
