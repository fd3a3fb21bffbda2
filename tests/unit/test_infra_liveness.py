"""A zombie is dead: a component that was killed but not yet reaped by its parent still
answers ``kill -0``; ``infra/component-start`` must start it again, ``infra/component-stop`` must not
wait out its grace for it, and ``make status`` (``infra/stack.py status``) must report it dead.

The zombies here are real: a child of this test process that exited and that the test does not
wait for until the checks are done. No server is involved (the components' "python" is a stand-in
script that exits at once), so this runs with the unit tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
ZOMBIE_WAIT_S = 10.0
SCRIPT_TIMEOUT_S = 60.0
# A component's command line as infra/component-start makes it (python -m <module>), that sleeps.
SLEEPING_COMPONENT = [sys.executable, "-c", "import time; time.sleep(120)", "-m", "test-component"]


def load_stack():
    spec = importlib.util.spec_from_file_location("infra_stack_under_test", INFRA / "stack.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def wait_zombie(proc: subprocess.Popen) -> None:
    """Until ``proc`` has exited and is a zombie (``Popen`` reaps only in ``poll``/``wait``)."""
    deadline = time.monotonic() + ZOMBIE_WAIT_S
    while state(proc.pid) != "Z":
        assert time.monotonic() < deadline, f"pid {proc.pid} did not become a zombie"
        time.sleep(0.01)


@contextlib.contextmanager
def zombie(argv: list[str]) -> Iterator[int]:
    """A real zombie: a child that exited (killed) and is not reaped until the block ends."""
    proc = subprocess.Popen(argv)
    try:
        proc.kill()
        wait_zombie(proc)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def sleeping_component() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(SLEEPING_COMPONENT)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def bash_says_alive(function: str, pid: int) -> bool:
    done = subprocess.run(["bash", "-c", f'. "{INFRA}/_procs"; {function} "$1"', "_", str(pid)], timeout=SCRIPT_TIMEOUT_S)
    return done.returncode == 0


def run(script: str, *args: str, run_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(INFRA / script), *args], cwd=ROOT, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S,
        env={**os.environ, "CHATPLANE_RUN_DIR": str(run_dir), "CHATPLANE_VAR_DIR": str(run_dir / "var"), **env},
        stdin=subprocess.DEVNULL,
    )


def test_a_zombie_is_dead_to_both_liveness_checks_and_a_running_process_is_alive():
    stack = load_stack()
    with sleeping_component() as live:
        assert stack.process_alive(live.pid) and bash_says_alive("pid_alive", live.pid)
        assert bash_says_alive("component_alive", live.pid)
        with zombie(SLEEPING_COMPONENT) as pid:
            os.kill(pid, 0)  # what component-start asked (kill -0): it succeeds on a zombie
            assert not stack.process_alive(pid)
            assert not bash_says_alive("pid_alive", pid) and not bash_says_alive("component_alive", pid)
    assert not stack.process_alive(2**22 + 1) and not bash_says_alive("pid_alive", 2**22 + 1)  # above pid_max


def test_component_start_starts_again_over_a_zombie_and_not_over_a_running_component(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexit 0\n")
    fake_python.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pid_file = run_dir / "edge.pid"
    with zombie(SLEEPING_COMPONENT) as pid:
        pid_file.write_text(f"{pid}\n")
        started = run("component-start", "edge", "edge", run_dir=run_dir, CHATPLANE_PYTHON=str(fake_python))
        assert started.returncode == 0, started.stderr
        assert "started pid=" in started.stdout and "already running" not in started.stdout, started.stdout
        assert pid_file.read_text().strip() != str(pid)
    with sleeping_component() as live:
        pid_file.write_text(f"{live.pid}\n")
        again = run("component-start", "edge", "edge", run_dir=run_dir, CHATPLANE_PYTHON=str(fake_python))
        assert f"already running (pid={live.pid})" in again.stdout, again.stdout


def test_component_stop_does_not_wait_for_a_component_that_died_into_a_zombie(tmp_path):
    grace_s = 3
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with sleeping_component() as live:
        # Its parent (this test) does not reap it until the end: SIGTERM leaves a zombie.
        (run_dir / "workers.pid").write_text(f"{live.pid}\n")
        t0 = time.monotonic()
        stopped = run("component-stop", "workers", run_dir=run_dir, CHATPLANE_STOP_GRACE_S=str(grace_s))
        elapsed_s = time.monotonic() - t0
        assert state(live.pid) == "Z"
        assert f"workers stopped (pid={live.pid})" in stopped.stdout, stopped.stdout
        assert "did not stop" not in stopped.stdout and elapsed_s < grace_s, (elapsed_s, stopped.stdout)
    with zombie(SLEEPING_COMPONENT) as pid:
        (run_dir / "workers.pid").write_text(f"{pid}\n")
        stale = run("component-stop", "workers", run_dir=run_dir, CHATPLANE_STOP_GRACE_S=str(grace_s))
        assert f"not running (stale pid {pid})" in stale.stdout, stale.stdout
    assert not (run_dir / "workers.pid").exists()


def test_status_reports_a_zombie_component_dead(tmp_path, monkeypatch, capsys):
    stack = load_stack()
    monkeypatch.setenv("CHATPLANE_RUN_DIR", str(tmp_path))
    # The servers' probes are not what this checks: both answer.
    monkeypatch.setattr(stack, "kafka_probe_quiet", lambda *a: True)
    monkeypatch.setattr(stack, "cassandra_probe_quiet", lambda *a: True)
    cfg = stack.Config.from_env()
    with sleeping_component() as live, zombie(SLEEPING_COMPONENT) as dead:
        (tmp_path / "edge.pid").write_text(f"{live.pid}\n")
        (tmp_path / "workers.pid").write_text(f"{dead}\n")
        assert stack.component_states(cfg) == {"edge": (live.pid, True), "workers": (dead, False)}
        assert stack.status(cfg) == 1
        out = capsys.readouterr().out
        assert "edge      running" in out and "workers   DEAD" in out, out
        (tmp_path / "workers.pid").unlink()
        assert stack.status(cfg) == 0
