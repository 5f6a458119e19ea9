"""Per-tenant request limits: requests per minute and requests in flight, answered with 429 + Retry-After.

Counters live in Redis when the broker is Redis, so every web process shares them; on the embedded
default (one web process) they live in memory. If Redis cannot be reached the limiter lets the
request through: publishing will fail a moment later and answer the honest 503.
"""
from __future__ import annotations

import math
import threading
import time
from collections import defaultdict

from django.conf import settings

from .errors import rate_limited


class RedisCounters:
    def __init__(self, url: str):
        import redis

        self._redis = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

    def hit_minute(self, tenant_id: int, window: int) -> int | None:
        key = f"lorafleet:rpm:{tenant_id}:{window}"
        try:
            pipe = self._redis.pipeline()
            pipe.incr(key)
            pipe.expire(key, 120)
            return int(pipe.execute()[0])
        except self._errors:
            return None

    def enter(self, tenant_id: int, ttl_s: int) -> int | None:
        key = f"lorafleet:inflight:{tenant_id}"
        try:
            pipe = self._redis.pipeline()
            pipe.incr(key)
            pipe.expire(key, ttl_s)  # a crashed web process cannot hold a tenant's slots for ever
            return int(pipe.execute()[0])
        except self._errors:
            return None

    def leave(self, tenant_id: int) -> None:
        try:
            self._redis.decr(f"lorafleet:inflight:{tenant_id}")
        except self._errors:
            pass


class LocalCounters:
    def __init__(self):
        self._lock = threading.Lock()
        self._minute: dict[tuple[int, int], int] = defaultdict(int)
        self._inflight: dict[int, int] = defaultdict(int)

    def hit_minute(self, tenant_id: int, window: int) -> int:
        with self._lock:
            for key in [k for k in self._minute if k[1] < window]:
                del self._minute[key]
            self._minute[(tenant_id, window)] += 1
            return self._minute[(tenant_id, window)]

    def enter(self, tenant_id: int, ttl_s: int) -> int:
        with self._lock:
            self._inflight[tenant_id] += 1
            return self._inflight[tenant_id]

    def leave(self, tenant_id: int) -> None:
        with self._lock:
            self._inflight[tenant_id] = max(0, self._inflight[tenant_id] - 1)


_counters = None


def counters():
    global _counters
    if _counters is None:
        url = settings.CELERY_BROKER_URL
        _counters = RedisCounters(url) if url.startswith(("redis://", "rediss://")) else LocalCounters()
    return _counters


def reset_counters() -> None:
    global _counters
    _counters = None


class TenantSlot:
    """`with TenantSlot(tenant):` admits one request or raises the 429 ApiError."""

    def __init__(self, tenant):
        self.tenant = tenant
        self._entered = False

    def __enter__(self) -> "TenantSlot":
        tenant, store = self.tenant, counters()
        now = time.time()
        count = store.hit_minute(tenant.pk, int(now // 60))
        if count is not None and count > tenant.requests_per_minute:
            raise rate_limited(
                "rate_limit_exceeded",
                f"Rate limit reached: {tenant.requests_per_minute} requests per minute for your organisation.",
                math.ceil(60 - now % 60),
            )
        ttl = int(settings.LORAFLEET_REQUEST_TIMEOUT_S) + 60
        inflight = store.enter(tenant.pk, ttl)
        self._entered = True
        if inflight is not None and inflight > tenant.max_concurrent_requests:
            self.__exit__(None, None, None)
            raise rate_limited(
                "concurrency_limit_exceeded",
                f"Too many requests in flight: at most {tenant.max_concurrent_requests} at once for your organisation.",
                1,
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._entered:
            self._entered = False
            counters().leave(self.tenant.pk)
