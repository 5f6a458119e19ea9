"""The Triton SGMV kernels on a CUDA device at Llama-2-7B shapes, against HBM bandwidth and against a
torch per-segment loop, side by side in one run.

    .venv/bin/python bench/gpu_kernels.py          # on a machine with a CUDA GPU, ~2 minutes
    TRITON_INTERPRET=1 .venv/bin/python bench/gpu_kernels.py --smoke   # CPU: tiny shapes, checks code paths only
    python3 bench/gpu_kernels.py --out DIR         # as above, and DIR/gpu_kernels.json (bench/gpu_check.sh)

bf16 weights and activations, r = 16, all seven projections of a decoder layer summed per cell. Weights
are pooled as the worker holds them: one flat buffer per layer, every adapter's A and B^T (rank-major) at
random offsets with gaps, exactly its real rank, one `LoraTable` per projection (kernels/table.py);
offsets are multiples of 16 bytes (the Triton kernels' vector-load path), and one line compares
unaligned ones.
Timing is triton.testing.do_bench (L2 flushed before every repeat), eager and as a CUDA graph replay
(the bandwidth figures use the graph time: GPU time without Python launch overhead). "bytes" is what the op must move at
least: A and B of the distinct adapters in the batch, x, and out read and written. The fraction is taken
against both the device's measured copy bandwidth and its datasheet HBM peak where the name is known.
Goal (DESIGN.md): at 64 tokens x 32 adapters, >= 70% of the measured copy bandwidth.

vLLM: its LoRA kernels (vllm/lora/ops/triton_ops) ship a benchmark (benchmarks/kernels/benchmark_lora.py)
but no published table of bandwidth at these shapes, dtype and device that this bench could quote, so
`VLLM_PUBLISHED` is empty and the comparison is printed as "none comparable" rather than guessed. A figure
added there needs its source (URL), device, dtype, shapes and what it counts.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu.common import PEAK_HBM_BYTES_S, run  # noqa: E402
from kernels import LoraMapping, LoraTable, add_lora  # noqa: E402
from kernels.reference import add_lora_reference  # noqa: E402
from kernels.testing import random_pool  # noqa: E402

# Published vLLM kernel figures comparable to a row of this bench: (tokens, adapters) -> dict(source=URL,
# device=..., dtype=..., rank=..., figure=..., counts=...). Empty: none found that states all of these.
VLLM_PUBLISHED: dict[tuple[int, int], dict] = {}
GOAL_CELL, GOAL_OF_COPY_BW = (64, 32), 0.70
TOKENS = (1, 16, 64, 256)
ADAPTERS = (1, 8, 32, 64)
SLOTS = 64


def shapes(smoke: bool) -> dict[str, tuple[int, int]]:
    hidden, inter = (96, 200) if smoke else (4096, 11008)
    if smoke:  # the three shapes of a layer, not all seven projections: the same code paths, fewer programs
        return {"q_proj": (hidden, hidden), "gate_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return {"q_proj": (hidden, hidden), "k_proj": (hidden, hidden), "v_proj": (hidden, hidden),
            "o_proj": (hidden, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def bench_ms(fn, smoke: bool) -> float:
    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graphed(fn, smoke: bool):
    """fn captured in a CUDA graph: its replay time is GPU time without Python launch overhead, which
    at these sizes (a few us of HBM traffic per projection) would otherwise dominate. None on failure."""
    if smoke:
        return None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as exc:  # a bench must still print the eager figures
        print(f"(CUDA graph capture failed: {exc})")
        return None


def batch_slots(tokens: int, adapters: int) -> list[int]:
    return [t * adapters // tokens if adapters <= tokens else t for t in range(tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out", help="also record checks, figures and the goal in OUT/gpu_kernels.json")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are first decorated
    if args.out:
        args.rehearsal, args.device = args.smoke, "cpu" if args.smoke else "cuda"
        run("gpu_kernels", args, lambda step: bench(args, step))
    bench(args)


def bench(args, step=None) -> None:
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        if step is not None:
            step.check("cuda_available", False, "torch.cuda.is_available()")
        sys.exit("no CUDA device: run this on a GPU machine (or --smoke on CPU)")
    if step is not None and not args.smoke:
        step.check("triton_compiled_not_interpreted", os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                   f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    projections = shapes(args.smoke)
    tokens_grid = (1, 16) if args.smoke else TOKENS
    adapters_grid = (1, 4) if args.smoke else ADAPTERS  # smoke: every code path, few interpreted programs

    name = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_HBM_BYTES_S.items() if k in name), None)
    src = torch.empty(256 * 1024 * 1024 if not args.smoke else 1024, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src), args.smoke)
    copy_bw = 2 * src.numel() / (copy_ms * 1e-3)
    print(f"# {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s measured; datasheet HBM peak: "
          f"{peak / 1e9:.0f} GB/s" if peak else f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s measured")

    def make_layer(ranks: list[int], seed: int = 0, align: int = 8) -> tuple[torch.Tensor, dict[str, LoraTable]]:
        """One layer's pooled weights (bf16; align 8 elements = 16 bytes) and a table per projection."""
        pooled = random_pool(projections, {n: ranks for n in projections}, dtype=dtype, std=0.05, garbage=0.05,
                             seed=seed, align=align, max_gap=max(8, align), device=device)
        return pooled.buffer, pooled.tables

    layer = make_layer([16] * SLOTS)
    base_w = {n: torch.randn(d_out, d_in, device=device, dtype=dtype) * 0.02
              for n, (d_in, d_out) in projections.items()}
    scales = torch.full((SLOTS,), 2.0, device=device)

    # correctness first: the timed op must be the right op (slot 3 has no weights in gate_proj)
    slots = batch_slots(16, 8)
    buffer, tables = layer
    gate = tables["gate_proj"]
    gate_ranks = [0 if s == 3 else r for s, r in enumerate(gate.rank_list)]
    table = LoraTable.build(list(gate.a_offset_list), list(gate.b_offset_list), gate_ranks, d_in=gate.d_in,
                            d_out=gate.d_out, device=device)
    x = torch.randn(16, table.d_in, device=device, dtype=dtype)
    out = torch.randn(16, table.d_out, device=device, dtype=dtype)
    mapping = LoraMapping.build(torch.tensor(slots, dtype=torch.int32, device=device), SLOTS)
    got = add_lora(out.clone(), x, buffer, table, mapping, scales, backend="triton")
    host_table = LoraTable.build(list(table.a_offset_list), list(table.b_offset_list), gate_ranks,
                                 d_in=table.d_in, d_out=table.d_out, device="cpu")
    want = add_lora_reference(out.cpu().clone(), x.cpu(), buffer.cpu(), host_table,
                              LoraMapping.build(slots, SLOTS), scales.cpu())
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)
    skipped = [t for t, s in enumerate(slots) if s == 3]
    if not torch.equal(got[skipped], out[skipped]):
        raise AssertionError("a rank-0 slot's tokens must be left untouched")
    if step is not None:
        step.check("timed_op_is_right", True, "bf16 gate_proj, 16 tokens x 8 adapters, a rank-0 slot: within 2e-2 of "
                   "the float64 reference, the rank-0 slot's rows untouched")
        step.figure(device=name, copy_bandwidth_gb_s=copy_bw / 1e9, datasheet_hbm_gb_s=peak / 1e9 if peak else None)
    rows = []

    def cell(tokens: int, adapters: int, layer: tuple[torch.Tensor, dict[str, LoraTable]]):
        buffer, tables = layer
        slots = batch_slots(tokens, adapters)
        mapping = LoraMapping.build(torch.tensor(slots, dtype=torch.int32, device=device), SLOTS)
        xs = {n: torch.randn(tokens, d_in, device=device, dtype=dtype) for n, (d_in, _) in projections.items()}
        outs = {n: torch.zeros(tokens, d_out, device=device, dtype=dtype) for n, (_, d_out) in projections.items()}

        def ours():
            for n, table in tables.items():
                add_lora(outs[n], xs[n], buffer, table, mapping, scales, backend="triton")

        def loop():  # torch per-segment: two matmuls per adapter run, as without SGMV
            for n, table in tables.items():
                for start, end, slot, _ in mapping.plan(table).segments:
                    a, b_t = table.a_of(buffer, slot), table.b_of(buffer, slot)  # [r, d_in], [r, d_out]
                    outs[n][start:end] += 2.0 * ((xs[n][start:end] @ a.t()) @ b_t)

        def base():
            for n, w in base_w.items():
                torch.nn.functional.linear(xs[n], w)

        moved = 0
        for n, (d_in, d_out) in projections.items():
            ranks = tables[n].rank_list
            moved += sum(ranks[s] * (d_in + d_out) * 2 for s in set(slots))
            moved += sum(1 for s in slots if ranks[s] > 0) * (d_in + 2 * d_out) * 2
        return ours, loop, base, moved, len(set(slots))

    print("\n| tokens | adapters | Triton ms | Triton graph ms | torch loop ms | base GEMM ms | Triton vs loop "
          "| GB/s (graph) | of copy bw | of HBM peak |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in tokens_grid:
        for adapters in adapters_grid:
            ours, loop, base, moved, distinct = cell(tokens, adapters, layer)
            t_ours, t_loop, t_base = (bench_ms(f, args.smoke) for f in (ours, loop, base))
            replay = graphed(ours, args.smoke)
            t_graph = bench_ms(replay, args.smoke) if replay else t_ours
            rate = moved / (t_graph * 1e-3)
            label = f"{adapters}" if distinct == adapters else f"{adapters} ({distinct} used)"
            peak_txt = f"{rate / peak:.0%}" if peak else "n/a"
            print(f"| {tokens} | {label} | {t_ours:.3f} | {t_graph:.3f} | {t_loop:.3f} | {t_base:.3f} "
                  f"| {t_loop / t_ours:.1f}x "
                  f"| {rate / 1e9:.0f} | {rate / copy_bw:.0%} | {peak_txt} |", flush=True)
            rows.append({"tokens": tokens, "adapters": adapters, "distinct": distinct, "triton_ms": t_ours,
                         "triton_graph_ms": t_graph if replay else None, "torch_loop_ms": t_loop,
                         "base_gemm_ms": t_base,
                         "triton_vs_loop": t_loop / t_ours, "mb_moved": moved / 1e6, "gb_s": rate / 1e9,
                         "of_copy_bw": rate / copy_bw, "of_hbm_peak": rate / peak if peak else None,
                         "vllm_published": VLLM_PUBLISHED.get((tokens, adapters))})
    print(f"\nvLLM published figures at these shapes: {len(VLLM_PUBLISHED) or 'none comparable'} "
          "(see VLLM_PUBLISHED in this file)")
    if step is not None:
        step.figure(cells=rows, vllm_published=VLLM_PUBLISHED or "none comparable recorded")
        goal = next((r for r in rows if (r["tokens"], r["adapters"]) == GOAL_CELL), None)
        if goal is not None:
            step.goal("sgmv_64tok_32ad_of_copy_bw", goal["of_copy_bw"], GOAL_OF_COPY_BW,
                      note="shrink + expand of all seven projections, CUDA graph time, against the measured copy")

    tokens, adapters = (16, 4) if args.smoke else GOAL_CELL
    timed = []
    for ranks in ([4 if s % 2 == 0 else 64 for s in range(SLOTS)], [64] * SLOTS):  # pools hold the real ranks
        fn = cell(tokens, adapters, make_layer(ranks, seed=1))[0]
        timed.append(bench_ms(graphed(fn, args.smoke) or fn, args.smoke))
    t_mixed, t_all = timed
    print(f"\nranks mixed 4/64 vs all 64 ({tokens} tokens x {adapters} adapters): {t_mixed:.3f} ms vs "
          f"{t_all:.3f} ms = {t_mixed / t_all:.2f}x (goal <= 0.65x)")
    if step is not None and not args.smoke:
        step.goal("ranks_mixed_4_64_vs_all_64", t_mixed / t_all, 0.65, at_least=False,
                  note="traffic proportional to the real rank")

    timed = []
    for align in (8, 1):  # 16-byte offsets (vector loads) against offsets of any element
        fn = cell(tokens, adapters, make_layer([16] * SLOTS, seed=2, align=align))[0]
        timed.append(bench_ms(graphed(fn, args.smoke) or fn, args.smoke))
    print(f"offsets aligned to 16 bytes vs unaligned ({tokens} tokens x {adapters} adapters, r = 16): "
          f"{timed[0]:.3f} ms vs {timed[1]:.3f} ms = {timed[0] / timed[1]:.2f}x")
    if step is not None:
        step.figure(ranks_mixed_vs_all_64=t_mixed / t_all, aligned_vs_unaligned=timed[0] / timed[1])


if __name__ == "__main__":
    main()
