"""Scale-out (issue 18): tok/s and latency for 1, 2 and 3 workers on one base, adapter affinity on and off.

    .venv/bin/python bench/scaleout.py [--workers 1,2,3] [--requests 600] [--clients 16] [--json FILE]

The production path end to end, on this machine: PostgreSQL (a database of its own, dropped after), a
private redis-server, gunicorn (one web with LORAFLEET_AFFINITY=1, one with 0), and N worker processes of
`manage.py run_worker` on the tiny local base (built on the fly). A fleet of --adapters adapters (ranks 4, 8,
12 on q_proj/v_proj); each worker's memory holds about a fifth of it (--memory-gb for the device pool,
--host-cache-mb for parsed blobs: the regime where a fleet outgrows one worker). Traffic: --clients
closed-loop clients, Zipf(--zipf) over the fleet, the same request sequence in every cell, --max-tokens
tokens each (ignore_eos), after --warmup requests that are not measured. Every cell starts fresh workers.

Reported per cell: generated tok/s over the measured window (completion tokens from the answers / wall
time), requests/s, p50 and p99 latency seen by the client, cold loads per 1,000 requests (storage ->
verified -> host), and on how many workers the most widespread adapter is resident at the end.

Needs PostgreSQL (LORAFLEET_E2E_DATABASE_URL or DATABASE_URL, default postgres://postgres@127.0.0.1:5432/postgres)
and the redis-server binary. Never run as a test.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import redis  # noqa: E402

from tests.e2e.conftest import (  # noqa: E402
    ADMIN_DB_URL,
    PYTHON,
    REPO,
    Proc,
    Stack,
    _db_url,
    _reachable,
    bearer,
    free_port,
    metrics_token,
    pg_connect,
    wait_until,
    worker_metric,
)
from tests.e2e.test_many_workers import FLEET_SEED  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Bench:
    def __init__(self, args):
        self.args = args
        self.root = Path(args.workdir) / f"scaleout-{secrets.token_hex(3)}"
        self.root.mkdir(parents=True)
        self.procs: list[Proc] = []

    # ---- the stack -----------------------------------------------------------------------------

    def up(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server is needed")
        if not _reachable(ADMIN_DB_URL, 5432):
            sys.exit(f"PostgreSQL is needed at {ADMIN_DB_URL}")
        port = free_port()
        self.procs.append(Proc("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(self.root)], dict(os.environ), self.root))
        self.broker_url = f"redis://127.0.0.1:{port}/0"
        wait_until(lambda: _reachable(self.broker_url, port), 20, "redis-server up", tuple(self.procs))
        self.broker = redis.Redis.from_url(self.broker_url)
        suffix = "b" + secrets.token_hex(3)
        self.db_name = f"lorafleet_bench_{suffix}"
        with pg_connect(ADMIN_DB_URL) as admin:
            admin.execute(f'CREATE DATABASE "{self.db_name}"')
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(REPO),
                    "DATABASE_URL": _db_url(self.db_name), "CELERY_BROKER_URL": self.broker_url,
                    "LORAFLEET_VAR_DIR": str(self.root / "var"), "LORAFLEET_STORAGE_DIR": str(self.root / "storage"),
                    "LORAFLEET_LOG_LEVEL": "WARNING", "LORAFLEET_REQUEST_TIMEOUT_S": "120"}
        self.env.pop("CELERY_RESULT_BACKEND", None)
        out = subprocess.run([PYTHON, "manage.py", "migrate", "--noinput"], cwd=REPO, env=self.env, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        from demo.tiny_base import build_tiny_base

        checkpoint = build_tiny_base(self.root / "tiny", arch="llama", seed=11)
        self.stack = Stack(self.root, self.env)
        seeded = self.stack.django(FLEET_SEED.format(base=f"bench-{suffix}", queue=f"bench.{suffix}",
                                                     tenant=f"bench-{suffix}", checkpoint=str(checkpoint),
                                                     work=str(self.root), n=self.args.adapters))
        self.base, self.key, self.models = seeded["base"], seeded["key"], seeded["names"]
        self.webs = {}
        for affinity in (True, False):
            stack = Stack(self.root, {**self.env, "LORAFLEET_AFFINITY": "1" if affinity else "0"})
            self.webs[affinity] = stack.start_web(f"web-affinity-{int(affinity)}")
            self.procs.extend(stack.procs)

    def down(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        if getattr(self, "db_name", None):
            with pg_connect(ADMIN_DB_URL) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
        shutil.rmtree(self.root, ignore_errors=True)

    def start_workers(self, n: int) -> list[SimpleNamespace]:
        workers = []
        for i in range(n):
            port = free_port()
            proc = Proc(f"worker-{n}-{i}", [PYTHON, "manage.py", "run_worker", "--base", self.base, "--metrics-port",
                                            str(port), "--loglevel", "WARNING", "--concurrency", str(self.args.concurrency),
                                            "--memory-gb", str(self.args.memory_gb),
                                            "--host-cache-mb", str(self.args.host_cache_mb)], self.env, self.root)
            workers.append(SimpleNamespace(proc=proc, metrics_url=f"http://127.0.0.1:{port}/metrics",
                                           metrics_token=metrics_token(self.env)))
        for w in workers:  # the exporter answers only the web's metrics token
            wait_until(lambda w=w: httpx.get(w.metrics_url, headers=bearer(w.metrics_token), timeout=2).status_code
                       == 200, 300, "worker metrics", (w.proc,))
        pids = {w.proc.popen.pid for w in workers}
        wait_until(lambda: len(self.heartbeats(pids)) == n, 60, "heartbeats")
        return workers

    def heartbeats(self, pids: set[int]) -> list[dict]:
        out = []
        for key in self.broker.scan_iter("lorafleet:worker:*"):
            value = self.broker.get(key)
            if value and json.loads(value)["pid"] in pids:
                out.append(json.loads(value))
        return out

    # ---- one cell ------------------------------------------------------------------------------

    def traffic(self, url: str, sequence: list[str]) -> list[dict]:
        lock, cursor, outcomes = threading.Lock(), [0], []

        def client(i: int) -> None:
            with httpx.Client(timeout=300) as http:
                while True:
                    with lock:
                        if cursor[0] >= len(sequence):
                            return
                        n = cursor[0]
                        cursor[0] += 1
                    started = time.perf_counter()
                    r = http.post(url + "/v1/completions", headers={"Authorization": f"Bearer {self.key}"},
                                  json={"model": sequence[n], "prompt": f"Client {i} request {n} says",
                                        "max_tokens": self.args.max_tokens, "temperature": 0, "ignore_eos": True})
                    seconds = time.perf_counter() - started
                    tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
                    with lock:
                        outcomes.append({"status": r.status_code, "seconds": seconds, "tokens": tokens})

        threads = [threading.Thread(target=client, args=(i,)) for i in range(self.args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return outcomes

    def cell(self, n: int, affinity: bool, sequence: list[str]) -> dict:
        workers = self.start_workers(n)
        try:
            url = self.webs[affinity]
            self.traffic(url, sequence[: self.args.warmup])
            cold0 = sum(worker_metric(w, "lorafleet_worker_cache_misses_total") for w in workers)
            started = time.perf_counter()
            outcomes = self.traffic(url, sequence[self.args.warmup:])
            wall = time.perf_counter() - started
            cold = sum(worker_metric(w, "lorafleet_worker_cache_misses_total") for w in workers) - cold0
            time.sleep(1.5 * float(self.env.get("LORAFLEET_HEARTBEAT_S", 5)))  # a beat after the traffic
            resident: Counter = Counter()
            for status in self.heartbeats({w.proc.popen.pid for w in workers}):
                resident.update(a["identity"] for a in status["resident_adapters"])
        finally:
            for w in workers:
                w.proc.stop()
        ok = [o for o in outcomes if o["status"] == 200]
        seconds = [o["seconds"] for o in ok]
        return {"workers": n, "affinity": affinity, "requests": len(outcomes), "errors": len(outcomes) - len(ok),
                "tok_s": sum(o["tokens"] for o in ok) / wall, "req_s": len(ok) / wall,
                "p50_s": statistics.median(seconds), "p99_s": percentile(seconds, 0.99),
                "cold_loads_per_1k": 1000 * cold / len(outcomes),
                "resident_max": max(resident.values()) if resident else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--adapters", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=600, help="measured requests per cell")
    ap.add_argument("--warmup", type=int, default=200, help="requests before each measured window")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16, help="task threads per worker")
    ap.add_argument("--memory-gb", type=float, default=0.0069)
    ap.add_argument("--host-cache-mb", type=float, default=0.6)
    ap.add_argument("--workdir", default="/tmp/lorafleet-bench")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    rng = random.Random(18)
    bench = Bench(args)
    try:
        bench.up()
        weights = [1 / (rank + 1) ** args.zipf for rank in range(len(bench.models))]
        sequence = rng.choices(bench.models, weights=weights, k=args.warmup + args.requests)
        rows = []
        for n in [int(x) for x in args.workers.split(",")]:
            for affinity in (False, True):
                row = bench.cell(n, affinity, sequence)
                rows.append(row)
                print(f"{n} worker(s), affinity {'on ' if affinity else 'off'}: {row['tok_s']:7.1f} tok/s "
                      f"{row['req_s']:5.1f} req/s  p50 {row['p50_s']:.3f} s  p99 {row['p99_s']:.3f} s  "
                      f"cold loads {row['cold_loads_per_1k']:5.0f}/1k  resident on <= {row['resident_max']} workers  "
                      f"errors {row['errors']}", flush=True)
    finally:
        bench.down()
    print("\n| workers | affinity | tok/s | req/s | p50 latency | p99 latency | cold loads / 1k requests | "
          "most workers one adapter is resident on |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {'on' if r['affinity'] else 'off'} | {r['tok_s']:.1f} | {r['req_s']:.1f} | "
              f"{r['p50_s'] * 1000:.0f} ms | {r['p99_s'] * 1000:.0f} ms | {r['cold_loads_per_1k']:.0f} | "
              f"{r['resident_max']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
