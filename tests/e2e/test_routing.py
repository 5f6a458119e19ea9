"""The gateway's routing (gateway/routing.py) in isolation: rendezvous ownership, the bounded spill, pools."""
from __future__ import annotations

from collections import Counter

import pytest

from gateway import routing
from gateway.routing import Route, Router, RoutingConfig, choose, rendezvous_order
from transport.replies import own_queue, pool_queue

KEYS = [f"adapter-{i}" for i in range(3000)]


def owners(workers: list[str]) -> dict[str, str]:
    return {k: rendezvous_order(k, workers)[0] for k in KEYS}


def test_every_web_process_computes_the_same_owner_and_the_load_is_even():
    workers = ["base@h1:10", "base@h2:11", "base@h3:12"]
    assert owners(workers) == owners(list(reversed(workers)))  # no coordination: order does not matter
    share = Counter(owners(workers).values())
    assert all(0.29 <= n / len(KEYS) <= 0.38 for n in share.values()), share


def test_a_worker_leaving_or_joining_moves_only_its_own_adapters():
    three = ["base@h1:10", "base@h2:11", "base@h3:12"]
    before = owners(three)
    after = owners(three[1:])  # h1 died
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == three[0] for k in moved)  # only the dead worker's adapters re-home
    assert {k for k in KEYS if before[k] == three[0]} == set(moved)
    four = owners(three + ["base@h4:13"])
    gained = [k for k in KEYS if four[k] != before[k]]
    assert all(four[k] == "base@h4:13" for k in gained)  # a new worker only takes adapters over
    assert 0.19 <= len(gained) / len(KEYS) <= 0.31  # about 1/4 of them


def _workers(*ids: str, pool: str = "base.q") -> list[dict]:
    return [{"worker_id": w, "own_queue": own_queue(pool, w), "pool_queue": pool,
             "processing": [f"lorafleet:processing:{w}:{own_queue(pool, w)}", f"lorafleet:processing:{w}:{pool}"]}
            for w in ids]


def test_the_owner_takes_the_job_until_it_is_deeper_than_the_threshold_then_the_next_then_the_pool():
    workers = _workers("w1", "w2", "w3")
    first, second, third = rendezvous_order("a", ["w1", "w2", "w3"])
    config = RoutingConfig(affinity=True, spill_depth=4, balance=1.5, choices=2)
    lengths: dict[str, int] = {}
    depth_of = lambda lists: [lengths.get(name, 0) for name in lists]  # noqa: E731

    def load(worker: str, waiting: int, taken: int) -> None:
        w = next(x for x in workers if x["worker_id"] == worker)
        lengths[w["own_queue"]] = waiting
        lengths[w["processing"][0]], lengths[w["processing"][1]] = taken, 0

    flat = RoutingConfig(affinity=True, spill_depth=4, balance=1.0, choices=2)
    assert choose("a", workers, "base.q", depth_of, flat) == Route(own_queue("base.q", first), first, "owner")
    load(first, 1, 3)  # 4 jobs in front of it (waiting + running): at the threshold, still the owner
    assert choose("a", workers, "base.q", depth_of, flat).worker_id == first
    load(first, 2, 3)
    assert choose("a", workers, "base.q", depth_of, flat) == Route(own_queue("base.q", second), second, "spill")
    load(second, 0, 6)
    # never the third choice: a hot adapter spreads over `choices` workers, then over the pool's shared queue
    assert choose("a", workers, "base.q", depth_of, flat) == Route("base.q", None, "shared")
    # bounded loads: past the floor, the threshold is 1.5 x the pool's mean depth, so when the whole pool is
    # busy an owner keeps its adapters until it is well above the others
    load(first, 0, 6), load(second, 0, 6), load(third, 0, 6)
    assert choose("a", workers, "base.q", depth_of, config).worker_id == first  # 6 <= 1.5 * 6
    load(first, 4, 6)  # 10 <= 1.5 * mean(10, 6, 6) = 11
    assert choose("a", workers, "base.q", depth_of, config).worker_id == first
    load(first, 8, 6)  # 14 > 1.5 * mean(14, 6, 6) = 13: the next choice
    assert choose("a", workers, "base.q", depth_of, config).worker_id == second


def test_off_base_requests_and_no_live_workers_use_the_pool_queue():
    never = lambda queues: pytest.fail("no queue length is needed")  # noqa: E731
    assert choose("a", _workers("w1"), "base.q", never, RoutingConfig(affinity=False)).queue == "base.q"
    assert choose(None, _workers("w1"), "base.q", never, RoutingConfig()) == Route("base.q", None, "base")
    assert choose("a", [], "base.q", never, RoutingConfig()) == Route("base.q", None, "no_workers")


def test_a_dedicated_pool_has_queues_of_its_own():
    dedicated = pool_queue("base.q", "acme")
    assert dedicated != pool_queue("base.q") == "base.q"
    assert own_queue(dedicated, "w1").startswith(dedicated) and own_queue(dedicated, "w1") != own_queue("base.q", "w1")


class FakeChannel:
    def __init__(self, workers: list[dict], depths: dict[str, int] | None = None):
        self.workers, self.depths = workers, depths or {}
        self.reads = 0

    def live_workers(self):
        self.reads += 1
        return [dict(w) for w in self.workers]

    def queue_lengths(self, queues):
        return [self.depths.get(q, 0) for q in queues]


def test_the_router_sends_a_dedicated_tenant_only_to_its_pool_and_skips_workers_about_to_expire(monkeypatch):
    shared = _workers("s1", "s2")
    mine = _workers("d1", pool="base.q.tenant.acme")
    dying = {**_workers("s3")[0], "expires_in_s": 0.5}  # its heartbeat expires before the cache is read again
    channel = FakeChannel([*(dict(w, expires_in_s=10) for w in shared + mine), dying])
    monkeypatch.setattr(routing, "reply_channel", lambda: channel)
    router = Router(RoutingConfig())
    monkeypatch.setattr(router, "dedicated_slug", lambda tenant_id: "acme" if tenant_id == "7" else None)
    picks = {router.route(base_queue="base.q", adapter_identity=f"a{i}", tenant_id="1").worker_id for i in range(200)}
    assert picks == {"s1", "s2"}  # never the dedicated worker, never the one about to expire
    picks = {router.route(base_queue="base.q", adapter_identity=f"a{i}", tenant_id="7").worker_id for i in range(200)}
    assert picks == {"d1"}
    assert channel.reads == 1  # one read of the heartbeats per LIVE_CACHE_S, not one per request
    channel.workers = [dict(w, expires_in_s=10) for w in shared]  # the dedicated worker is gone
    monkeypatch.setattr(routing, "LIVE_CACHE_S", 0.0)
    assert router.route(base_queue="base.q", adapter_identity="a1", tenant_id="7") == \
        Route("base.q.tenant.acme", None, "no_workers")  # it waits in its own pool, never the shared one
