"""Worker and broker faults on a private stack: its own redis-server on a free port (never the shared
one on 6379), a gunicorn web and a worker over rel_stack's database and blobs. Traffic is real HTTP
on 127.0.0.1; every test bounds its duration and stops what it started.

- Worker faults: the worker is killed with SIGKILL while clients keep sending over 20 adapters; a new
  one is started each time. Every accepted request ends answered (200) or with an explicit error code,
  none is lost or left pending in the audit log, and none is answered twice; every adapter is served.
  No job ends as a 504: what a killed worker had taken (even a job Redis had just handed it) is in its
  processing list (inference_worker/consumer.py) and is run by the next worker once its heartbeat expires.
- Broker faults: redis-server is killed under traffic. While it is down every request is a 503 within
  2 s and on the record; after it returns, requests are answered again within 30 s, no manual step.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
import redis

from tests.e2e.conftest import Proc, Stack, _reachable, free_port, wait_until
from tests.e2e.test_many_workers import affinity_and_failover, audit_rows, fleet_stack
from tests.support.traffic import Traffic

FULL = os.environ.get("LORAFLEET_FAULTS_FULL", "").lower() in ("1", "true", "yes")
KILLS = 5 if FULL else 1
CLIENTS = 16 if FULL else 8
KILL_EVERY_S = 20 if FULL else 4
OUTAGE_S = 60 if FULL else 4
ADAPTERS = 20               # the fleet: rel_stack's 2 plus 18 uploaded here
MIN_REQUESTS = 1000 if FULL else 0  # the figure, asserted in the full run
EXPLICIT_ERRORS = {"worker_lost", "timeout", "queue_unavailable", "internal_error", "adapter_load_failed",
                   "engine_stopped", "cancelled"}


class PrivateRedis:
    """redis-server on one fixed free port that a test may kill and start again."""

    def __init__(self, root):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is needed for the broker fault tests") if os.environ.get("CI") else \
                pytest.skip("redis-server binary not available")
        self.binary, self.root, self.port = binary, root, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self):
        self.proc = Proc("redis", [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", str(self.root)], dict(os.environ), self.root)
        wait_until(lambda: _reachable(self.url, self.port), 20, "redis-server up", (self.proc,))

    def kill(self):
        self.proc.kill(signal.SIGKILL)


MORE_ADAPTERS = """
from pathlib import Path
from adapters.models import BaseModel
from adapters.services import create_adapter
from adapters.uploads import create_adapter_version
from tests.support.peft_factory import make_random_peft_adapter
from tenants.models import Tenant
tenant, base = Tenant.objects.get(slug={tenant!r}), BaseModel.objects.get(slug={base!r})
names = []
for i in range({n}):
    folder = make_random_peft_adapter({checkpoint!r}, Path({work!r}) / f"fleet-{{i}}", r=4 + 4 * (i % 3),
                                      alpha=16, target_modules=("q_proj", "v_proj"), seed=100 + i)
    adapter = create_adapter(tenant, f"fleet-{{i:02d}}", base)
    with open(folder / "adapter_config.json", "rb") as c, open(folder / "adapter_model.safetensors", "rb") as w:
        create_adapter_version(adapter, config_file=c, weights_file=w)
    names.append(adapter.name)
result = {{"names": names}}
"""


HEARTBEAT_S, HEARTBEAT_TTL_S = 1, 5  # a killed worker's jobs come back within ~6 s (defaults: 5 s and 15 s)


def start_worker(stack, base: str, name: str):
    # a pool that holds all 20 adapters beside the KV blocks (tiny base), small enough for several workers
    return stack.start_worker(base, name, args=("--memory-gb", "0.05"))


@pytest.fixture(scope="module")
def fault_stack(rel_stack, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    broker = PrivateRedis(root)
    env = {**rel_stack.env, "CELERY_BROKER_URL": broker.url, "LORAFLEET_MAX_ATTEMPTS": "3",
           "LORAFLEET_HEARTBEAT_S": str(HEARTBEAT_S), "LORAFLEET_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S),
           "LORAFLEET_REQUEST_TIMEOUT_S": "30"}
    stack = Stack(root, env)
    try:
        base = rel_stack.seed["bases"]["main"]["slug"]
        models = sorted(rel_stack.seed["adapters"]) + stack.django(MORE_ADAPTERS.format(
            tenant=rel_stack.seed["tenants"]["a"]["slug"], base=base, checkpoint=str(rel_stack.checkpoint),
            work=str(root), n=ADAPTERS - len(rel_stack.seed["adapters"])))["names"]
        assert len(set(models)) == ADAPTERS
        stack.start_web("web-faults")
        state = SimpleNamespace(stack=stack, broker=broker, base=base, url=stack.web_url, rel=rel_stack,
                                worker=start_worker(stack, base, "worker-faults-0"), models=models,
                                key=rel_stack.seed["keys"]["a"])
        yield state
    finally:
        stack.close()
        broker.kill()


def _traffic(fs, timeout: float = 150) -> Traffic:
    """CLIENTS threads sending completions until stopped, each cycling through the adapters."""
    return Traffic(fs.url, fs.key, lambda i, n: fs.models[(i + n) % len(fs.models)], CLIENTS, timeout=timeout)


def test_killing_the_worker_loses_no_request(fault_stack):
    fs = fault_stack
    with _traffic(fs) as traffic:
        wait_until(lambda: traffic.count() >= CLIENTS, 60, "first answers")
        for k in range(KILLS):
            time.sleep(KILL_EVERY_S)
            fs.worker.proc.kill(signal.SIGKILL)  # kill -9, mid-traffic
            fs.worker = start_worker(fs.stack, fs.base, f"worker-faults-{k + 1}")
        time.sleep(KILL_EVERY_S / 2)
        # on a loaded machine the short run can end before every client went round: keep sending until each
        # adapter has been answered once
        wait_until(lambda: {o["model"] for o in list(traffic.outcomes) if o["status"] == 200} == set(fs.models), 120,
                   "every adapter answered")
    outcomes = traffic.outcomes
    lost = [o for o in outcomes if o["status"] is None]
    assert not lost, lost[:3]
    unexplained = [o for o in outcomes if o["status"] != 200 and o["code"] not in EXPLICIT_ERRORS]
    assert not unexplained, unexplained[:3]
    ids = [o["request_id"] for o in outcomes]
    assert len(ids) == len(set(ids)), "two answers carried one request id"
    rows = audit_rows(fs.rel, ids)
    assert sorted(rows) == sorted(ids), "a request has no audit row"
    twice = [rid for rid, rs in rows.items() if len(rs) != 1]
    assert not twice, twice[:3]
    pending = [rid for rid, rs in rows.items() if rs[0]["status"] == "pending"]
    assert not pending, pending[:3]
    for o in outcomes:
        row = rows[o["request_id"]][0]
        assert row["http_status"] == o["status"] and (row["status"] == "ok") == (o["status"] == 200), (o, row)
    ok = sum(o["status"] == 200 for o in outcomes)
    codes: dict[str, int] = {}
    for o in outcomes:
        if o["status"] != 200:
            codes[o["code"]] = codes.get(o["code"], 0) + 1
    redelivered = sum(rows[o["request_id"]][0]["attempts"] > 1 for o in outcomes)
    served = {o["model"] for o in outcomes if o["status"] == 200}
    assert served == set(fs.models), f"adapters never served: {sorted(set(fs.models) - served)}"
    assert len(outcomes) >= MIN_REQUESTS, f"only {len(outcomes)} requests in the full run"
    # What the reapers handed back from the killed workers: jobs they had taken (running, or just handed to
    # them by Redis) and jobs still waiting in their own queues.
    broker = redis.Redis.from_url(fs.broker.url)
    reclaimed = [json.loads(x) for x in broker.lrange("lorafleet:reclaimed", 0, -1)]
    handed_back = {r["request_id"] for r in reclaimed}
    answered_after = sum(o["status"] == 200 for o in outcomes if o["request_id"] in handed_back)
    # taken by a worker that was killed before it started the job (its one attempt was counted by the next
    # worker): the jobs kombu's BRPOP consumer lost, one per kill or so, each a 504 at the request timeout
    unstarted = sum(rows[r["request_id"]][0]["attempts"] == 1 for r in reclaimed
                    if r["was"] == "taken" and r["request_id"] in rows)
    timed_out = [o["request_id"] for o in outcomes if o["code"] == "timeout"]
    wait_until(lambda: not any(broker.llen(k) for k in broker.scan_iter("lorafleet:processing:*")), 30,
               "no job left taken and unacknowledged")
    print(f"\nworker faults: {KILLS} kill -9 under {CLIENTS} clients over {len(fs.models)} adapters; "
          f"{len(outcomes)} requests, {ok} answered, errors {codes or 'none'}, {redelivered} answered after "
          f"redelivery; {len(handed_back)} jobs handed back from killed workers "
          f"({dict(Counter(r['was'] for r in reclaimed))}; {unstarted} taken but not yet started), {answered_after} "
          f"of them answered 200; 0 lost, 0 pending, "
          f"0 answered twice, {len(timed_out)} timeouts; slowest {max(o['seconds'] for o in outcomes):.1f}s")
    # The gap kombu's BRPOP consumer left (a job popped by a worker killed before it recorded the job ended
    # as a 504 at the request timeout, about one per kill) is closed: not one such job.
    assert not timed_out, [o for o in outcomes if o["code"] == "timeout"][:3]


def test_a_dead_broker_is_a_fast_recorded_503_and_recovery_needs_no_one(fault_stack):
    fs = fault_stack
    with _traffic(fs, timeout=60) as traffic:  # > the server's 30 s: every request gets its own answer
        wait_until(lambda: traffic.count() >= CLIENTS, 60, "first answers")
        fs.broker.kill()
        down_at = time.monotonic()
        time.sleep(OUTAGE_S)
        fs.broker.start()  # empty: what was queued in it is gone, which is why those requests got errors
        up_at = time.monotonic()
        # a probe of its own: traffic clients may still be waiting on jobs the dead broker held
        probe = lambda: httpx.post(fs.url + "/v1/completions", headers={"Authorization": f"Bearer {fs.key}"},  # noqa: E731
                                   json={"model": fs.models[0], "prompt": "back?", "max_tokens": 2}, timeout=10)
        wait_until(lambda: probe().status_code == 200, 30, "an answer after the broker came back",
                   (fs.worker.proc, fs.stack.web))
        recovered = {"started": up_at, "seconds": time.monotonic() - up_at}
    outcomes = traffic.outcomes
    assert not [o for o in outcomes if o["status"] is None]
    during = [o for o in outcomes if down_at + 0.5 < o["started"] < up_at - 2.5]
    assert during, "no request was sent while the broker was down"
    slow = [o for o in during if o["status"] != 503 or o["seconds"] > 2.0]
    assert not slow, [(o["status"], o["code"], round(o["started"] - down_at, 2), round(o["seconds"], 2))
                      for o in slow[:10]] + [f"{len(slow)} of {len(during)}"]
    assert {o["code"] for o in during} == {"queue_unavailable"}
    rows = audit_rows(fs.rel, [o["request_id"] for o in outcomes])
    for o in outcomes:
        assert len(rows[o["request_id"]]) == 1 and rows[o["request_id"]][0]["status"] != "pending", o
        assert rows[o["request_id"]][0]["http_status"] == o["status"], o
    unexplained = [o for o in outcomes if o["status"] != 200 and o["code"] not in EXPLICIT_ERRORS]
    assert not unexplained, unexplained[:3]
    print(f"\nbroker faults: redis down {OUTAGE_S}s under {CLIENTS} clients; {len(during)} requests while down, all "
          f"503 queue_unavailable in <= {max(o['seconds'] for o in during):.2f}s, all audited; first answer "
          f"{recovered['started'] - up_at + recovered['seconds']:.1f}s after the broker returned")


@pytest.mark.skipif(not FULL, reason="the short sizes run in make test: tests/e2e/test_many_workers.py")
@pytest.mark.timeout(2400)  # two runs of 4,000 requests and the kill: ~15 minutes on 2 busy cores
def test_three_workers_affinity_and_a_sigkill_at_full_sizes(rel_stack, tmp_path_factory):
    """Issue 18's e2e scenario at its full sizes (16 clients, 1,000 warm-up + 3,000 measured requests per run,
    40 s of traffic around the kill): tests/e2e/test_many_workers.py, run here (over this suite's database, as
    its runtime role) so that `make faults` has it."""
    with fleet_stack(rel_stack.env, rel_stack.checkpoint, rel_stack.stack.django,
                     tmp_path_factory.mktemp("fleet")) as fleet:
        affinity_and_failover(fleet)
