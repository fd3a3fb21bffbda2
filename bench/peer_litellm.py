"""LiteLLM's proxy as the peer of bench/bench_stack.py (``--peer litellm``): same load, same machine.

The proxy (``litellm[proxy]==1.106.12``, pinned so runs compare) is installed by this script into its own
virtual environment (``--peer-venv``, default ``~/.cache/chatplane/litellm-1.106.12``), never into
chatplane's: it is a yardstick, not a dependency. It runs ``litellm --config`` with one model routed to
bench/fake_openai.py (a FAKE model server with the ``sim`` engine's timing), a master key and no
database, with ``--peer-workers`` worker processes (its limits would then be per process, not global).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stackrun import free_port  # noqa: E402

LITELLM_VERSION = "1.106.12"
DEFAULT_VENV = Path.home() / ".cache" / "chatplane" / f"litellm-{LITELLM_VERSION}"
MASTER_KEY = "sk-chatplane-bench"  # the proxy's admin key for this throwaway run, not a secret of ours
START_TIMEOUT_S = 180.0
INSTALL_TIMEOUT_S = 1_800.0


def ensure_venv(venv: Path) -> Path:
    """The proxy's ``litellm`` executable, installing it first when the venv does not have it."""
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return exe
    print(f"[peer] installing litellm[proxy]=={LITELLM_VERSION} into {venv} (once; a few minutes)", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=INSTALL_TIMEOUT_S)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"], check=True,
                   timeout=INSTALL_TIMEOUT_S)
    return exe


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


class LiteLLMPeer:
    def __init__(self, work_dir: Path, venv: Path, workers: int, model: str, ttft_ms: float, inter_token_ms: float) -> None:
        self.work_dir, self.venv, self.workers, self.model = work_dir, venv, workers, model
        self.ttft_ms, self.inter_token_ms = ttft_ms, inter_token_ms
        self.fake_port, self.port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    async def start(self) -> None:
        exe = await asyncio.to_thread(ensure_venv, self.venv)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            f"  - model_name: {self.model}\n"
            "    litellm_params:\n"
            f"      model: openai/{self.model}\n"
            f"      api_base: http://127.0.0.1:{self.fake_port}/v1\n"
            "      api_key: fake\n"
            "general_settings:\n"
            f"  master_key: {MASTER_KEY}\n"
            "litellm_settings:\n"
            "  drop_params: true\n"
        )
        self._spawn("fake-model", [sys.executable, str(ROOT / "bench" / "fake_openai.py"), "--port", str(self.fake_port),
                                   "--ttft-ms", str(self.ttft_ms), "--inter-token-ms", str(self.inter_token_ms)], {})
        env = {"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "DISABLE_SCHEMA_UPDATE": "True"}
        self._spawn("litellm", [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(self.port),
                                "--num_workers", str(self.workers)], env)
        deadline = time.monotonic() + START_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.work_dir}/{name}.log")
                try:
                    r = await http.post(f"{self.url}/v1/chat/completions", headers=self.headers(),
                                        json={"model": self.model, "max_tokens": 1,
                                              "messages": [{"role": "user", "content": "ready?"}]})
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1.0)
        raise RuntimeError(f"LiteLLM not answering after {START_TIMEOUT_S:.0f} s; see {self.work_dir}/litellm.log")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.work_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                            start_new_session=True)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {MASTER_KEY}"}

    def pids(self) -> dict[str, list[int]]:
        """The processes to measure: the proxy with all its worker processes, and the fake apart."""
        return {name: descendants(proc.pid) for name, proc in self.procs.items() if proc.poll() is None}

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
