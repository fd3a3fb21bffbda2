"""The client address a request is limited by, and the per-address burst bucket.

Where this sits: the first thing every authenticated route does (``edge.deps.principal``) is take one
token from the bucket of the request's client address, before the bearer token is even parsed; an
empty bucket is ``429 rate_limited`` with ``details.scope = "ip"`` and ``Retry-After``. A flood of bad
tokens, or of new accounts' good ones, from one address is refused there at the cost of a dictionary
look-up, never a signature check. docs/edge.md ("The IP bucket") gives the rule beside the user bucket's.

The client address:

- The socket peer (the ASGI ``client``, which uvicorn's protocol takes from the TCP connection).
  uvicorn's own proxy-header rewriting is off (``edge.__main__.uvicorn_config``: ``proxy_headers=False``):
  it would trust ``X-Forwarded-For`` from 127.0.0.1 by default, which any local process could spoof.
- Only when the peer is inside ``CHATPLANE_EDGE_TRUSTED_PROXIES`` (CIDRs; none by default), the header
  ``CHATPLANE_EDGE_CLIENT_IP_HEADER`` (``X-Forwarded-For``) is read from the right: each proxy appends
  the address it received the request from, so the right-most entry not in a trusted range is the
  first address no trusted proxy vouches for: the client. Entries to its left were written by the
  client itself and are ignored (a client can put anything there). If every entry is trusted, the
  left-most one is the client; an entry that is not an address ends the walk at the last good one.
  At most ``CHATPLANE_EDGE_CLIENT_IP_HOPS_MAX`` entries are read. From an untrusted peer the header
  is ignored altogether.
- The bucket is per network: ``CHATPLANE_EDGE_IPV4_PREFIX`` (32: one address) and
  ``CHATPLANE_EDGE_IPV6_PREFIX`` (64: one IPv6 subscriber usually holds a whole /64, so per-address
  buckets would be free to multiply). IPv4-mapped IPv6 addresses count as IPv4. A peer that is not an
  IP address (a Unix socket, a test client) is bucketed by its name.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from edge.ratelimit import TokenBuckets

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# A peer that is not an IP address is bucketed by its name, cut to this length.
PEER_NAME_CHARS_MAX = 64


def parse_networks(raw: str) -> tuple[IPNetwork, ...]:
    """``"10.0.0.0/8, ::1"`` -> networks (an address is its own /32 or /128); ValueError on a bad one."""
    return tuple(ipaddress.ip_network(item.strip(), strict=False) for item in raw.split(",") if item.strip())


def parse_address(text: str) -> IPAddress | None:
    """An address as proxies write it: ``1.2.3.4``, ``1.2.3.4:5678``, ``2001:db8::1`` or
    ``[2001:db8::1]:5678``; an IPv4-mapped IPv6 address as its IPv4 one; None if it is none of these."""
    t = text.strip()
    if t.startswith("["):
        t = t[1 : t.find("]")] if "]" in t else ""
    elif t.count(":") == 1:
        t = t.partition(":")[0]
    try:
        address = ipaddress.ip_address(t)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(frozen=True)
class ClientAddresses:
    """Finds a request's client address (the module docstring's rule) and its bucket key."""

    trusted_proxies: tuple[IPNetwork, ...] = ()
    header: str = "x-forwarded-for"
    hops_max: int = 16
    ipv4_prefix: int = 32
    ipv6_prefix: int = 64

    def __post_init__(self) -> None:
        assert 0 <= self.ipv4_prefix <= 32 and 0 <= self.ipv6_prefix <= 128 and self.hops_max >= 1
        object.__setattr__(self, "_header_bytes", self.header.lower().encode("latin-1"))

    def trusted(self, address: IPAddress) -> bool:
        return any(address.version == n.version and address in n for n in self.trusted_proxies)

    def client(self, peer: IPAddress, forwarded: Iterable[str]) -> IPAddress:
        """The client behind ``peer``, given the values of the forwarding header (in their order)."""
        if not self.trusted_proxies or not self.trusted(peer):
            return peer
        entries = ",".join(forwarded).split(",")[-self.hops_max :]
        client = peer
        for entry in reversed(entries):
            address = parse_address(entry)
            if address is None:
                break  # not an address: the last good hop is all that can be known
            client = address
            if not self.trusted(address):
                break
        return client

    def bucket_key(self, address: IPAddress) -> str:
        prefix = self.ipv4_prefix if address.version == 4 else self.ipv6_prefix
        return str(ipaddress.ip_network((address, prefix), strict=False))

    def key_of(self, scope: dict[str, Any]) -> str:
        """The bucket key of an ASGI request."""
        client = scope.get("client")
        host = client[0] if client else None
        peer = parse_address(host) if isinstance(host, str) else None
        if peer is None:
            return "peer:" + str(host)[:PEER_NAME_CHARS_MAX]
        forwarded = ()
        if self.trusted_proxies:
            want = self._header_bytes  # type: ignore[attr-defined]
            forwarded = tuple(v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == want)
        return self.bucket_key(self.client(peer, forwarded))


class IpLimiter:
    """The per-address burst bucket of this edge: its preallocated share of the fleet's bucket.

    The load balancer is sticky by user, not by address, so one address's requests reach every edge;
    each edge holds ``burst / edges`` tokens refilled at ``rate / edges`` per second, and the fleet
    together never admits more than one address's bucket (seed section 10: preallocated shares).
    """

    def __init__(self, addresses: ClientAddresses, buckets: TokenBuckets | None) -> None:
        self.addresses = addresses
        self.buckets = buckets  # None: off

    @classmethod
    def for_fleet(
        cls, addresses: ClientAddresses, rate_per_s: float, burst: float, buckets_max: int, edges: int
    ) -> IpLimiter:
        if rate_per_s <= 0 or burst <= 0:
            return cls(addresses, None)
        edges = max(1, edges)
        return cls(addresses, TokenBuckets(max(1.0, burst / edges), edges / rate_per_s, buckets_max))

    def take(self, scope: dict[str, Any]) -> float:
        """Take one token for the request's address: 0.0 if allowed, else the seconds until one is there."""
        if self.buckets is None:
            return 0.0
        return self.buckets.take(self.addresses.key_of(scope))

    def has_token(self, scope: dict[str, Any]) -> bool:
        """Whether the request's address could take a token now, without taking one (a peek: the
        proxy's route-key look-up, edge/routes/internal.py, must not spend the client's requests)."""
        if self.buckets is None:
            return True
        return self.buckets.available(self.addresses.key_of(scope)) >= 1.0
