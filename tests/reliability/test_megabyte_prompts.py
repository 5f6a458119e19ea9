"""Issue 47, must show: megabyte prompts cost the web a few milliseconds, not seconds, and not its memory.

On the real stack (gunicorn's one gthread worker, a real worker on the tiny base, PostgreSQL, Redis): waves of
60 concurrent 2 MB prompts to /v1/completions, each of which cannot fit the base's context, refused 400
`context_length_exceeded` before anything tokenizes them (gateway/input_bounds.py). Measured on the web's own
processes (psutil: CPU time, not wall time; resident memory), asserted at the issue's bounds:

- each costs < 50 ms of the web's CPU (one wave's CPU time over 60);
- another tenant's latency while a wave is in flight is <= 2x its solo value (medians; solo and loaded requests
  alternate, so a change in the shared box's load between the two phases does not tilt the ratio);
- the web's RSS after seven waves is within 150 MB of before the first (the process has already answered 60
  concurrent small requests, so its threads exist before and after).

2026-12-07, this 2-core box shared with other sessions (load average 5-10): 1.29-1.82x, 12-20 ms, RSS +29 to
+78 MB in seven runs. Without the rest between a key's large-body turns (gateway/input_bounds.py's
LARGE_BODY_REST) the other tenant waited 1.71-2.57x in five runs; before the turns, 7.2x. Before
gateway/middleware.py's release_body the RSS grew +300 to +420 MB: DRF's request and view refer to each other,
so each request's 2 MB body lived until the cyclic collector's next full pass (tracemalloc in the gunicorn
worker: 140 bodies, 270 MB alive after the waves); MALLOC_ARENA_MAX=2 or a fixed mmap threshold changed nothing.

The flood runs in a process of its own, so that its client-side work never holds this process's GIL and
inflates the latencies measured here (a real flooder is another machine; on this box it shares the CPUs).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.timeout(600)

WAVE = 60
PROMPT_BYTES = 2_000_000
CPU_PER_REQUEST_S = 0.050
LATENCY_RATIO = 2.0
RSS_GROWTH_BYTES = 150 * 1024 * 1024
ROUNDS = 6  # waves with another tenant's request in flight, each after one solo request

SETUP = """
from pathlib import Path
from adapters.models import BaseModel
from adapters.services import create_adapter
from adapters.uploads import create_adapter_version
from gateway.services import issue_api_key
from tenants.services import create_tenant
base = BaseModel.objects.get(slug=BASE)
result = {}
for name in ("flood", "other"):
    tenant = create_tenant(f"mb-{name}-{SUFFIX}", name)
    tenant.requests_per_minute = 100000
    tenant.max_concurrent_requests = 63
    tenant.save()
    adapter = create_adapter(tenant, f"{name}-bot", base)
    folder = Path(ROOT) / "peft-1"
    with open(folder / "adapter_config.json", "rb") as c, open(folder / "adapter_model.safetensors", "rb") as w:
        create_adapter_version(adapter, config_file=c, weights_file=w)
    _, key = issue_api_key(tenant, "mb")
    result[name] = {"key": key, "model": adapter.name}
"""

# One wave per line read on stdin ("big": 2 MB prompts; "small": a short prompt asking for more tokens than the
# context, also refused without the worker): WAVE concurrent requests released together; prints their answers.
FLOOD = """
import json, sys, threading, httpx
args = json.loads(sys.argv[1])
text = ("The quick brown fox jumps over the lazy dog. " * (args["bytes"] // 45 + 1))[:args["bytes"]]
bodies = {"big": json.dumps({"model": args["model"], "prompt": text, "max_tokens": 4}).encode(),
          "small": json.dumps({"model": args["model"], "prompt": "Once upon a time", "max_tokens": 10**6}).encode()}
headers = {"Authorization": "Bearer " + args["key"], "Content-Type": "application/json", "Connection": "close"}
clients = [httpx.Client(timeout=120) for _ in range(args["wave"])]
print("ready", flush=True)
for line in sys.stdin:
    body = bodies[line.strip()]
    out, barrier = [None] * args["wave"], threading.Barrier(args["wave"])
    def send(i):
        barrier.wait()
        try:
            r = clients[i].post(args["url"] + "/v1/completions", content=body, headers=headers)
            out[i] = [r.status_code, r.json().get("error", {}).get("code")]
        except Exception as exc:
            out[i] = [None, repr(exc)]
    threads = [threading.Thread(target=send, args=(i,)) for i in range(args["wave"])]
    for t in threads: t.start()
    for t in threads: t.join()
    print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def tenants(rel_stack):
    code = (f"BASE={rel_stack.seed['bases']['main']['slug']!r}; SUFFIX={rel_stack.suffix!r}; "
            f"ROOT={str(rel_stack.root)!r}\n" + SETUP)
    return rel_stack.stack.django(code)


def web_processes(rel_stack) -> list[psutil.Process]:
    master = psutil.Process(rel_stack.stack.web.popen.pid)
    return [master, *master.children(recursive=True)]


def cpu_seconds(procs: list[psutil.Process]) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def rss_bytes(procs: list[psutil.Process]) -> int:
    return sum(p.memory_info().rss for p in procs)


def other_request(url: str, other: dict) -> float:
    started = time.monotonic()
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {other['key']}"}, timeout=120,
                   json={"model": other["model"], "prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True,
                         "temperature": 0})
    assert r.status_code == 200, r.text[:500]
    return time.monotonic() - started


def test_sixty_concurrent_two_megabyte_prompts_cost_the_web_little(rel_stack, tenants):
    url, flood, other = rel_stack.url, tenants["flood"], tenants["other"]
    refused = [[400, "context_length_exceeded"]] * WAVE
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, json.dumps({"url": url, "key": flood["key"], "model": flood["model"],
                                                  "wave": WAVE, "bytes": PROMPT_BYTES})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"

        def release(kind: str) -> None:
            proc.stdin.write(kind + "\n")
            proc.stdin.flush()

        def answers() -> list:
            return json.loads(proc.stdout.readline())

        # warm: the base's tokenizer loaded, connections open, the worker's adapter resident, and the web's
        # threads started by 60 concurrent small requests (refused for max_tokens, before the worker)
        for _ in range(3):
            other_request(url, other)
        release("small")
        assert all(status == 400 for status, _ in answers())
        time.sleep(1.0)
        web = web_processes(rel_stack)
        rss_before = rss_bytes(web)

        cpu_before = cpu_seconds(web)
        release("big")
        assert answers() == refused
        cpu_each = (cpu_seconds(web) - cpu_before) / WAVE

        solo: list[float] = []
        during: list[float] = []  # each started after its wave was released, answered before the wave was
        for _ in range(ROUNDS):
            solo.append(other_request(url, other))
            release("big")
            time.sleep(0.05)  # the wave's requests are on their way
            during.append(other_request(url, other))
            assert answers() == refused
            print(f"\nafter a wave: web RSS {rss_bytes(web_processes(rel_stack)) / 2**20:.0f} MB", end="")
        time.sleep(1.0)
        rss_after = rss_bytes(web_processes(rel_stack))
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)

    alone, loaded = statistics.median(solo), statistics.median(during)
    print(f"\nweb CPU per 2 MB prompt: {cpu_each * 1000:.1f} ms; other tenant solo {alone * 1000:.0f} ms, "
          f"during waves {loaded * 1000:.0f} ms ({loaded / alone:.2f}x); web RSS {rss_before / 2**20:.0f} -> "
          f"{rss_after / 2**20:.0f} MB ({(rss_after - rss_before) / 2**20:+.0f} MB)")
    assert cpu_each < CPU_PER_REQUEST_S, f"{cpu_each * 1000:.1f} ms of web CPU per refused 2 MB prompt"
    assert loaded <= LATENCY_RATIO * alone, f"the other tenant's latency went {alone:.3f} s -> {loaded:.3f} s"
    assert rss_after - rss_before <= RSS_GROWTH_BYTES, \
        f"web RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MB"
