"""``infra/edge-wait`` (what ``make up`` runs last): it returns only once the edge is ready AND admission
is up, and gives up after its named bound.

The edge here is a fake HTTP server (named as a fake: the script only reads two status codes; the
real endpoints are tested in tests/unit/test_edge.py and tests/integration/test_edge_admission.py).
"""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT_TIMEOUT_S = 60


class FakeEdge(http.server.ThreadingHTTPServer):
    """Answers /readyz and /healthz/admission with 503 for the first ``*_503s`` requests, then 200."""

    def __init__(self, ready_503s: int, admission_503s: int) -> None:
        super().__init__(("127.0.0.1", 0), FakeEdgeHandler)
        self.left = {"/readyz": ready_503s, "/healthz/admission": admission_503s}
        self.seen: list[tuple[str, int]] = []


class FakeEdgeHandler(http.server.BaseHTTPRequestHandler):
    server: FakeEdge

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        left = self.server.left.get(self.path)
        if left is None:
            status = 404
        elif left > 0:
            self.server.left[self.path] = left - 1
            status = 503
        else:
            status = 200
        self.server.seen.append((self.path, status))
        body = b'{"admission":"down"}' if status == 503 else b"{}"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def fake_edge(ready_503s: int, admission_503s: int) -> Iterator[FakeEdge]:
    server = FakeEdge(ready_503s, admission_503s)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def edge_wait(port: int, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "infra" / "edge-wait")],
        env={**os.environ, "CHATPLANE_EDGE_PORT": str(port), **env},
        capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S,
    )


def test_edge_wait_returns_only_once_admission_is_up_too():
    with fake_edge(ready_503s=2, admission_503s=3) as edge:
        done = edge_wait(edge.server_address[1])
    assert done.returncode == 0, done.stderr
    assert "waiting for the edge to serve" in done.stdout and "waiting for admission" in done.stdout
    assert "admission up" in done.stdout
    admission = [status for path, status in edge.seen if path == "/healthz/admission"]
    assert admission == [503, 503, 503, 200]
    assert [status for path, status in edge.seen if path == "/readyz"] == [503, 503, 200]


def test_edge_wait_gives_up_after_its_admission_bound():
    with fake_edge(ready_503s=0, admission_503s=10**6) as edge:
        done = edge_wait(edge.server_address[1], CHATPLANE_EDGE_ADMISSION_READY_TIMEOUT_S="1")
    assert done.returncode == 1
    assert "admission" in done.stderr and "after 1 s" in done.stderr and '{"admission":"down"}' in done.stderr


def test_edge_wait_refuses_a_bad_bound_with_one_line():
    done = edge_wait(1, CHATPLANE_EDGE_ADMISSION_READY_TIMEOUT_S="soon")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["chatplane-infra: error: CHATPLANE_EDGE_ADMISSION_READY_TIMEOUT_S='soon': expected a number"]
