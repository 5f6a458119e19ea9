"""Where a lorafleet pass's time goes: GEMMs by row count, the LoRA term (decode and prefill calls), attention.

    .venv/bin/python bench/breakdown.py [--workload smollm2] [--modes base,fleet] [--rounds 2] [--lora-prefetch-ab]

One engine on a bench/peers.py workload (the same setup as its lorafleet row), its passes alternating between
the modes. Every GEMM (`Projection.__call__` / `add_to`), every LoRA call (`StepLora.add`), every GEMM with its LoRA term
inside (`Projection.with_lora`, a decode step's where the fused term is on), every attention call
(`Block.attend`, and `StepKernels.attention` where a step attends on the step's kernels) and each forward step
(`ModelRunner.forward`) is timed; a GEMM's FLOPs come from its shapes, so
each row bucket prints the rate the engine got, to set beside bench/limits.py's rates for the same row counts.
"rest of forward" is what the forward spends outside those (norms, RoPE and the KV write, SwiGLU's gate, the
LM head's sampling input); "outside" is the wall time outside the forward (scheduling, sampling, replies). Each pass
also prints its minor page faults and the seconds the process spent in the kernel (getrusage).

The timers cost ~0.3 us a call (~40,000 calls a SmolLM2 pass: ~10 ms), well under the noise between passes.
What it showed is in bench/RESULTS.md ("Where a SmolLM2 pass's time goes").
"""
from __future__ import annotations

import argparse
import collections
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import peers  # noqa: E402
from inference_worker import lora as lora_mod  # noqa: E402
from inference_worker import model as model_mod  # noqa: E402

seconds: dict[str, float] = collections.defaultdict(float)
calls: dict[str, int] = collections.defaultdict(int)
flops: dict[str, float] = collections.defaultdict(float)


def timed(fn, key, count_flops=None):
    """fn, timed into `key(*args)`'s bucket (and its FLOPs from `count_flops(*args, result)`)."""

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        result = fn(*args, **kwargs)
        k = key(*args)
        seconds[k] += time.perf_counter() - t
        calls[k] += 1
        if count_flops is not None:
            flops[k] += count_flops(*args, result)
        return result

    return wrapper


def gemm_bucket(rows: int) -> str:
    return "GEMM <= 64 rows" if rows <= 64 else "GEMM <= 512 rows" if rows <= 512 else "GEMM > 512 rows"


def instrument(decode_rows: int) -> None:
    """Wrap the engine's GEMMs, LoRA calls, attention and forward in timers; a step of at most `decode_rows`
    tokens is a decode step."""
    proj = model_mod.Projection
    # (a side stream to prefetch may follow x: model.StepSides; the result comes last)
    def x_first_flops(self, x, *rest):  # x, then any other arguments, the result last (add_to: after out)
        return 2.0 * x.shape[0] * x.shape[1] * rest[-1].shape[1]

    proj.__call__ = timed(proj.__call__, lambda self, x, *_: gemm_bucket(x.shape[0]), x_first_flops)
    proj.add_to = timed(proj.add_to, lambda self, out, x, *_: gemm_bucket(x.shape[0]),
                        lambda self, out, x, *rest: x_first_flops(self, x, *rest))
    # a decode step's GEMM with its LoRA term inside (kernels.gemm_lora): its own bucket, its rate the GEMM's FLOPs only
    proj.with_lora = timed(proj.with_lora, lambda *_: "fused GEMM + LoRA, decode steps", x_first_flops)
    lora_mod.StepLora.add = timed(lora_mod.StepLora.add,
                                  lambda self, out, x, layer, proj: "LoRA, decode steps" if x.shape[0] <= decode_rows
                                  else "LoRA, steps with a prefill")
    model_mod.Block.attend = timed(model_mod.Block.attend, lambda *a: "attention")
    model_mod.Block._attend_decode = timed(model_mod.Block._attend_decode, lambda *a: "attention of decode tokens")
    # a step's attention on the step's kernels (not inside Block.attend): of decode tokens when the step has no prompt
    step = model_mod.StepKernels
    step.attention = timed(timed(step.attention, lambda self, *a: "attention of decode tokens" if self.T <= decode_rows
                                 else "attention, steps with a prompt"), lambda *a: "attention")
    model_mod.ModelRunner.forward = timed(model_mod.ModelRunner.forward, lambda *a: "forward")
    # parts of the rest: the step's small ops, the step's set-up, the LM head's norm and cast (its GEMM is a GEMM)
    for name in ("norm", "rope_kv", "swiglu"):
        setattr(step, name, timed(getattr(step, name), lambda self, *a, name=name:
                                  f"rest: {name}, " + ("decode steps" if self.T <= decode_rows else "steps with a prompt")))
    model_mod.ModelRunner._context = timed(model_mod.ModelRunner._context, lambda *a: "rest: the step's set-up")
    model_mod.ModelRunner._head = timed(model_mod.ModelRunner._head, lambda *a: "rest: LM head (its GEMM too)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="smollm2", choices=sorted(peers.WORKLOADS))
    ap.add_argument("--modes", default="base,fleet")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/lorafleet-bench")
    ap.add_argument("--huge-pages", choices=("on", "off"), default="on",
                    help="off: leave the weights on the 4 KB pages malloc gave them (ModelRunner(huge_pages=False)); "
                         "an A/B runs the two in alternating processes, as the choice is the process's")
    ap.add_argument("--lora-prefetch-ab", action="store_true",
                    help="each mode twice a round: the GEMMs prefetching the adapter matrices the LoRA work after "
                         "them reads (ModelRunner.lora_side_prefetch), then not")
    args = ap.parse_args()

    w = peers.WORKLOADS[args.workload](Path(args.workdir))
    engine = peers.Lorafleet(w, huge_pages=args.huge_pages == "on")
    runner = engine.engine.runner
    print("weights' pages:", runner.huge_pages.describe() if runner.huge_pages else "as malloc gave them", flush=True)
    instrument(decode_rows=len(w.prompts))  # a step of no more rows than running requests: a decode step
    generated = len(w.prompts) * w.new_tokens
    prefetch = [True, False] if args.lora_prefetch_ab else [runner.lora_side_prefetch]
    for _ in range(args.rounds):
        for mode, pf in [(m, p) for m in args.modes.split(",") for p in prefetch]:
            runner.lora_side_prefetch = pf
            mode_label = f"{mode} (prefetch {'on' if pf else 'off'})" if args.lora_prefetch_ab else mode
            seconds.clear()
            calls.clear()
            flops.clear()
            before = resource.getrusage(resource.RUSAGE_SELF)
            wall, _ = engine.timed(mode)
            after = resource.getrusage(resource.RUSAGE_SELF)
            gemm = sum(v for k, v in seconds.items() if k.startswith("GEMM"))
            lora = sum(v for k, v in seconds.items() if k.startswith("LoRA"))
            fused = sum(v for k, v in seconds.items() if k.startswith("fused"))
            fwd, attn = seconds["forward"], seconds["attention"]
            print(f"{args.workload} {mode_label:5s} wall {wall:6.2f} s ({generated / wall:6.1f} tok/s): forward {fwd:6.2f} = "
                  f"GEMMs {gemm:5.2f} + LoRA {lora:5.2f} + fused GEMM + LoRA {fused:5.2f} + attention {attn:5.2f} + "
                  f"rest {fwd - gemm - lora - fused - attn:5.2f}; "
                  f"outside the forward {wall - fwd:5.2f}; {after.ru_minflt - before.ru_minflt} page faults, "
                  f"{after.ru_stime - before.ru_stime:5.2f} s in the kernel", flush=True)
            print(f"    attention of decode tokens  {seconds['attention of decode tokens']:6.2f} s, "
                  f"{calls['attention of decode tokens']:6d} calls", flush=True)
            for k in sorted(seconds):
                if k.startswith(("GEMM", "LoRA", "fused", "rest")):
                    rate = f", {flops[k] / seconds[k] / 1e9:6.1f} GFLOP/s" if flops[k] else ""
                    print(f"    {k:27s} {seconds[k]:6.2f} s, {calls[k]:6d} calls{rate}", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
