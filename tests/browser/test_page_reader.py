"""The page's stream reader and its safe Markdown, in headless Chromium, against a fake edge that sends
its event stream one byte per write (``FakeByteEdge``: a fake, named so; the real stack's scenarios are
in test_page_stack.py).

One byte per write splits every event frame and every multi-byte UTF-8 character across reads; some
frames end their lines in CRLF. The answer holds Markdown, a code block, characters of 2, 3 and 4 bytes,
and an ``<img onerror>`` that must be shown as text: no element is created and no script runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import mimetypes
import socket
from pathlib import Path
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from edge.routes.ui import PAGE_HEADERS
from infra.harness.chromium import LoopThreadServer, chromium, console, last_answer, screenshot, sign_in_dev, wait_for

UI = Path(__file__).resolve().parents[2] / "edge" / "ui"
INJECTION = '<img src=x onerror="window.__xss=1">'
ANSWER = (
    "Hello **w\u00f6rld** \u2014 caf\u00e9 \U0001f44b!\n\n"
    f"{INJECTION}\n\n"
    "```\ncode <b>bold?</b> \u00e9\n```\n\n"
    "- first \u2713\n- second [link](javascript:alert(1))\n"
)
# Delta boundaries fall inside words; the byte writer splits characters further.
DELTAS = [ANSWER[i : i + 7] for i in range(0, len(ANSWER), 7)]
BYTE_GAP_S = 0.001


def _sse(events: list[tuple[int, str, dict[str, Any]]]) -> bytes:
    out = b""
    for n, (seq, name, data) in enumerate(events):
        nl = b"\r\n" if n % 3 == 1 else b"\n"
        out += b"id: %d" % seq + nl + b"event: " + name.encode() + nl + b"data: " + json.dumps(data, ensure_ascii=False).encode() + nl + nl
        if n == 2:
            out += b": keep-alive" + nl + nl
    return out


class FakeByteEdge(LoopThreadServer):
    """A fake of the edge's HTTP surface for the page (a thread with its own event loop)."""

    def __init__(self, lagging_history: bool = False) -> None:
        super().__init__()
        self.beacons: list[float] = []
        self.submits: list[dict[str, Any]] = []
        # History available, but its store lags the log: a created conversation is not listed yet.
        self.lagging_history = lagging_history
        self.list_reads = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                if not await self._route(method, path.split("?")[0], body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _respond(self, writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nCache-Control: no-store\r\n"
        for k, v in (extra or {}).items():
            head += f"{k}: {v}\r\n"
        writer.write(head.encode() + b"\r\n" + body)
        await writer.drain()

    async def _json(self, writer: asyncio.StreamWriter, status: int, doc: Any, extra: dict[str, str] | None = None) -> None:
        await self._respond(writer, status, json.dumps(doc).encode(), "application/json", extra)

    async def _route(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if path == "/":
            await self._respond(writer, 200, (UI / "index.html").read_bytes(), "text/html; charset=utf-8", PAGE_HEADERS)
        elif path.startswith("/ui/"):
            f = UI / path[4:]
            await self._respond(writer, 200, f.read_bytes(), mimetypes.guess_type(f.name)[0] or "text/plain")
        elif path == "/dev":
            await self._json(writer, 200, {"dev_mode": True})
        elif path == "/dev/token":
            claims = base64.urlsafe_b64encode(json.dumps({"sub": json.loads(body)["user"]}).encode()).decode().rstrip("=")
            await self._json(writer, 200, {"token": f"fake.{claims}.sig"})
        elif path == "/v1/models":
            await self._json(writer, 200, {"object": "list", "data": [{"id": "fake-model"}]})
        elif path == "/v1/usage":
            await self._json(writer, 200, {"quota": {"limit": 40, "used": len(self.submits), "reserved": 0, "remaining": 40 - len(self.submits),
                                                     "window_start": "2026-12-05T15:00:00Z", "reset_at": "2026-12-05T18:00:00Z"}})
        elif path == "/v1/conversations" and self.lagging_history:
            if method == "POST":
                await self._json(writer, 201, {"id": "conv_fake", "object": "conversation", "title": json.loads(body)["title"], "revision": 0})
            else:
                self.list_reads += 1
                await self._json(writer, 200, {"object": "list", "data": [], "next_cursor": None})
        elif path.startswith("/v1/conversations/") and self.lagging_history:
            error = {"code": "conversation_not_found", "message": "No such conversation.", "retryable": False, "details": {}}
            await self._json(writer, 404, {"error": error})
        elif path == "/v1/conversations":
            error = {"code": "history_unavailable", "message": "History is unavailable.", "retryable": True, "action": "retry", "details": {}}
            await self._json(writer, 503, {"error": error}, {"Retry-After": "1"})
        elif path == "/v1/client-metrics":
            self.beacons.append(json.loads(body)["first_token_ms"])
            await self._respond(writer, 204, b"", "text/plain")
        elif path == "/v1/generations" and method == "POST":
            self.submits.append(json.loads(body))
            await self._stream(writer)
            return False
        else:
            await self._json(writer, 404, {"error": {"code": "not_found", "message": "no", "details": {}}})
        return True

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        events: list[tuple[int, str, dict[str, Any]]] = [(0, "generation.created", {"generation_id": "gen_fake", "sequence": 0, "status": "queued"})]
        for i, d in enumerate(DELTAS, start=1):
            events.append((i, "generation.text.delta", {"generation_id": "gen_fake", "sequence": i, "index": i - 1, "delta": d}))
        events.append((0, "generation.completed", {"generation_id": "gen_fake", "sequence": 0, "usage": {"input_tokens": 3, "output_tokens": len(DELTAS)}}))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n")
        await writer.drain()
        for b in _sse(events):
            writer.write(bytes([b]))
            await writer.drain()
            await asyncio.sleep(BYTE_GAP_S)


def test_page_renders_a_one_byte_per_write_stream_as_safe_markdown_and_reports_first_token():
    with FakeByteEdge() as fake, chromium() as driver:
        sign_in_dev(driver, fake.url, "reader")
        prompt = driver.find_element(By.ID, "prompt")
        prompt.send_keys('Show me <img src=x onerror="window.__xss=2">' + Keys.ENTER)
        wait_for(lambda: (last_answer(driver) is not None and last_answer(driver).get_attribute("data-status") == "completed"),
                 lambda: f"no completed answer: {console(driver)}", timeout_s=90)
        screenshot(driver, "page-one-byte-stream")
        answer = last_answer(driver)
        body = answer.find_element(By.CSS_SELECTOR, ".body")
        text = body.get_attribute("textContent")
        # Every character arrived whole, in order, once.
        assert "Hello w\u00f6rld \u2014 caf\u00e9 \U0001f44b!" in text, text
        assert "first \u2713" in text and "code <b>bold?</b> \u00e9" in text, text
        # Markdown became elements; the injected markup stayed characters.
        assert body.find_element(By.CSS_SELECTOR, "strong").text == "w\u00f6rld"
        assert body.find_element(By.CSS_SELECTOR, "pre code").get_attribute("textContent") == "code <b>bold?</b> \u00e9"
        assert INJECTION in text, text
        assert driver.find_elements(By.CSS_SELECTOR, "#messages img, #messages b") == []
        # The javascript: link is not a link.
        assert body.find_elements(By.CSS_SELECTOR, "a") == [] and "[link](javascript:alert(1))" in text
        user = driver.find_elements(By.CSS_SELECTOR, "#messages .msg.user")[-1]
        assert user.text == 'Show me <img src=x onerror="window.__xss=2">'
        assert driver.execute_script("return window.__xss === undefined")
        # The request: a fresh key, stateless (history unavailable), the user's turn last.
        assert fake.submits[-1]["messages"][-1] == {"role": "user", "content": 'Show me <img src=x onerror="window.__xss=2">'}
        assert answer.get_attribute("data-key")
        # The content-free beacon: one number, at least the time the first frame took to arrive.
        wait_for(lambda: fake.beacons, "no first-token beacon")
        assert 0 < fake.beacons[0] < 60_000 and float(answer.get_attribute("data-first-token-ms")) > 0


def test_a_new_conversation_stays_in_the_sidebar_while_the_store_has_not_listed_it_yet():
    # The history writer fills the list from the log, so right after a turn the list can lack the
    # conversation the page just created (seen on a loaded CI machine): the page keeps it.
    with FakeByteEdge(lagging_history=True) as fake, chromium() as driver:
        sign_in_dev(driver, fake.url, "lagged")
        driver.find_element(By.ID, "prompt").send_keys("Name three colors." + Keys.ENTER)
        wait_for(lambda: (last_answer(driver) is not None and last_answer(driver).get_attribute("data-status") == "completed"),
                 lambda: f"no completed answer: {console(driver)}", timeout_s=90)
        assert fake.submits[-1]["conversation_id"] == "conv_fake", fake.submits[-1]
        # The page re-read the (lagging) list after the turn; the conversation is still there.
        wait_for(lambda: fake.list_reads >= 2, "the page did not re-read the list after the turn")
        items = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#conversations li a"), "no conversation in the sidebar")
        assert [a.text for a in items] == ["Name three colors."]
