"""Every route reads its body through ``edge.body``, capped while reading, and the smaller contract
defects of the edge's answers: messages that name what is wrong, no redirects, a bounded token
lifetime, ``/v1/models``' ``created``, failures apart from admission, the beacon's bounds and bucket.

The app runs in-process over ``httpx.ASGITransport`` (no lifespan, ``FakeDecider`` in place of the
command client, as in tests/unit/test_edge.py). The transport pulls a streamed request body from its
generator only when the app asks for the next piece, so counting what the generator yielded counts
what the app read. The same bounds on a real socket: tests/unit/test_edge_connections.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import jwt
import pytest
from fastapi.routing import APIRoute, iter_route_contexts

from edge.app import create_app
from edge.body import BODY_ROUTES
from edge.errors import NO_SUCH_ROUTE, not_found_message
from edge.routes.ui import first_token_ms_max
from edge.settings import EdgeSettings
from infra.models.catalog import load_catalog
from schemas.codes import REJECTIONS, RejectionCode, Tier
from tests.unit.test_edge import BODY, FakeDecider, assert_typed, hdrs, make

# The size of each piece of a chunked body the tests send.
PIECE_BYTES = 4096
OPENAI_PATHS = ("/v1/chat/completions", "/v1/models")
# Routes outside the OpenAPI document that the walk covers too (development mode serves the last two;
# the proxy's route-key look-up is served in every mode).
UNLISTED = (("GET", "/"), ("GET", "/internal/route-key"), ("GET", "/dev"), ("POST", "/dev/token"))


def dev_make(**over):
    return make(dev_mode=True, **over)


def concrete(path: str) -> str:
    return path.replace("{generation_id}", "g1").replace("{conversation_id}", "c1")


async def operations(http: httpx.AsyncClient) -> list[tuple[str, str]]:
    doc = (await http.get("/openapi.json")).json()
    listed = [(method.upper(), path) for path, ops in doc["paths"].items() for method in ops]
    assert len(listed) >= 15, listed
    return listed + list(UNLISTED)


def body_refusal(resp: httpx.Response, path: str) -> int:
    """The typed 400 naming the body; returns its details.limit (the route's cap)."""
    assert resp.status_code == 400, (path, resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert err["code"] == RejectionCode.INVALID_REQUEST.value, (path, err)
    if path in OPENAI_PATHS:  # OpenAI's shape: the field in param, the bound beside it
        assert err["param"] == "body" and isinstance(err["limit"], int), (path, err)
        return err["limit"]
    assert err["details"]["field"] == "body" and isinstance(err["details"]["limit"], int), (path, err)
    assert err["retryable"] is False and err["request_id"].startswith("req_"), (path, err)
    assert str(err["details"]["limit"]) in err["message"], (path, err)  # the message names the cap
    return err["details"]["limit"]


class CountedBody:
    """A chunked request body of ``size`` bytes that counts how much of it was pulled."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.pulled < self.size:
            piece = b"x" * min(PIECE_BYTES, self.size - self.pulled)
            self.pulled += len(piece)
            yield piece


def walk_headers(settings) -> dict[str, str]:
    return {**hdrs(settings, key="walk-1"), "Content-Type": "application/json"}


async def test_every_route_refuses_a_body_one_byte_over_its_cap_declared_or_chunked_without_reading_past_it():
    settings, app, fake, http = dev_make()
    cap = settings.request_body_bytes_max
    async with http:
        for method, path in await operations(http):
            url = concrete(path)
            sent = len(fake.commands)
            # Declared: refused unread, whatever the route.
            declared = await http.request(method, url, content=b"x" * (cap + 1), headers=walk_headers(settings))
            limit = body_refusal(declared, path)
            assert (limit > 0) == ((method, path) in BODY_ROUTES) and limit <= cap, (path, limit)
            # Chunked (no length): refused at the first piece past the route's own cap.
            body = CountedBody(cap + 1)
            chunked = await http.request(method, url, content=body, headers=walk_headers(settings))
            assert body_refusal(chunked, path) == limit, path
            assert body.pulled <= limit + PIECE_BYTES, (path, body.pulled, limit)
            # One byte over the route's own cap is refused too; at the cap, the size is not what is refused.
            over = await http.request(method, url, content=b" " * (limit + 1), headers=walk_headers(settings))
            assert body_refusal(over, path) == limit, path
            assert len(fake.commands) == sent, path  # nothing was sent for a refused body
            if limit:
                at = await http.request(method, url, content=b" " * limit, headers=walk_headers(settings))
                err = at.json().get("error", {})
                assert not (at.status_code == 400 and "limit" in (err.get("details") or err)), (path, at.text[:200])


async def test_a_route_that_takes_no_body_accepts_an_empty_one():
    settings, app, fake, http = dev_make()
    async with http:
        for method, url, expected in (("GET", "/healthz", 200), ("GET", "/v1/models", 200), ("GET", "/v1/generations/g1", 404)):
            for extra in ({"Content-Length": "0"}, {}):
                r = await http.request(method, url, headers={**hdrs(settings, key=None), **extra})
                assert r.status_code == expected, (url, r.text)
            empty_chunked = CountedBody(0)
            r = await http.request(method, url, content=empty_chunked, headers=hdrs(settings, key=None))
            assert r.status_code == expected, (url, r.text)


def test_the_routes_that_take_a_body_are_the_ones_listed_and_none_binds_it_through_fastapi():
    settings = EdgeSettings(capacity_check=False, read_model=False, dev_mode=True)
    app = create_app(settings)
    contexts = [c for c in iter_route_contexts(app.routes) if isinstance(c.original_route, APIRoute)]
    routes = {(m, c.path_format) for c in contexts for m in c.methods}
    assert BODY_ROUTES <= routes, BODY_ROUTES - routes
    for c in contexts:
        # The path the body check reads (scope["route"].path) is the served one.
        assert c.original_route.path == c.path_format, c.path_format
        # FastAPI's own body binding reads the whole body before any check.
        assert c.original_route.body_field is None, c.path_format
    doc = app.openapi()
    declared = {(m.upper(), p) for p, ops in doc["paths"].items() for m, op in ops.items() if "requestBody" in op}
    listed = {(m, p) for m, p in BODY_ROUTES if p in doc["paths"]}
    assert declared == listed


async def test_the_beacon_is_bounded_by_the_generation_deadline_and_has_a_bucket_of_its_own():
    settings, app, fake, http = make(beacon_bucket_capacity_tokens=3, beacon_bucket_refill_interval_s=3600)
    edge = app.state.edge
    bound = first_token_ms_max(settings.policy)
    assert bound == settings.policy.queue_wait_max_ms + settings.policy.generation_duration_max_ms + settings.policy.run_deadline_grace_ms
    headers = hdrs(settings, key=None)
    async with http:
        for bad, field in (({"first_token_ms": bound + 1}, "first_token_ms"), ({"first_token_ms": -1}, "first_token_ms"),
                           ({"first_token_ms": "12"}, "first_token_ms"), ({"first_token_ms": True}, "first_token_ms"),
                           ({"first_token_ms": 5, "text": "x"}, "text"), ({}, "first_token_ms")):
            err = assert_typed(await http.post("/v1/client-metrics", json=bad, headers=headers), RejectionCode.INVALID_REQUEST)
            assert err["details"]["field"] == field and field in err["message"], (bad, err)
        r = await http.post("/v1/client-metrics", content=b"{not json", headers=headers)
        assert assert_typed(r, RejectionCode.INVALID_REQUEST)["details"]["field"] == "body"
        statuses = [(await http.post("/v1/client-metrics", json={"first_token_ms": bound}, headers=headers)).status_code for _ in range(5)]
        assert statuses == [204, 204, 204, 429, 429]
        err = assert_typed(await http.post("/v1/client-metrics", json={"first_token_ms": 5}, headers=headers), RejectionCode.RATE_LIMITED)
        assert err["details"]["scope"] == "client_metrics"
    # The user's generation bucket was never touched.
    assert edge.buckets.available("alice") == settings.bucket_capacity_tokens
    assert edge.metrics.registry.get_sample_value("chatplane_edge_client_first_token_seconds_count") == 3


async def test_dev_token_errors_name_the_field_not_the_method():
    settings, app, fake, http = dev_make()
    async with http:
        for bad, field in (({"user": 5}, "user"), ({"user": "a", "extra": 1}, "extra"), ({"tier": "free"}, "user"),
                           ({"user": "a", "tier": "gold"}, "tier"), ({"user": "a b"}, "user")):
            err = assert_typed(await http.post("/dev/token", json=bad), RejectionCode.INVALID_REQUEST)
            assert err["details"]["field"] == field, (bad, err)
        err = assert_typed(await http.post("/dev/token", content=b"[1,"), RejectionCode.INVALID_REQUEST)
        assert err["details"]["field"] == "body"
        r = await http.post("/dev/token", json={"user": "carol"})
        assert r.status_code == 200 and r.json()["user"] == "carol"
        # A method the route does not take is the one answer that names the method.
        err = (await http.get("/dev/token")).json()["error"]
        assert err["details"]["field"] == "method" and "method" in err["message"]


async def test_messages_name_what_is_wrong():
    settings, app, fake, http = make()
    async with http:
        err = assert_typed(await http.get("/v1/generations/nope", headers=hdrs(settings)), RejectionCode.NOT_FOUND)
        assert err["message"] == "No such generation."
        err = assert_typed(await http.post("/v1/generations", json={**BODY, "model": "no-such-model"}, headers=hdrs(settings)),
                           RejectionCode.INVALID_REQUEST)
        assert err["details"]["field"] == "model" and "model" in err["message"] and "no-such-model" not in err["message"]
        err = assert_typed(await http.post("/v1/generations", json={**BODY, "max_output_tokens": 100_000}, headers=hdrs(settings)),
                           RejectionCode.INVALID_REQUEST)
        assert "max_output_tokens" in err["message"] and str(settings.policy.max_output_tokens_max) in err["message"]
        err = assert_typed(await http.get("/v1/nothing-here"), RejectionCode.NOT_FOUND)
        assert err["message"] == NO_SUCH_ROUTE
    # The conversation routes' 404 names the conversation (their store is Cassandra: the message is
    # picked by the route's path, checked here for every route that has an id).
    paths = {c.path_format for c in iter_route_contexts(app.routes)}
    assert {not_found_message(p) for p in paths if "{conversation_id}" in p} == {"No such conversation."}
    assert {not_found_message(p) for p in paths if "{generation_id}" in p} == {"No such generation."}
    assert "generation" not in REJECTIONS[RejectionCode.NOT_FOUND].message


async def test_a_trailing_slash_is_a_typed_404_and_never_a_redirect():
    settings, app, fake, http = make()
    async with http:
        for path in ("/v1/usage/", "/healthz/", "/v1/generations/", "/v1/models/"):
            # Not followed: Starlette's slash redirect answered 307 with a Location built from the
            # client's Host header (http://evil.example/...); following it would hide that answer.
            r = await http.get(path, headers={**hdrs(settings, key=None), "Host": "evil.example"}, follow_redirects=False)
            assert not r.is_redirect and "location" not in r.headers, (path, r.status_code, r.headers.get("location"))
            err = assert_typed(r, RejectionCode.NOT_FOUND)
            assert r.headers["content-type"].startswith("application/json"), path
            assert err["message"] == NO_SUCH_ROUTE and "evil.example" not in r.text, path


def token(settings, **claims) -> str:
    base = {"sub": "dave", "iss": settings.jwt_issuer, "aud": settings.jwt_audience, "exp": int(time.time()) + 60}
    return jwt.encode({**base, **claims}, settings.jwt_secret, algorithm="HS256")


async def test_a_token_whose_expiry_lies_beyond_the_lifetime_maximum_is_refused():
    settings, app, fake, http = make()
    now = int(time.time())
    async with http:
        for exp in (10**30, now + settings.jwt_lifetime_max_s + settings.jwt_leeway_s + 120):
            r = await http.get("/v1/generations/g1", headers={"Authorization": f"Bearer {token(settings, exp=exp)}"})
            assert_typed(r, RejectionCode.UNAUTHORIZED)
        # Within it, with or without iat: authenticated (the id is unknown).
        for claims in ({"exp": now + settings.jwt_lifetime_max_s - 60}, {"exp": now + 600, "iat": now}):
            r = await http.get("/v1/generations/g1", headers={"Authorization": f"Bearer {token(settings, **claims)}"})
            assert_typed(r, RejectionCode.NOT_FOUND)


def test_the_mint_command_refuses_a_lifetime_the_edge_would_refuse(monkeypatch, capsys):
    from edge import mint_token

    monkeypatch.setenv("CHATPLANE_DEV_MODE", "1")
    with pytest.raises(SystemExit):
        mint_token.main(["--user", "erin", "--ttl-s", str(10**9)])
    assert "CHATPLANE_EDGE_JWT_LIFETIME_MAX_S" in capsys.readouterr().err


async def test_models_created_is_the_catalogs_time_not_zero():
    settings, app, fake, http = make()
    async with http:
        doc = (await http.get("/v1/models", headers=hdrs(settings, key=None, tier=Tier.PAID))).json()
    created = {m["id"]: m["created"] for m in doc["data"]}
    catalog = load_catalog()
    assert created and all(c > 1_600_000_000 for c in created.values()), created
    for alias, c in created.items():
        if catalog.models[alias].created_s is not None:
            assert c == catalog.models[alias].created_s


async def test_store_failures_and_bugs_have_codes_of_their_own_apart_from_admission(monkeypatch):
    from infra.stores import replay as replay_store
    from infra.stores.queries import ReadModelUnavailable

    class DownReader:
        async def get(self, *args, **kwargs):
            raise ReadModelUnavailable("test: the store is down")

    async def refuse_to_open(*args, **kwargs):
        raise ConnectionError("test: the replay store is down")

    settings = EdgeSettings(capacity_check=False, read_model=True)
    app = create_app(settings)
    app.state.edge.client = FakeDecider(answer=lambda c: RuntimeError("test: a bug"))
    app.state.edge.reader._reader = DownReader()
    monkeypatch.setattr(replay_store.ReplayStore, "open", refuse_to_open)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
        err = assert_typed(await http.get("/v1/generations/g1", headers=hdrs(settings)), RejectionCode.STORE_UNAVAILABLE)
        assert err["retryable"] is True
        r = await http.get("/v1/generations/g1/events", headers=hdrs(settings))
        assert_typed(r, RejectionCode.STORE_UNAVAILABLE)
        assert int(r.headers["retry-after"]) >= 1
        r = await http.post("/v1/generations", json=BODY, headers=hdrs(settings))
        assert_typed(r, RejectionCode.INTERNAL_ERROR)
    assert app.state.edge.metrics.unhandled_errors._value.get() == 1
