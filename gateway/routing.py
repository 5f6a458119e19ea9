"""Which queue a job goes to: the worker that owns its adapter, the next choice, or the pool's shared queue.

A pool is the set of workers serving one base for the shared tenants (queue `base.<slug>`), or one
tenant's dedicated workers on that base (`Tenant.dedicated`, workers started with `run_worker --tenant`).
A tenant's requests go only to its pool; a dedicated pool serves no one else.

Inside a pool, with affinity on (the default; `LORAFLEET_AFFINITY=0` is the old shared-queue behaviour),
an adapter's requests go to its *owner*: the live worker with the highest rendezvous (highest-random-weight)
score hash(worker, adapter identity), read from the workers' heartbeats. Every web process computes the
same owner with no coordination, a worker joining or leaving moves only the adapters it gains or loses
(about 1/N of them), and so each adapter is cold-loaded and kept resident on one worker instead of all.

The spill is bounded. A worker's queue depth is the jobs in front of a new one there: waiting in its own
queue plus taken and not finished (its processing lists; one round trip reads them for the whole pool).
When the owner's depth exceeds the threshold — `LORAFLEET_AFFINITY_SPILL_DEPTH` (4), or
`LORAFLEET_AFFINITY_BALANCE` (1.5) times the pool's mean depth if that is more, so a busy pool does not
spill everything (consistent hashing with bounded loads, Mirrokni et al. 2018) — the next choice in the same
order takes the job, up to `LORAFLEET_AFFINITY_CHOICES` (2) workers; past them the job goes to the pool's
shared queue, which every worker of the pool consumes. So a hot adapter runs on up to `choices` workers
before it spreads over the pool, and one hot adapter cannot pile a worker's queue up while others idle.

A worker that dies stops being chosen within one heartbeat TTL: its heartbeat key expires, and a worker
whose key expires before this process would look again (the 1 s cache below) is already left out. Its
adapters then have new owners by the same hash, and what waited in its queue is handed back to the pool's
shared queue by the other workers (inference_worker/consumer.py).
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass

from transport.replies import ChannelUnavailable, pool_queue, reply_channel

LIVE_CACHE_S = 1.0  # how long one web process reuses the list of live workers
TENANT_CACHE_S = 2.0  # how long a tenant's dedicated setting is reused (a change applies within this)


class RoutingUnavailable(RuntimeError):
    """The heartbeats or queue lengths cannot be read (Redis is down)."""


def _setting(name: str, default: str) -> str:
    from django.conf import settings

    value = getattr(settings, name, None)
    if value is None:
        value = os.environ.get(name)
    return default if value in (None, "") else str(value)


@dataclass(frozen=True)
class RoutingConfig:
    affinity: bool = True
    spill_depth: int = 4  # a worker with at most this many jobs in front always takes its adapters' jobs
    balance: float = 1.5  # ... and beyond that, at most this times the pool's mean depth
    choices: int = 2  # workers tried in rendezvous order before the shared queue

    @classmethod
    def from_settings(cls) -> RoutingConfig:
        return cls(affinity=_setting("LORAFLEET_AFFINITY", "1").lower() not in ("0", "false", "no", "off"),
                   spill_depth=max(0, int(_setting("LORAFLEET_AFFINITY_SPILL_DEPTH", "4"))),
                   balance=max(1.0, float(_setting("LORAFLEET_AFFINITY_BALANCE", "1.5"))),
                   choices=max(1, int(_setting("LORAFLEET_AFFINITY_CHOICES", "2"))))

    def threshold(self, depths: list[int]) -> float:
        """The depth above which a worker passes a job on to the next choice."""
        mean = sum(depths) / len(depths) if depths else 0.0
        return max(float(self.spill_depth), self.balance * mean)


@dataclass(frozen=True)
class Route:
    queue: str
    worker_id: str | None  # whose own queue; None for the pool's shared queue
    reason: str  # owner | spill | shared (spilled past every choice) | no_workers | off | base


def rendezvous_score(worker_id: str, key: str) -> int:
    digest = hashlib.blake2b(f"{worker_id}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, worker_ids: list[str]) -> list[str]:
    """Workers from the owner of `key` down: highest-random-weight first (ties, which need a 64-bit
    collision, by id)."""
    return sorted(worker_ids, key=lambda w: (-rendezvous_score(w, key), w))


def choose(key: str | None, workers: list[dict], pool: str, depth_of, config: RoutingConfig) -> Route:
    """The queue for a job of adapter `key` (its identity; None for the base) among the live `workers` of
    `pool` (heartbeat statuses: worker_id, own_queue, processing). `depth_of(lists)` -> the length of each."""
    if not config.affinity:
        return Route(pool, None, "off")
    if key is None:
        return Route(pool, None, "base")  # base-model requests need no adapter: any free worker
    if not workers:
        return Route(pool, None, "no_workers")
    lists = [[w["own_queue"], *w.get("processing", [])] for w in workers]
    lengths = iter(depth_of([name for names in lists for name in names]))
    depth = {w["worker_id"]: sum(next(lengths) for _ in names) for w, names in zip(workers, lists, strict=True)}
    own = {w["worker_id"]: w["own_queue"] for w in workers}
    threshold = config.threshold(list(depth.values()))
    for rank, worker_id in enumerate(rendezvous_order(key, list(own))[: config.choices]):
        if depth[worker_id] <= threshold:
            return Route(own[worker_id], worker_id, "owner" if rank == 0 else "spill")
    return Route(pool, None, "shared")


class Router:
    """One per web process: caches the live workers (LIVE_CACHE_S) and tenants' pool settings."""

    def __init__(self, config: RoutingConfig | None = None):
        self.config = config or RoutingConfig.from_settings()
        self._lock = threading.Lock()
        self._live: tuple[float, list[dict]] = (0.0, [])
        self._tenants: dict[str, tuple[float, str | None]] = {}

    def live_workers(self) -> list[dict]:
        now = time.monotonic()
        with self._lock:
            at, workers = self._live
            if now - at < LIVE_CACHE_S:
                return workers
        try:
            workers = reply_channel().live_workers()
        except ChannelUnavailable as exc:
            raise RoutingUnavailable(str(exc)) from exc
        # Leave out a worker whose heartbeat expires before we look again: within one TTL of its last beat
        # it receives nothing new.
        workers = [w for w in workers if w.get("expires_in_s", LIVE_CACHE_S + 1) > LIVE_CACHE_S]
        with self._lock:
            self._live = (time.monotonic(), workers)
        return workers

    def dedicated_slug(self, tenant_id: str) -> str | None:
        """The tenant's slug when its requests go to its own pool, else None."""
        if not tenant_id:
            return None
        now = time.monotonic()
        with self._lock:
            cached = self._tenants.get(tenant_id)
        if cached is not None and now - cached[0] < TENANT_CACHE_S:
            return cached[1]
        from tenants.models import Tenant

        try:
            pk = int(tenant_id)
        except ValueError:
            return None
        row = Tenant.objects.filter(pk=pk).values_list("slug", "dedicated").first()
        slug = row[0] if row and row[1] else None
        with self._lock:
            self._tenants[tenant_id] = (now, slug)
        return slug

    def route(self, *, base_queue: str, adapter_identity: str | None, tenant_id: str) -> Route:
        pool = pool_queue(base_queue, self.dedicated_slug(tenant_id))
        if not self.config.affinity:
            return Route(pool, None, "off")
        if adapter_identity is None:
            return Route(pool, None, "base")
        workers = [w for w in self.live_workers() if w.get("pool_queue") == pool and w.get("own_queue")]

        def depth_of(lists: list[str]) -> list[int]:
            try:
                return reply_channel().queue_lengths(lists)
            except ChannelUnavailable as exc:
                raise RoutingUnavailable(str(exc)) from exc

        return choose(adapter_identity, workers, pool, depth_of, self.config)
