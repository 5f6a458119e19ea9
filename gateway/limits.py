"""Per-tenant request limits: requests per minute and requests in flight, answered with 429 + Retry-After.

Requests per minute are a rate, not a count per clock minute (GCRA, the token bucket's arithmetic): a
tenant may send up to a minute's quota at once, then one request every 60/quota seconds. A fixed
one-minute window let a flooding tenant spend its whole minute's quota in the first seconds of every
minute — 10x its rate for a tenth of the time — which is what the other tenants' p95 latency felt
(docs/RELIABILITY.md, load). Retry-After is the time until the next request is admitted.

Counters live in Redis when the broker is Redis, so every web process shares them (the check and the
update are one Lua script, on Redis's clock); on the embedded default (one web process) they live in
memory. If Redis cannot be reached the limiter lets the request through: publishing will fail a moment
later and answer the honest 503.

The same stores count failed logins (gateway/login_limits.py): `fail` adds one and returns the count,
which expires `ttl_s` after the first failure — and again `ttl_s` after the one that reaches the limit,
so a lockout lasts its full length; `failures` reads (count, seconds left); `clear` forgets.
"""
from __future__ import annotations

import math
import threading
import time
from collections import defaultdict

from django.conf import settings

from .errors import rate_limited

# KEYS[1]: the tenant's theoretical arrival time; ARGV: seconds per request, burst (requests).
# Returns "0" when admitted (and records it), else the seconds until a request would be admitted.
_GCRA = """
local emission, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local allow_at = tat - emission * (burst - 1)
if now < allow_at then return tostring(allow_at - now) end
local new_tat = tat + emission
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil((new_tat - now) * 1000) + 1000)
return '0'
"""


# KEYS[1]: a failure counter; ARGV: ttl seconds, the count that locks. Returns the new count.
_FAIL = """
local n = redis.call('INCR', KEYS[1])
if n == 1 or n == tonumber(ARGV[2]) then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return n
"""


def _rate(requests_per_minute: int) -> tuple[float, int]:
    """(seconds per request, burst): a minute's quota at once, then the per-minute rate."""
    quota = max(1, int(requests_per_minute))
    return 60.0 / quota, quota


class RedisCounters:
    def __init__(self, url: str):
        import redis

        self._redis = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._gcra = self._redis.register_script(_GCRA)
        self._fail = self._redis.register_script(_FAIL)

    def admit(self, tenant_id: int, requests_per_minute: int) -> float | None:
        """0 when admitted, else seconds until a request would be; None if Redis cannot be reached."""
        emission, burst = _rate(requests_per_minute)
        try:
            return float(self._gcra(keys=[f"lorafleet:rate:{tenant_id}"], args=[repr(emission), burst]))
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

    def fail(self, key: str, ttl_s: int, limit: int) -> int | None:
        try:
            return int(self._fail(keys=[f"lorafleet:fail:{key}"], args=[ttl_s, limit]))
        except self._errors:
            return None

    def failures(self, key: str) -> tuple[int, int]:
        try:
            pipe = self._redis.pipeline()
            pipe.get(f"lorafleet:fail:{key}")
            pipe.ttl(f"lorafleet:fail:{key}")
            count, ttl = pipe.execute()
        except self._errors:
            return 0, 0
        return int(count or 0), max(0, int(ttl))

    def clear(self, key: str) -> None:
        try:
            self._redis.delete(f"lorafleet:fail:{key}")
        except self._errors:
            pass


class LocalCounters:
    def __init__(self):
        self._lock = threading.Lock()
        self._tat: dict[int, float] = {}
        self._inflight: dict[int, int] = defaultdict(int)
        self._failures: dict[str, tuple[int, float]] = {}  # key -> (count, expires at)

    def admit(self, tenant_id: int, requests_per_minute: int) -> float:
        emission, burst = _rate(requests_per_minute)
        with self._lock:
            now = time.time()
            tat = max(self._tat.get(tenant_id, 0.0), now)
            allow_at = tat - emission * (burst - 1)
            if now < allow_at:
                return allow_at - now
            self._tat[tenant_id] = tat + emission
            return 0.0

    def enter(self, tenant_id: int, ttl_s: int) -> int:
        with self._lock:
            self._inflight[tenant_id] += 1
            return self._inflight[tenant_id]

    def leave(self, tenant_id: int) -> None:
        with self._lock:
            self._inflight[tenant_id] = max(0, self._inflight[tenant_id] - 1)

    def fail(self, key: str, ttl_s: int, limit: int) -> int:
        with self._lock:
            now = time.monotonic()
            if len(self._failures) > 10_000:  # one process's memory: forget expired counters now and then
                self._failures = {k: v for k, v in self._failures.items() if v[1] > now}
            count, expires = self._failures.get(key, (0, 0.0))
            if expires <= now:
                count, expires = 0, now + ttl_s
            count += 1
            if count == limit:
                expires = now + ttl_s
            self._failures[key] = (count, expires)
            return count

    def failures(self, key: str) -> tuple[int, int]:
        with self._lock:
            count, expires = self._failures.get(key, (0, 0.0))
            left = expires - time.monotonic()
            return (count, math.ceil(left)) if left > 0 else (0, 0)

    def clear(self, key: str) -> None:
        with self._lock:
            self._failures.pop(key, None)


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

    def __enter__(self) -> TenantSlot:
        tenant, store = self.tenant, counters()
        wait = store.admit(tenant.pk, tenant.requests_per_minute)
        if wait:  # None (Redis unreachable) or 0 (admitted) let it through
            raise rate_limited(
                "rate_limit_exceeded",
                f"Rate limit reached: {tenant.requests_per_minute} requests per minute for your organisation.",
                math.ceil(wait),
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
