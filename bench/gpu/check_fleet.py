"""Step 4 of bench/gpu_check.sh: the engine on a fleet workload on CUDA, side by side with PEFT's
`generate(adapter_names=...)` and transformers' `generate` on the same GPU, in one run.

    python3 bench/gpu/check_fleet.py --out DIR              # CUDA: random Llama with 7B layer shapes
    python bench/gpu/check_fleet.py --rehearsal --out DIR   # CPU, tiny shapes and workload

Workload (bench/engine.py's, DESIGN.md "Performance targets"): 64 concurrent requests, 64-token prompts,
64 new tokens each (EOS ignored), adapters drawn Zipf(1.1) over 100 adapters of r=16 on all seven
projections (only the drawn ones are made; PEFT loads exactly those). bf16 everywhere. Model: hidden
4096, 32 heads, ffn 11008, vocab 32000, --layers decoder layers (default 8: what fits the check's time;
per-layer figures scale to 32). Every system gets one warm-up and the best of --repeats timed passes;
tok/s is generated tokens per wall second, prefill included.

Then the decode step itself: 64 sequences at mid-generation context, every one on its Zipf adapter (and
base-only), timed alone with the GPU synchronised, against the bytes it must read at least — every
weight once, the KV cache of every sequence, each distinct adapter's A and B once — as a fraction of the
copy bandwidth measured in the same process (and of the datasheet HBM peak).

Checks: every request completes with all its tokens, on the engine and on the peers. Goals: mixed
tok/s >= 2x PEFT's (the issue; DESIGN.md), mixed >= 0.85x lorafleet base-only (DESIGN.md).
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu.common import copy_bandwidth, datasheet_peak, parse_args, require_device, run, sync  # noqa: E402

N_ADAPTERS, RANK, ALPHA, ZIPF_S = 100, 16, 32.0, 1.1


def extra(ap) -> None:
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; rehearsal 2)")
    ap.add_argument("--requests", type=int, default=None, help="concurrent requests (default 64; rehearsal 16)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; rehearsal 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64; rehearsal 16)")
    ap.add_argument("--repeats", type=int, default=None, help="timed passes per system, best kept (default 2; 1)")
    ap.add_argument("--shapes", choices=("auto", "tiny", "7b"), default="auto",
                    help="model shapes (auto: 7b on the GPU, tiny in the rehearsal)")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra)
    tiny = args.rehearsal
    args.layers = args.layers or (2 if tiny else 8)
    args.requests = args.requests or (16 if tiny else 64)
    args.prompt_len = args.prompt_len or (16 if tiny else 64)
    args.new_tokens = args.new_tokens or (16 if tiny else 64)
    args.repeats = args.repeats or (1 if tiny else 2)
    run("fleet", args, lambda step: body(step, args))


def workload(n: int, prompt_len: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """bench/engine.py's draw: random prompt ids, adapters Zipf(1.1) over 100."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = rng.integers(10, vocab, size=(n, prompt_len)).tolist()
    p = 1.0 / np.arange(1, N_ADAPTERS + 1) ** ZIPF_S
    return prompts, rng.choice(N_ADAPTERS, size=n, p=p / p.sum()).tolist()


def body(step, args) -> None:
    import torch

    require_device(step)
    from bench.gpu.models import (
        ALL_TARGETS,
        SEVEN_B,
        TINY,
        adapter_ref,
        build_random_llama,
        free_all_adapters,
        load_hf,
        load_into_runner,
        make_peft_adapters,
    )
    from inference_worker.engine import Engine
    from inference_worker.model import ModelRunner, SeqStep
    from protocol.jobs import GenerationJob
    from protocol.lora_layout import ModelShape
    from protocol.memory import adapter_pages

    dev, tiny, dtype = args.device, args.rehearsal, torch.bfloat16
    R, P, NEW = args.requests, args.prompt_len, args.new_tokens
    shape = dict(TINY if args.shapes == "tiny" or (args.shapes == "auto" and tiny) else SEVEN_B)
    work = Path(args.work) / "fleet"
    t = time.perf_counter()
    base = build_random_llama(work / "base", layers=args.layers, seed=2, device=dev,
                              max_position=2 * (P + NEW) + 64, **shape)
    prompts, drawn = workload(R, P, shape["vocab"])
    distinct = sorted(set(drawn))
    step.figure(model={**shape, "layers": args.layers, "dtype": "bfloat16"},
                workload={"requests": R, "prompt_len": P, "new_tokens": NEW, "adapters": N_ADAPTERS, "rank": RANK,
                          "zipf": ZIPF_S, "distinct_adapters": len(distinct), "targets": "all seven"},
                build_model_s=round(time.perf_counter() - t, 1))

    model = load_hf(base, device=dev, dtype=dtype)
    specs = [dict(name=f"z{a:03d}", r=RANK, alpha=ALPHA, targets=ALL_TARGETS, rslora=False, seed=1000 + a)
             for a in distinct]
    peft_model, dirs = make_peft_adapters(model, work / "adapters", specs, device=dev)
    refs, blobs = {}, {}
    for i, sp in enumerate(specs):
        refs[sp["name"]], blobs[f"adapters/{sp['name']}"] = adapter_ref(dirs[sp["name"]], i + 1, sp["name"])
    names = [f"z{a:03d}" for a in drawn]
    step.log(f"model and {len(specs)} adapters ready")

    shape_ = ModelShape.from_config({"hidden_size": shape["hidden"], "num_attention_heads": shape["heads"],
                                     "num_key_value_heads": shape["kv_heads"], "num_hidden_layers": args.layers,
                                     "intermediate_size": shape["intermediate"]})
    bs = 16
    kv_pages = R * math.ceil((P + NEW) / bs) + 16
    lora_pages = len(specs) * adapter_pages(shape_, RANK, ALL_TARGETS, bs)
    runner = ModelRunner(base, device=dev, dtype=dtype, pool_pages=kv_pages + lora_pages + lora_pages // 8 + 32,
                         block_size=bs, max_lora_rank=RANK, max_running=R)
    engine = Engine(runner, blobs.__getitem__, max_running=R, prefill_chunk=512, host_cache_bytes=16 << 30).start()
    wait = 60 if tiny else 120  # a pass takes seconds: a hung engine fails the step with its reason, in time

    def pass_(tag: str, with_adapters: bool, new_tokens: int) -> tuple[float, int, list]:
        jobs = [GenerationJob(request_id=f"{tag}{k}", adapter=refs[names[k]] if with_adapters else None,
                              prompt_token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
                for k, p in enumerate(prompts)]
        t0 = time.perf_counter()
        results = [h.result(wait) for h in [engine.submit(j) for j in jobs]]
        wall = time.perf_counter() - t0
        bad = [r for r in results if not r.ok or r.completion_tokens != new_tokens]
        if bad:
            raise RuntimeError(f"{len(bad)} {tag} requests failed or came short: {bad[0].error_code} "
                               f"{bad[0].error_message}")
        return wall, sum(r.completion_tokens for r in results), [r.token_ids for r in results]

    best: dict[str, tuple] = {}
    try:
        pass_("warm", True, 2)  # loads the adapters, compiles the kernels
        pass_("warmb", False, 2)
        for rep in range(args.repeats):
            for key, with_adapters in (("base", False), ("mixed", True)):
                wall, toks, tokens = pass_(f"{key}{rep}-", with_adapters, NEW)
                if key not in best or wall < best[key][0]:
                    best[key] = (wall, toks, tokens)
        stats = engine.stats()
    finally:
        engine.stop()
    step.check("engine_requests_complete", True, f"{R} requests x {NEW} tokens, base-only and mixed, "
               f"{args.repeats} timed passes each")
    tok_s = {k: v[1] / v[0] for k, v in best.items()}
    step.figure(engine_batch_size_max=stats.get("batch_size_max"),
                engine_distinct_adapters_max=stats.get("distinct_adapters_max"))
    step.log(f"engine: base {tok_s['base']:.0f} tok/s, mixed {tok_s['mixed']:.0f} tok/s")

    # --- the decode step alone, against the bytes it must read ---------------------------------------
    free_all_adapters(runner)
    slot_of = {sp["name"]: load_into_runner(runner, dirs[sp["name"]], refs[sp["name"]]) for sp in specs}
    ctx = P + NEW // 2  # mid-generation
    blocks = [runner.kv.allocator.allocate(math.ceil((ctx + 1) / bs)) for _ in range(R)]
    order = sorted(range(R), key=lambda k: slot_of[names[k]])  # each adapter's tokens contiguous, as the engine does

    def decode_ms(with_adapters: bool, reps: int) -> float:
        steps = [SeqStep(blocks[k], ctx - 1, [prompts[k][0]], slot_of[names[k]] if with_adapters else -1)
                 for k in order]
        for _ in range(3):
            runner.forward(steps)
        times = []
        for _ in range(reps):
            sync(dev)
            t0 = time.perf_counter()
            runner.forward(steps)
            sync(dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    reps = 5 if tiny else 20
    step_ms = {"base": decode_ms(False, reps), "mixed": decode_ms(True, reps)}
    for b in blocks:
        runner.kv.allocator.free(b)
    h, i, L, V = shape["hidden"], shape["intermediate"], args.layers, shape["vocab"]
    hd = h // shape["heads"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    weight_bytes = 2 * (L * (h * (q + 2 * kv) + q * h + 3 * h * i) + V * h)
    kv_bytes = 2 * R * ctx * L * 2 * kv
    lora_bytes = 2 * len(set(names)) * RANK * L * sum(a + b for a, b in shape_.projections().values())
    bw = copy_bandwidth(dev)
    peak = datasheet_peak(dev)
    decode = {}
    for key, extra_bytes in (("base", 0), ("mixed", lora_bytes)):
        moved = weight_bytes + kv_bytes + extra_bytes
        rate = moved / (step_ms[key] * 1e-3)
        decode[key] = {"ms": step_ms[key], "mb_moved": moved / 1e6, "gb_s": rate / 1e9, "of_copy_bw": rate / bw,
                       "of_datasheet_peak": rate / peak if peak else None}
    step.figure(copy_bandwidth_gb_s=bw / 1e9, datasheet_hbm_gb_s=peak / 1e9 if peak else None,
                decode_step={"sequences": R, "context": ctx, **decode})
    step.log(f"decode step: base {step_ms['base']:.2f} ms = {decode['base']['of_copy_bw']:.0%} of copy bandwidth, "
             f"mixed {step_ms['mixed']:.2f} ms = {decode['mixed']['of_copy_bw']:.0%}")
    runner = engine = None  # the peers get the GPU memory back
    if dev == "cuda":
        torch.cuda.empty_cache()

    # --- the peers on the same GPU: transformers generate (base) and PEFT generate(adapter_names) -------
    ids = torch.tensor(prompts, device=dev)
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids),
               pad_token_id=0)

    def hf_pass(with_adapters: bool, rows=None, new_tokens=None):
        kw = dict(gen)
        x = ids if rows is None else ids[:rows]
        kw["attention_mask"] = torch.ones_like(x)
        if new_tokens:
            kw.update(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        with torch.inference_mode():
            if with_adapters:
                out = peft_model.generate(input_ids=x, adapter_names=names[:x.shape[0]], **kw)
            else:
                with peft_model.disable_adapter():
                    out = peft_model.generate(input_ids=x, **kw)
        sync(dev)
        return out[:, x.shape[1]:]

    for key, with_adapters in (("hf", False), ("peft", True)):
        hf_pass(with_adapters, rows=4, new_tokens=2)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            new = hf_pass(with_adapters)
            wall = time.perf_counter() - t0
            if key not in best or wall < best[key][0]:
                best[key] = (wall, new.numel(), new.tolist())
        tok_s[key] = best[key][1] / best[key][0]
    step.check("peers_complete", all(best[k][1] == R * NEW for k in ("hf", "peft")),
               f"transformers and PEFT generated {R} x {NEW} tokens each")

    same_base = sum(a == b for a, b in zip(best["base"][2], best["hf"][2], strict=True))
    same_mixed = sum(a == b for a, b in zip(best["mixed"][2], best["peft"][2], strict=True))
    step.figure(tok_s=tok_s, wall_s={k: v[0] for k, v in best.items()},
                greedy_equal={"base_vs_transformers": same_base, "mixed_vs_peft": same_mixed, "of": R,
                              "note": "batched bf16 runs of a random model: near ties flip under another "
                                      "summation order (parity step checks this one request at a time)"})
    step.log("tok/s: " + ", ".join(f"{k} {v:.0f}" for k, v in tok_s.items()))
    step.goal("mixed_vs_peft", tok_s["mixed"] / tok_s["peft"], 2.0,
              note="fleet tok/s over PEFT generate(adapter_names)")
    step.goal("mixed_vs_base", tok_s["mixed"] / tok_s["base"], 0.85, note="DESIGN.md: fleet >= 0.85x base-only")
    step.figure(base_vs_transformers=tok_s["base"] / tok_s["hf"])


if __name__ == "__main__":
    main()
