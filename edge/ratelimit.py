"""Burst token bucket per user, checked at the edge before a command is appended.

Where it is authoritative, and why: the core has no bucket (a burst limit protects the edge and the
log from retry storms; it is not an entitlement, so it need not be exact or durable). This edge is
authoritative for the users routed to it: the load balancer pins a user to one edge replica by a
hash of the user id (``CHATPLANE_EDGE_USERS_STICKY=1``, the default), so one local bucket per user
is the global bucket. Without stickiness, each replica gets a preallocated share,
``capacity / replicas`` and ``refill / replicas`` (seed section 10: a local limiter per replica is not
a global bound), so the fleet never admits more than one bucket's worth. A replica restart forgets
buckets, which at worst allows one extra burst per user: acceptable for a burst limiter, and the
quota and concurrency limits stay exact in the core.

The table of buckets is bounded (``users_max``); the least recently used user's bucket is dropped,
which is safe because a dropped bucket was idle (it refills to full while idle anyway).

The same class also holds the per-client-address buckets (``edge.client_ip.IpLimiter``), taken before
authentication. Their rule differs in one point: the load balancer is sticky by user, never by address,
so one address's requests reach every replica, and each replica always holds a preallocated share,
``burst / replicas`` tokens refilled at ``rate / replicas`` (``CHATPLANE_EDGE_IP_*``, docs/edge.md).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated_s: float


class TokenBuckets:
    def __init__(
        self,
        capacity_tokens: float,
        refill_interval_s: float,
        users_max: int,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        assert capacity_tokens >= 1 and refill_interval_s > 0 and users_max >= 1
        self.capacity_tokens = capacity_tokens
        self.refill_interval_s = refill_interval_s
        self.users_max = users_max
        self.clock_s = clock_s
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @classmethod
    def for_fleet(cls, capacity: float, refill_interval_s: float, users_max: int, replicas: int, sticky: bool) -> TokenBuckets:
        if sticky or replicas <= 1:
            return cls(capacity, refill_interval_s, users_max)
        return cls(max(1.0, capacity / replicas), refill_interval_s * replicas, users_max)

    def take(self, user_id: str) -> float:
        """Take one token; returns 0.0 if allowed, else the seconds until a token is available."""
        now = self.clock_s()
        bucket = self._buckets.get(user_id)
        if bucket is None:
            bucket = _Bucket(self.capacity_tokens, now)
            self._buckets[user_id] = bucket
            if len(self._buckets) > self.users_max:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(user_id)
            bucket.tokens = self._refilled(bucket, now)
            bucket.updated_s = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return math.ceil((1.0 - bucket.tokens) * self.refill_interval_s * 1000) / 1000

    def available(self, user_id: str) -> float:
        """Tokens ``user_id`` could take now, without taking one (a user never seen has a full bucket)."""
        bucket = self._buckets.get(user_id)
        return self.capacity_tokens if bucket is None else self._refilled(bucket, self.clock_s())

    def _refilled(self, bucket: _Bucket, now: float) -> float:
        """The bucket's tokens at ``now``: what it held plus the refill since, up to capacity."""
        elapsed = max(0.0, now - bucket.updated_s)
        return min(self.capacity_tokens, bucket.tokens + elapsed / self.refill_interval_s)

    def __len__(self) -> int:
        return len(self._buckets)
