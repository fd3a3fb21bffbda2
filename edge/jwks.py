"""Signing keys from the identity provider's URL, as identity providers publish them.

``CHATPLANE_EDGE_JWKS_URL`` names the JWKS; ``CHATPLANE_EDGE_OIDC_DISCOVERY=1`` finds it instead from
``<issuer>/.well-known/openid-configuration`` (its ``jwks_uri``; the document's ``issuer`` must be
the configured ``CHATPLANE_EDGE_JWT_ISSUER``, as OIDC discovery requires, so keys published for
another issuer are never trusted). ``RemoteKeys`` keeps the keys it fetched and:

- refreshes them when they are older than ``CHATPLANE_EDGE_JWKS_MAX_AGE_S`` (3,600), in the
  background, so a provider's scheduled rotation is picked up without a failed request;
- refreshes at once on a token whose ``kid`` it does not know (a key rotated in early), at most once
  per ``CHATPLANE_EDGE_JWKS_REFRESH_MIN_INTERVAL_S`` (60): a stream of tokens with made-up ``kid``s
  costs the provider one request a minute, not one per token;
- keeps serving with the keys it has while the provider is unreachable or answers garbage (logged,
  retried at that interval); only a well-formed set replaces them. Each fetch is bounded by
  ``CHATPLANE_EDGE_JWKS_FETCH_TIMEOUT_S`` (5) and ``JWKS_BYTES_MAX``.

Only RSA keys for signing (``kty: RSA``, ``use`` absent or ``sig``) are taken; the edge verifies RS256.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import httpx
import jwt

log = logging.getLogger("chatplane.edge.jwks")

JWKS_BYTES_MAX = 256 * 1024
KEYS_MAX = 64


class JwksError(Exception):
    """A fetch that gave no usable key set (the reason, never a key)."""


def keys_from_jwks(doc: Any) -> dict[str, object]:
    """The RSA signing keys of a JWKS document, by ``kid``; raises ``JwksError`` if it has none."""
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise JwksError("not a JWKS document")
    keys: dict[str, object] = {}
    for jwk in doc["keys"][:KEYS_MAX]:
        if not isinstance(jwk, dict) or jwk.get("kty") != "RSA" or jwk.get("use", "sig") != "sig":
            continue
        try:
            keys[str(jwk.get("kid", ""))] = jwt.algorithms.RSAAlgorithm.from_jwk(json.dumps(jwk))
        except (jwt.PyJWTError, ValueError, TypeError):
            continue
    if not keys:
        raise JwksError("no RSA signing key in the JWKS")
    return keys


class RemoteKeys:
    def __init__(
        self,
        issuer: str,
        jwks_url: str,
        discovery: bool,
        max_age_s: float,
        refresh_min_interval_s: float,
        fetch_timeout_s: float,
    ) -> None:
        self.issuer = issuer
        self.jwks_url = jwks_url
        self.discovery = discovery
        self.max_age_s = max_age_s
        self.refresh_min_interval_s = refresh_min_interval_s
        self.fetch_timeout_s = fetch_timeout_s
        self.keys: dict[str, object] = {}
        self.fetched_at = 0.0  # monotonic; 0: never
        self.attempted_at = float("-inf")
        self.fetches = 0
        self.failures = 0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """A first fetch (its failure is logged: requests are refused until one succeeds), then the
        background refresher."""
        await self.refresh()
        self._task = asyncio.create_task(self._refresher(), name="jwks-refresher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def refresh_for_unknown_kid(self) -> bool:
        """Refetch for a token with an unknown ``kid``, unless the last attempt is too recent.
        True when a fetch was made and succeeded."""
        if time.monotonic() - self.attempted_at < self.refresh_min_interval_s:
            return False
        return await self.refresh()

    async def refresh(self) -> bool:
        async with self._lock:
            self.attempted_at = time.monotonic()
            self.fetches += 1
            try:
                self.keys = await self._fetch()
            except (JwksError, httpx.HTTPError, ValueError) as exc:
                self.failures += 1
                log.warning("JWKS refresh failed (%s: %s); keeping %d cached keys", type(exc).__name__, exc, len(self.keys))
                return False
            self.fetched_at = time.monotonic()
            return True

    async def _fetch(self) -> dict[str, object]:
        async with httpx.AsyncClient(timeout=self.fetch_timeout_s, follow_redirects=False) as http:
            url = self.jwks_url
            if self.discovery:
                config = await _get_json(http, self.issuer.rstrip("/") + "/.well-known/openid-configuration")
                if not isinstance(config, dict) or config.get("issuer") != self.issuer:
                    raise JwksError("the discovery document names another issuer")
                url = config.get("jwks_uri")
                if not isinstance(url, str) or not url:
                    raise JwksError("the discovery document has no jwks_uri")
            return keys_from_jwks(await _get_json(http, url))

    async def _refresher(self) -> None:
        while True:
            if self.fetched_at and time.monotonic() - self.fetched_at < self.max_age_s:
                await asyncio.sleep(self.fetched_at + self.max_age_s - time.monotonic())
                continue
            if not await self.refresh():
                # Failing: try again at the minimum interval, keeping the cached keys meanwhile.
                await asyncio.sleep(self.refresh_min_interval_s)


async def _get_json(http: httpx.AsyncClient, url: str) -> Any:
    async with http.stream("GET", url, headers={"Accept": "application/json"}) as response:
        if response.status_code != 200:
            raise JwksError(f"HTTP {response.status_code} from {url}")
        body = b""
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > JWKS_BYTES_MAX:
                raise JwksError(f"more than {JWKS_BYTES_MAX} bytes from {url}")
    return json.loads(body)
