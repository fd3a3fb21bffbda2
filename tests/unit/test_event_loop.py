"""infra.runtime.event_loop: every process runs uvloop unless CHATPLANE_EVENT_LOOP=asyncio (each case in
a fresh interpreter: the policy is process-wide, and the test process keeps its own loop)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import asyncio
from infra.runtime.event_loop import use_event_loop
kind = use_event_loop()
async def running():
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
print(kind, asyncio.run(running()))
"""


def run(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CHATPLANE_")}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                          env={**base, **env}, timeout=60)


def test_uvloop_by_default():
    out = run()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["uvloop", "uvloop"]


def test_the_standard_loop_on_request():
    out = run(CHATPLANE_EVENT_LOOP="asyncio")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["asyncio", "asyncio"]


def test_a_bad_value_is_named():
    out = run(CHATPLANE_EVENT_LOOP="libev")
    assert out.returncode != 0
    assert "CHATPLANE_EVENT_LOOP='libev': expected one of uvloop, asyncio" in out.stderr
