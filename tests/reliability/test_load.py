"""Load: 64 concurrent clients across 4 tenants on the real stack, one tenant sending 10x its quota.

Two phases of equal length on the same stack — without the flood, then with it — so the others'
p95 latency is compared side by side. The flooding tenant must get 429 with Retry-After, the others
must not notice (p95 within 10% in `make faults`; the short run in `make test` is too short and too
noisy on 2 shared cores for any latency bound and only records the ratio), non-429 errors
stay under 0.1%, and the queue drains afterwards.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import redis

from tests.e2e.conftest import wait_until

FULL = os.environ.get("LORAFLEET_FAULTS_FULL", "").lower() in ("1", "true", "yes")
PHASE_S = 300 if FULL else 12  # full: the 5-minute run with the flood, after a 5-minute baseline
# The latency bound is a benchmark figure, asserted only in the full run (`make faults`): 12 s phases on
# a shared 2-core CI box swing by more than 50% with no flood at all, and timed tests must not flake.
P95_BOUND = 1.10 if FULL else None
CLIENTS_PER_TENANT = 16
QUOTA_PER_MIN = 120          # the flooding tenant's requests_per_minute
FLOOD_PER_S = 10 * QUOTA_PER_MIN / 60
THINK_S = 3.0                # the polite tenants' clients pause between requests

# two phases, the warm-up and the drain, plus the stack's start: beyond the suite's default per-test timeout
pytestmark = pytest.mark.timeout(2 * PHASE_S + 480)

SETUP = """
from pathlib import Path
from adapters.models import BaseModel
from adapters.services import create_adapter
from adapters.uploads import create_adapter_version
from gateway.services import issue_api_key
from tenants.services import create_tenant
base = BaseModel.objects.get(slug=BASE)
result = {}
for name in ("p1", "p2", "p3", "flood"):
    tenant = create_tenant(f"load-{name}-{SUFFIX}", name)
    tenant.requests_per_minute = QUOTA if name == "flood" else 100000
    tenant.save()
    adapter = create_adapter(tenant, f"{name}-bot", base)
    folder = Path(ROOT) / "peft-1"
    with open(folder / "adapter_config.json", "rb") as c, open(folder / "adapter_model.safetensors", "rb") as w:
        create_adapter_version(adapter, config_file=c, weights_file=w)
    _, key = issue_api_key(tenant, "load")
    result[name] = {"key": key, "model": adapter.name}
"""


@pytest.fixture(scope="module")
def tenants(rel_stack):
    code = (f"BASE={rel_stack.seed['bases']['main']['slug']!r}; SUFFIX={rel_stack.suffix!r}; "
            f"ROOT={str(rel_stack.root)!r}; QUOTA={QUOTA_PER_MIN}\n" + SETUP)
    return rel_stack.stack.django(code)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def _phase(url: str, tenants: dict, *, flood: bool) -> list[dict]:
    """One phase: the three polite tenants' 48 clients in this process (their latencies are what is
    measured), the fourth tenant's 16 clients in a process of their own — flooding, or polite in the
    baseline — so that the flood's client-side work never holds this process's GIL and inflates the
    latencies measured here (a real flooder is another machine; on this box it still shares the CPUs)."""
    outcomes: list[dict] = []
    lock = threading.Lock()
    fourth = subprocess.Popen([sys.executable, "-c", FOURTH_TENANT, json.dumps({
        "url": url, "key": tenants["flood"]["key"], "model": tenants["flood"]["model"], "clients": CLIENTS_PER_TENANT,
        "seconds": PHASE_S, "period": CLIENTS_PER_TENANT / FLOOD_PER_S if flood else 10.0})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = time.monotonic() + PHASE_S

    def client(name: str, i: int):
        t = tenants[name]
        with httpx.Client(timeout=120) as http:
            n = 0
            while time.monotonic() < stop:
                started = time.monotonic()
                n += 1
                try:
                    r = http.post(url + "/v1/completions", headers={"Authorization": f"Bearer {t['key']}"},
                                  json={"model": t["model"], "prompt": f"{name} {i} {n}", "max_tokens": 4,
                                        "temperature": 0})
                    out = {"tenant": name, "status": r.status_code, "retry_after": r.headers.get("Retry-After")}
                except Exception as exc:
                    out = {"tenant": name, "status": None, "error": repr(exc)}
                out["seconds"] = time.monotonic() - started
                with lock:
                    outcomes.append(out)
                time.sleep(max(0.0, min(THINK_S, stop - time.monotonic())))

    threads = [threading.Thread(target=client, args=(name, i), daemon=True)
               for name in ("p1", "p2", "p3") for i in range(CLIENTS_PER_TENANT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=PHASE_S + 150)
    assert not any(t.is_alive() for t in threads), "a client never got an answer"
    try:
        out, err = fourth.communicate(timeout=150)
    finally:
        if fourth.poll() is None:
            fourth.kill()
    assert fourth.returncode == 0, err[-3000:]
    return outcomes + [{"tenant": "flood", **o} for o in json.loads(out)]


# The fourth tenant's clients: each sends, then sleeps what is left of its period (flooding: 16 clients
# x 0.8 s period = 20/s; polite baseline: one request per 10 s per client). Prints the outcomes as JSON.
FOURTH_TENANT = """
import json, sys, threading, time
import httpx
a = json.loads(sys.argv[1])
stop, outcomes, lock = time.monotonic() + a["seconds"], [], threading.Lock()
def client(i):
    with httpx.Client(timeout=120) as http:
        n = 0
        while time.monotonic() < stop:
            started, n = time.monotonic(), n + 1
            try:
                r = http.post(a["url"] + "/v1/completions", headers={"Authorization": "Bearer " + a["key"]},
                              json={"model": a["model"], "prompt": f"flood {i} {n}", "max_tokens": 4, "temperature": 0})
                out = {"status": r.status_code, "retry_after": r.headers.get("Retry-After")}
            except Exception as exc:
                out = {"status": None, "error": repr(exc)}
            out["seconds"] = time.monotonic() - started
            with lock:
                outcomes.append(out)
            time.sleep(max(0.0, min(a["period"] - out["seconds"], stop - time.monotonic())))
threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a["clients"])]
for t in threads:
    t.start()
for t in threads:
    t.join(a["seconds"] + 140)
print(json.dumps(outcomes))
"""


def _warm_up(url: str, tenants: dict) -> None:
    """Every tenant's adapter answers once before measuring, so neither phase pays the cold loads."""
    for t in tenants.values():
        r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {t['key']}"}, timeout=120,
                       json={"model": t["model"], "prompt": "warm", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text


def test_one_tenant_flooding_does_not_hurt_the_others(rel_stack, tenants):
    _warm_up(rel_stack.url, tenants)
    baseline = _phase(rel_stack.url, tenants, flood=False)
    flooded = _phase(rel_stack.url, tenants, flood=True)

    polite = lambda outcomes: [o for o in outcomes if o["tenant"] != "flood"]  # noqa: E731
    for outcomes in (baseline, flooded):
        errors = [o for o in polite(outcomes) if o["status"] != 200]
        assert len(errors) <= 0.001 * len(polite(outcomes)), errors[:3]
    floods = [o for o in flooded if o["tenant"] == "flood"]
    refused = [o for o in floods if o["status"] == 429]
    assert refused, "the flooding tenant was never limited"
    assert all(o["retry_after"] and int(o["retry_after"]) > 0 for o in refused)
    assert all(o["status"] in (200, 429) for o in floods), {o["status"] for o in floods}
    windows = int(PHASE_S // 60) + 2  # fixed one-minute windows the phase can touch
    assert len(floods) - len(refused) <= QUOTA_PER_MIN * windows

    base_p95 = _p95([o["seconds"] for o in polite(baseline)])
    flood_p95 = _p95([o["seconds"] for o in polite(flooded)])
    ratio = flood_p95 / base_p95

    queue = rel_stack.seed["bases"]["main"]["queue"]
    broker = redis.Redis.from_url(rel_stack.env["CELERY_BROKER_URL"])
    drained = wait_until(lambda: broker.llen(queue) == 0 and 1, 30, "the queue to drain")
    print(f"\nload: 64 clients x 4 tenants, {PHASE_S}s per phase; polite tenants {len(polite(baseline))} requests "
          f"(p95 {base_p95:.3f}s) without the flood, {len(polite(flooded))} (p95 {flood_p95:.3f}s) with it: ratio "
          f"{ratio:.2f}; flooder sent {len(floods)} ({len(floods) / PHASE_S:.1f}/s vs quota {QUOTA_PER_MIN}/min), "
          f"{len(refused)} got 429 + Retry-After; non-429 errors 0; queue drained: {bool(drained)}")
    if P95_BOUND is not None:
        assert ratio <= P95_BOUND, f"the others' p95 went from {base_p95:.3f}s to {flood_p95:.3f}s"


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_the_quota_is_a_rate_not_a_count_per_clock_minute(store):
    """A fixed per-minute window let the flooder spend its whole quota in the first seconds of every
    minute (10x its rate, a tenth of the time) — which the other tenants' p95 felt. Now: a minute's
    quota at once, then one request per 60/quota s, with Retry-After the time to the next one."""
    import secrets

    from gateway import limits
    from tests.conftest import REDIS_URL, _reachable, require_service

    if store == "redis":
        from urllib.parse import urlparse

        parsed = urlparse(REDIS_URL)
        require_service(f"Redis at {REDIS_URL}", _reachable(parsed.hostname or "127.0.0.1", parsed.port or 6379))
        counters = limits.RedisCounters(REDIS_URL)
    else:
        counters = limits.LocalCounters()
    tenant = 10**9 + secrets.randbelow(10**9)  # a tenant id no real row has
    quota = 120                                # 0.5 s per request
    assert all(counters.admit(tenant, quota) == 0 for _ in range(quota))  # the burst: a minute's quota
    wait = counters.admit(tenant, quota)
    assert 0.3 < wait <= 0.5                   # refused, and told when the next one is admitted
    time.sleep(wait + 0.05)
    assert counters.admit(tenant, quota) == 0  # exactly one more, not a new minute's 120
    assert counters.admit(tenant, quota) > 0
    assert counters.admit(tenant + 1, quota) == 0  # per tenant
