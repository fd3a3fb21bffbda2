"""The web page in headless Chromium against the real stack (the page's browser scenarios).

The real processor, ``python -m projections.readmodel``, the history writer, a ``python -m workers
--engine sim`` worker (the one fake: no GPU; it stores its deltas for replay) and ``python -m edge`` in
development mode, on a fresh topology and keyspace. Each scenario saves a screenshot under
``test-artifacts/``:

1. type and see the answer stream, then Stop mid-answer ("stopped" only once the server confirms);
2. a connection dropped before any response, then the page's retry with the same key: one generation,
   one message spent, the text equal to the server's;
3. quota exhausted: the reset time shown, no automatic retry;
4. CORS: a page on another origin streams an answer through a preflighted POST; an origin not on the
   list is refused by the browser.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from infra.harness.chromium import (
    LoopThreadServer,
    answer_status,
    chromium,
    console,
    last_answer,
    screenshot,
    sign_in_dev,
    wait_for,
)
from infra.harness.processes import ProjectionProcess, WorkerProcess
from tests.integration.test_edge_harness import edge_process_factory  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

MODEL = "simulated-text-model"
GRACE_S = 3.0
START_WAIT_S = 60.0


@pytest.fixture
async def stack(kafka_bootstrap, topology, running_processor, cassandra_hosts, cassandra_port, fresh_keyspace, tmp_path,
                edge_process_factory):  # noqa: F811
    cass = {"CHATPLANE_CASSANDRA_HOSTS": ",".join(cassandra_hosts), "CHATPLANE_CASSANDRA_PORT": str(cassandra_port),
            "CHATPLANE_CASSANDRA_KEYSPACE": fresh_keyspace}
    projection = ProjectionProcess(kafka_bootstrap, topology.namespace, tmp_path, **cass)
    writer = ProjectionProcess(kafka_bootstrap, topology.namespace, tmp_path, module="projections.history", **cass)
    # 150 tokens at 40 ms: about 6 s per answer, long enough to press Stop after the first words on a
    # loaded machine.
    worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_WORKER_RESULT_STORE="cassandra",
                           CHATPLANE_SIM_TTFT_MS=20, CHATPLANE_SIM_INTER_TOKEN_MS=40, CHATPLANE_SIM_OUTPUT_TOKENS=150, **cass)
    for p in (projection, writer, worker):
        p.start()
    deadline = time.monotonic() + START_WAIT_S
    while "history: started" not in writer.log_text():
        assert writer.alive() and time.monotonic() < deadline, writer.log_text()
        await asyncio.sleep(0.1)
    edge = edge_process_factory(CHATPLANE_EDGE_READ_MODEL="1", CHATPLANE_EDGE_DISCONNECT_GRACE_S=str(GRACE_S),
                                CHATPLANE_EDGE_BUCKET_CAPACITY="1000", **cass)
    await edge.start()
    try:
        yield edge
    finally:
        worker.stop()
        writer.stop()
        projection.stop()


def choose_model(driver: Any) -> None:
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, f"#model option[value='{MODEL}']"), "the model list did not load")
    Select(driver.find_element(By.ID, "model")).select_by_value(MODEL)


def send(driver: Any, text: str) -> None:
    driver.find_element(By.ID, "prompt").send_keys(text + Keys.ENTER)


def answer_text(driver: Any) -> str:
    a = last_answer(driver)
    return a.find_element(By.CSS_SELECTOR, ".body").get_attribute("textContent") if a is not None else ""


def wait_status(driver: Any, *statuses: str, timeout_s: float = 60.0) -> str:
    return wait_for(lambda: answer_status(driver) in statuses and answer_status(driver),
                    lambda: f"status {answer_status(driver)!r}, not {statuses}: {console(driver)}", timeout_s=timeout_s)


def usage(edge: Any, user: str) -> dict[str, Any]:
    return httpx.get(f"{edge.url}/v1/usage", headers=edge.headers(user), timeout=10).json()["quota"]


def generation(edge: Any, user: str, gid: str) -> dict[str, Any]:
    r = httpx.get(f"{edge.url}/v1/generations/{gid}", headers=edge.headers(user), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def output_text(doc: dict[str, Any]) -> str:
    return "".join(o.get("text", "") for o in doc.get("output") or [])


def wait_terminal(edge: Any, user: str, gid: str) -> dict[str, Any]:
    return wait_for(lambda: (d := generation(edge, user, gid))["status"] in ("completed", "cancelled", "failed") and d,
                    f"{gid} did not end", timeout_s=60)


async def test_type_and_see_the_answer_stream_then_stop_mid_answer(stack):
    edge = stack

    def scenario() -> None:
        with chromium() as driver:
            sign_in_dev(driver, edge.url, "alice")
            choose_model(driver)
            send(driver, "Name three colors.")
            # Streaming: some text is on the page before the answer is complete.
            wait_for(lambda: answer_text(driver) and answer_status(driver) == "streaming",
                     lambda: f"no streaming text: {answer_status(driver)} {console(driver)}")
            wait_status(driver, "completed")
            screenshot(driver, "page-stream")
            first = last_answer(driver)
            gid = first.get_attribute("data-generation-id")
            doc = wait_terminal(edge, "alice", gid)
            assert doc["status"] == "completed" and answer_text(driver) == output_text(doc), (doc, answer_text(driver))
            # The turn is a conversation: in the sidebar, and its messages are the page's.
            wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#conversations li"), "no conversation in the sidebar")
            assert "Name three colors." in driver.find_element(By.CSS_SELECTOR, "#conversations li a").text
            wait_for(lambda: driver.find_element(By.ID, "usage").get_attribute("data-used") == "1", "usage did not show 1 used")

            # Stop mid-answer: "stopping" until the server confirms, then "stopped".
            send(driver, "Tell me a story.")
            wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) == 2 and answer_text(driver),
                     "the second answer did not start")
            driver.find_element(By.ID, "stop").click()
            wait_status(driver, "stopped", timeout_s=30)
            screenshot(driver, "page-stop")
            gid = last_answer(driver).get_attribute("data-generation-id")
            doc = wait_terminal(edge, "alice", gid)
            assert doc["status"] == "cancelled", doc
            # The partial text is kept, and Regenerate is offered (a new request, never appended).
            assert answer_text(driver).startswith("sim-token-1"), answer_text(driver)
            assert last_answer(driver).find_elements(By.CSS_SELECTOR, "button.regenerate")
            assert driver.find_element(By.ID, "send").is_displayed()

    await asyncio.to_thread(scenario)


class DroppingProxy(LoopThreadServer):
    """A TCP proxy in front of the edge that, when armed, loses the next ``POST /v1/generations``: the
    request reaches the edge, then both connections close before any response byte reaches the page."""

    FORWARD_AFTER_HEAD_S = 0.5

    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port
        self.armed = False
        self.dropped = 0

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        dropping = asyncio.Event()

        async def up() -> None:
            while data := await creader.read(65536):
                uwriter.write(data)
                await uwriter.drain()
                if self.armed and b"POST /v1/generations " in data:
                    self.armed = False
                    dropping.set()
                    self.loop.call_later(self.FORWARD_AFTER_HEAD_S, lambda: (cwriter.transport.abort(), uwriter.transport.abort()))
                    self.dropped += 1

        async def down() -> None:
            while data := await ureader.read(65536):
                if dropping.is_set():
                    continue  # lost on the way: the page never sees a byte of this response
                cwriter.write(data)
                await cwriter.drain()

        with contextlib.suppress(Exception):
            await asyncio.gather(up(), down())
        for w in (cwriter, uwriter):
            w.transport.abort()


async def test_a_dropped_connection_then_the_retry_with_the_same_key_is_one_generation_and_one_message(stack):
    edge = stack

    def scenario() -> None:
        with DroppingProxy(edge.port) as proxy, chromium() as driver:
            sign_in_dev(driver, proxy.url, "carol")
            choose_model(driver)
            proxy.armed = True
            send(driver, "Name three colors.")
            wait_status(driver, "completed", timeout_s=60)
            screenshot(driver, "page-dropped-then-retried")
            assert proxy.dropped == 1
            answer = last_answer(driver)
            gid = answer.get_attribute("data-generation-id")
            doc = wait_terminal(edge, "carol", gid)
            assert doc["status"] == "completed" and answer_text(driver) == output_text(doc)
            # One message spent: the retry was the same logical request.
            quota = wait_for(lambda: (q := usage(edge, "carol"))["reserved"] == 0 and q, "a reservation stayed open")
            # The whole document (its window_start included) if this ever fails: pytest elides a dict.
            assert quota["used"] == 1, json.dumps(quota)
            assert len(driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) == 1

    await asyncio.to_thread(scenario)


async def test_quota_exhausted_shows_the_reset_time_and_is_not_retried(stack):
    edge = stack
    user = "dave"
    limit = usage(edge, user)["limit"]
    with httpx.Client(base_url=edge.url, timeout=30) as http:
        for _ in range(limit):
            r = http.post("/v1/generations", headers=edge.headers(user, uuid.uuid4().hex),
                          json={"model": MODEL, "max_output_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text

    def refusals() -> float:
        text = httpx.get(f"{edge.url}/metrics", timeout=10).text
        line = [ln for ln in text.splitlines() if ln.startswith('chatplane_edge_admissions_total{code="quota_exhausted"}')]
        return float(line[0].split()[-1]) if line else 0.0

    def scenario() -> None:
        with chromium() as driver:
            sign_in_dev(driver, edge.url, user)
            choose_model(driver)
            wait_for(lambda: driver.find_element(By.ID, "usage").get_attribute("data-remaining") == "0", "usage did not show 0 left")
            send(driver, "One more?")
            wait_status(driver, "refused")
            answer = last_answer(driver)
            reset_at = usage(edge, user)["reset_at"]
            assert answer.get_attribute("data-code") == "quota_exhausted"
            assert answer.get_attribute("data-reset-at") == reset_at
            assert "resets" in answer.find_element(By.CSS_SELECTOR, ".state").text
            screenshot(driver, "page-quota-exhausted")
            time.sleep(2.0)  # longer than any automatic retry would wait
            assert refusals() == 1.0
            assert answer_status(driver) == "refused" and not answer.find_elements(By.CSS_SELECTOR, "button.retry")

    await asyncio.to_thread(scenario)


CROSS_ORIGIN_SCRIPT = """
const [api, token, model, done] = [arguments[0], arguments[1], arguments[2], arguments[arguments.length - 1]];
(async () => {
  try {
    const resp = await fetch(api + "/v1/generations", {
      method: "POST",
      headers: {"Authorization": "Bearer " + token, "Content-Type": "application/json", "Idempotency-Key": crypto.randomUUID()},
      body: JSON.stringify({model, stream: true, max_output_tokens: 8, messages: [{role: "user", content: "hi"}]}),
    });
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let text = "";
    for (;;) { const {value, done: end} = await reader.read(); if (end) break; text += dec.decode(value, {stream: true}); }
    done({status: resp.status, requestId: resp.headers.get("X-Request-Id"), body: text});
  } catch (e) { done({error: String(e)}); }
})();
"""


class StaticOrigin:
    """Another origin: a plain page on its own port (the product's own front end)."""

    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BlankPage)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StaticOrigin:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()


class _BlankPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the handler's name)
        body = b"<!doctype html><title>app</title><p>another origin</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


async def test_cors_a_page_on_an_allowed_origin_streams_an_answer_and_another_origin_is_refused(
    kafka_bootstrap, topology, running_processor, tmp_path, edge_process_factory  # noqa: F811
):
    with StaticOrigin() as allowed, StaticOrigin() as other:
        worker = WorkerProcess(kafka_bootstrap, topology, tmp_path, engine="sim", CHATPLANE_SIM_TTFT_MS=10,
                               CHATPLANE_SIM_INTER_TOKEN_MS=5, CHATPLANE_SIM_OUTPUT_TOKENS=8)
        worker.start()
        edge = edge_process_factory(CHATPLANE_EDGE_CORS_ORIGINS=allowed.url)
        await edge.start()
        token = edge.headers("erin")["Authorization"].split(" ", 1)[1]

        def scenario() -> None:
            with chromium() as driver:
                driver.get(allowed.url + "/")
                got = driver.execute_async_script(CROSS_ORIGIN_SCRIPT, edge.url, token, MODEL)
                assert got.get("status") == 200, got
                assert "event: generation.completed" in got["body"] and got["requestId"], got
                screenshot(driver, "page-cors-allowed-origin")
                driver.get(other.url + "/")
                refused = driver.execute_async_script(CROSS_ORIGIN_SCRIPT, edge.url, token, MODEL)
                assert "error" in refused and "Failed to fetch" in refused["error"], refused

        try:
            await asyncio.to_thread(scenario)
        finally:
            worker.stop()


async def test_two_tabs_sending_at_once_the_late_one_gets_the_conflict_reloads_and_keeps_its_text(stack):
    edge = stack

    def scenario() -> None:
        with chromium() as driver:
            sign_in_dev(driver, edge.url, "frank")
            choose_model(driver)
            send(driver, "First question.")
            wait_status(driver, "completed")
            tab_a = driver.current_window_handle
            # Tab B opens the same conversation at the same revision.
            driver.switch_to.new_window("tab")
            sign_in_dev(driver, edge.url, "frank")  # a token is kept per tab (sessionStorage)
            wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#conversations li a"), "tab B has no sidebar")
            choose_model(driver)
            driver.find_element(By.CSS_SELECTOR, "#conversations li a").click()
            wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 2, "tab B did not load the history")
            tab_b = driver.current_window_handle
            # Tab A sends first; tab B, still at the old revision, sends right after.
            driver.switch_to.window(tab_a)
            send(driver, "From tab A.")
            wait_for(lambda: answer_text(driver), "tab A's answer did not start")
            driver.switch_to.window(tab_b)
            send(driver, "From tab B.")
            notice = wait_for(lambda: (n := driver.find_element(By.ID, "notice")).is_displayed() and n.text, "no notice in tab B")
            assert "changed in another tab" in notice, notice
            # Tab B's text is back in the box, unsent.
            assert driver.find_element(By.ID, "prompt").get_attribute("value") == "From tab B."
            assert "From tab B." not in [m.text for m in driver.find_elements(By.CSS_SELECTOR, "#messages .msg.user")]
            # Once tab A's answer is committed, tab B reloads the conversation, sees it, and sends again.
            driver.switch_to.window(tab_a)
            wait_status(driver, "completed")
            driver.switch_to.window(tab_b)
            driver.find_element(By.CSS_SELECTOR, "#conversations li a").click()
            wait_for(lambda: "From tab A." in [m.text for m in driver.find_elements(By.CSS_SELECTOR, "#messages .msg.user")],
                     "tab B does not show tab A's turn")
            driver.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
            wait_status(driver, "completed")
            users = [m.text for m in driver.find_elements(By.CSS_SELECTOR, "#messages .msg.user")]
            assert users == ["First question.", "From tab A.", "From tab B."], users
            screenshot(driver, "page-two-tabs-conflict")

    await asyncio.to_thread(scenario)
