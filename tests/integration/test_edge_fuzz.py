"""Property-based fuzz of the running edge from its OpenAPI document (schemathesis + hypothesis).

``python -m edge`` runs as a process in front of the real processor and a fake worker; schemathesis
generates requests for every operation of ``/openapi.json`` (positive and negative data: bodies,
headers, path ids), sent with a valid bearer token and, for a share of them, with none. The
properties: no answer is a 5xx other than the table's typed 503s, and every error answer is the
seed's typed body (a known code with its table's status, ``retryable``, ``action``, a
``request_id`` and ``details``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from schemas.codes import REJECTIONS, RejectionCode
from tests.integration.test_edge_harness import FakeSimWorker, edge_process_factory  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

EXAMPLES_PER_OPERATION = 60
ADMISSION_UP_WAIT_S = 30.0
CODES = {c.value: c for c in RejectionCode}
# The 503s a healthy edge may answer under fuzzing; a 500 internal_error is a bug and fails the test.
TYPED_503 = ("capacity_exhausted", "quota_service_unavailable", "store_unavailable")
# A request head past CHATPLANE_EDGE_REQUEST_HEAD_BYTES_MAX's default, and a token expiry no edge accepts.
HUGE_HEADER_BYTES = 200_000
FAR_EXPIRY_S = 10**30


def header(response: object, name: str) -> str:
    """A header of a schemathesis response (its headers map names to lists of values)."""
    headers = {k.lower(): v for k, v in response.headers.items()}  # type: ignore[attr-defined]
    value = headers.get(name, "")
    return value[0] if isinstance(value, list) else value


OPENAI_ROUTES = ("/v1/chat/completions", "/v1/models")


def check_openai(response: object, label: str) -> None:
    """The OpenAI-compatible routes answer errors in OpenAI's shape (edge/openai_compat.py), with
    the native status of the code and ``x-should-retry`` saying whether a retry can help."""
    status = response.status_code
    if status >= 400:
        assert header(response, "content-type").startswith("application/json"), (label, status)
        err = response.json()["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str) and "param" in err, (label, err)
        if err["code"] == "cancelled":
            assert status == 409, (label, err)
        else:
            spec = REJECTIONS[CODES[err["code"]]]
            assert status == spec.http_status, (label, status, err)
            assert header(response, "x-should-retry") == ("true" if spec.retryable else "false"), (label, err)
        if status in (429, 503):
            assert int(header(response, "retry-after")) >= 1 and int(header(response, "retry-after-ms")) >= 0, (label, err)
        assert status < 500 or err["code"] in TYPED_503, (label, status, err)


def check(response: object, label: str) -> None:
    if any(route in label for route in OPENAI_ROUTES):
        check_openai(response, label)
        return
    status = response.status_code
    typed_503 = False
    if status >= 400:
        assert header(response, "content-type").startswith("application/json"), (label, status)
        err = response.json()["error"]
        code = CODES[err["code"]]
        spec = REJECTIONS[code]
        assert status == spec.http_status or (status == 405 and code is RejectionCode.INVALID_REQUEST), (label, status, err)
        assert err["retryable"] is spec.retryable and err["action"] == spec.action.value, (label, err)
        assert isinstance(err["request_id"], str) and err["request_id"] and isinstance(err["details"], dict), (label, err)
        typed_503 = status == 503 and code.value in TYPED_503
        if status in (429, 503):
            assert int(header(response, "retry-after")) >= 1, (label, err)
    assert status < 500 or typed_503, (label, status, response.text[:300])


def fuzz(url: str, headers_for: Callable[[str], dict[str, str]]) -> dict[str, set[int]]:
    doc = httpx.get(f"{url}/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    statuses: dict[str, set[int]] = {}
    admitted: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        # A user per operation: one operation's admissions never spend another's message quota.
        headers = headers_for(f"fuzzer-{op.method.lower()}-{op.path}")
        raw = doc["paths"][op.path][op.method.lower()]
        # Negative data needs an input to break; the operational GETs have none.
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if raw.get("parameters") or raw.get("requestBody") else [])
        for mode in modes:

            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode), authenticated=st.integers(0, 3), steer=st.integers(0, 3))
            def run(case, authenticated, steer):
                auth = headers if authenticated else {}
                if steer and mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                    # Most valid bodies name a model of the catalog and end with a user turn, so the
                    # fuzz reaches admission, streaming and the result buffer too. Each gets a key of
                    # its own: generated keys repeat, and a repeat with other content is a typed 409.
                    case.body["model"] = "simulated-text-model"
                    if case.headers and any(k.lower() == "idempotency-key" for k in case.headers):
                        case.headers = {k: v for k, v in case.headers.items() if k.lower() != "idempotency-key"}
                        case.headers["Idempotency-Key"] = f"fuzz-{uuid.uuid4().hex}"
                    if op.path == "/v1/generations":
                        # Stateless: conversation turns need the history store, which this edge has not.
                        for name in ("conversation_id", "expected_revision", "regenerate"):
                            case.body.pop(name, None)
                        if not case.body.get("messages"):
                            case.body["messages"] = [{"role": "user", "content": "hello"}]
                    if case.body.get("messages"):
                        case.body["messages"][-1]["role"] = "user"
                    if op.path == "/v1/chat/completions":
                        # Only user/assistant turns are served; the default budget is valid.
                        # An empty message is refused (typed 400); steered ones say something.
                        for m in case.body.get("messages") or []:
                            if isinstance(m, dict):
                                m["role"] = "user"
                                parts = m.get("content")
                                if not parts or (isinstance(parts, list) and not all(p.get("text") for p in parts if isinstance(p, dict))):
                                    m["content"] = "hello"
                        case.body.pop("max_tokens", None)
                        case.body.pop("max_completion_tokens", None)
                response = case.call(base_url=url, headers=auth, timeout=30)
                statuses.setdefault(op.label, set()).add(response.status_code)
                if response.status_code == 200 and auth:
                    admitted[op.label] = admitted.get(op.label, 0) + 1
                check(response, f"{op.label} {mode.value}")

            run()
    print("admitted (200) by operation:", admitted)
    return statuses


def bad_inputs(url: str, headers_for: Callable[[str], dict[str, str]]) -> int:
    """The bad inputs of the contract, sent to every operation of the served document: a body one
    byte over the cap (declared, and chunked), a trailing slash with a hostile Host, a 200 KB header,
    a token whose expiry lies centuries ahead. Each answer is typed; returns how many were sent."""
    import jwt

    from edge.settings import EdgeSettings

    doc = httpx.get(f"{url}/openapi.json").json()
    cap = EdgeSettings(dev_mode=True).request_body_bytes_max
    sent = 0

    def pieces():
        for _ in range(cap // 4096 + 1):
            yield b"x" * 4096

    with httpx.Client(base_url=url, timeout=30) as http:
        for path, ops in doc["paths"].items():
            concrete = path.replace("{generation_id}", "g1").replace("{conversation_id}", "c1")
            for method in ops:
                headers = {**headers_for(f"bad-{method}-{path}"), "Idempotency-Key": f"bad-{uuid.uuid4().hex}", "Content-Type": "application/json"}
                label = f"{method.upper()} {path}"
                for content in (b"x" * (cap + 1), pieces()):
                    r = http.request(method.upper(), concrete, content=content, headers=headers)
                    check(r, f"{label} oversized body")
                    assert r.status_code == 400, (label, r.status_code, r.text[:200])
                    err = r.json()["error"]
                    assert err.get("param", (err.get("details") or {}).get("field")) == "body", (label, err)
                    sent += 1
                r = http.request(method.upper(), concrete + "/", headers={**headers, "Host": "evil.example"})
                # Unrouted, so in the native shape on every path: a typed 404, never a redirect.
                assert r.status_code == 404 and "location" not in r.headers, (label, r.status_code, r.headers)
                assert r.json()["error"]["code"] == "not_found", (label, r.text[:200])
                r = http.request(method.upper(), concrete, headers={**headers, "X-Pad": "a" * HUGE_HEADER_BYTES})
                assert r.status_code == 400 and r.json()["error"]["details"]["field"] == "headers", (label, r.text[:200])
                sent += 2
                if path.startswith("/v1/"):
                    settings = EdgeSettings(dev_mode=True)
                    far = jwt.encode({"sub": "bad-far", "iss": settings.jwt_issuer, "aud": settings.jwt_audience, "exp": FAR_EXPIRY_S},
                                     settings.jwt_secret, algorithm="HS256")
                    r = http.request(method.upper(), concrete, headers={**headers, "Authorization": f"Bearer {far}"})
                    check(r, f"{label} far expiry")
                    assert r.status_code == 401, (label, r.status_code, r.text[:200])
                    sent += 1
    return sent


async def test_fuzz_from_openapi_no_5xx_and_every_error_typed(kafka_bootstrap, topology, running_processor, edge_process_factory):
    edge = edge_process_factory(CHATPLANE_EDGE_BUCKET_CAPACITY="100000")
    async with FakeSimWorker(kafka_bootstrap, topology, tokens=["a", "\u00e9"], token_interval_s=0.0):
        await edge.start()
        async with edge.http() as http:
            # /healthz/admission is one of the operations: it answers 200 once the first probe is decided.
            deadline = asyncio.get_running_loop().time() + ADMISSION_UP_WAIT_S
            while (await http.get("/healthz/admission")).status_code != 200:
                assert asyncio.get_running_loop().time() < deadline, "admission did not come up"
                await asyncio.sleep(0.1)
        statuses = await asyncio.to_thread(fuzz, edge.url, edge.headers)
        bad = await asyncio.to_thread(bad_inputs, edge.url, edge.headers)
        assert bad >= 60, bad
        async with edge.http() as http:
            assert (await http.get("/healthz")).status_code == 200
            metrics = (await http.get("/metrics")).text
    # A bug is answered as a typed 503 too; the counter tells them apart, and none happened.
    assert "chatplane_edge_unhandled_errors_total 0.0" in metrics
    # The fuzz reached past authentication and validation: admitted, refused and typed-invalid answers.
    assert {200, 400, 401} <= statuses["POST /v1/generations"], statuses
    assert {401, 404} <= statuses["GET /v1/generations/{generation_id}"], statuses
    assert {200, 400, 401} <= statuses["POST /v1/chat/completions"], statuses
