"""The LoRA term on CPU tensors, by the strategy measured fastest for each kind of segment.

Measured on 7B shapes (bench/kernels.py, bench/RESULTS.md):
- short segments (decode: a few tokens per adapter) are memory-bound GEMVs. One call of the native kernel
  (csrc/sgmv_cpu.c) covers all of them: no Python per segment, work proportional to each real rank,
  and it reaches a large fraction of copy bandwidth. Per-segment torch calls pay ~10 us of dispatch each
  and torch's small-GEMM threading stalls when the other core is busy.
- long segments (prefill: one adapter, many tokens) are GEMM-shaped. On an idle host torch's BLAS is
  up to 4x faster than the native loops there (32-64 tokens); but on a host shared with other processes
  (this project's 2-core CI box) its 2-thread GEMMs stall at every OpenMP barrier and the native kernel
  wins on median by 4-10x and ties on best case from 128 tokens. So by default every segment goes native;
  LORAFLEET_CPU_LONG_SEGMENT=32 sends segments of 32+ tokens to BLAS on dedicated hosts.
B layout: `b_stack` is [S, d_out, r_max] by shape, in either memory order. Rank-major memory
([S, r_max, d_out] allocated, passed as `.transpose(1, 2)`) is the one to allocate on CPU: the expand then
streams exactly rank x d_out floats per adapter. Column-major B ([S, d_out, r_max] contiguous) works too,
but for ranks well below r_max its reads are strided and latency-bound (measured, r_max 64: a rank-4
adapter costs ~0.3x a rank-64 one in thread CPU time and up to ~1x under memory contention, against
~0.1x rank-major). At r = 64 itself column-major is ~20-40% faster; rank-major wins up to r = 16.
Anything the native kernel does not cover (non-fp32, exotic strides, no compiler) takes the torch path.
"""
from __future__ import annotations

import os

import torch

from . import cpu_native
from .mapping import LoraMapping

LONG_SEGMENT = int(os.environ.get("LORAFLEET_CPU_LONG_SEGMENT", 1 << 30))  # tokens from which BLAS is used
PARALLEL_BYTES = 1 << 20  # weight bytes from which the native kernel uses torch's thread count


def add_lora_cpu(
    out: torch.Tensor,  # [T, d_out], updated in place
    x: torch.Tensor,  # [T, d_in]
    a_stack: torch.Tensor,  # [S, r_max, d_in]
    b_stack: torch.Tensor,  # [S, d_out, r_max]
    mapping: LoraMapping,
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:
    lib = cpu_native.load() if _native_ok(out, x, a_stack, b_stack, slot_scales) else None
    if lib is None:
        return _add_lora_torch(out, x, a_stack, b_stack, mapping.segments, slot_scales)
    plan = mapping.cpu_plan(LONG_SEGMENT)
    if plan.num_short:
        _call_native(lib, out, x, a_stack, b_stack, plan, slot_scales)
    if plan.long_segments:
        _add_lora_torch(out, x, a_stack, b_stack, plan.long_segments, slot_scales)
    return out


def _native_ok(out, x, a_stack, b_stack, slot_scales) -> bool:
    return (
        out.dtype == x.dtype == a_stack.dtype == b_stack.dtype == torch.float32
        and slot_scales.dtype == torch.float32 and slot_scales.is_contiguous()
        and out.stride(1) == 1 and x.stride(1) == 1 and a_stack.stride(2) == 1
        and (b_stack.stride(2) == 1 and b_stack.stride(1) < (1 << 20)  # [S, d_out, r_max] (int32 gathers)
             or b_stack.stride(1) == 1)  # rank-major: a transposed view of [S, r_max, d_out]
    )


def _call_native(lib, out, x, a_stack, b_stack, plan, slot_scales) -> None:
    y = plan.scratch(x.shape[0], a_stack.shape[1])  # [T, r_max] fp32 scratch for the shrink
    weight_bytes = plan.short_rank_sum * (x.shape[1] + out.shape[1]) * 4
    threads = torch.get_num_threads() if weight_bytes >= PARALLEL_BYTES else 1
    starts, lens, slots, ranks = plan.short_ptrs
    lib.sgmv_add_f32(
        plan.num_short, starts, lens, slots, ranks,
        x.data_ptr(), x.stride(0),
        a_stack.data_ptr(), a_stack.stride(0), a_stack.stride(1),
        b_stack.data_ptr(), b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        out.data_ptr(), out.stride(0),
        slot_scales.data_ptr(),
        y.data_ptr(), y.stride(0),
        x.shape[1], out.shape[1], threads,
    )


def _add_lora_torch(out, x, a_stack, b_stack, segments, slot_scales) -> torch.Tensor:
    """One shrink GEMM and one expand GEMM per segment; any dtype, any strides.

    Both products accumulate in fp32 and the result is rounded once into `out`, as the Triton kernels
    and the native kernel do (bf16 intermediates drifted past the reference's tolerance at rank 52).
    """
    scales = slot_scales.tolist()
    for start, end, slot, rank in segments:
        y = torch.mm(x[start:end].float(), a_stack[slot, :rank].t().float())  # [n, r] fp32
        delta = torch.mm(y, b_stack[slot, :, :rank].t().float())  # [n, d_out] fp32
        out[start:end] += (delta * scales[slot]).to(out.dtype)
    return out


def lora_shrink_cpu(
    x: torch.Tensor,  # [T, d_in]
    a_stack: torch.Tensor,  # [S, r_max, d_in]
    mapping: LoraMapping,
    y: torch.Tensor,  # float32 [T, r_max], zeroed; written for active tokens
) -> torch.Tensor:
    for start, end, slot, rank in mapping.segments:
        y[start:end, :rank] = torch.mm(x[start:end], a_stack[slot, :rank].t())
    return y


def lora_expand_cpu(
    y: torch.Tensor,  # [T, r_max]
    b_stack: torch.Tensor,  # [S, d_out, r_max]
    mapping: LoraMapping,
    out: torch.Tensor,  # [T, d_out], updated in place
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:
    scales = slot_scales.tolist()
    for start, end, slot, rank in mapping.segments:
        delta = torch.mm(y[start:end, :rank].float(), b_stack[slot, :, :rank].t().float())  # [n, d_out] fp32
        out[start:end] += (delta * scales[slot]).to(out.dtype)
    return out
