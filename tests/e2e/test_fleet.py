"""Two tenants, eight adapters, 64 concurrent requests through the real stack."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from protocol.jobs import AdapterRef, GenerationJob
from tests.e2e.conftest import series_value

PROMPTS = ["Once upon a time", "The little dog", "She said hello to", "In the morning the",
           "A bird sang", "They went to the", "It was a sunny", "He looked at the"]


def test_64_concurrent_requests_over_8_adapters_of_2_tenants(e2e, db_rows):
    adapters = [(name, a) for name, a in e2e.seed["adapters"].items() if a["tenant"] in ("a", "b")]
    assert len(adapters) == 8
    calls = [(adapters[i % 8], PROMPTS[(i // 8) % 8]) for i in range(64)]

    def call(item):
        (name, adapter), prompt = item
        r = e2e.post(e2e.seed["keys"][adapter["tenant"]], {"model": name, "prompt": prompt, "max_tokens": 12,
                                                            "temperature": 0})
        return name, prompt, r

    started = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(call, calls))
    elapsed = time.monotonic() - started

    version_of = {name: a["versions"][0] for name, a in adapters}
    refused = [(name, prompt, r.status_code, r.text[:300]) for name, prompt, r in answers if r.status_code != 200]
    assert not refused, refused
    for name, _prompt, r in answers:
        meta = r.json()["lorafleet"]
        version = version_of[name]
        blob = (e2e.storage / version["storage_key"]).read_bytes()
        assert meta["weights_sha256"] == version["sha256"] == hashlib.sha256(blob).hexdigest()
        assert r.headers["X-Lorafleet-Weights-Sha256"] == version["sha256"]
        assert meta["adapter"] == name and meta["version"] == 1 and meta["worker_id"]

    # the worker batched different tenants' adapters together
    most = e2e.metric(e2e.worker.metrics_url, "lorafleet_worker_distinct_adapters_per_batch_max")
    print(f"\n64 requests x 12 tokens over 8 adapters: {elapsed:.2f} s; most distinct adapters in one batch: {most:g}; "
          f"largest batch: {e2e.metric(e2e.worker.metrics_url, 'lorafleet_worker_batch_size_max'):g}")
    assert most >= 3
    assert e2e.metric(e2e.worker.metrics_url, "lorafleet_worker_tokens_generated_total") >= 64

    # every answer is on the record, finalised with the sha256 the worker verified
    ids = [r.json()["lorafleet"]["request_id"] for _, _, r in answers]
    rows = db_rows("SELECT request_id::text AS rid, status, http_status, weights_sha256, expected_sha256, "
                   "completion_tokens, worker_id FROM gateway_auditrecord WHERE request_id::text = ANY(%s)", (ids,))
    assert len(rows) == 64
    assert all(r["status"] == "ok" and r["http_status"] == 200 and r["weights_sha256"] == r["expected_sha256"]
               and r["completion_tokens"] >= 1 and r["worker_id"] for r in rows)

    # greedy outputs are exactly those of the engine run directly on the same checkpoint and blobs
    from inference_worker.engine import Engine
    from inference_worker.model import ModelRunner

    # a pool of its own (the size does not change greedy tokens); one request at a time
    engine = Engine(ModelRunner(e2e.checkpoint, pool_pages=512), lambda key: (e2e.storage / key).read_bytes()).start()
    differ = []
    try:
        for name, prompt, r in answers:
            v = version_of[name]
            ref = AdapterRef(version_id=v["id"], sha256=v["sha256"], storage_key=v["storage_key"], rank=v["rank"],
                             alpha=v["alpha"], use_rslora=v["use_rslora"], target_modules=v["target_modules"])
            direct = engine.generate(GenerationJob(request_id="direct", adapter=ref, prompt=prompt, max_tokens=12,
                                                   temperature=0), timeout=60)
            assert direct.ok, direct.error_message
            if r.json()["choices"][0]["text"] != direct.text:
                differ.append((name, prompt, r.json()["choices"][0]["text"], direct.text))
    finally:
        engine.stop()
    assert not differ, differ
    distinct_texts = {r.json()["choices"][0]["text"] for _, p, r in answers if p == PROMPTS[0]}
    assert len(distinct_texts) >= 4  # the adapters really change the output


def test_worker_status_lists_the_worker_and_its_resident_adapters(e2e):
    out = subprocess.run([sys.executable, "manage.py", "worker_status", "--json"], cwd=e2e.stack.env["PYTHONPATH"],
                         env=e2e.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    workers = [w for w in json.loads(out.stdout) if w["base"] == e2e.seed["bases"]["main"]["slug"]]
    assert len(workers) == 1
    resident = {a["sha256"] for a in workers[0]["resident_adapters"]}
    ours = {a["versions"][0]["sha256"] for a in e2e.seed["adapters"].values() if a["tenant"] in ("a", "b")}
    assert resident & ours


def test_web_metrics_count_requests_by_tenant(e2e):
    """One completion each for tenants A and B moves each tenant's own 200 series by exactly one (the stack
    runs with LORAFLEET_METRICS_TENANT_LABELS=1); without the token, or with another, /metrics is a 401
    that exports nothing."""
    def served(letter: str) -> float:
        slug = e2e.seed["tenants"][letter]["slug"]
        series = f'lorafleet_http_requests_total{{route="completions",status="200",tenant="{slug}"}}'
        return series_value(e2e.web_metrics(), series) or 0.0

    before = {letter: served(letter) for letter in ("a", "b")}
    for letter in ("a", "b"):
        r = e2e.post(e2e.seed["keys"][letter], {"model": f"{letter}-0", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert {letter: served(letter) - before[letter] for letter in ("a", "b")} == {"a": 1.0, "b": 1.0}

    api_key = e2e.seed["keys"]["a"]
    for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": f"Bearer {api_key}"}):
        r = httpx.get(e2e.url + "/metrics", headers=headers, timeout=10)
        assert r.status_code == 401 and "lorafleet_" not in r.text, (headers, r.status_code)
