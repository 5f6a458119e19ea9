"""One SmolLM2 fleet step's LoRA term, replayed: the 210 native SGMV calls of a step, from a real LoraPool.

    .venv/bin/python bench/lora_step.py [--prefill] [--cached] [--threads 2] [--steps 40] [LIB.so LIB.so ...]

The adapters are bench/peers.py's SmolLM2 fleet: Zipf(1.1) over 100 adapters of ranks 8/16/32 on all seven
projections, 64 requests; the 29 drawn ones are placed in a LoraPool over a PagePool as the worker places them
(645 MB, 30 layers). A decode step is 64 tokens in 29 segments; `--prefill` makes it a 512-token prefill chunk
(13 prompts of 38 tokens and 18 tokens of a 14th, each its own adapter). Each step calls the SGMV entry point
once per projection of every layer, as the engine does, with the arguments kernels/cpu.py passes.

`--cached` points every slot of a projection at the largest-rank adapter's weights, so a step reads them from
the caches: the kernel's arithmetic and call structure without DRAM. Comparing the three (a step from DRAM, the
same step cached, and a plain read of the step's bytes) says whether the kernel's time is its reads, its
arithmetic, or both one after the other.

With no library given it runs the project's own build (kernels/cpu_native.py). Given several builds of
kernels/csrc/sgmv_cpu.c (e.g. `gcc -O3 -march=native -ffast-math -fopenmp-simd -fopenmp -pthread -shared -fPIC
-DSOME_VARIANT -o /tmp/v.so kernels/csrc/sgmv_cpu.c -lm`), their steps alternate and the paired median ratio
against the first is printed: on a shared host only an A/B inside one process is worth reading.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.engine import N_ADAPTERS, SMOL_RANKS, rank_of, smollm2_base, zipf_adapters  # noqa: E402
from bench.limits import read_bandwidth  # noqa: E402
from inference_worker.lora import LoraPool  # noqa: E402
from inference_worker.memory_pool import PagePool  # noqa: E402
from inference_worker.model import ModelConfig  # noqa: E402
from kernels import LoraTable, cpu_native  # noqa: E402
from kernels.cpu import LONG_SEGMENT  # noqa: E402
from protocol.lora_layout import TARGET_MODULES, ModelShape, peft_tensor_name  # noqa: E402
from protocol.memory import adapter_pages, page_elements  # noqa: E402

BLOCK = 16  # the worker's KV block size (pages per adapter follow from it)


def build_pool(shape: ModelShape) -> tuple[LoraPool, dict[int, int], list[int], list[int]]:
    """The drawn adapters placed in a pool: (pool, slot of each adapter, adapter of each request, ranks)."""
    ranks = [rank_of(i) for i in range(N_ADAPTERS)]
    adapter_of = sorted(zipf_adapters(np.random.default_rng(0)))  # chat_workload's draw (seed 0), grouped
    used = sorted(set(adapter_of))
    pages = sum(adapter_pages(shape, ranks[a], TARGET_MODULES, BLOCK) for a in used)
    pool = LoraPool(PagePool(num_layers=shape.num_layers, num_pages=pages, page_elems=page_elements(shape, BLOCK),
                             dtype=torch.float32, device="cpu"), shape, max_rank=max(SMOL_RANKS), block_size=BLOCK)
    g = torch.Generator().manual_seed(0)
    slot_of = {}
    for a in used:
        r, weights = ranks[a], {}
        for layer in range(shape.num_layers):
            for proj, (d_in, d_out) in shape.projections().items():
                weights[peft_tensor_name(layer, proj, "A")] = torch.randn(r, d_in, generator=g) * 0.05
                weights[peft_tensor_name(layer, proj, "B")] = torch.randn(d_out, r, generator=g) * 0.05
        slot_of[a] = pool.place(f"a{a}", weights, rank=r, scale=2.0)
    return pool, slot_of, adapter_of, ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("libs", nargs="*", help="builds of kernels/csrc/sgmv_cpu.c to alternate (default: the project's)")
    ap.add_argument("--prefill", action="store_true", help="a 512-token prefill chunk instead of a decode step")
    ap.add_argument("--cached", action="store_true", help="every slot reads the largest adapter's weights")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()

    shape = ModelShape.from_config(ModelConfig.from_dir(smollm2_base()))
    pool, slot_of, adapter_of, ranks = build_pool(shape)
    if args.prefill:
        prompts = sorted(slot_of)[:14]
        token_slots = [slot_of[a] for i, a in enumerate(prompts) for _ in range(38 if i < 13 else 512 - 13 * 38)]
    else:
        token_slots = [slot_of[a] for a in adapter_of]
    step = pool.mapping(token_slots)
    assert step is not None
    T = len(token_slots)
    step_bytes = 0
    calls, keep = [], []  # keep: the tables and tensors the raw pointers point into
    for layer in range(shape.num_layers):
        buf = pool._buffers[layer]
        for proj, (d_in, d_out) in shape.projections().items():
            table = pool.tables[proj]
            if args.cached:  # every slot at the largest-rank adapter's A and B^T, each slot keeping its own rank
                r = table.ranks.tolist()
                big = max(range(len(r)), key=r.__getitem__)
                a, b = table.a_offsets.tolist(), table.b_offsets.tolist()
                table = LoraTable.build([a[big]] * len(a), [b[big]] * len(b), r, d_in=d_in, d_out=d_out, device="cpu")
            plan = step.mapping.plan(table).cpu_plan(LONG_SEGMENT)
            assert not plan.long_segments
            x, out, y = torch.randn(T, d_in), torch.zeros(T, d_out), torch.zeros(T, max(ranks))
            keep += [table, plan, x, out, y]
            starts, lens, slots, rks = plan.short_ptrs
            calls.append((plan.num_short, starts, lens, slots, rks, x.data_ptr(), x.stride(0), buf.data_ptr(),
                          *table.host_offset_ptrs, out.data_ptr(), out.stride(0), pool.scales.data_ptr(),
                          y.data_ptr(), y.stride(0), d_in, d_out, args.threads))
            step_bytes += plan.short_rank_sum * (d_in + d_out) * 4
    fns = []
    for path in args.libs or [None]:
        if path is None:
            fn = cpu_native.sgmv_for(torch.float32)
            assert fn is not None, "the native kernel library cannot be built here"
        else:
            fn = ctypes.CDLL(path).sgmv_add_f32
            fn.argtypes, fn.restype = cpu_native._ARGTYPES, None
        fns.append(fn)
    times: list[list[float]] = [[] for _ in fns]
    for i in range(args.steps + 3):
        for fn, ts in zip(fns, times, strict=True):
            t = time.perf_counter()
            for c in calls:
                fn(*c)
            if i >= 3:  # the first steps fault pages in and build the OpenMP team
                ts.append(time.perf_counter() - t)
    read = read_bandwidth()
    print(f"{'prefill chunk' if args.prefill else 'decode step'}: {T} tokens, {len(calls)} calls, "
          f"{step_bytes / 1e6:.0f} MB of adapter weights read a step{' (from the caches)' if args.cached else ''}; "
          f"{args.threads} threads; a plain read of 700 MB ran {read / 1e9:.1f} GB/s, "
          f"{step_bytes / read * 1e3:.1f} ms for the step's bytes")
    for name, ts in zip(args.libs or ["project build"], times, strict=True):
        print(f"  {name}: best {min(ts) * 1e3:.1f} ms, median {statistics.median(ts) * 1e3:.1f} ms a step "
              f"({step_bytes / min(ts) / 1e9:.1f} GB/s at best)")
    for name, ts in zip(args.libs[1:], times[1:], strict=False):
        ratio = statistics.median(b / a for a, b in zip(times[0], ts, strict=True))
        print(f"  {name} / {args.libs[0]}: paired median {ratio:.3f}")


if __name__ == "__main__":
    main()
