"""Debian's nginx in front of local edges, as a foreground process (the fleet test, docs/fleet.md).

``NginxProcess(edge_urls).start()`` renders ``infra/nginx/chatplane.conf.template`` (the production
proxy settings and route-key look-up, ``infra/nginx/chatplane-proxy.conf`` and
``chatplane-route-key.conf``, included as they are) into a fresh prefix folder
and runs ``nginx -p PREFIX -c PREFIX/nginx.conf -g 'daemon off; pid PREFIX/nginx.pid;'``; its error and
access logs stay in that folder. ``infra/nginx-install`` installs nginx (``make test`` runs it);
``CHATPLANE_NGINX`` names another binary.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "infra" / "nginx" / "chatplane.conf.template"
PROXY_CONF = ROOT / "infra" / "nginx" / "chatplane-proxy.conf"
ROUTE_KEY_CONF = ROOT / "infra" / "nginx" / "chatplane-route-key.conf"
NGINX_START_TIMEOUT_S = 20.0
NGINX_STOP_TIMEOUT_S = 10.0
# An upstream that refuses a connection is left out for this long (chatplane.example.conf: the same).
UPSTREAM_FAIL_TIMEOUT_S = 5


def nginx_binary() -> str | None:
    """The nginx to run: ``CHATPLANE_NGINX``, else the one on PATH or Debian's /usr/sbin/nginx."""
    explicit = os.environ.get("CHATPLANE_NGINX", "")
    if explicit:
        return explicit
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)


def render(prefix: Path, port: int, edge_addresses: list[str]) -> str:
    servers = "\n".join(
        f"        server {a} max_fails=1 fail_timeout={UPSTREAM_FAIL_TIMEOUT_S}s;" for a in edge_addresses
    )
    text = TEMPLATE.read_text()
    for name, value in (("PREFIX", str(prefix)), ("PORT", str(port)), ("UPSTREAM_SERVERS", servers),
                        ("PROXY_CONF", str(PROXY_CONF)), ("ROUTE_KEY_CONF", str(ROUTE_KEY_CONF))):
        text = text.replace("{{" + name + "}}", value)
    assert "{{" not in text, "a template field was left unfilled"
    return text


class NginxProcess:
    def __init__(self, edge_urls: list[str]) -> None:
        self.binary = nginx_binary()
        assert self.binary, "nginx is not installed: run infra/nginx-install (make test does)"
        # Not under pytest's tmp_path: when the tests run as root nginx's workers drop to `nobody`,
        # which must be able to reach the prefix (pytest's folders are private to their user).
        self.prefix = Path(tempfile.mkdtemp(prefix="chatplane-nginx-"))
        self.prefix.chmod(0o755)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = self.prefix / "nginx.conf"
        try:
            self.conf.write_text(render(self.prefix, self.port, [u.removeprefix("http://") for u in edge_urls]))
        except BaseException:
            self.cleanup()
            raise
        self.proc: subprocess.Popen[bytes] | None = None

    def _args(self, *extra: str) -> list[str]:
        assert self.binary
        return [self.binary, "-p", str(self.prefix), "-c", str(self.conf),
                "-g", f"daemon off; pid {self.prefix / 'nginx.pid'};", *extra]

    def check(self) -> None:
        """``nginx -t`` on the rendered config (syntax and every include)."""
        r = subprocess.run(self._args("-t"), capture_output=True, text=True, timeout=NGINX_START_TIMEOUT_S)
        assert r.returncode == 0, r.stderr

    def start(self) -> None:
        self.check()
        log = open(self.prefix / "stdout.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + NGINX_START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"nginx exited: {self.error_log()}"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert time.monotonic() < deadline, "nginx did not listen"
            time.sleep(0.05)

    def http(self, timeout_s: float = 30.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def access_log(self) -> str:
        path = self.prefix / "access.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # fast shutdown: open streams are closed
            try:
                self.proc.wait(timeout=NGINX_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=NGINX_STOP_TIMEOUT_S)

    def cleanup(self) -> None:
        shutil.rmtree(self.prefix, ignore_errors=True)
