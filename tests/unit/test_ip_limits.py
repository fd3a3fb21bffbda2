"""The per-address burst bucket (edge/client_ip.py): client address rules, the fleet share, the bound."""

from __future__ import annotations

import ipaddress

import pytest

from edge.client_ip import ClientAddresses, IpLimiter, parse_address, parse_networks
from edge.ratelimit import TokenBuckets
from edge.settings import EdgeSettings
from infra.runtime.settings import SettingsError

ip = ipaddress.ip_address
PROXIES = parse_networks("10.0.0.0/8, 127.0.0.1, fd00::/8")


def scope(peer: str | None, *forwarded: str, header: bytes = b"x-forwarded-for") -> dict:
    return {"client": (peer, 5555) if peer is not None else None, "headers": [(header, v.encode()) for v in forwarded]}


def test_the_header_is_ignored_from_an_untrusted_peer():
    addresses = ClientAddresses(PROXIES)
    assert addresses.key_of(scope("203.0.113.9", "198.51.100.1")) == "203.0.113.9/32"
    # With no trusted proxy configured at all, from any peer.
    assert ClientAddresses(()).key_of(scope("127.0.0.1", "198.51.100.1")) == "127.0.0.1/32"


def test_a_trusted_peer_gives_the_right_most_untrusted_entry():
    addresses = ClientAddresses(PROXIES)
    # The client wrote "1.1.1.1" itself (spoofed); the trusted proxy chain appended the real one.
    assert addresses.key_of(scope("127.0.0.1", "1.1.1.1, 198.51.100.7, 10.1.2.3")) == "198.51.100.7/32"
    # Several header lines are one list, in order.
    assert addresses.key_of(scope("10.9.9.9", "1.1.1.1", "198.51.100.8")) == "198.51.100.8/32"
    # Every entry trusted: the left-most one.
    assert addresses.key_of(scope("127.0.0.1", "10.0.0.5, 10.0.0.6")) == "10.0.0.5/32"
    # No header: the peer itself.
    assert addresses.key_of(scope("127.0.0.1")) == "127.0.0.1/32"
    # Garbage ends the walk at the last good hop; ports and brackets are understood.
    assert addresses.key_of(scope("127.0.0.1", "198.51.100.1, nonsense, 10.0.0.7")) == "10.0.0.7/32"
    assert addresses.key_of(scope("127.0.0.1", "198.51.100.2:4711")) == "198.51.100.2/32"
    assert addresses.key_of(scope("127.0.0.1", "[2001:db8::1]:443")) == "2001:db8::/64"


def test_only_the_last_hops_max_entries_are_read():
    addresses = ClientAddresses(PROXIES, hops_max=2)
    # Three hops from the right would reach 198.51.100.1; two stop at the trusted ones (left-most read).
    assert addresses.key_of(scope("127.0.0.1", "198.51.100.1, 10.0.0.1, 10.0.0.2")) == "10.0.0.1/32"


def test_a_configured_header_name_is_used_and_others_ignored():
    addresses = ClientAddresses(PROXIES, header="X-Real-IP")
    assert addresses.key_of(scope("127.0.0.1", "198.51.100.3", header=b"x-real-ip")) == "198.51.100.3/32"
    assert addresses.key_of(scope("127.0.0.1", "198.51.100.3")) == "127.0.0.1/32"


def test_ipv6_is_bucketed_per_prefix_and_mapped_ipv4_counts_as_ipv4():
    addresses = ClientAddresses(())
    assert addresses.key_of(scope("2001:db8:1:2:aaaa::1")) == addresses.key_of(scope("2001:db8:1:2:bbbb::9"))
    assert addresses.key_of(scope("2001:db8:1:3::1")) == "2001:db8:1:3::/64"
    assert addresses.key_of(scope("::ffff:198.51.100.4")) == "198.51.100.4/32"
    wide = ClientAddresses((), ipv4_prefix=24, ipv6_prefix=48)
    assert wide.key_of(scope("198.51.100.200")) == "198.51.100.0/24"
    assert wide.key_of(scope("2001:db8:1:3::1")) == "2001:db8:1::/48"


def test_a_peer_that_is_no_address_is_bucketed_by_its_name():
    addresses = ClientAddresses(PROXIES)
    assert addresses.key_of(scope("testclient", "198.51.100.1")) == "peer:testclient"
    assert addresses.key_of(scope(None)) == "peer:None"
    assert parse_address("not an address") is None and parse_address("[::1") is None


def test_the_bucket_refuses_after_its_burst_and_refills():
    now = [0.0]
    limiter = IpLimiter(ClientAddresses(()), TokenBuckets(3, 0.5, 100, clock_s=lambda: now[0]))
    a, b = scope("198.51.100.1"), scope("198.51.100.2")
    assert [limiter.take(a) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take(a) == pytest.approx(0.5)
    assert limiter.take(b) == 0.0  # another address has its own bucket
    now[0] += 0.5
    assert limiter.take(a) == 0.0 and limiter.take(a) > 0


def test_each_edge_holds_its_share_of_the_fleet_bucket():
    limiter = IpLimiter.for_fleet(ClientAddresses(()), rate_per_s=20, burst=200, buckets_max=10, edges=4)
    assert limiter.buckets is not None
    assert limiter.buckets.capacity_tokens == 50 and limiter.buckets.refill_interval_s == pytest.approx(4 / 20)
    assert IpLimiter.for_fleet(ClientAddresses(()), 20, 0, 10, 1).take(scope("198.51.100.1")) == 0.0  # off


def test_the_bucket_table_is_bounded_least_recent_dropped():
    limiter = IpLimiter(ClientAddresses(()), TokenBuckets(1, 60, 3))
    for last in range(10):
        limiter.take(scope(f"198.51.100.{last}"))
    assert limiter.buckets is not None and len(limiter.buckets) == 3
    # The newest three are remembered (empty); an address dropped long ago starts full again.
    assert limiter.take(scope("198.51.100.9")) > 0
    assert limiter.take(scope("198.51.100.0")) == 0.0


def test_settings_name_every_limit(monkeypatch):
    monkeypatch.setenv("CHATPLANE_EDGE_TRUSTED_PROXIES", "10.0.0.0/8,::1")
    monkeypatch.setenv("CHATPLANE_EDGE_IPV6_PREFIX", "56")
    s = EdgeSettings()
    assert s.trusted_proxies == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128"))
    assert (s.ipv6_prefix, s.ipv4_prefix, s.client_ip_header) == (56, 32, "X-Forwarded-For")
    monkeypatch.setenv("CHATPLANE_EDGE_TRUSTED_PROXIES", "10.0.0.0/33")
    with pytest.raises(SettingsError, match="CHATPLANE_EDGE_TRUSTED_PROXIES"):
        EdgeSettings()
