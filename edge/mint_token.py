"""Mint a local bearer token: ``python -m edge.mint_token --user alice --tier free [--ttl-s 3600]``.

Uses the same settings as the edge (``CHATPLANE_EDGE_JWT_SECRET``, issuer, audience), so a token
minted here authenticates against a local edge. Like the edge, it uses the built-in development
secret only with ``CHATPLANE_DEV_MODE=1``; a missing secret is one line on stderr and exit status 2.
Prints the token only.
"""

from __future__ import annotations

import argparse

from edge.auth import mint
from edge.settings import EdgeSettings
from infra.runtime.settings import SettingsError, exit_on_settings_error
from schemas.codes import Tier


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--user", required=True)
    parser.add_argument("--tier", choices=[t.value for t in Tier], default=Tier.FREE.value)
    parser.add_argument("--ttl-s", type=int, default=3600)
    parser.add_argument("--rs256-private-key", help="PEM file: sign RS256 instead of HS256")
    parser.add_argument("--kid", default="")
    args = parser.parse_args(argv)
    try:
        settings = EdgeSettings()
    except SettingsError as exc:
        exit_on_settings_error(exc)
    if not 0 < args.ttl_s <= settings.jwt_lifetime_max_s:
        # The edge refuses a token whose expiry lies further ahead than its maximum lifetime.
        parser.error(f"--ttl-s must be 1..{settings.jwt_lifetime_max_s} (CHATPLANE_EDGE_JWT_LIFETIME_MAX_S)")
    key = open(args.rs256_private_key, encoding="utf-8").read() if args.rs256_private_key else None  # noqa: SIM115
    print(mint(settings, args.user, Tier(args.tier), args.ttl_s, private_key=key, kid=args.kid))


if __name__ == "__main__":
    main()
