"""The Triton SGMV kernels on a CUDA device at Llama-2-7B shapes, against HBM bandwidth and against a
torch per-segment loop, side by side in one run.

    .venv/bin/python bench/gpu_kernels.py          # on a machine with a CUDA GPU, ~2 minutes
    TRITON_INTERPRET=1 .venv/bin/python bench/gpu_kernels.py --smoke   # CPU: tiny shapes, checks code paths only

bf16 weights and activations, r = 16, all seven projections of a decoder layer summed per cell, B stacks
rank-major in memory (kernels/dispatch.py says why).
Timing is triton.testing.do_bench (L2 flushed before every repeat), eager and as a CUDA graph replay
(the bandwidth figures use the graph time: GPU time without Python launch overhead). "bytes" is what the op must move at
least: A and B of the distinct adapters in the batch, x, and out read and written. The fraction is taken
against both the device's measured copy bandwidth and its datasheet HBM peak where the name is known.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels import LoraMapping, add_lora  # noqa: E402
from kernels.reference import add_lora_reference  # noqa: E402

PEAK_HBM_BYTES_S = {  # datasheet figures, by substring of torch.cuda.get_device_name()
    "H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
    "A100 80GB": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12, "A10": 0.6e12,
}
TOKENS = (1, 16, 64, 256)
ADAPTERS = (1, 8, 32, 64)
SLOTS = 64


def shapes(smoke: bool) -> dict[str, tuple[int, int]]:
    hidden, inter = (96, 200) if smoke else (4096, 11008)
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
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine (or --smoke on CPU)")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    projections = shapes(args.smoke)
    tokens_grid = (1, 16) if args.smoke else TOKENS
    adapters_grid = (1, 8) if args.smoke else ADAPTERS

    name = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_HBM_BYTES_S.items() if k in name), None)
    src = torch.empty(256 * 1024 * 1024 if not args.smoke else 1024, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src), args.smoke)
    copy_bw = 2 * src.numel() / (copy_ms * 1e-3)
    print(f"# {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s measured; datasheet HBM peak: "
          f"{peak / 1e9:.0f} GB/s" if peak else f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s measured")

    def make_layer(r_max: int) -> dict:
        # B: [S, d_out, r_max] as a view of rank-major memory, so a rank-r slot reads r rows of d_out
        return {n: (torch.randn(SLOTS, r_max, d_in, device=device, dtype=dtype) * 0.05,  # [S, r_max, d_in]
                    (torch.randn(SLOTS, r_max, d_out, device=device, dtype=dtype) * 0.05).transpose(1, 2))
                for n, (d_in, d_out) in projections.items()}

    layer = make_layer(16)
    base_w = {n: torch.randn(d_out, d_in, device=device, dtype=dtype) * 0.02 for n, (d_in, d_out) in projections.items()}
    scales = torch.full((SLOTS,), 2.0, device=device)

    # correctness first: the timed op must be the right op
    slots = batch_slots(16, 8)
    mapping = LoraMapping.build(torch.tensor(slots, dtype=torch.int32, device=device), [16] * SLOTS)
    a, b = layer["gate_proj"]
    x = torch.randn(16, a.shape[2], device=device, dtype=dtype)
    out = torch.randn(16, b.shape[1], device=device, dtype=dtype)
    got = add_lora(out.clone(), x, a, b, mapping, scales, backend="triton")
    want = add_lora_reference(out.cpu().clone(), x.cpu(), a.cpu(), b.cpu(),
                              LoraMapping.build(slots, [16] * SLOTS), scales.cpu())
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)

    def cell(tokens: int, adapters: int, layer: dict, ranks: list[int]):
        slots = batch_slots(tokens, adapters)
        mapping = LoraMapping.build(torch.tensor(slots, dtype=torch.int32, device=device), ranks)
        xs = {n: torch.randn(tokens, d_in, device=device, dtype=dtype) for n, (d_in, _) in projections.items()}
        outs = {n: torch.zeros(tokens, d_out, device=device, dtype=dtype) for n, (_, d_out) in projections.items()}

        def ours():
            for n, (a, b) in layer.items():
                add_lora(outs[n], xs[n], a, b, mapping, scales, backend="triton")

        def loop():  # torch per-segment: two matmuls per adapter run, as without SGMV
            for n, (a, b) in layer.items():
                for start, end, slot, r in mapping.segments:
                    outs[n][start:end] += 2.0 * ((xs[n][start:end] @ a[slot, :r].t()) @ b[slot, :, :r].t())

        def base():
            for n, w in base_w.items():
                torch.nn.functional.linear(xs[n], w)

        moved = 0
        for d_in, d_out in projections.values():
            moved += sum(ranks[s] * (d_in + d_out) * 2 for s in set(slots))
            moved += tokens * (d_in + 2 * d_out) * 2
        return ours, loop, base, moved, len(set(slots))

    print("\n| tokens | adapters | Triton ms | Triton graph ms | torch loop ms | base GEMM ms | Triton vs loop "
          "| GB/s (graph) | of copy bw | of HBM peak |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in tokens_grid:
        for adapters in adapters_grid:
            ours, loop, base, moved, distinct = cell(tokens, adapters, layer, [16] * SLOTS)
            t_ours, t_loop, t_base = (bench_ms(f, args.smoke) for f in (ours, loop, base))
            replay = graphed(ours, args.smoke)
            t_graph = bench_ms(replay, args.smoke) if replay else t_ours
            rate = moved / (t_graph * 1e-3)
            label = f"{adapters}" if distinct == adapters else f"{adapters} ({distinct} used)"
            peak_txt = f"{rate / peak:.0%}" if peak else "n/a"
            print(f"| {tokens} | {label} | {t_ours:.3f} | {t_graph:.3f} | {t_loop:.3f} | {t_base:.3f} "
                  f"| {t_loop / t_ours:.1f}x "
                  f"| {rate / 1e9:.0f} | {rate / copy_bw:.0%} | {peak_txt} |", flush=True)

    tokens, adapters = (16, 8) if args.smoke else (64, 32)
    mixed_ranks = [4 if s % 2 == 0 else 64 for s in range(SLOTS)]
    layer64 = make_layer(64)
    timed = []
    for ranks in (mixed_ranks, [64] * SLOTS):
        fn = cell(tokens, adapters, layer64, ranks)[0]
        timed.append(bench_ms(graphed(fn, args.smoke) or fn, args.smoke))
    t_mixed, t_all = timed
    print(f"\nranks mixed 4/64 vs all 64 ({tokens} tokens x {adapters} adapters): {t_mixed:.3f} ms vs "
          f"{t_all:.3f} ms = {t_mixed / t_all:.2f}x (goal <= 0.65x)")


if __name__ == "__main__":
    main()
