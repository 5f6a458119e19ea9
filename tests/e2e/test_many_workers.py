"""Many workers on one base (issue 18): adapter affinity, failover after kill -9, a dedicated tenant pool.

A stack of its own over the e2e session's database: a private redis-server (never the shared one), a base
with queues of its own, gunicorn webs with affinity on and off, and three worker processes on the tiny
base. Each worker's memory holds about a
third of the 200-adapter fleet (`--memory-gb` for the device pool, `--host-cache-mb` for parsed blobs),
the regime the issue is about: a fleet larger than any one worker.

- Affinity: the same Zipf(1.1) request sequence through the shared queue (LORAFLEET_AFFINITY=0) and with
  affinity, each on three fresh workers: after a warm-up, cold loads per 1,000 requests with affinity are at
  most half the shared queue's, and no adapter is resident on more than 2 workers.
- Failover: one of the three killed with SIGKILL under traffic: every request answered 200 (none lost,
  none left pending, none answered twice), the jobs it held come back through the reaper, none of them
  published more than one heartbeat TTL after the kill, and its adapters are answered by the others.
- Dedicated pool: a tenant with `dedicated` on is answered only by its `run_worker --tenant` worker, which
  answers no one else; with that worker gone its requests wait (504), never reaching the shared workers.

Short sizes in `make test`; LORAFLEET_FAULTS_FULL=1 runs the issue's full sizes.
"""
from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import psycopg
import pytest
import redis
from psycopg.rows import dict_row

from tests.e2e.conftest import (
    PYTHON,
    Proc,
    Stack,
    _reachable,
    _require,
    bearer,
    free_port,
    metrics_token,
    wait_until,
    worker_metric,
)
from tests.support.traffic import Traffic

FULL = os.environ.get("LORAFLEET_FAULTS_FULL", "").lower() in ("1", "true", "yes")
ADAPTERS = 200
ZIPF_S = 1.1
CLIENTS = 16 if FULL else 8
WARMUP = 1000 if FULL else 300  # requests before the measured window (compulsory first loads)
MEASURED = 3000 if FULL else 500  # the window cold loads per 1,000 requests are measured over
KILL_TRAFFIC_S = 40 if FULL else 14  # the failover phase; the kill comes at a third of it
HEARTBEAT_S, HEARTBEAT_TTL_S = 1, 4  # fast failover for the test (defaults: 5 s and 15 s)
pytestmark = pytest.mark.timeout(2400 if FULL else 900)  # 200 adapters to seed, 7 worker starts on 2 cores
WORKER_ARGS = ("--concurrency", "16",
               # the device pool: 82 pages of 8 KB beside the tiny base's weights and workspace (0.0004 GiB of it
               # the CPU runner's per-layer copies of its small ops' outputs), ~40 of these adapters (1-3 pages
               # each) beside the KV blocks of 16 requests
               "--memory-gb", "0.0069",
               # parsed blobs kept in host memory: ~40 of these adapters (8-22 KB each)
               "--host-cache-mb", "0.6")

# A base of its own (its own queues), a tenant with a key and 200 adapters, fast: one real PEFT folder per rank
# (4, 8, 12), then each adapter redraws its tensors at random (std 1/sqrt(fan_in), as
# tests/support/peft_factory.py does) into a copy of that folder.
FLEET_SEED = """
import shutil
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from adapters.services import create_adapter, register_base_model
from adapters.uploads import create_adapter_version
from gateway.services import issue_api_key
from tenants.models import Tenant
from tenants.services import create_tenant
from tests.support.peft_factory import make_random_peft_adapter
base = register_base_model({base!r}, {checkpoint!r}, queue_name={queue!r})
tenant = create_tenant({tenant!r}, "Fleet")
Tenant.objects.filter(pk=tenant.pk).update(requests_per_minute=10**6, max_concurrent_requests=1000)
_, key = issue_api_key(tenant, "fleet")
work = Path({work!r})
templates = {{r: make_random_peft_adapter({checkpoint!r}, work / f"template-{{r}}", r=r, alpha=16,
                                        target_modules=("q_proj", "v_proj"), seed=r) for r in (4, 8, 12)}}
names = []
for i in range({n}):
    r = 4 + 4 * (i % 3)
    folder = work / f"fleet-{{i}}"
    shutil.copytree(templates[r], folder)
    gen = torch.Generator().manual_seed(1000 + i)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    save_file({{k: torch.randn(v.shape, generator=gen) / v.shape[1] ** 0.5 for k, v in tensors.items()}},
              str(folder / "adapter_model.safetensors"), metadata={{"format": "pt"}})
    adapter = create_adapter(tenant, f"z-{{i:03d}}", base)
    with open(folder / "adapter_config.json", "rb") as c, open(folder / "adapter_model.safetensors", "rb") as w:
        create_adapter_version(adapter, config_file=c, weights_file=w)
    names.append(adapter.name)
result = {{"names": names, "key": key, "base": base.slug, "queue": base.queue_name}}
"""

DEDICATED_TENANT = """
from adapters.models import BaseModel
from adapters.services import create_adapter
from adapters.uploads import create_adapter_version
from gateway.services import issue_api_key
from tenants.models import Tenant
from tenants.services import create_tenant
tenant = create_tenant({slug!r}, "Dedicated")
Tenant.objects.filter(pk=tenant.pk).update(dedicated=True, requests_per_minute=10**6)
base = BaseModel.objects.get(slug={base!r})
adapter = create_adapter(tenant, "d-0", base)
with open({folder!r} + "/adapter_config.json", "rb") as c, open({folder!r} + "/adapter_model.safetensors", "rb") as w:
    create_adapter_version(adapter, config_file=c, weights_file=w)
_, secret = issue_api_key(tenant, "dedicated")
result = {{"id": tenant.pk, "slug": tenant.slug, "key": secret}}
"""


@contextmanager
def fleet_stack(base_env: dict, checkpoint: Path, django, root: Path):
    """The fleet over an existing stack's database (base_env's DATABASE_URL, storage, checkpoint): a private
    redis-server, a base with queues of its own, a tenant and ADAPTERS adapters. Webs and workers are started
    by the tests; all are stopped here."""
    binary = shutil.which("redis-server")
    _require("redis-server binary", binary is not None)
    suffix = "f" + secrets.token_hex(3)
    port = free_port()
    broker = Proc("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                            "--dir", str(root)], dict(os.environ), root)
    broker_url = f"redis://127.0.0.1:{port}/0"
    env = {**base_env, "CELERY_BROKER_URL": broker_url, "LORAFLEET_REQUEST_TIMEOUT_S": "60",
           "LORAFLEET_MAX_ATTEMPTS": "3", "LORAFLEET_HEARTBEAT_S": str(HEARTBEAT_S),
           "LORAFLEET_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S)}
    env.pop("LORAFLEET_AFFINITY", None)
    stack = Stack(root, env)
    try:
        wait_until(lambda: _reachable(broker_url, port), 20, "redis-server up", (broker,))
        seeded = django(FLEET_SEED.format(base=f"fleet-{suffix}", queue=f"e2e.fleet.{suffix}", tenant=f"fleet-{suffix}",
                                          checkpoint=str(checkpoint), work=str(root), n=ADAPTERS))
        yield SimpleNamespace(stack=stack, env=env, root=root, base=seeded["base"], queue=seeded["queue"],
                              models=seeded["names"], key=seeded["key"], broker=redis.Redis.from_url(broker_url),
                              db_url=env["DATABASE_URL"], checkpoint=checkpoint, suffix=suffix, django=django,
                              workers_started=[])
    finally:
        stack.close()
        broker.kill()


@pytest.fixture(scope="module")
def fleet(e2e, tmp_path_factory):
    """Over the e2e session's database (already migrated); tests/reliability/test_faults.py builds one over its own."""
    with fleet_stack(e2e.env, e2e.checkpoint, e2e.stack.django, tmp_path_factory.mktemp("fleet")) as fl:
        yield fl


@pytest.fixture(autouse=True)
def own_workers(fleet):
    """Each test starts its own workers; whatever it started is stopped when it ends, failed or not, so a test
    that fails half-way leaves no worker to answer the next test's requests."""
    yield
    while fleet.workers_started:
        fleet.workers_started.pop().stop()


# ---- helpers ----------------------------------------------------------------------------------------

def start_web(fl, name: str, affinity: bool) -> str:
    """A gunicorn web of its own, with adapter affinity on or off (LORAFLEET_AFFINITY)."""
    stack = Stack(fl.root, {**fl.env, "LORAFLEET_AFFINITY": "1" if affinity else "0"})
    url = stack.start_web(name)
    fl.stack.procs.extend(stack.procs)  # stopped with the fleet
    return url


def start_workers(fl, n: int, tag: str, args: tuple[str, ...] = WORKER_ARGS, env: dict | None = None) -> list:
    """n worker processes started together (their start-up overlaps), each with .worker_id from its heartbeat."""
    workers = []
    for i in range(n):
        port = free_port()
        proc = Proc(f"worker-{tag}-{i}", [PYTHON, "manage.py", "run_worker", "--base", fl.base, "--metrics-port",
                                          str(port), "--loglevel", "WARNING", *args], {**fl.env, **(env or {})},
                    fl.root)
        fl.stack.procs.append(proc)
        fl.workers_started.append(proc)
        workers.append(SimpleNamespace(proc=proc, metrics_url=f"http://127.0.0.1:{port}/metrics",
                                       metrics_token=metrics_token({**fl.env, **(env or {})})))
    procs = tuple(w.proc for w in workers)
    wait_until(lambda: len(live(fl, {p.popen.pid for p in procs})) == n, 180, f"{n} workers' heartbeats", procs)
    for w in workers:
        w.worker_id = live(fl, {w.proc.popen.pid})[0]["worker_id"]
        wait_until(lambda w=w: httpx.get(w.metrics_url, headers=bearer(w.metrics_token), timeout=2).status_code == 200,
                   60, "metrics", (w.proc,))
    return workers


def live(fl, pids: set[int] | None = None) -> list[dict]:
    out = []
    for key in fl.broker.scan_iter("lorafleet:worker:*"):
        value = fl.broker.get(key)
        if value:
            status = json.loads(value)
            if pids is None or status["pid"] in pids:
                out.append(status)
    return out


def stop(workers) -> None:
    for w in workers:
        w.proc.stop()


def zipf_sequence(models: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(len(models))]
    return rng.choices(models, weights=weights, k=n)


def Clients(fl, url: str, sequence: list[str] | None = None, seed: int = 0) -> Traffic:  # noqa: N802
    """CLIENTS client threads sending completions, from a fixed sequence of adapters (shared by the clients,
    each taken once) or (sequence=None) a Zipf stream until stopped; every outcome recorded."""
    lock, taken = threading.Lock(), [0]
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(len(fl.models))]

    def next_model(client: int, turn: int) -> str | None:
        with lock:
            if sequence is not None:
                if taken[0] >= len(sequence):
                    return None
                taken[0] += 1
                return sequence[taken[0] - 1]
            return rng.choices(fl.models, weights=weights)[0]

    return Traffic(url, fl.key, next_model, CLIENTS, timeout=120, join_s=200, until_stopped=sequence is None)


def run_sequence(fl, url: str, sequence: list[str]) -> list[dict]:
    with Clients(fl, url, sequence) as clients:
        pass
    return clients.outcomes


def loads(workers) -> dict[str, float]:
    """Summed over the workers: cold loads (storage -> verified -> host) and device loads (host -> pool)."""
    return {"cold": sum(worker_metric(w, "lorafleet_worker_cache_misses_total") for w in workers),
            "device": sum(worker_metric(w, "lorafleet_worker_cache_device_loads_total") for w in workers)}


def residency(fl, workers) -> Counter:
    """adapter identity -> on how many of `workers` it is resident now (from their heartbeats)."""
    time.sleep(HEARTBEAT_S * 1.5)  # a beat after the traffic
    counts: Counter = Counter()
    for status in live(fl, {w.proc.popen.pid for w in workers}):
        counts.update({a["identity"] for a in status["resident_adapters"]})
    return counts


def audit_rows(fl, request_ids: list[str]) -> dict[str, list[dict]]:
    with psycopg.connect(fl.db_url, row_factory=dict_row) as conn:
        rows = conn.execute("SELECT request_id::text AS rid, status, http_status, error_code, attempts, worker_id "
                            "FROM gateway_auditrecord WHERE request_id::text = ANY(%s)", (request_ids,)).fetchall()
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["rid"], []).append(row)
    return out


def assert_all_answered_once(fl, outcomes: list[dict]) -> dict[str, dict]:
    """Every request a 200, exactly one final audit row each, no request id twice; -> request id -> row."""
    failed = [o for o in outcomes if o["status"] != 200]
    assert not failed, failed[:5]
    ids = [o["request_id"] for o in outcomes]
    assert len(ids) == len(set(ids)), "two answers carried one request id"
    rows = audit_rows(fl, ids)
    assert sorted(rows) == sorted(ids), "a request has no audit row"
    twice = [rid for rid, rs in rows.items() if len(rs) != 1]
    assert not twice, twice[:3]
    pending = [rid for rid, rs in rows.items() if rs[0]["status"] != "ok" or rs[0]["http_status"] != 200]
    assert not pending, pending[:3]
    return {rid: rs[0] for rid, rs in rows.items()}


# ---- the tests --------------------------------------------------------------------------------------

def test_three_workers_affinity_halves_cold_loads_and_a_sigkilled_worker_loses_nothing(fleet):
    affinity_and_failover(fleet)


def affinity_and_failover(fl) -> None:
    """The whole scenario (tests/reliability/test_faults.py runs it at full sizes)."""
    sequence = zipf_sequence(fl.models, WARMUP + MEASURED, seed=18)
    figures, urls = {}, {}
    for mode in ("shared", "affinity"):
        url = urls[mode] = start_web(fl, f"web-{mode}", affinity=mode == "affinity")
        workers = start_workers(fl, 3, mode)
        started = time.monotonic()
        warm = run_sequence(fl, url, sequence[:WARMUP])
        before = loads(workers)
        measured = run_sequence(fl, url, sequence[WARMUP:])
        after = loads(workers)
        elapsed = time.monotonic() - started
        rows = assert_all_answered_once(fl, warm + measured)
        resident = residency(fl, workers)
        figures[mode] = SimpleNamespace(
            cold_per_1k=1000 * (after["cold"] - before["cold"]) / MEASURED,
            device_per_1k=1000 * (after["device"] - before["device"]) / MEASURED,
            cold_total=after["cold"], resident_max=max(resident.values()), seconds=elapsed,
            workers_used=len({r["worker_id"] for r in rows.values()}),
            spread=Counter(r["worker_id"] for r in rows.values()))
        if mode == "shared":
            stop(workers)
    shared, affinity = figures["shared"], figures["affinity"]
    print(f"\n3 workers, {ADAPTERS} adapters, Zipf({ZIPF_S}), {CLIENTS} clients, {WARMUP} warm-up + {MEASURED} "
          f"measured requests per run:")
    for mode, f in figures.items():
        print(f"  {mode:8s}: cold loads {f.cold_per_1k:.0f}/1k requests (device loads {f.device_per_1k:.0f}/1k; "
              f"{f.cold_total:.0f} over the whole run), most workers one adapter is resident on: {f.resident_max}, "
              f"{f.seconds:.1f} s, requests per worker {sorted(f.spread.values())}")
    print(f"  affinity / shared cold loads: {affinity.cold_per_1k / max(shared.cold_per_1k, 1e-9):.2f} (bound 0.5)")
    assert shared.workers_used == affinity.workers_used == 3, "every worker took part in both runs"
    assert affinity.cold_per_1k <= 0.5 * shared.cold_per_1k
    assert affinity.resident_max <= 2

    # --- failover: kill -9 one of the three affinity workers under Zipf traffic -------------------
    victim = workers[0]
    others = workers[1:]
    url = urls["affinity"]
    fl.broker.delete("lorafleet:reclaimed")
    with Clients(fl, url, seed=7) as clients:
        time.sleep(KILL_TRAFFIC_S / 3)
        victim.proc.kill(signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(KILL_TRAFFIC_S * 2 / 3)
    outcomes = clients.outcomes
    rows = assert_all_answered_once(fl, outcomes)
    reclaimed = [json.loads(x) for x in fl.broker.lrange("lorafleet:reclaimed", 0, -1)]
    mine = [r for r in reclaimed if r["worker"] == victim.worker_id]
    by_id = {o["request_id"]: o for o in outcomes}
    published_late = [r for r in mine if by_id.get(r["request_id"], {}).get("started", 0) > killed_at + HEARTBEAT_TTL_S]
    assert not published_late, published_late[:3]
    redelivered = [r for r in mine if r["request_id"] in by_id]
    # A job the victim had taken may carry its answer: the kill can fall between publishing a final answer and
    # acknowledging the job (LREM), and the job then comes back through the reaper already done, is not run
    # again, and its one answer is the victim's, given on its first delivery. A job still queued for it was never
    # started there: the others answer it.
    answered_by_victim = [r for r in redelivered if rows[r["request_id"]]["worker_id"] == victim.worker_id]
    assert all(r["was"] == "taken" and rows[r["request_id"]]["attempts"] == 1 for r in answered_by_victim), \
        [(r, rows[r["request_id"]]) for r in answered_by_victim]
    # the victim's adapters: those it answered before the kill; after one TTL the others answer them
    owned = {o["model"] for o in outcomes if rows[o["request_id"]]["worker_id"] == victim.worker_id}
    after = [o for o in outcomes if o["started"] > killed_at + HEARTBEAT_TTL_S + 1]
    rehomed = {o["model"] for o in after if o["model"] in owned}
    assert owned and rehomed, "the killed worker owned adapters that were asked for again after it died"
    other_ids = {w.worker_id for w in others}
    late = [(o, rows[o["request_id"]]["worker_id"]) for o in after if rows[o["request_id"]]["worker_id"] not in other_ids]
    assert not late, (late[:3], victim.worker_id)
    attempts = Counter(rows[o["request_id"]]["attempts"] for o in outcomes)
    unstarted = sum(rows[r["request_id"]]["attempts"] == 1 for r in redelivered
                    if r["was"] == "taken" and r not in answered_by_victim)
    print(f"  kill -9 of one worker under {CLIENTS} clients: {len(outcomes)} requests, all 200, 0 lost, 0 pending, "
          f"0 answered twice; {len(mine)} of its jobs handed back ({dict(Counter(r['was'] for r in mine))}; {unstarted} "
          f"taken but not yet started), "
          f"{len(redelivered) - len(answered_by_victim)} of them answered by the others, "
          f"{len(answered_by_victim)} answered by it before the kill (only the acknowledgement lost); "
          f"attempts {dict(attempts)}; {len(owned)} adapters it owned, {len(rehomed)} of them asked for again after "
          f"the kill and answered by the other two; slowest "
          f"{max(o['seconds'] for o in outcomes):.1f} s")
    stop(workers)


def test_a_dedicated_tenant_is_served_only_by_its_own_worker(fleet):
    from tests.support.peft_factory import make_random_peft_adapter

    fl = fleet
    folder = make_random_peft_adapter(fl.checkpoint, fl.root / "dedicated-peft", r=8, alpha=16,
                                      target_modules=("q_proj", "v_proj"), seed=77)
    tenant = fl.django(DEDICATED_TENANT.format(slug=f"ded-{fl.suffix}", base=fl.base, folder=str(folder)))
    url = start_web(fl, "web-dedicated", affinity=True)
    shared = start_workers(fl, 2, "shared-pool")  # the dedicated worker's start-up after theirs: ids in order
    dedicated = start_workers(fl, 1, "dedicated", args=WORKER_ARGS + ("--tenant", tenant["slug"]))[0]
    assert live(fl, {dedicated.proc.popen.pid})[0]["tenant"] == tenant["slug"]

    def send(key: str, model: str, n: int, timeout: str = "60") -> list[httpx.Response]:
        out = []
        with httpx.Client(timeout=120) as http:
            for i in range(n):
                out.append(http.post(url + "/v1/completions", json={"model": model, "prompt": f"turn {i}",
                                                                     "max_tokens": 2},
                                     headers={"Authorization": f"Bearer {key}", "X-Lorafleet-Timeout": timeout}))
        return out

    mixed: list[tuple[str, httpx.Response]] = []
    threads = [threading.Thread(target=lambda: mixed.extend(("ded", r) for r in send(tenant["key"], "d-0", 20))),
               threading.Thread(target=lambda: mixed.extend(("shared", r) for r in send(fl.key, fl.models[0], 10))),
               threading.Thread(target=lambda: mixed.extend(("shared", r) for r in send(fl.key, fl.models[1], 10)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r.status_code == 200 for _, r in mixed), [r.text[:200] for _, r in mixed if r.status_code != 200]
    rows = audit_rows(fl, [r.headers["X-Lorafleet-Request-Id"] for _, r in mixed])
    answered_by = {who: Counter(rows[r.headers["X-Lorafleet-Request-Id"]][0]["worker_id"] for w, r in mixed if w == who)
                   for who in ("ded", "shared")}
    assert set(answered_by["ded"]) == {dedicated.worker_id}, answered_by
    assert dedicated.worker_id not in answered_by["shared"], answered_by
    shared_ids = {w.worker_id for w in shared}
    assert set(answered_by["shared"]) <= shared_ids
    # its worker's own count says the same: 20 jobs, all of its tenant
    tasks = wait_until(lambda: (t := live(fl, {dedicated.proc.popen.pid})[0]["tasks"]) and sum(t.values()) >= 20 and t,
                       10, "a heartbeat after the traffic")
    assert tasks == {"ok": 20}, tasks

    # without its worker, the tenant's requests wait (and time out, recorded) — never served by the shared pool
    dedicated.proc.kill(signal.SIGKILL)
    # the shared workers' counts once their heartbeats show all 20 shared jobs (a heartbeat can lag the answers)
    def shared_counts() -> dict[str, dict[str, int]]:
        return {s["worker_id"]: dict(s["tasks"]) for s in live(fl, {w.proc.popen.pid for w in shared})}

    before = wait_until(lambda: (c := shared_counts()) and sum(sum(t.values()) for t in c.values()) >= 20 and c,
                        10, "the shared workers' heartbeats after the traffic")
    lonely = send(tenant["key"], "d-0", 2, timeout="3")
    assert [r.status_code for r in lonely] == [504, 504], [r.text[:200] for r in lonely]
    time.sleep(HEARTBEAT_S * 1.5)
    after = shared_counts()
    assert after == before
    print(f"\ndedicated pool: tenant {tenant['slug']}: 20/20 answered by {dedicated.worker_id}; the shared tenant's 20 by "
          f"{dict(answered_by['shared'])}; with its worker killed, 2/2 requests 504 and the shared workers ran none")
    stop(shared)
