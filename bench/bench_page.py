"""The web page's first-token time against the API's, in the same run. A script,
not a test.

    .venv/bin/python bench/bench_page.py            # 30 turns each way
    .venv/bin/python bench/bench_page.py --turns 10

One bench/stackrun.py stack (its own broker and Cassandra; a processor, a read model, a history
writer, a sim worker, one edge). Turns alternate, each waiting for the previous to end:

- page: headless Debian chromium (selenium), signed in through the development form, types a message
  and presses Enter in its own conversation; the figure is the page's own, Enter (keydown) -> the
  frame that shows the first token (``data-first-token-ms``, what the page also beacons);
- raw: an httpx client sends a turn in its own conversation, POST -> first ``generation.text.delta``
  bytes read.

The page's overhead is the difference of the two distributions (the target: under 20 ms at p50).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_stack import SIM_ENV, pct  # noqa: E402
from bench.stackrun import Stack  # noqa: E402
from schemas.codes import Tier  # noqa: E402

MODEL = "simulated-text-model"


def page_turns(url: str, user: str, turns: int) -> list[float]:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    from infra.harness.chromium import chromium, wait_for

    out = []
    with chromium() as driver:
        driver.get(url + "/")
        wait_for(lambda: driver.find_element(By.ID, "signin-user").is_displayed(), "no sign-in form")
        Select(driver.find_element(By.ID, "signin-tier")).select_by_value("paid")
        driver.find_element(By.ID, "signin-user").send_keys(user)
        driver.find_element(By.ID, "signin-submit").click()
        wait_for(lambda: driver.find_element(By.ID, "prompt").is_displayed(), "the chat did not open")
        wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, f"#model option[value='{MODEL}']"), "no model list")
        Select(driver.find_element(By.ID, "model")).select_by_value(MODEL)
        for i in range(turns + 1):
            before = len(driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant"))
            driver.find_element(By.ID, "prompt").send_keys(f"Say something, {i}." + Keys.ENTER)

            def done():
                a = driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")
                return len(a) > before and a[-1].get_attribute("data-status") in ("completed", "error", "refused", "incomplete") and a[-1]

            from infra.harness.chromium import console

            def why() -> str:
                a = driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")
                return f"a turn did not end: {[(x.get_attribute('data-status'), x.text[:80]) for x in a]} {console(driver)}"

            answer = wait_for(done, why, timeout_s=60)
            ms = answer.get_attribute("data-first-token-ms")
            wait_for(lambda: driver.find_element(By.ID, "send").is_displayed(), "the page stayed busy")
            if i > 0 and ms:  # the first turn creates the conversation: a warm-up, not counted
                out.append(float(ms))
            yield_to_raw.append(1)
            while len(yield_to_raw) > len(raw_done):
                time.sleep(0.01)
    return out


yield_to_raw: list[int] = []
raw_done: list[int] = []


async def raw_turns(stack: Stack, url: str, turns: int) -> list[float]:
    user = f"raw-{uuid.uuid4().hex[:8]}"
    auth = {"Authorization": f"Bearer {stack.token(user, Tier.PAID)}"}
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        conv = (await http.post("/v1/conversations", json={"title": "raw"}, headers={**auth, "Idempotency-Key": uuid.uuid4().hex})).json()
        revision = conv["revision"]
        for i in range(turns + 1):
            while len(yield_to_raw) <= len(raw_done):  # alternate with the page
                await asyncio.sleep(0.01)
            body = {"model": MODEL, "stream": True, "max_output_tokens": 512, "conversation_id": conv["id"],
                    "expected_revision": revision, "messages": [{"role": "user", "content": f"Say something, {i}."}]}
            t0 = time.monotonic()
            first = None
            text = ""
            async with http.stream("POST", "/v1/generations", json=body, headers={**auth, "Idempotency-Key": uuid.uuid4().hex}) as r:
                async for chunk in r.aiter_text():
                    if first is None and "generation.text.delta" in chunk:
                        first = (time.monotonic() - t0) * 1000
                    text += chunk
            # The user turn committed at created.revision; its answer at the next (the store can lag).
            created = next(json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and '"revision"' in line)
            revision = created["revision"] + 1
            if i > 0 and first is not None:
                out.append(first)
            raw_done.append(1)
    return out


async def bench(args: argparse.Namespace, work: Path) -> None:
    env = {**SIM_ENV, "CHATPLANE_SIM_OUTPUT_TOKENS": 12}
    stack = Stack(work, namespace=f"page{uuid.uuid4().hex[:6]}", processors=1, workers=1, edges=1, readmodels=1, histories=1, env=env)
    await stack.start()
    try:
        url = stack.edge_urls[0]
        page_task = asyncio.to_thread(page_turns, url, f"page-{uuid.uuid4().hex[:8]}", args.turns)
        page, raw = await asyncio.gather(page_task, raw_turns(stack, url, args.turns))
        print(f"first token, {len(page)} page turns and {len(raw)} raw turns, alternating, one stack (conversation turns):")
        print(f"   page: Enter -> first token painted   p50 {pct(page, .5):7.1f} ms  p90 {pct(page, .9):7.1f} ms")
        print(f"   raw:  POST -> first delta read        p50 {pct(raw, .5):7.1f} ms  p90 {pct(raw, .9):7.1f} ms")
        print(f"   page overhead at p50: {pct(page, .5) - pct(raw, .5):+.1f} ms (target: under 20 ms)")
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="chatplane-bench-page-") as work:
        asyncio.run(bench(args, Path(work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
