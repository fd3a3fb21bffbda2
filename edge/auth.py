"""Bearer-token authentication: a JWT gives the principal (``sub``) and its tier (``tier`` claim).

Local use: HS256 with ``CHATPLANE_EDGE_JWT_SECRET`` (tokens from ``python -m edge.mint_token``).
Production: RS256 verified against the keys of a JWKS, chosen by the token's ``kid``: fetched from the
identity provider (``CHATPLANE_EDGE_JWKS_URL``, or OIDC discovery from the issuer; refreshed,
edge/jwks.py) or read from a file (``CHATPLANE_EDGE_JWKS_PATH``). Issuer, audience and expiry are always checked. A failure of any kind is one
``unauthorized`` answer; the reason is logged without the token.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass

import jwt

from edge.admission import PROBE_USER_ID_PREFIX
from edge.errors import ApiError
from edge.jwks import RemoteKeys
from edge.settings import EdgeSettings
from schemas.codes import RejectionCode, Tier

log = logging.getLogger("chatplane.edge.auth")

AUTH_HEADER_BYTES_MAX = 8 * 1024
USER_ID_CHARS_MAX = 128
_RISK_CLASS = re.compile(r"^[a-z0-9_]{0,32}$")  # as schemas.commands.RiskClassName
# Verified tokens remembered (token -> principal, until its expiry): a client streams many requests
# with one token, and signature checks were a tenth of the edge's CPU per request. Bounded LRU.
VERIFIED_TOKENS_MAX = 50_000


class _UnknownKid(Exception):
    """A token signed with a key the provider's cached set lacks (``authenticate_async`` refetches)."""


@dataclass(frozen=True, slots=True)
class Principal:
    user_id: str
    tier: Tier
    # The account's risk class from the token's ``risk_class`` claim ("" = none): the processor
    # applies its stricter limits (docs/core.md, "Account risk classes").
    risk_class: str = ""


class Authenticator:
    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.algorithm = settings.jwt_algorithm
        self._keys: dict[str, object] = {}
        self._verified: OrderedDict[str, tuple[Principal, float]] = OrderedDict()
        # RS256 keys from the provider's URL (edge/jwks.py), refreshed; None: a file, or HS256.
        self.remote: RemoteKeys | None = None
        if self.algorithm == "RS256":
            if settings.jwks_url or settings.oidc_discovery:
                self.remote = RemoteKeys(
                    settings.jwt_issuer, settings.jwks_url, settings.oidc_discovery, settings.jwks_max_age_s,
                    settings.jwks_refresh_min_interval_s, settings.jwks_fetch_timeout_s,
                )
            elif not settings.jwks_path:
                raise ValueError("RS256 needs CHATPLANE_EDGE_JWKS_PATH, CHATPLANE_EDGE_JWKS_URL or CHATPLANE_EDGE_OIDC_DISCOVERY")
            else:
                with open(settings.jwks_path, encoding="utf-8") as f:
                    jwks = json.load(f)
                for jwk in jwks.get("keys", []):
                    self._keys[jwk.get("kid", "")] = jwt.algorithms.RSAAlgorithm.from_jwk(json.dumps(jwk))
        elif self.algorithm != "HS256":
            raise ValueError(f"unsupported JWT algorithm {self.algorithm}")

    def _key(self, token: str) -> object:
        if self.algorithm == "HS256":
            return self.settings.jwt_secret
        kid = jwt.get_unverified_header(token).get("kid", "")
        key = (self.remote.keys if self.remote is not None else self._keys).get(kid)
        if key is None:
            if self.remote is not None:
                raise _UnknownKid()
            raise jwt.InvalidKeyError("unknown kid")
        return key

    async def authenticate_async(self, authorization: str | None) -> Principal:
        """``authenticate``, refetching the provider's keys once for a token whose ``kid`` is unknown
        (bounded by ``CHATPLANE_EDGE_JWKS_REFRESH_MIN_INTERVAL_S``; edge/jwks.py)."""
        try:
            return self.authenticate(authorization)
        except _UnknownKid:
            if self.remote is not None and await self.remote.refresh_for_unknown_kid():
                try:
                    return self.authenticate(authorization)
                except _UnknownKid:
                    pass
            log.info("token rejected: unknown kid")
            raise ApiError(RejectionCode.UNAUTHORIZED) from None

    def authenticate(self, authorization: str | None) -> Principal:
        if not authorization or len(authorization) > AUTH_HEADER_BYTES_MAX:
            raise ApiError(RejectionCode.UNAUTHORIZED)
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(RejectionCode.UNAUTHORIZED)
        cached = self._verified.get(token)
        if cached is not None:
            if time.time() < cached[1]:
                self._verified.move_to_end(token)
                return cached[0]
            del self._verified[token]
        principal, expires_s = self._verify(token)
        self._verified[token] = (principal, expires_s)
        if len(self._verified) > VERIFIED_TOKENS_MAX:
            self._verified.popitem(last=False)
        return principal

    def _verify(self, token: str) -> tuple[Principal, float]:
        try:
            claims = jwt.decode(
                token.strip(),
                self._key(token.strip()),
                algorithms=[self.algorithm],
                audience=self.settings.jwt_audience,
                issuer=self.settings.jwt_issuer,
                leeway=self.settings.jwt_leeway_s,
                options={"require": ["sub", "exp", "iss", "aud"]},
            )
        except (jwt.PyJWTError, ValueError) as exc:
            log.info("token rejected: %s", type(exc).__name__)
            raise ApiError(RejectionCode.UNAUTHORIZED) from None
        if float(claims["exp"]) - time.time() > self.settings.jwt_lifetime_max_s + self.settings.jwt_leeway_s:
            # An expiry further ahead than any token this service accepts (CHATPLANE_EDGE_JWT_LIFETIME_MAX_S):
            # were it accepted, a stolen token would be good for as long as it says.
            log.info("token rejected: expiry beyond the lifetime maximum")
            raise ApiError(RejectionCode.UNAUTHORIZED)
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub or len(sub) > USER_ID_CHARS_MAX:
            raise ApiError(RejectionCode.UNAUTHORIZED)
        if sub.startswith(PROBE_USER_ID_PREFIX):
            # The edge's own admission probes run as these users (edge.admission); no client may.
            log.info("token rejected: reserved subject")
            raise ApiError(RejectionCode.UNAUTHORIZED)
        try:
            tier = Tier(claims.get("tier", Tier.FREE.value))
        except ValueError:
            raise ApiError(RejectionCode.UNAUTHORIZED) from None
        risk_class = claims.get("risk_class", "")
        if not isinstance(risk_class, str) or not _RISK_CLASS.match(risk_class):
            raise ApiError(RejectionCode.UNAUTHORIZED)
        # Remembered until expiry as checked here (the leeway is not extended to cached tokens).
        return Principal(user_id=sub, tier=tier, risk_class=risk_class), float(claims["exp"])


def mint(
    settings: EdgeSettings,
    user_id: str,
    tier: Tier,
    ttl_s: int = 3600,
    private_key: str | None = None,
    kid: str = "",
    risk_class: str = "",
) -> str:
    """A token for local use (HS256 with the configured secret, or RS256 with ``private_key``)."""
    now = int(time.time())
    claims: dict[str, object] = {
        "sub": user_id,
        "tier": tier.value,
        "iss": settings.jwt_issuer,
        "aud": settings.jwt_audience,
        "iat": now,
        "exp": now + ttl_s,
    }
    if risk_class:
        claims["risk_class"] = risk_class
    if private_key is not None:
        return jwt.encode(claims, private_key, algorithm="RS256", headers={"kid": kid})
    return jwt.encode(claims, settings.jwt_secret, algorithm="HS256")
