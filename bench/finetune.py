"""Fine-tuning (issue 50) on SmolLM2-135M-Instruct: the training core's speed against a plain transformers + PEFT
loop, and the time from `files.create` to the first answer of the new adapter on the real stack.

    .venv/bin/python bench/finetune.py [--only speed,e2e,latency] [--speed-examples 64] [--rounds 2] [--epochs 1]
        [--latency-passes 10,noyield] [--latency-pairs 16] [--json f]
    make bench-finetune

- speed: the same chat examples (the demo's styles, demo/styles.py), the same LoRA (r=8, alpha 16 on q/k/v/o), the
  same batches in the same order, the same AdamW and clipping, the same thread count, one after the other on this
  machine. `ours` is finetune/training.py's train_lora; `plain` is the loop a user writes with transformers and
  PEFT: right-padded batches with an attention mask, labels -100 off the assistant tokens (the core's own mask, so
  both learn the same thing), `model(input_ids, attention_mask, labels).loss`. Training tokens/s = tokens of the
  examples (chat template included) x epochs / seconds of the training steps (loading excluded from both). The two
  first-step losses are printed too: the same numbers up to float rounding, so the speed compares equal work.
- e2e: gunicorn, an inference worker and a trainer (`manage.py run_trainer`), each its own process, over PostgreSQL
  and Redis (as tests/finetune/test_real_stack.py); with the official `openai` client: files.create (200 examples)
  -> fine_tuning.jobs.create -> poll retrieve -> chat.completions.create(model=job.fine_tuned_model) answers. The
  seconds from before files.create to the first answer, split into upload, queue wait, training and first answer.
- latency: the same stack; tenant B fine-tunes (a job long enough to outlast the measurement, cancelled after)
  while tenant A asks the base a one-line question (max_tokens 32, greedy, ignore_eos: 32 tokens every time).
  A's requests come in pairs, one with the trainer stopped (SIGSTOP to its process group: "solo") and one with it
  training (SIGCONT: "during"), each after the same one-second pause, the order alternating pair
  by pair, so a change in the host's other load falls on both sides. Once per pass, each with a fresh trainer: the
  defaults (niceness 10, holding its work while the engine has requests in hand: transport/busy.py), then
  'noyield' (niceness 10, LORAFLEET_TRAINER_YIELD=0: the niceness alone); `--latency-passes` also takes a
  niceness (0: the trainer as nice as the worker). The figure is the ratio
  during / solo of A's request seconds, median and p95, within each trainer's own pairs, and the same pair by
  pair (each pair's two requests ran seconds apart: the steadier figure on a host whose other load moves); with
  the trainer's steps in the measurement, what the trainer got meanwhile.

OMP_WAIT_POLICY=PASSIVE; other processes may share the CPUs: the load average is printed with the figures.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from demo import styles  # noqa: E402
from demo.training import chat_examples  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
SLUG = "smollm2-135m-instruct"


def dataset(n: int) -> list[dict]:
    """n chat examples: the demo's three styles over corpus/instructions.tsv, then plain answers, in turn."""
    pairs = []
    for style in styles.STYLES:
        pairs += styles.instruct_examples(style)
    pairs += [(q, ". ".join(p[:1].upper() + p[1:] for p in parts) + ".") for q, parts in styles.instructions()]
    out = chat_examples(pairs)
    return (out * math.ceil(n / len(out)))[:n]


def smollm2_base() -> Path:
    """The imported checkpoint, where `make demo` keeps it (imported once, ~30 s; reused while the GGUF is unchanged)."""
    from adapters.gguf_import import import_gguf
    from demo.plan import SMOLLM2, SMOLLM2_PACKAGE

    folder = Path(os.environ.get("LORAFLEET_VAR_DIR", REPO / "var")) / "models" / SMOLLM2.slug
    import_gguf(SMOLLM2_PACKAGE, folder, progress=False)
    return folder


# --- speed -------------------------------------------------------------------------------------------


def run_ours(base: Path, examples: list[dict], settings, threads: int) -> dict:
    from finetune.training import train_lora

    events: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        result = train_lora(base, examples, None, settings, Path(tmp) / "out", on_event=events.append,
                            should_cancel=lambda: False, threads=threads)
    metrics = [e for e in events if e["type"] == "metrics"]
    # elapsed_s counts from the start of the training loop (after loading): the steps' own time
    return {"seconds": metrics[-1]["elapsed_s"], "steps": result.steps, "tokens": result.trained_tokens,
            "first_loss": metrics[0]["train_loss"], "last_loss": metrics[-1]["train_loss"]}


def run_plain(base: Path, examples: list[dict], settings, threads: int) -> dict:
    """The loop a user writes with transformers + PEFT, with the core's batches, mask, optimizer and schedule."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.training import _batches, _lr_at, _tokenizer, encode_example

    torch.set_num_threads(threads)
    torch.manual_seed(settings.seed)
    tok = _tokenizer(str(base))
    encoded = [encode_example(tok, e, i) for i, e in enumerate(examples)]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                           LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(TARGETS),
                                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(settings.seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    total = math.ceil(len(encoded) / settings.batch_size) * settings.n_epochs
    losses, step = [], 0
    model.train()
    started = time.perf_counter()
    for _ in range(settings.n_epochs):
        for picks in _batches(len(encoded), settings.batch_size, gen):
            batch = [encoded[i] for i in picks]
            width = max(len(e.ids) for e in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            for row, e in enumerate(batch):
                n = len(e.ids)
                ids[row, :n], mask[row, :n] = torch.tensor(e.ids), 1
                labels[row, :n] = torch.where(torch.tensor(e.target), torch.tensor(e.ids), -100)
            for group in opt.param_groups:
                group["lr"] = _lr_at(step / total, settings.learning_rate)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            losses.append(loss.item())
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "steps": step, "tokens": sum(len(e.ids) for e in encoded) * settings.n_epochs,
            "first_loss": losses[0], "last_loss": losses[-1]}


def speed(args) -> dict:
    from finetune.training import TrainSettings, default_threads

    base = smollm2_base()
    threads = args.threads or default_threads()
    examples = dataset(args.speed_examples)
    settings = TrainSettings(n_epochs=args.epochs, batch_size=8, learning_rate=5e-3, rank=8, alpha=16,
                             target_modules=TARGETS, seed=1)
    out = {"examples": len(examples), "threads": threads, "epochs": args.epochs, "batch_size": 8,
           "rounds": args.rounds}
    runs = {"plain": run_plain, "ours": run_ours}
    for round_ in range(args.rounds):
        # alternate the order, so neither side always runs after the other's warm-up
        for name in (("plain", "ours") if round_ % 2 == 0 else ("ours", "plain")):
            load = os.getloadavg()[0]
            r = runs[name](base, examples, settings, threads)
            r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 1)
            r["load_before"] = round(load, 2)
            if name not in out or r["tokens_per_s"] > out[name]["tokens_per_s"]:  # best of the rounds
                out[name] = r
            print(f"  {name:5s}: {r['steps']} steps, {r['tokens']} tokens in {r['seconds']:.1f} s = "
                  f"{r['tokens_per_s']} tok/s; loss {r['first_loss']:.4f} -> {r['last_loss']:.4f} (load {load:.1f})",
                  flush=True)
    out["speedup"] = round(out["ours"]["tokens_per_s"] / out["plain"]["tokens_per_s"], 2)
    print(f"  train_lora / plain transformers+PEFT, best of {args.rounds}: {out['speedup']}x tokens/s", flush=True)
    return out


# --- end to end ---------------------------------------------------------------------------------------


SEED = """
from adapters.services import register_base_model
from finetune.models import FineTuneLimits
from gateway.services import issue_api_key
from tenants.services import create_tenant
base = register_base_model(SLUG, CHECKPOINT, display_name="SmolLM2-135M-Instruct")
tenant = create_tenant("bench-" + SUFFIX, "Bench")
result = {"key": issue_api_key(tenant, "bench")[1]}
"""


def e2e(args) -> dict:
    import openai

    from tests.e2e.conftest import ADMIN_DB_URL, PYTHON, REDIS_URL, Proc, Stack, _db_url, pg_connect, wait_until

    base = smollm2_base()
    root = Path(tempfile.mkdtemp(prefix="lorafleet-bench-ft-"))
    suffix = secrets.token_hex(3)
    db_name = f"lorafleet_bench_ft_{suffix}"
    with pg_connect(ADMIN_DB_URL) as admin:
        admin.execute(f'CREATE DATABASE "{db_name}"')
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(REPO),
           "DATABASE_URL": _db_url(db_name), "CELERY_BROKER_URL": REDIS_URL.rsplit("/", 1)[0] + "/12",
           "LORAFLEET_VAR_DIR": str(root / "var"), "LORAFLEET_STORAGE_DIR": str(root / "storage"),
           "LORAFLEET_LOG_LEVEL": "WARNING"}
    env.pop("CELERY_RESULT_BACKEND", None)
    stack = Stack(root, env)
    try:
        out = subprocess.run([PYTHON, "manage.py", "migrate", "--noinput"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        key = stack.django(f"SLUG, CHECKPOINT, SUFFIX = {SLUG!r}, {str(base)!r}, {suffix!r}\n" + SEED)["key"]
        stack.start_web()
        stack.start_worker(SLUG)
        trainer = Proc("trainer", [PYTHON, "manage.py", "run_trainer", "--base", SLUG], env, root)
        stack.procs.append(trainer)
        wait_until(lambda: "ready" in trainer.tail(20000), 180, "trainer ready", (trainer,))
        client = openai.OpenAI(base_url=stack.web_url + "/v1", api_key=key, max_retries=0, timeout=300)
        data = b"".join(json.dumps(e).encode() + b"\n" for e in dataset(args.e2e_examples))
        question = [{"role": "user", "content": "How do I stay healthy?"}]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        uploaded = client.files.create(file=("bench.jsonl", data), purpose="fine-tune")
        t_file = time.perf_counter()
        job = client.fine_tuning.jobs.create(training_file=uploaded.id, model=SLUG, suffix="bench", seed=1,
                                             hyperparameters={"n_epochs": args.epochs, "batch_size": 8,
                                                              "learning_rate_multiplier": 25})
        t_job = time.perf_counter()
        started = None
        while job.status not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.5)
            job = client.fine_tuning.jobs.retrieve(job.id)
            if started is None and job.status == "running":
                started = time.perf_counter()
            assert trainer.alive(), trainer.tail()
        t_done = time.perf_counter()
        assert job.status == "succeeded", job.error
        reply = client.chat.completions.create(model=job.fine_tuned_model, messages=question, max_tokens=40,
                                               temperature=0)
        t_answer = time.perf_counter()
        result = {
            "examples": args.e2e_examples, "epochs": args.epochs, "trained_tokens": job.trained_tokens,
            "fine_tuned_model": job.fine_tuned_model, "answer": reply.choices[0].message.content,
            "seconds_total": round(t_answer - t0, 1), "upload_s": round(t_file - t0, 2),
            "create_s": round(t_job - t_file, 2), "queued_s": round((started or t_job) - t_job, 1),
            "running_s": round(t_done - (started or t_job), 1), "first_answer_s": round(t_answer - t_done, 2),
            "load_before": round(load, 2),
        }
        print(f"  files.create -> first answer of {job.fine_tuned_model}: {result['seconds_total']} s (upload "
              f"{result['upload_s']} s, job create {result['create_s']} s, queued {result['queued_s']} s, training "
              f"{result['running_s']} s, first answer {result['first_answer_s']} s); {job.trained_tokens} tokens; "
              f"answer {result['answer']!r}", flush=True)
        return result
    finally:
        stack.close()
        with pg_connect(ADMIN_DB_URL) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


# --- another tenant's latency while a job trains ---------------------------------------------------------


LATENCY_SEED = SEED + """
from finetune.models import FineTuneLimits
trainee = create_tenant("bench-b-" + SUFFIX, "Bench B")
FineTuneLimits.objects.create(tenant=trainee, max_concurrent_jobs=4, max_tokens_per_job=10**9,
                              max_tokens_per_day=10**10)
result["trainee_key"] = issue_api_key(trainee, "bench")[1]
"""


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _trainer_pass(stack, env: dict, root: Path, key: str, trainee_key: str, nice: str, args) -> dict:
    """One trainer at LORAFLEET_TRAINER_NICE=`nice`: a long job of tenant B, pairs of tenant A's requests."""
    import signal

    import openai

    from tests.e2e.conftest import PYTHON, Proc, wait_until

    no_yield = nice == "noyield"  # the default niceness without holding while the engine is busy
    trainer = Proc(f"trainer-nice{nice}", [PYTHON, "manage.py", "run_trainer", "--base", SLUG],
                   {**env, "LORAFLEET_TRAINER_NICE": "10" if no_yield else nice,
                    "LORAFLEET_TRAINER_YIELD": "0" if no_yield else "1"}, root)
    stack.procs.append(trainer)
    import httpx2  # the openai client's HTTP library

    # a new connection a request: a kept-alive one that the web closes as the next request goes out ("server
    # disconnected", 2026-12-07 16:36) would fail a sample, and a retry would time two
    fresh = openai.DefaultHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0))
    a = openai.OpenAI(base_url=stack.web_url + "/v1", api_key=key, max_retries=0, timeout=300, http_client=fresh)
    b = openai.OpenAI(base_url=stack.web_url + "/v1", api_key=trainee_key, max_retries=0, timeout=300)
    try:
        wait_until(lambda: "ready" in trainer.tail(20000), 180, "trainer ready", (trainer,))
        line = next(x for x in trainer.tail(20000).splitlines() if "one job at a time" in x)
        data = b"".join(json.dumps(e).encode() + b"\n" for e in dataset(64))
        uploaded = b.files.create(file=("long.jsonl", data), purpose="fine-tune")
        job = b.fine_tuning.jobs.create(training_file=uploaded.id, model=SLUG, suffix=f"long{nice}", seed=1,
                                        hyperparameters={"n_epochs": 50, "batch_size": 8})

        def training() -> bool:  # the model is loaded and steps are being taken
            return any(e.type == "metrics" for e in b.fine_tuning.jobs.list_events(job.id, limit=5).data)

        wait_until(training, 300, "the job's first step", (trainer,))
        question = [{"role": "user", "content": "What is the capital of France?"}]

        def ask() -> float:
            t0 = time.perf_counter()
            reply = a.chat.completions.create(model=f"base/{SLUG}", messages=question, max_tokens=32,
                                              temperature=0, extra_body={"ignore_eos": True})
            seconds = time.perf_counter() - t0
            assert reply.usage.completion_tokens == 32, reply.usage
            return seconds

        def stopped(flag: bool) -> None:
            os.killpg(trainer.popen.pid, signal.SIGSTOP if flag else signal.SIGCONT)
            time.sleep(1.0)  # a resumed trainer's threads back on the cores; the same gap before either kind

        def last_step() -> int:
            metrics = [e for e in b.fine_tuning.jobs.list_events(job.id, limit=20).data if e.type == "metrics"]
            return max((int(e.data["step"]) for e in metrics), default=0)

        ask()  # warm-up
        step_before, t_before = last_step(), time.perf_counter()
        solo: list[float] = []
        during: list[float] = []
        load = [os.getloadavg()[0]]
        for pair in range(args.latency_pairs):
            for trains in ((False, True) if pair % 2 == 0 else (True, False)):
                stopped(not trains)
                (during if trains else solo).append(ask())
            stopped(False)
            load.append(os.getloadavg()[0])
        steps, seconds = last_step() - step_before, time.perf_counter() - t_before
        job = b.fine_tuning.jobs.retrieve(job.id)
        assert job.status == "running", f"the job ended during the measurement: {job.status} {job.error}"
        b.fine_tuning.jobs.cancel(job.id)
        wait_until(lambda: b.fine_tuning.jobs.retrieve(job.id).status == "cancelled", 120, "the cancel", (trainer,))
    finally:
        if trainer.alive():
            os.killpg(trainer.popen.pid, signal.SIGCONT)
        trainer.stop()
        stack.procs.remove(trainer)
    out = {"trainer": line.split(": ", 1)[-1], "pairs": len(solo),
           "solo_median_s": round(statistics.median(solo), 3), "solo_p95_s": round(_pct(solo, 0.95), 3),
           "during_median_s": round(statistics.median(during), 3), "during_p95_s": round(_pct(during, 0.95), 3),
           "load_min": round(min(load), 2), "load_max": round(max(load), 2)}
    out["ratio_median"] = round(out["during_median_s"] / out["solo_median_s"], 3)
    out["ratio_p95"] = round(out["during_p95_s"] / out["solo_p95_s"], 3)
    # each pair's two requests ran seconds apart, under nearly the same other load: their ratio is the steadier one
    paired = [d / s for d, s in zip(during, solo, strict=True)]
    out["paired_ratio_median"] = round(statistics.median(paired), 3)
    out["paired_ratio_p95"] = round(_pct(paired, 0.95), 3)
    out["trainer_steps"], out["measured_s"] = steps, round(seconds, 1)
    print(f"  LORAFLEET_TRAINER_NICE={nice} ({out['trainer']}): tenant A's 32-token chat, {len(solo)} pairs: solo "
          f"median {out['solo_median_s']} s p95 {out['solo_p95_s']} s; while B trains median "
          f"{out['during_median_s']} s p95 {out['during_p95_s']} s; ratio median {out['ratio_median']}x, p95 "
          f"{out['ratio_p95']}x; pair by pair median {out['paired_ratio_median']}x, p95 {out['paired_ratio_p95']}x; "
          f"the trainer took {steps} steps in {out['measured_s']} s (load {out['load_min']}-{out['load_max']})",
          flush=True)
    return out


def latency(args) -> dict:
    from tests.e2e.conftest import ADMIN_DB_URL, PYTHON, REDIS_URL, Stack, _db_url, pg_connect

    base = smollm2_base()
    root = Path(tempfile.mkdtemp(prefix="lorafleet-bench-ftlat-"))
    suffix = secrets.token_hex(3)
    db_name = f"lorafleet_bench_ftlat_{suffix}"
    with pg_connect(ADMIN_DB_URL) as admin:
        admin.execute(f'CREATE DATABASE "{db_name}"')
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(REPO),
           "DATABASE_URL": _db_url(db_name), "CELERY_BROKER_URL": REDIS_URL.rsplit("/", 1)[0] + "/13",
           "LORAFLEET_VAR_DIR": str(root / "var"), "LORAFLEET_STORAGE_DIR": str(root / "storage"),
           "LORAFLEET_LOG_LEVEL": "WARNING"}
    env.pop("CELERY_RESULT_BACKEND", None)
    env.pop("LORAFLEET_TRAINER_NICE", None)
    # gunicorn 27's control socket is one path per user (~/.gunicorn/gunicorn.ctl), shared with any other stack on
    # the host; without it, nothing but our own signals stops this web
    env["GUNICORN_CMD_ARGS"] = (env.get("GUNICORN_CMD_ARGS", "") + " --no-control-socket").strip()
    stack = Stack(root, env)
    try:
        out = subprocess.run([PYTHON, "manage.py", "migrate", "--noinput"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        seeded = stack.django(f"SLUG, CHECKPOINT, SUFFIX = {SLUG!r}, {str(base)!r}, {suffix!r}\n" + LATENCY_SEED)
        stack.start_web()
        stack.start_worker(SLUG)
        return {"pairs": args.latency_pairs, "max_tokens": 32,
                **{f"nice_{nice}": _trainer_pass(stack, env, root, seeded["key"], seeded["trainee_key"], nice, args)
                   for nice in args.latency_passes.split(",")}}
    finally:
        stack.close()
        with pg_connect(ADMIN_DB_URL) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="speed,e2e,latency")
    parser.add_argument("--speed-examples", type=int, default=64, help="examples for the speed comparison")
    parser.add_argument("--e2e-examples", type=int, default=200, help="examples in the end-to-end dataset")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="speed: timed runs of each, best kept")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: the core's default)")
    parser.add_argument("--latency-passes", default="10,noyield",
                        help="latency: LORAFLEET_TRAINER_NICE of each pass (holding while the engine is busy, the "
                             "default); 'noyield': 10 without the holds")
    parser.add_argument("--latency-pairs", type=int, default=16, help="latency: solo/during request pairs per trainer")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if "DJANGO_SETTINGS_MODULE" not in os.environ:
        os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
    import django

    django.setup()
    for noisy in ("httpx", "httpx2", "openai"):  # one line per poll otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    figures = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"bench/finetune.py on {figures['machine']} (load {os.getloadavg()[0]:.1f})", flush=True)
    only = set(args.only.split(","))
    if "speed" in only:
        figures["speed"] = speed(args)
    if "e2e" in only:
        figures["e2e"] = e2e(args)
    if "latency" in only:
        figures["latency"] = latency(args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
