"""``GET /internal/route-key`` (edge/routes/internal.py): the key nginx hashes a request onto an edge by.

In-process over ``httpx.ASGITransport``, as tests/unit/test_edge.py. What the proxy relies on: one
user's tokens give one key, every edge of the fleet gives the same key, a refused token gives none
(and the real request then gets its typed 401), and the look-up spends neither the user's burst
bucket nor the client address's. nginx itself running the look-up: tests/integration/test_fleet.py.
"""

from __future__ import annotations

import re
import time

import jwt

from edge.auth import mint
from edge.routes.internal import ROUTE_KEY_DIGEST_BYTES, ROUTE_KEY_HEADER, ROUTE_KEY_PATH, route_key
from schemas.codes import RejectionCode, Tier
from schemas.outcomes import user_ref
from tests.unit.test_edge import assert_typed, make

HEX_KEY = re.compile(rf"^[0-9a-f]{{{2 * ROUTE_KEY_DIGEST_BYTES}}}$")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_two_tokens_of_one_user_give_one_hex_key_and_other_users_other_keys():
    settings, app, fake, http = make()
    # Two different tokens of one user (different lifetimes, so different signatures).
    one, two = mint(settings, "alice", Tier.FREE, ttl_s=600), mint(settings, "alice", Tier.PAID, ttl_s=900)
    assert one != two
    async with http:
        answers = [await http.get(ROUTE_KEY_PATH, headers=bearer(t)) for t in (one, two, mint(settings, "bob", Tier.FREE))]
    assert [r.status_code for r in answers] == [204, 204, 204]
    keys = [r.headers[ROUTE_KEY_HEADER] for r in answers]
    assert keys[0] == keys[1] != keys[2]
    assert all(HEX_KEY.match(k) for k in keys), keys
    # Neither the user id nor the outcome records' reference of the user: the key names nobody.
    assert keys[0] == route_key("alice", settings.fingerprint_key)
    assert "alice" not in keys[0] and keys[0] != user_ref("alice", settings.fingerprint_key)
    assert not fake.commands  # nothing was sent to the processor


async def test_every_edge_of_a_fleet_gives_a_user_the_same_key_and_another_fingerprint_key_another():
    first, second = make(), make()
    other = make(fingerprint_key="another-fleet-fingerprint-key", dev_mode=True)
    keys = []
    for settings, _app, _fake, http in (first, second, other):
        async with http:
            keys.append((await http.get(ROUTE_KEY_PATH, headers=bearer(mint(settings, "carol", Tier.FREE)))).headers[ROUTE_KEY_HEADER])
    assert keys[0] == keys[1] != keys[2]


async def test_a_missing_or_refused_token_gets_no_key_and_the_real_request_its_typed_401():
    settings, app, fake, http = make()
    expired = jwt.encode({"sub": "dave", "iss": settings.jwt_issuer, "aud": settings.jwt_audience,
                          "exp": int(time.time()) - 3600}, settings.jwt_secret, algorithm="HS256")
    forged = jwt.encode({"sub": "dave", "iss": settings.jwt_issuer, "aud": settings.jwt_audience,
                         "exp": int(time.time()) + 60}, "a-secret-that-is-not-this-edges-own", algorithm="HS256")
    cases = ({}, {"Authorization": "Basic ZGF2ZTpwdw=="}, bearer("not.a.jwt"), bearer(expired), bearer(forged),
             # Text that must never reach a header: the answer carries no byte of the client's.
             {"Authorization": "Bearer \x1b[31mred\x1b[0m"})
    async with http:
        for headers in cases:
            r = await http.get(ROUTE_KEY_PATH, headers=headers)
            assert r.status_code == 204 and ROUTE_KEY_HEADER.lower() not in r.headers, (headers, r.headers)
            assert r.content == b""
            assert_typed(await http.get("/v1/usage", headers=headers), RejectionCode.UNAUTHORIZED)


async def test_the_look_up_takes_nothing_from_the_users_bucket_or_the_addresses():
    settings, app, fake, http = make(ip_burst=5, ip_rate_per_s=0.001)
    edge = app.state.edge
    token = mint(settings, "erin", Tier.FREE)
    async with http:
        for _ in range(3 * settings.ip_burst):
            r = await http.get(ROUTE_KEY_PATH, headers=bearer(token))
            assert r.headers[ROUTE_KEY_HEADER] == route_key("erin", settings.fingerprint_key)
    assert edge.buckets.available("erin") == edge.buckets.capacity_tokens
    assert edge.ip_limiter.buckets is not None and len(edge.ip_limiter.buckets) == 0  # never even opened


async def test_an_address_whose_bucket_is_empty_gets_no_key_and_an_answer_nginx_does_not_cache():
    settings, app, fake, http = make(ip_burst=2, ip_rate_per_s=0.001)
    token = bearer(mint(settings, "frank", Tier.FREE))
    async with http:
        # The address's real requests drain its bucket.
        statuses = [(await http.get("/v1/models", headers=token)).status_code for _ in range(settings.ip_burst + 1)]
        assert statuses[-1] == 429, statuses
        r = await http.get(ROUTE_KEY_PATH, headers=token)
    assert r.status_code == 204 and ROUTE_KEY_HEADER.lower() not in r.headers
    assert r.headers["x-accel-expires"] == "0"


async def test_the_route_is_not_in_the_public_openapi_document_and_refuses_a_body():
    settings, app, fake, http = make()
    async with http:
        doc = (await http.get("/openapi.json")).json()
        assert not [p for p in doc["paths"] if p.startswith("/internal")]
        r = await http.request("GET", ROUTE_KEY_PATH, content=b"x" * 10, headers=bearer(mint(settings, "gina", Tier.FREE)))
    err = assert_typed(r, RejectionCode.INVALID_REQUEST)
    assert err["details"]["field"] == "body"
