"""Fairness across tenants on the real stack (issue 12): one tenant floods at its concurrency cap with long
requests, another sends small ones; the small tenant's time to first token, solo and under the flood,
with the worker scheduling FIFO (`LORAFLEET_WORKER_FAIR=0`) and with VTC (the default).

The stack is tests/reliability's `rel_stack` (gunicorn, PostgreSQL, Redis); this test registers a base of
its own on the same tiny checkpoint (context 512) with its own queue, so the workers it starts — one FIFO,
then one VTC, each `manage.py run_worker` exactly as deployed, one at a time — serve only its traffic
while the fixture's worker sits idle on the main queue.

Per worker: S solo, then S under F's flood. F: FLOOD_CLIENTS clients in a process of their own (their
client-side work must not hold this process's GIL), closed loop, each sending the next long request as
soon as the last one is answered. F's max_concurrent_requests (gateway/limits.py: requests in flight per
tenant, counted at the web) is set to FLOOD_CLIENTS = 16, the issue's attacker, so the flood runs at its
cap (a 429 at the cap — the slot is given back a moment after the answer — would be retried after 20 ms).
The worker runs with run_worker's defaults, 128 task threads and an engine batch of up to 64: a tenant at
the default cap (64) holds half the threads, never all of them — when it could, S's job waited in Redis,
where no scheduler sees it (bench/RESULTS.md, "Fairness", has the figures).
Long = 400 prompt tokens (token ids) + 112 generated with ignore_eos = the base's context of 512, not
streamed. S: open loop, one request every SMALL_EVERY_S whatever the answers do (no coordinated
omission), a short text prompt, max_tokens 4, `stream: true`; TTFT = time to the first SSE data chunk
(the web sends one as soon as the worker has the first token). Each S request's TTFT is split with its
audit row (`_split`): web, engine (the worker's submit -> first token) and handoff. Throughput: the
worker's `lorafleet_worker_tokens_generated_total` over S's flooded window (both tenants' tokens).

Asserted in every run: no errors, and S's p95 *engine* time to first token (what the scheduler decides)
under the flood lower with VTC than with FIFO, counted in the worker's mean steps — 8 of 8 runs on
2026-11-30, by 2.7x to 30x in seconds; in CI on 2026-12-01 it failed in seconds (VTC 30 ms, FIFO 25 ms)
with the VTC worker's steps 40% slower throughout (load average 2.9) and a newcomer lifted level with the
flood's charged-but-unprefilled prompts (fixed in the engine: 16 ms against FIFO's 50 ms since). S's
client-side p95 was lower with VTC in 7 of those 8 only: the web and the handoff, which the flood slows
through the shared CPUs whatever the order, swamp it in 15 s phases. Asserted only in `make faults`
(LORAFLEET_FAULTS_FULL=1): the issue's bounds, client-side VTC p95 <= 1.5x solo p95 and tok/s VTC >=
0.95x FIFO — missed on the shared 2-CPU machine (3.7-7.1x in seven quiet-host runs on 2026-12-01: S's web
part alone, before its job exists, was 30-61 ms p95 under the flood against a solo total of 16-20 ms).
The figures are printed, and recorded in bench/RESULTS.md ("Fairness").
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import worker_metric

FULL = os.environ.get("LORAFLEET_FAULTS_FULL", "").lower() in ("1", "true", "yes")
SOLO_S = 60 if FULL else 10
FLOOD_S = 120 if FULL else 15
FLOOD_WARM_S = 3.0           # the flood reaches its cap and its prefill/decode cycle before S is measured
FLOOD_CLIENTS = int(os.environ.get("LORAFLEET_FAIRNESS_FLOOD_CLIENTS", 16))  # = F's max_concurrent_requests
LONG_PROMPT = int(os.environ.get("LORAFLEET_FAIRNESS_LONG_PROMPT", 400))
LONG_TOKENS = int(os.environ.get("LORAFLEET_FAIRNESS_LONG_TOKENS", 112))  # prompt + max_tokens = context 512
SMALL_EVERY_S = 0.25
SMALL_MAX_TOKENS = 4
# run_worker's defaults: 128 task threads, the engine runs up to 64 sequences and queues the rest in its order
WORKER_CONCURRENCY = os.environ.get("LORAFLEET_FAIRNESS_WORKER_CONCURRENCY", "128")
WORKER_ENV: dict[str, str] = {}  # extra environment for the workers (investigations)
P95_BOUND = 1.5 if FULL else None      # VTC flooded p95 / solo p95 (the issue's goal)
TOKS_BOUND = 0.95 if FULL else None    # tok/s VTC / FIFO under the flood (the issue's goal)

pytestmark = pytest.mark.timeout(2 * (SOLO_S + FLOOD_S + FLOOD_WARM_S) + 420)

SETUP = """
from pathlib import Path
from adapters.services import create_adapter, register_base_model
from adapters.uploads import create_adapter_version
from gateway.services import issue_api_key
from tenants.services import create_tenant
base = register_base_model(f"fair-{SUFFIX}", CHECKPOINT, queue_name=f"rel.fair.{SUFFIX}")
result = {"base": base.slug, "vocab": int(base.shape_manifest["vocab_size"]),
          "context": int(base.shape_manifest["max_position_embeddings"])}
for name in ("flood", "small"):
    tenant = create_tenant(f"fair-{name}-{SUFFIX}", name)
    tenant.requests_per_minute = 10**6           # only the concurrency cap binds
    tenant.max_concurrent_requests = FLOOD_CLIENTS if name == "flood" else 10**6
    tenant.save()
    adapter = create_adapter(tenant, f"{name}-bot", base)
    folder = Path(ROOT) / "peft-1"
    with open(folder / "adapter_config.json", "rb") as c, open(folder / "adapter_model.safetensors", "rb") as w:
        create_adapter_version(adapter, config_file=c, weights_file=w)
    _, key = issue_api_key(tenant, "fair")
    result[name] = {"key": key, "model": adapter.name, "tenant_id": tenant.pk}
"""

# F's clients: closed loop at the cap until `seconds` have passed, then the last answers are awaited.
FLOODER = """
import json, sys, threading, time
import httpx
a = json.loads(sys.argv[1])
stop, lock = time.monotonic() + a["seconds"], threading.Lock()
out = {"ok": 0, "refused": 0, "errors": [], "completion_tokens": 0}
def client(i):
    with httpx.Client(timeout=300) as http:
        n = 0
        while time.monotonic() < stop:
            n += 1
            prompt = [(7 * i + 13 * n + 3 * k) % (a["vocab"] - 8) + 4 for k in range(a["prompt"])]
            try:
                r = http.post(a["url"] + "/v1/completions", headers={"Authorization": "Bearer " + a["key"]},
                              json={"model": a["model"], "prompt": prompt, "max_tokens": a["max_tokens"],
                                    "temperature": 0, "ignore_eos": True})
            except Exception as exc:
                with lock:
                    out["errors"].append(repr(exc))
                time.sleep(0.1)
                continue
            with lock:
                if r.status_code == 429:
                    out["refused"] += 1
                elif r.status_code == 200:
                    out["ok"] += 1
                    out["completion_tokens"] += r.json()["usage"]["completion_tokens"]
                else:
                    out["errors"].append(f"{r.status_code} {r.text[:200]}")
            if r.status_code == 429:
                time.sleep(0.02)
threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a["clients"])]
for t in threads:
    t.start()
for t in threads:
    t.join(a["seconds"] + 200)
print(json.dumps(out))
"""


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _small_request(http: httpx.Client, url: str, t: dict, k: int) -> dict:
    sent_at, started = time.time(), time.monotonic()
    ttft = None
    try:
        with http.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {t['key']}"},
                         json={"model": t["model"], "prompt": f"small tenant question {k}",
                               "max_tokens": SMALL_MAX_TOKENS, "temperature": 0, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code, "error": r.text[:300]}
            request_id = r.headers.get("X-Lorafleet-Request-Id")
            for line in r.iter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.monotonic() - started
                    if '"error"' in line:
                        return {"status": 200, "error": line[:300]}
            total = time.monotonic() - started
    except Exception as exc:
        return {"status": None, "error": repr(exc)}
    return {"status": 200, "ttft": ttft, "total": total, "request_id": request_id, "sent_at": sent_at}


def _small_phase(url: str, t: dict, seconds: float) -> list[dict]:
    """S's open loop: request k leaves at start + k * SMALL_EVERY_S, whatever the earlier ones do."""
    outcomes: list[dict] = []
    lock = threading.Lock()
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64)) as http, \
            ThreadPoolExecutor(max_workers=48) as pool:
        def one(k: int) -> None:
            out = _small_request(http, url, t, k)
            with lock:
                outcomes.append(out)

        start = time.monotonic()
        k = 0
        while True:
            at = start + k * SMALL_EVERY_S
            if at >= start + seconds:
                break
            time.sleep(max(0.0, at - time.monotonic()))
            pool.submit(one, k)
            k += 1
    return outcomes


def _split(rel_stack, outcomes: list[dict]) -> dict:
    """Where S's TTFT went, per request, from its audit row: `web` = sent -> the pending row written (the
    gateway: HTTP, auth, limits, the prompt check; the row is written just before the job is published),
    `engine` = the worker's submit -> first token (`first_token_seconds`; `queue_seconds` = submit ->
    admission), `handoff` = the rest (publish -> Celery -> task thread -> engine, and the first delta's way
    back through Redis and the web to the client)."""
    sent = {o["request_id"]: o for o in outcomes if o.get("request_id") and o.get("ttft") is not None}
    code = (f"from gateway.models import AuditRecord\nids = {sorted(sent)!r}\n"
            "result = {str(r): [c.timestamp(), f, q] for r, c, f, q in AuditRecord.objects.filter(request_id__in=ids)"
            ".values_list('request_id', 'created_at', 'first_token_seconds', 'queue_seconds')}")
    rows = rel_stack.stack.django(code)
    web, engine, queued, handoff = [], [], [], []
    for rid, (created, first, queue_s) in rows.items():
        o = sent[rid]
        if first is None:
            continue
        web.append(created - o["sent_at"])
        engine.append(first)
        queued.append(queue_s or 0.0)
        handoff.append(o["ttft"] - web[-1] - first)
    return {"web": web, "engine": engine, "queued": queued, "handoff": handoff}


def _summary(outcomes: list[dict]) -> dict:
    ok = [o for o in outcomes if o.get("ttft") is not None and "error" not in o]
    ttft = [o["ttft"] for o in ok]
    total = [o["total"] for o in ok]
    return {"n": len(outcomes), "ok": len(ok), "errors": [o for o in outcomes if "error" in o][:3],
            "p50": _pct(ttft, 0.50), "p95": _pct(ttft, 0.95),
            "mean": statistics.fmean(ttft) if ttft else float("nan"), "total_p95": _pct(total, 0.95),
            "outcomes": ok}


def _warm_up(url: str, tenants: dict) -> None:
    """Each adapter is loaded once before anything is measured."""
    for name in ("flood", "small"):
        t = tenants[name]
        r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {t['key']}"}, timeout=120,
                       json={"model": t["model"], "prompt": "warm", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text


def _run_mode(rel_stack, tenants: dict, *, fair: bool) -> dict:
    """Start a worker (FIFO or VTC), S solo, then S under F's flood; stop the worker."""
    url = rel_stack.url
    worker = rel_stack.stack.start_worker(tenants["base"], name="worker-vtc" if fair else "worker-fifo",
                                          env={**WORKER_ENV, "LORAFLEET_WORKER_FAIR": "1" if fair else "0"},
                                          args=("--concurrency", WORKER_CONCURRENCY))
    try:
        _warm_up(url, tenants)
        solo = _summary(_small_phase(url, tenants["small"], SOLO_S))
        flooder = subprocess.Popen([sys.executable, "-c", FLOODER, json.dumps({
            "url": url, "key": tenants["flood"]["key"], "model": tenants["flood"]["model"], "clients": FLOOD_CLIENTS,
            "seconds": FLOOD_WARM_S + FLOOD_S, "prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS,
            "vocab": tenants["vocab"]})], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(FLOOD_WARM_S)
            tokens0, t0 = worker_metric(worker, "lorafleet_worker_tokens_generated_total"), time.monotonic()
            steps0 = worker_metric(worker, "lorafleet_worker_steps_total")
            batch0 = worker_metric(worker, "lorafleet_worker_batch_size_sum_total")
            flooded = _summary(_small_phase(url, tenants["small"], FLOOD_S))
            tokens1, t1 = worker_metric(worker, "lorafleet_worker_tokens_generated_total"), time.monotonic()
            steps1 = worker_metric(worker, "lorafleet_worker_steps_total")
            batch1 = worker_metric(worker, "lorafleet_worker_batch_size_sum_total")
            out, err = flooder.communicate(timeout=FLOOD_WARM_S + FLOOD_S + 240)
        finally:
            if flooder.poll() is None:
                flooder.kill()
                flooder.wait()
        assert flooder.returncode == 0, err[-3000:]
        flood = json.loads(out)
        return {"solo": solo, "flooded": flooded, "flood": flood, "tok_s": (tokens1 - tokens0) / (t1 - t0),
                "steps_s": (steps1 - steps0) / (t1 - t0),
                "batch": (batch1 - batch0) / max(1.0, steps1 - steps0),
                "split_solo": _split(rel_stack, solo["outcomes"]), "split_flooded": _split(rel_stack, flooded["outcomes"])}
    finally:
        worker.proc.stop()


@pytest.fixture(scope="module")
def fair_tenants(rel_stack):
    code = (f"SUFFIX={rel_stack.suffix!r}; CHECKPOINT={str(rel_stack.checkpoint)!r}; ROOT={str(rel_stack.root)!r}; "
            f"FLOOD_CLIENTS={FLOOD_CLIENTS}\n" + SETUP)
    return rel_stack.stack.django(code)


def _ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def test_a_flooding_tenant_does_not_take_the_small_tenants_first_token(rel_stack, fair_tenants):
    assert LONG_PROMPT + LONG_TOKENS <= fair_tenants["context"]
    started = time.monotonic()
    fifo = _run_mode(rel_stack, fair_tenants, fair=False)
    vtc = _run_mode(rel_stack, fair_tenants, fair=True)

    lines = [f"\nfairness: F = {FLOOD_CLIENTS} clients at its cap, {LONG_PROMPT}-token prompts + {LONG_TOKENS} "
             f"tokens (context {fair_tenants['context']}), not streamed; S = 1 request / {SMALL_EVERY_S}s, "
             f"max_tokens {SMALL_MAX_TOKENS}, streamed; solo {SOLO_S}s, flooded {FLOOD_S}s per worker; "
             f"worker -c {WORKER_CONCURRENCY}"]
    for name, m in (("FIFO", fifo), ("VTC", vtc)):
        s, f = m["solo"], m["flooded"]
        lines.append(
            f"  {name:4} worker: S TTFT p50/p95 solo {_ms(s['p50'])}/{_ms(s['p95'])} ms ({s['ok']} req), flooded "
            f"{_ms(f['p50'])}/{_ms(f['p95'])} ms ({f['ok']} req), p95 ratio {f['p95'] / s['p95']:.2f}x; "
            f"flood: tok/s {m['tok_s']:.0f}, {m['steps_s']:.0f} steps/s, mean batch {m['batch']:.1f}, "
            f"F {m['flood']['ok']} answered, {m['flood']['refused']} 429 at the cap, "
            f"{len(m['flood']['errors'])} errors {m['flood']['errors'][:2]}")
        for phase in ("solo", "flooded"):
            sp = m[f"split_{phase}"]
            lines.append(f"       {phase:7} p50/p95 ms: web {_ms(_pct(sp['web'], .5))}/{_ms(_pct(sp['web'], .95))}, "
                         f"engine submit->first token {_ms(_pct(sp['engine'], .5))}/{_ms(_pct(sp['engine'], .95))} "
                         f"(->admitted {_ms(_pct(sp['queued'], .5))}/{_ms(_pct(sp['queued'], .95))}), handoff "
                         f"{_ms(_pct(sp['handoff'], .5))}/{_ms(_pct(sp['handoff'], .95))}")
    ratio_vtc = vtc["flooded"]["p95"] / vtc["solo"]["p95"]
    toks = vtc["tok_s"] / fifo["tok_s"]
    lines.append(f"  VTC flooded p95 / solo p95 {ratio_vtc:.2f}x (goal <= 1.5x; FIFO "
                 f"{fifo['flooded']['p95'] / fifo['solo']['p95']:.2f}x); FIFO flooded p95 / VTC flooded p95 "
                 f"{fifo['flooded']['p95'] / vtc['flooded']['p95']:.2f}x; tok/s VTC/FIFO {toks:.2f} (goal >= 0.95); "
                 f"load average {os.getloadavg()[0]:.1f}; {time.monotonic() - started:.0f}s")
    print("\n".join(lines))

    for m in (fifo, vtc):
        for phase in ("solo", "flooded"):
            assert m[phase]["ok"] == m[phase]["n"], m[phase]["errors"]
        assert m["flood"]["ok"] > 0
        # the flooder's own answers are not what is measured: a rare timeout on an overloaded box is tolerated
        assert len(m["flood"]["errors"]) <= 0.01 * m["flood"]["ok"], m["flood"]["errors"][:3]
    # in steps of the worker's own mean step under the flood: a worker slowed as a whole by the machine (the
    # two run one after the other) does not count against its order
    engine_steps = {name: _pct(m["split_flooded"]["engine"], 0.95) * m["steps_s"] for name, m in (("fifo", fifo),
                                                                                               ("vtc", vtc))}
    assert engine_steps["vtc"] < engine_steps["fifo"], f"S's engine p95 TTFT under the flood, in steps: {engine_steps}"
    if P95_BOUND is not None:
        assert ratio_vtc <= P95_BOUND, f"S's p95 TTFT went from {vtc['solo']['p95']:.3f}s to {vtc['flooded']['p95']:.3f}s"
    if TOKS_BOUND is not None:
        assert toks >= TOKS_BOUND, f"tok/s under the flood: VTC {vtc['tok_s']:.0f} vs FIFO {fifo['tok_s']:.0f}"
