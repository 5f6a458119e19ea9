"""Step 3 of bench/gpu_check.sh: the bf16 runner and the engine on CUDA compute what transformers and PEFT
compute, and a request's tokens do not depend on the batch it shares.

    python3 bench/gpu/check_parity.py --out DIR              # CUDA: random Llama, Llama-2-7B layer shapes
    python bench/gpu/check_parity.py --rehearsal --out DIR   # CPU, tiny shapes

A random Llama (hidden 4096, 32 heads, ffn 11008, vocab 32000, --layers of them; bench/gpu/models.py) and
one PEFT-made random adapter per request (ranks 8..128, four target sets, some rsLoRA). Every request runs
greedy for --new-tokens tokens, EOS ignored:

- transformers (base) / PEFT (adapter) in bf16, a plain cached greedy loop, logits kept;
- the same model upcast to fp32, teacher-forced on the bf16 tokens: the reference for logits;
- our ModelRunner in bf16, teacher-forced on the same tokens (prefill, then one decode step per token);
- the engine in bf16: every request alone, then all of them submitted at once (a mixed batch of base and
  adapter requests, prefill and decode together).

Checks: our logits are no further from fp32 than transformers' own bf16 logits are (within 2x of its
largest error); every greedy token where we part from transformers/PEFT is a near tie (the reference's
margin between the two tokens is below twice the two bf16 implementations' disagreement at that
position); every token where the mixed batch parts from the request alone is a near tie (below twice
transformers' bf16 error); adapters change outputs. Goals: >= 30 of 32 requests equal transformers
exactly, >= 30 of 32 equal PEFT, and every request's mixed-batch tokens equal its tokens alone. Random
weights give flatter next-token distributions than a trained model, so near ties are more frequent here
than in serving; the near-tie checks are what says the code is right, the counts how often bf16 noise
flips a token.
"""
from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu.common import parse_args, require_device, run, sync  # noqa: E402

TARGET_SETS = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
               ("o_proj", "down_proj"), ("k_proj", "gate_proj", "up_proj")]


def extra(ap) -> None:
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; rehearsal 2)")
    ap.add_argument("--requests", type=int, default=None, help="base requests = adapter requests (default 32; 8)")
    ap.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per request (default 32; 12)")
    ap.add_argument("--shapes", choices=("auto", "tiny", "7b"), default="auto",
                    help="model shapes (auto: 7b on the GPU, tiny in the rehearsal)")
    ap.add_argument("--arch", choices=("llama", "qwen3", "phi3", "gemma2", "gemma3"), default="llama",
                    help="the family (qwen3: Qwen3-8B's layer shapes, or tiny ones with head_dim 24; phi3: Llama's "
                         "shapes, q/k/v and gate/up fused, adapters on qkv_proj / gate_up_proj; gemma2 / gemma3: "
                         "Gemma-2-9B's / Gemma-3-4B's layer shapes, or tiny ones, every Gemma feature on "
                         "(bench/gpu/models.py); step parity_<arch>)")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra)
    tiny = args.rehearsal
    args.layers = args.layers or (2 if tiny else 4)
    args.requests = args.requests or (8 if tiny else 32)
    args.new_tokens = args.new_tokens or (12 if tiny else 32)
    run("parity" if args.arch == "llama" else f"parity_{args.arch}", args, lambda step: body(step, args))


def body(step, args) -> None:
    import torch

    require_device(step)
    from bench.gpu.models import (
        GEMMA_SHAPES,
        QWEN3_8B,
        QWEN3_TINY,
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
    R, N = args.requests, args.new_tokens
    small = args.shapes == "tiny" or (args.shapes == "auto" and tiny)
    if args.arch == "qwen3":
        shape = dict(QWEN3_TINY if small else QWEN3_8B)
    elif args.arch in GEMMA_SHAPES:
        shape = dict(GEMMA_SHAPES[args.arch]["tiny" if small else "gpu"])
    else:
        shape = dict(TINY if small else SEVEN_B)
    work = Path(args.work) / f"parity_{args.arch}"
    t = time.perf_counter()
    base = build_random_llama(work / "base", layers=args.layers, seed=1, device=dev, arch=args.arch, **shape)
    step.figure(model={**shape, "arch": args.arch, "layers": args.layers, "dtype": "bfloat16"}, requests=R,
                new_tokens=N,
                build_model_s=round(time.perf_counter() - t, 1))
    step.log(f"built {base}")
    vocab = shape["vocab"]

    ladder = [4, 8, 16, 32, 64] if tiny else [8, 16, 32, 64, 128]
    rank_of = [ladder[i % len(ladder)] for i in range(R)]
    target_sets = TARGET_SETS
    if args.arch == "phi3":  # PEFT's names for Phi-3: q/k/v are one module, gate/up another
        fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                 "up_proj": "gate_up_proj"}
        target_sets = [tuple(dict.fromkeys(fused.get(t, t) for t in ts)) for ts in TARGET_SETS]
    specs = [dict(name=f"ad{i:02d}", r=rank_of[i], alpha=float(2 * rank_of[i] if i % 2 else 16),
                  targets=target_sets[i % len(target_sets)], rslora=i % 3 == 2, seed=100 + i) for i in range(R)]
    rng = random.Random(0)  # noqa: S311 — reproducible draws, not secrets
    lo, hi = (3, 40) if tiny else (8, 120)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(R)]
    requests = [(f"base{j}", prompts[j], None) for j in range(R)] + \
               [(f"lora{j}", prompts[j], specs[j]["name"]) for j in range(R)]

    # --- transformers / PEFT in bf16: greedy with a KV cache, logits kept -------------------------------
    t = time.perf_counter()
    model = load_hf(base, device=dev, dtype=dtype)
    peft_model, dirs = make_peft_adapters(model, work / "adapters", specs, device=dev)
    refs, blobs = {}, {}
    for i, sp in enumerate(specs):
        refs[sp["name"]], blobs[f"adapters/{sp['name']}"] = adapter_ref(dirs[sp["name"]], i + 1, sp["name"])
    lora_dtype = next(p.dtype for n, p in peft_model.named_parameters() if "lora_A" in n)
    step.figure(peft_adapter_param_dtype=str(lora_dtype), adapters_s=round(time.perf_counter() - t, 1),
                adapter_ranks=[sp["r"] for sp in specs])
    step.log(f"{len(specs)} PEFT adapters made (PEFT keeps them in {lora_dtype})")

    def adapter_ctx(name):
        if name is None:
            return peft_model.disable_adapter()
        peft_model.set_adapter(name)
        return contextlib.nullcontext()

    hf_tokens, hf_logits = {}, {}
    t = time.perf_counter()
    with torch.inference_mode():
        for rid, prompt, name in requests:
            with adapter_ctx(name):
                out = peft_model(input_ids=torch.tensor([prompt], device=dev), use_cache=True)
                rows = [out.logits[0, -1].float()]
                for _ in range(N - 1):
                    tok = rows[-1].argmax().view(1, 1)
                    out = peft_model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
                    rows.append(out.logits[0, -1].float())
            hf_logits[rid] = torch.stack(rows)  # [N, vocab]
            hf_tokens[rid] = hf_logits[rid].argmax(-1).tolist()
    step.figure(hf_bf16_greedy_s=round(time.perf_counter() - t, 1))
    step.log("transformers/PEFT bf16 greedy done")

    # --- the fp32 reference: the same weights upcast, teacher-forced on the bf16 tokens -----------------
    peft_model.float()
    ref_logits = {}
    with torch.inference_mode():
        for rid, prompt, name in requests:
            with adapter_ctx(name):
                ids = torch.tensor([prompt + hf_tokens[rid][:-1]], device=dev)
                ref_logits[rid] = peft_model(input_ids=ids).logits[0, len(prompt) - 1:].float()  # [N, vocab]
    peft_model = model = out = None  # our runner gets the GPU memory back
    if dev == "cuda":
        torch.cuda.empty_cache()
    step.log("fp32 reference done")

    # --- our runner, teacher-forced on the same tokens ---------------------------------------------------
    shape_ = ModelShape.from_config({"hidden_size": shape["hidden"], "num_attention_heads": shape["heads"],
                                     "num_key_value_heads": shape["kv_heads"], "num_hidden_layers": args.layers,
                                     "intermediate_size": shape["intermediate"], "head_dim": shape.get("head_dim")})
    bs = 16
    kv_pages = sum(math.ceil((len(p) + N) / bs) for _, p, _ in requests) + 16
    lora_pages = sum(adapter_pages(shape_, sp["r"], sp["targets"], bs) for sp in specs)
    runner = ModelRunner(base, device=dev, dtype=dtype, pool_pages=kv_pages + lora_pages + lora_pages // 8 + 32,
                         block_size=bs,
                         max_lora_rank=max(ladder), max_running=2 * R)
    slots = {sp["name"]: load_into_runner(runner, dirs[sp["name"]], refs[sp["name"]]) for sp in specs}

    def teacher_forced(prompt, tokens, slot) -> torch.Tensor:
        """Our logits [len(tokens) + 1, vocab]: after the prompt, then after each given token."""
        blocks = runner.kv.allocator.allocate(math.ceil((len(prompt) + len(tokens) + 1) / bs))
        try:
            rows = [runner.forward([SeqStep(blocks, 0, list(prompt), slot)])[0]]
            for i, tok in enumerate(tokens):
                rows.append(runner.forward([SeqStep(blocks, len(prompt) + i, [tok], slot)])[0])
            return torch.stack(rows)
        finally:
            runner.kv.allocator.free(blocks)

    t = time.perf_counter()
    ours_tf = {rid: teacher_forced(prompt, hf_tokens[rid][:-1], slots[name] if name else -1)
               for rid, prompt, name in requests}
    sync(dev)
    step.figure(runner_teacher_forced_s=round(time.perf_counter() - t, 1))
    free_all_adapters(runner)

    # --- logits: no further from fp32 than transformers' bf16 ------------------------------------------
    err = {"ours": {}, "hf": {}, "ours_vs_hf": {}}
    top1 = {"ours": [], "hf": []}
    for rid, _, _ in requests:
        ref = ref_logits[rid]
        scale = ref.std().item()
        err["ours"][rid] = (ours_tf[rid] - ref).abs().max().item() / scale
        err["hf"][rid] = (hf_logits[rid] - ref).abs().max().item() / scale
        err["ours_vs_hf"][rid] = (ours_tf[rid] - hf_logits[rid]).abs().max().item() / scale
        top1["ours"].append((ours_tf[rid].argmax(-1) == ref.argmax(-1)).float().mean().item())
        top1["hf"].append((hf_logits[rid].argmax(-1) == ref.argmax(-1)).float().mean().item())
    for kind in ("base", "lora"):
        ks = [rid for rid, _, _ in requests if rid.startswith(kind)]
        mx = {w: max(err[w][k] for k in ks) for w in err}
        mean = {w: sum(err[w][k] for k in ks) / len(ks) for w in err}
        who = "transformers" if kind == "base" else "PEFT"
        step.figure(**{f"{kind}_logit_err_of_std": {"max": mx, "mean": mean}})
        tol = max(2 * mx["hf"], 1e-3)
        step.check(f"{kind}_logits_within_bf16_tolerance", mx["ours"] <= tol,
                   f"max |ours - fp32| = {mx['ours']:.3f} std of the logits (mean {mean['ours']:.4f}); {who} bf16: "
                   f"{mx['hf']:.3f} (mean {mean['hf']:.4f}); tolerance 2x {who}'s")
    step.figure(top1_agreement_with_fp32={w: sum(v) / len(v) for w, v in top1.items()})

    # --- the engine: every request alone, then all at once ---------------------------------------------
    engine = Engine(runner, blobs.__getitem__, max_running=2 * R, prefill_chunk=512, host_cache_bytes=16 << 30).start()
    wait = 60  # seconds for one request's (or the batch's) result: a hung engine fails the step with its reason

    def job(rid, prompt, name):
        return GenerationJob(request_id=rid, adapter=refs[name] if name else None, prompt_token_ids=list(prompt),
                             max_tokens=N, temperature=0.0, ignore_eos=True)

    try:
        t = time.perf_counter()
        alone = {}
        for rid, prompt, name in requests:
            res = engine.generate(job(rid, prompt, name), timeout=wait)
            if not res.ok:
                raise RuntimeError(f"{rid} failed alone: {res.error_code} {res.error_message}")
            alone[rid] = res.token_ids
        step.figure(engine_alone_s=round(time.perf_counter() - t, 1))
        order = list(requests)
        random.Random(1).shuffle(order)  # noqa: S311
        t = time.perf_counter()
        handles = {rid: engine.submit(job(rid, prompt, name)) for rid, prompt, name in order}
        mixed = {}
        for rid, h in handles.items():
            res = h.result(wait)
            if not res.ok:
                raise RuntimeError(f"{rid} failed in the mixed batch: {res.error_code} {res.error_message}")
            mixed[rid] = res.token_ids
        stats = engine.stats()
        step.figure(engine_mixed_s=round(time.perf_counter() - t, 1), engine_batch_size_max=stats.get("batch_size_max"),
                    engine_distinct_adapters_max=stats.get("distinct_adapters_max"))
    finally:
        engine.stop()
    free_all_adapters(runner)

    # --- greedy tokens: equal to transformers / PEFT, or parted at a near tie ---------------------------
    def first_diff(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)

    for kind, who in (("base", "transformers"), ("lora", "PEFT")):
        ks = [rid for rid, _, _ in requests if rid.startswith(kind)]
        same = sum(alone[k] == hf_tokens[k] for k in ks)
        unexplained, parted = [], []
        for k in ks:
            i = first_diff(alone[k], hf_tokens[k])
            if i is None:
                continue
            ours_tok, their_tok = alone[k][i], hf_tokens[k][i]
            margin = (ref_logits[k][i, their_tok] - ref_logits[k][i, ours_tok]).abs().item()
            disagreement = (ours_tf[k][i] - hf_logits[k][i]).abs().max().item()
            scale = ref_logits[k].std().item()
            parted.append({"request": k, "at": i, "ref_margin_of_std": margin / scale,
                           "bf16_disagreement_of_std": disagreement / scale})
            if margin > 2 * disagreement:
                unexplained.append(f"{k}@{i}")
        step.figure(**{f"{kind}_greedy_equal": same, f"{kind}_greedy_parted": parted})
        step.check(f"{kind}_greedy_tokens_equal_{who}_or_part_at_near_ties", not unexplained,
                   f"{same}/{len(ks)} equal; {len(parted)} parted, all at a fp32 margin below twice the bf16 "
                   "disagreement" if not unexplained else "parted beyond a near tie: " + ", ".join(unexplained[:8]))
        step.goal(f"{kind}_requests_equal_{who}", same, math.ceil(len(ks) * 30 / 32),
                  note=f"of {len(ks)}, greedy over {N} tokens (goal 30 of 32)")
    changed = sum(hf_tokens[f"lora{j}"] != hf_tokens[f"base{j}"] for j in range(R))
    step.check("adapters_change_outputs", changed >= R // 2, f"{changed}/{R} adapter requests differ from the base "
               "on the same prompt (PEFT's tokens)")

    # --- batch invariance: mixed batch == alone, or parted at a near tie ---------------------------------
    same = sum(mixed[k] == alone[k] for k in alone)
    parted, unexplained = [], []
    for rid, prompt, name in requests:
        i = first_diff(mixed[rid], alone[rid])
        if i is None:
            continue
        slot = load_into_runner(runner, dirs[name], refs[name]) if name else -1
        logits = teacher_forced(prompt, alone[rid][:i], slot)[i]
        if name:
            runner.unload_adapter(slot)
        a, m = alone[rid][i], mixed[rid][i]
        margin = (logits[a] - logits[m]).abs().item()
        noise = (hf_logits[rid] - ref_logits[rid]).abs().max().item()  # what bf16 rounding moves a logit by
        scale = ref_logits[rid].std().item()
        parted.append({"request": rid, "at": i, "margin_of_std": margin / scale, "bf16_noise_of_std": noise / scale})
        if margin > 2 * noise:
            unexplained.append(f"{rid}@{i}")
    step.figure(batch_invariance_equal=same, batch_invariance_parted=parted)
    step.check("mixed_batch_tokens_equal_alone_or_part_at_near_ties", not unexplained,
               f"{same}/{len(alone)} equal; {len(parted)} parted, all at a margin below twice the bf16 noise"
               if not unexplained else "parted beyond a near tie: " + ", ".join(unexplained[:8]))
    step.goal("mixed_batch_requests_equal_alone", same, len(alone), note=f"{R} adapters + {R} base requests")


if __name__ == "__main__":
    main()
