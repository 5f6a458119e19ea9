"""Scheduling by share on the engine (issue 46), on SmolLM2-135M-Instruct: four scenarios, each measured side by
side in one run, printed as ratios.

    .venv/bin/python bench/scheduling.py [--only capture,long,pool,prefix] [--json var/scheduling.json]
    make bench-scheduling

- capture: tenant `hog` runs 8 requests of n = 8, max_tokens 1024, ignore_eos (all 64 sequences); tenant `small`
  then sends a one-line chat question (max_tokens 32, greedy). Its latency (submit -> done) and first token, solo
  and under the capture; the engine's mean step time with 1 and with 64 decode rows says how much of the
  difference is the bigger batch itself (on a CPU a step's time grows with its rows).
- long: tenant `reader` sends a near-context prompt (6,000 tokens; the context is 8,192) while tenant `chat` streams
  short answers one after another. `chat`'s inter-token latency p50/p95 solo and while the prompt is read, and the
  long prompt's time to first token (TTFT) alone and under the bound.
- pool: 64 chat questions (the model's template), max_tokens 1024, natural stops, greedy, all at once, in one pool
  of 256 MiB: KV reserved for prompt + max_tokens at admission (the engine before issue 46, `reserve_full`) against
  KV on demand. Peak running sequences, tok/s, preemptions, the same tokens.
- prefix: one tenant and adapter, a 500-token system prompt shared by 64 chat requests sent one after another
  (max_tokens 16): TTFT p50/p95 with the prefix cache and without it; the same tokens.

One engine per system at a time, threads for the clients; OMP_WAIT_POLICY=PASSIVE (other processes share the CPUs:
say so with the figures).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.engine import chat_questions, smollm2_base  # noqa: E402
from inference_worker.engine import Engine  # noqa: E402
from inference_worker.model import ModelRunner  # noqa: E402
from protocol.jobs import AdapterRef, GenerationJob  # noqa: E402

MIB = 1 << 20


def pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else float("nan")


def render(tok, question: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def pool_pages(base: Path, pool_mb: int) -> int:
    """Pages of a pool of `pool_mb` MiB: one page is one KV block (16 positions) of every layer, fp32."""
    cfg = json.loads((base / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    page = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * 16 * head_dim * 4
    return pool_mb * MIB // page


def engine(base: Path, *, memory_mb: int, max_running: int = 64, lora: bool = False, blobs=None, **kw) -> Engine:
    runner = ModelRunner(base, pool_pages=pool_pages(base, memory_mb), enable_lora=lora, max_running=max_running,
                         max_batch_tokens=512 + max_running, max_lora_rank=16)
    return Engine(runner, (blobs or {}).get, max_running=max_running, prefill_chunk=512, **kw).start()


def chat(rid, prompt, tenant, max_tokens, **kw) -> GenerationJob:
    return GenerationJob(rid, kw.pop("adapter", None), prompt_token_ids=prompt, max_tokens=max_tokens,
                         temperature=0.0, tenant=tenant, **kw)


def timed_request(eng: Engine, job: GenerationJob) -> dict:
    """Latency, first token and inter-token gaps of one request, read from its stream."""
    t0 = time.perf_counter()
    h = eng.submit(job)
    stamps = []
    for _ in h.stream(timeout=900):
        stamps.append(time.perf_counter())
    res = h.result(900)
    assert res.ok, res.error_message
    done = time.perf_counter()
    return {"latency": done - t0, "ttft": res.first_token_s, "gaps": list(np.diff(stamps)), "tokens": res.token_ids,
            "n": res.completion_tokens}


# ---- capture ----------------------------------------------------------------------------------------------


def step_time(eng: Engine, rows: int, tok, q: str) -> float:
    """Mean seconds of a decode step with `rows` sequences (the engine's own step timer)."""
    prompt = render(tok, q)
    hs = [eng.submit(chat(f"st{rows}-{i}", prompt, "probe", 48, ignore_eos=True)) for i in range(rows)]
    while any(r.seqs[0].out_ids == [] for r in list(eng._running)) or eng.stats()["running_sequences"] < rows:
        if all(h.done() for h in hs):
            break
        time.sleep(0.01)
    s0 = eng.stats()
    time.sleep(1.5)
    s1 = eng.stats()
    for h in hs:
        h.result(900)
    return (s1["step_seconds"] - s0["step_seconds"]) / max(1, s1["steps"] - s0["steps"])


def bench_capture(base: Path, tok) -> dict:
    q = chat_questions()[0]
    small = render(tok, q)
    eng = engine(base, memory_mb=1024)
    try:
        timed_request(eng, chat("warm", small, "small", 8))
        solo = [timed_request(eng, chat(f"solo{i}", small, "small", 32, ignore_eos=True)) for i in range(3)]
        one, sixty_four = step_time(eng, 1, tok, q), step_time(eng, 64, tok, q)
        hog_prompt = render(tok, chat_questions()[5])
        hogs = [eng.submit(chat(f"hog{i}", hog_prompt, "hog", 1024, n=8, ignore_eos=True)) for i in range(8)]
        while eng.stats()["running_sequences"] < 64:
            time.sleep(0.05)
        time.sleep(2.0)
        under = [timed_request(eng, chat(f"cap{i}", small, "small", 32, ignore_eos=True)) for i in range(3)]
        stats = eng.stats()
        for h in hogs:
            h.cancel()
        for h in hogs:
            h.result(900)
    finally:
        eng.stop()
    assert all(u["tokens"] == solo[0]["tokens"] for u in under)
    lat_solo, lat_cap = statistics.median(r["latency"] for r in solo), statistics.median(r["latency"] for r in under)
    out = {"solo_latency_s": lat_solo, "capture_latency_s": lat_cap, "ratio": lat_cap / lat_solo,
           "solo_ttft_s": statistics.median(r["ttft"] for r in solo),
           "capture_ttft_s": statistics.median(r["ttft"] for r in under),
           "step_s_1_row": one, "step_s_64_rows": sixty_four, "step_ratio": sixty_four / one,
           "preemptions_for_share": stats["preemptions_for_share"]}
    print(f"capture: small tenant's latency solo {lat_solo:.2f} s, under capture {lat_cap:.2f} s = "
          f"{out['ratio']:.2f}x (TTFT {out['solo_ttft_s']:.3f} -> {out['capture_ttft_s']:.3f} s); a decode step with "
          f"64 rows takes {out['step_ratio']:.2f}x one with 1 row ({sixty_four * 1e3:.0f} vs {one * 1e3:.0f} ms); "
          f"preemptions for share {out['preemptions_for_share']}", flush=True)
    return out


# ---- long prompt --------------------------------------------------------------------------------------------


def bench_long(base: Path, tok, long_tokens: int = 6000) -> dict:
    questions = chat_questions()
    eng = engine(base, memory_mb=1024)
    rng = np.random.default_rng(0)
    vocab = int(eng.runner.config.vocab_size)
    long_prompt = render(tok, "Summarise this.") + [int(t) for t in rng.integers(100, vocab - 100, long_tokens)]
    try:
        timed_request(eng, chat("warm", render(tok, questions[1]), "chat", 8))
        # each read of the long prompt under its own cache_salt: the second must not find the first's KV
        alone = timed_request(eng, chat("alone", long_prompt, "reader", 4, cache_salt="alone"))
        solo = [timed_request(eng, chat(f"solo{i}", render(tok, questions[i]), "chat", 48, ignore_eos=True))
                for i in range(4)]
        out_holder: dict = {}
        reader = threading.Thread(target=lambda: out_holder.update(
            r=timed_request(eng, chat("long", long_prompt, "reader", 4, cache_salt="beside"))))
        reader.start()
        time.sleep(0.5)
        during, i = [], 0
        while reader.is_alive():
            during.append(timed_request(eng, chat(f"dur{i}", render(tok, questions[i % 64]), "chat", 48,
                                                  ignore_eos=True)))
            i += 1
        reader.join()
        under = out_holder["r"]
        fitted = eng.stats()["step_cost"]
    finally:
        eng.stop()
    gaps_solo = [g for r in solo for g in r["gaps"]]
    gaps_during = [g for r in during for g in r["gaps"]]
    out = {"long_prompt_tokens": len(long_prompt), "itl_p50_solo_ms": pct(gaps_solo, 50) * 1e3,
           "itl_p95_solo_ms": pct(gaps_solo, 95) * 1e3, "itl_p50_during_ms": pct(gaps_during, 50) * 1e3,
           "itl_p95_during_ms": pct(gaps_during, 95) * 1e3, "long_ttft_alone_s": alone["ttft"],
           "long_ttft_bounded_s": under["ttft"], "answers_during": len(during), "step_cost": fitted}
    out["itl_p95_ratio"] = out["itl_p95_during_ms"] / out["itl_p95_solo_ms"]
    print(f"long prompt ({len(long_prompt)} tokens): the other tenant's ITL p50/p95 solo {out['itl_p50_solo_ms']:.1f}/"
          f"{out['itl_p95_solo_ms']:.1f} ms, while it is read {out['itl_p50_during_ms']:.1f}/"
          f"{out['itl_p95_during_ms']:.1f} ms (p95 {out['itl_p95_ratio']:.2f}x, {len(during)} answers); the long "
          f"prompt's TTFT alone {alone['ttft']:.1f} s, beside the other tenant {under['ttft']:.1f} s; the worker's "
          f"fitted step cost {fitted['fixed_s'] * 1e3:.1f} ms + {fitted['per_token_s'] * 1e3:.2f} ms a token + "
          f"{fitted['per_attended_s'] * 1e6:.2f} us an attended position + {fitted.get('per_read_s', 0.0) * 1e6:.2f} us a "
          f"cached position read", flush=True)
    return out


# ---- pool: reservation against on-demand KV -------------------------------------------------------------------


def run_pool(base: Path, prompts, *, reserve_full: bool, pool_mb: int) -> dict:
    eng = engine(base, memory_mb=pool_mb, reserve_full=reserve_full)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], eng.stats()["running_sequences"])
            time.sleep(0.02)

    try:
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        t0 = time.perf_counter()
        hs = [eng.submit(chat(f"p{i}", p, "chat", 1024)) for i, p in enumerate(prompts)]
        results = [h.result(3600) for h in hs]
        wall = time.perf_counter() - t0
        stop.set()
        w.join()
        stats = eng.stats()
        blocks = stats["total_kv_blocks"]
    finally:
        eng.stop()
    assert all(r.ok for r in results), [r.error_message for r in results if not r.ok][:3]
    tokens = sum(r.completion_tokens for r in results)
    return {"tok_s": tokens / wall, "wall_s": wall, "peak_running": peak[0], "preemptions": stats["preemptions"],
            "recomputed_tokens": stats["recomputed_tokens"], "kv_blocks": blocks, "completion_tokens": tokens,
            "stops": sum(r.finish_reason == "stop" for r in results), "tokens": [r.token_ids for r in results]}


def bench_pool(base: Path, tok, pool_mb: int = 256) -> dict:
    prompts = [render(tok, q) for q in chat_questions()]
    reserved = run_pool(base, prompts, reserve_full=True, pool_mb=pool_mb)
    on_demand = run_pool(base, prompts, reserve_full=False, pool_mb=pool_mb)
    same = sum(a == b for a, b in zip(reserved["tokens"], on_demand["tokens"], strict=True))
    out = {"pool_mib": pool_mb, "reserved": {k: v for k, v in reserved.items() if k != "tokens"},
           "on_demand": {k: v for k, v in on_demand.items() if k != "tokens"}, "same_tokens": same,
           "requests": len(prompts), "peak_ratio": on_demand["peak_running"] / max(1, reserved["peak_running"]),
           "tok_s_ratio": on_demand["tok_s"] / reserved["tok_s"]}
    print(f"pool {pool_mb} MiB ({reserved['kv_blocks']} KV blocks), 64 chats, max_tokens 1024, natural stops: peak "
          f"running {reserved['peak_running']} reserved -> {on_demand['peak_running']} on demand "
          f"({out['peak_ratio']:.1f}x); tok/s {reserved['tok_s']:.1f} -> {on_demand['tok_s']:.1f} "
          f"({out['tok_s_ratio']:.2f}x); preemptions {on_demand['preemptions']} ({on_demand['recomputed_tokens']} "
          f"tokens re-read); stops {reserved['stops']}/{on_demand['stops']} of 64; same tokens {same}/64", flush=True)
    return out


# ---- prefix cache ------------------------------------------------------------------------------------------


def adapter_for(base: Path, workdir: Path) -> tuple[AdapterRef, dict]:
    import hashlib

    from tests.support.peft_factory import make_random_peft_adapter
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    folder = make_random_peft_adapter(base, workdir / "prefix-adapter", r=8, alpha=16, target_modules=targets, seed=46)
    blob = (folder / "adapter_model.safetensors").read_bytes()
    ref = AdapterRef(version_id=1, sha256=hashlib.sha256(blob).hexdigest(), storage_key="p", rank=8, alpha=16.0,
                     use_rslora=False, target_modules=targets, name="support-bot")
    return ref, {"p": blob}


def run_prefix(base: Path, prompts, ref, blobs, *, cache: bool) -> dict:
    """The requests one after another (a closed loop of one client): each TTFT is its own prompt's reading, not
    a queue's."""
    eng = engine(base, memory_mb=1024, lora=True, blobs=blobs, prefix_cache=cache)
    try:
        eng.generate(chat("warm", prompts[0][-20:], "acme", 2, adapter=ref), timeout=600)  # loads the adapter
        results = [eng.generate(chat(f"q{i}", p, "acme", 16, adapter=ref, ignore_eos=True), timeout=900)
                   for i, p in enumerate(prompts)]
    finally:
        eng.stop()
    assert all(r.ok for r in results)
    ttft = [r.first_token_s for r in results]
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
            "cached_tokens_mean": float(np.mean([r.cached_tokens for r in results])),
            "tokens": [r.token_ids for r in results]}


def bench_prefix(base: Path, tok, workdir: Path) -> dict:
    ref, blobs = adapter_for(base, workdir)
    system, n = "", 1
    while len(tok(system)["input_ids"]) < 500:
        system += (f"Policy {n}: be courteous, cite the order number, never promise dates, escalate refunds over "
                   f"{100 + n} euros. ")
        n += 1
    prompts = [render(tok, q, system) for q in chat_questions()]
    cold = run_prefix(base, prompts, ref, blobs, cache=False)
    warm = run_prefix(base, prompts, ref, blobs, cache=True)
    same = sum(a == b for a, b in zip(cold["tokens"], warm["tokens"], strict=True))
    out = {"system_tokens": len(tok(system)["input_ids"]), "prompt_tokens_mean": float(np.mean([len(p) for p in prompts])),
           "uncached": {k: v for k, v in cold.items() if k != "tokens"},
           "cached": {k: v for k, v in warm.items() if k != "tokens"}, "same_tokens": same,
           "ttft_p50_ratio": warm["ttft_p50_s"] / cold["ttft_p50_s"]}
    print(f"prefix: {out['system_tokens']}-token system prompt, 64 requests one after another, one tenant and adapter: TTFT "
          f"p50/p95 uncached {cold['ttft_p50_s'] * 1e3:.0f}/{cold['ttft_p95_s'] * 1e3:.0f} ms, cached "
          f"{warm['ttft_p50_s'] * 1e3:.0f}/{warm['ttft_p95_s'] * 1e3:.0f} ms (p50 {out['ttft_p50_ratio']:.2f}x); "
          f"{warm['cached_tokens_mean']:.0f} tokens cached a request; same tokens {same}/64", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="capture,long,pool,prefix")
    ap.add_argument("--json", default="")
    ap.add_argument("--long-tokens", type=int, default=6000)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    base = smollm2_base()
    tok = AutoTokenizer.from_pretrained(str(base))
    print(f"bench/scheduling.py {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or ''} "
          f"{os.cpu_count()} CPUs; SmolLM2-135M-Instruct; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
          flush=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            if name == "capture":
                out[name] = bench_capture(base, tok)
            elif name == "long":
                out[name] = bench_long(base, tok, args.long_tokens)
            elif name == "pool":
                out[name] = bench_pool(base, tok)
            elif name == "prefix":
                out[name] = bench_prefix(base, tok, Path(tmp))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
