"""Signing keys from the provider's URL (edge/jwks.py) and CORS (edge/app.py), against real HTTP:
a local identity provider (``http.server`` on a socket, its keys rotated by the test) and the edge's
ASGI app for the CORS answers (no Kafka needed for a preflight or a refusal)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from edge.app import create_app
from edge.auth import Authenticator, mint
from edge.errors import ApiError
from edge.settings import EdgeSettings
from schemas.codes import Tier


def rsa_pair(kid: str) -> tuple[str, dict[str, Any]]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    return pem, {**jwk, "kid": kid, "use": "sig", "alg": "RS256"}


class Provider:
    """A local identity provider: OIDC discovery and a JWKS the test rotates; ``down`` makes it fail."""

    def __init__(self) -> None:
        self.jwks: dict[str, Any] = {"keys": []}
        self.down = False
        self.requests: list[str] = []
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                provider.requests.append(self.path)
                if provider.down:
                    self.send_response(503)
                    self.end_headers()
                    return
                if self.path == "/.well-known/openid-configuration":
                    body = {"issuer": provider.issuer, "jwks_uri": provider.url + "/keys"}
                elif self.path == "/keys":
                    body = provider.jwks
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.issuer = self.url
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def provider() -> Iterator[Provider]:
    p = Provider()
    yield p
    p.close()


def settings_for(p: Provider, **over: Any) -> EdgeSettings:
    base: dict[str, Any] = dict(
        jwt_algorithm="RS256", jwt_issuer=p.issuer, oidc_discovery=True, jwks_refresh_min_interval_s=0.3,
        fingerprint_key="f" * 32,
    )
    return EdgeSettings(**{**base, **over})


def with_remote_keys(settings: EdgeSettings, scenario: Callable[[Authenticator], Awaitable[None]]) -> None:
    """Run ``scenario`` with an authenticator whose keys come from the provider (started, then stopped)."""

    async def main() -> None:
        auth = Authenticator(settings)
        assert auth.remote is not None
        await auth.remote.start()
        try:
            await scenario(auth)
        finally:
            await auth.remote.stop()

    asyncio.run(main())


def bearer(settings: EdgeSettings, pem: str, kid: str, user: str = "bob") -> str:
    return "Bearer " + mint(settings, user, Tier.PAID, private_key=pem, kid=kid)


def test_keys_come_from_discovery_rotate_in_and_survive_an_outage(provider: Provider) -> None:
    pem1, jwk1 = rsa_pair("k1")
    pem2, jwk2 = rsa_pair("k2")
    provider.jwks = {"keys": [jwk1]}
    settings = settings_for(provider)

    async def scenario(auth: Authenticator) -> None:
        assert (await auth.authenticate_async(bearer(settings, pem1, "k1"))).user_id == "bob"
        assert provider.requests == ["/.well-known/openid-configuration", "/keys"]
        # The provider rotates in k2 before the cached set is due: the unknown kid triggers a refetch.
        provider.jwks = {"keys": [jwk1, jwk2]}
        await asyncio.sleep(0.35)
        assert (await auth.authenticate_async(bearer(settings, pem2, "k2", "carol"))).user_id == "carol"
        fetched = len(provider.requests)
        # Made-up kids cost at most one refetch per minimum interval, and are refused.
        for _ in range(5):
            with pytest.raises(ApiError):
                await auth.authenticate_async(bearer(settings, pem2, "made-up", "mallory"))
        assert len(provider.requests) <= fetched + 2
        # The provider goes down: the cached keys keep serving (a new token, so no verified-token cache).
        provider.down = True
        await asyncio.sleep(0.35)
        assert await auth.remote.refresh() is False
        assert (await auth.authenticate_async(bearer(settings, pem1, "k1", "dave"))).user_id == "dave"
        assert auth.remote.failures >= 1 and set(auth.remote.keys) == {"k1", "k2"}

    with_remote_keys(settings, scenario)


def test_keys_published_for_another_issuer_are_never_trusted(provider: Provider) -> None:
    pem, jwk = rsa_pair("k1")
    provider.jwks = {"keys": [jwk]}
    provider.issuer = "https://someone-else.example"  # the discovery document names another issuer
    settings = settings_for(provider, jwt_issuer=provider.url)

    async def scenario(auth: Authenticator) -> None:
        assert auth.remote.keys == {}
        with pytest.raises(ApiError):
            await auth.authenticate_async(bearer(settings, pem, "k1"))

    with_remote_keys(settings, scenario)


def test_a_token_of_another_issuer_is_refused_with_a_known_key(provider: Provider) -> None:
    pem, jwk = rsa_pair("k1")
    provider.jwks = {"keys": [jwk]}
    settings = settings_for(provider)
    other = EdgeSettings(jwt_algorithm="RS256", jwt_issuer="https://other.example", jwks_url=provider.url + "/keys",
                         fingerprint_key="f" * 32)

    async def scenario(auth: Authenticator) -> None:
        with pytest.raises(ApiError):
            await auth.authenticate_async("Bearer " + mint(other, "bob", Tier.PAID, private_key=pem, kid="k1"))

    with_remote_keys(settings, scenario)


def test_cors_answers_only_the_listed_origins_and_exposes_the_retry_headers() -> None:
    settings = EdgeSettings(cors_origins="https://app.example.com")
    app = create_app(settings)

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
            preflight = await http.options("/v1/generations", headers={
                "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, idempotency-key",
            })
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == "https://app.example.com"
            allowed = preflight.headers["access-control-allow-headers"].lower()
            assert "authorization" in allowed and "idempotency-key" in allowed
            assert "access-control-allow-credentials" not in preflight.headers
            refused = await http.options("/v1/generations", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
            })
            assert "access-control-allow-origin" not in refused.headers
            # A cross-origin call refused by the edge still lets the page's script read why.
            r = await http.post("/v1/generations", json={}, headers={"Origin": "https://app.example.com"})
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example.com"
            exposed = r.headers["access-control-expose-headers"].lower()
            assert "retry-after" in exposed and "x-request-id" in exposed

    asyncio.run(scenario())
    plain = create_app(EdgeSettings())

    async def without() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain), base_url="http://edge") as http:
            r = await http.post("/v1/generations", json={}, headers={"Origin": "https://app.example.com"})
            assert "access-control-allow-origin" not in r.headers

    asyncio.run(without())
