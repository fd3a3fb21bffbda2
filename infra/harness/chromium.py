"""Headless Chromium for the web page's tests and bench/bench_page.py: Debian's ``chromium`` driven through ``chromium-driver``
by selenium (browser builds cannot be downloaded here; ``.ci/run`` installs both packages).

Each scenario saves a screenshot under ``test-artifacts/`` (``CHATPLANE_TEST_ARTIFACTS`` overrides it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

CHROMIUM = os.environ.get("CHATPLANE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHATPLANE_CHROMEDRIVER", "/usr/bin/chromedriver")
ARTIFACTS = Path(os.environ.get("CHATPLANE_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
WAIT_S = 30.0
POLL_S = 0.05


def require_chromium() -> None:
    """The browser tests need the system browser; without it they fail with how to install it."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    assert not missing, f"{missing} not found: apt-get install chromium chromium-driver (.ci/run does)"


@contextlib.contextmanager
def chromium(width: int = 1200, height: int = 900) -> Iterator[webdriver.Chrome]:
    require_chromium()
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chatplane-chromium-")
    # The flags the machine's notes name: no sandbox as root, and no background connections (the
    # network is closed; Chromium's own calls home would be refused, many at a time).
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={width},{height}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def screenshot(driver: webdriver.Chrome, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def wait_for(what: Callable[[], Any], message: Callable[[], str] | str = "", timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message() if callable(message) else message or "timed out")
        time.sleep(POLL_S)


def console(driver: webdriver.Chrome) -> list[str]:
    try:
        return [e["message"] for e in driver.get_log("browser")]
    except Exception:  # noqa: BLE001 (a driver without the log endpoint)
        return []


def sign_in_dev(driver: webdriver.Chrome, base_url: str, user: str) -> None:
    """The development sign-in form: a user name, no password."""
    driver.get(base_url + "/")
    field = wait_for(lambda: _visible(driver, "signin-user"), "the development sign-in form did not show")
    field.send_keys(user)
    driver.find_element(By.ID, "signin-submit").click()
    wait_for(lambda: _visible(driver, "prompt"), lambda: "the chat did not open: " + driver.find_element(By.ID, "signin-error").text)


def _visible(driver: webdriver.Chrome, element_id: str) -> Any:
    found = driver.find_elements(By.ID, element_id)
    return found[0] if found and found[0].is_displayed() else None


def assistant_turns(driver: webdriver.Chrome) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")


def last_answer(driver: webdriver.Chrome) -> Any:
    turns = assistant_turns(driver)
    return turns[-1] if turns else None


def answer_status(driver: webdriver.Chrome) -> str:
    a = last_answer(driver)
    return a.get_attribute("data-status") if a is not None else ""


class LoopThreadServer:
    """A TCP server on its own event loop in a daemon thread, for the fakes and proxies of these tests;
    subclasses implement ``_serve(reader, writer)``. Leaving the context cancels open connections."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Any:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._cancel_connections(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)

    async def _cancel_connections(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._serve, sock=self.sock))
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
