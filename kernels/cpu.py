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
Weights are read in place from the flat buffer at the table's offsets: A_s as [r, d_in] rows, B_s as
rank-major [r, d_out] rows (B^T), so the expand streams exactly rank x d_out floats per adapter and a
rank-4 adapter costs ~1/10 of a rank-64 one (a column-major B cost ~1/3: strided reads, latency-bound).
The weights may be bf16 or fp16 beside fp32 activations (the 16-bit adapter pool: half the bytes a decode
step reads); the kernel widens them on the way in, so only the stored weights are rounded. Anything the
native kernel does not cover (x or out not fp32, or with a non-unit column stride, no compiler) takes
the torch path, which also accumulates in fp32 and rounds once.
"""
from __future__ import annotations

import os

import torch

from . import cpu_native
from .mapping import LoraMapping, SegmentPlan
from .table import LoraTable

LONG_SEGMENT = int(os.environ.get("LORAFLEET_CPU_LONG_SEGMENT", 1 << 30))  # tokens from which BLAS is used
PARALLEL_BYTES = 1 << 20  # weight bytes from which the native kernel uses torch's thread count
# ... or multiply-adds (tokens x rank x (d_in + d_out)): a batch on one adapter reads little but computes much. With
# the bytes alone, SmolLM2's 64-token decode steps all on one adapter (~0.15 MB of weights a projection) ran their
# LoRA term on one thread, 1.32-1.38 s a pass, slower than 29 adapters' 0.9-1.5 (bench/breakdown.py, Zen 4 host,
# 2026-12-06); ~1M multiply-adds is ~20 us on one core, well above a parallel region's start.
PARALLEL_MACS = 1 << 20

Segments = tuple[tuple[int, int, int, int], ...]  # (start, end, slot, rank)


def add_lora_cpu(
    out: torch.Tensor,  # [T, d_out], updated in place
    x: torch.Tensor,  # [T, d_in]
    buffer: torch.Tensor,  # 1-D contiguous, x's dtype (or bf16 / fp16 beside an fp32 x)
    table: LoraTable,
    mapping: LoraMapping,
    plan: SegmentPlan,  # mapping.plan(table), not empty
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:
    sgmv = cpu_native.sgmv_for(buffer.dtype) if _native_ok(out, x, buffer, slot_scales) else None
    if sgmv is None:
        return _add_lora_torch(out, x, buffer, table, plan.segments, slot_scales)
    cpu_plan = plan.cpu_plan(LONG_SEGMENT)
    if cpu_plan.num_short:
        _short_call(sgmv, cpu_plan, buffer, table, mapping, slot_scales).run(out, x, buffer.data_ptr())
    if cpu_plan.long_segments:
        _add_lora_torch(out, x, buffer, table, cpu_plan.long_segments, slot_scales)
    return out


def _native_ok(out, x, buffer, slot_scales) -> bool:
    return (
        out.dtype == x.dtype == slot_scales.dtype == torch.float32
        and slot_scales.is_contiguous() and buffer.is_contiguous()
        and out.stride(1) == 1 and x.stride(1) == 1
    )


def _add_lora_torch(out, x, buffer, table: LoraTable, segments: Segments, slot_scales) -> torch.Tensor:
    """One shrink GEMM and one expand GEMM per segment; any float dtype, any strides.

    Both products accumulate in fp32 and the result is rounded once into `out`, as the Triton kernels
    and the native kernel do (bf16 intermediates drifted past the reference's tolerance at rank 52).
    """
    scales = slot_scales.tolist()
    for start, end, slot, _ in segments:
        y = torch.mm(x[start:end].float(), table.a_of(buffer, slot).t().float())  # [n, r] fp32
        delta = torch.mm(y, table.b_of(buffer, slot).float())  # [n, d_out] fp32
        out[start:end] = (out[start:end].float() + delta * scales[slot]).to(out.dtype)  # rounded once
    return out


def lora_shrink_cpu(
    x: torch.Tensor,  # [T, d_in]
    buffer: torch.Tensor,  # 1-D, x's dtype (or bf16 / fp16 beside an fp32 x)
    table: LoraTable,
    plan: SegmentPlan,
    y: torch.Tensor,  # float32 [T, table.max_rank], zeroed; written for active tokens
) -> torch.Tensor:
    for start, end, slot, rank in plan.segments:
        y[start:end, :rank] = torch.mm(x[start:end].float(), table.a_of(buffer, slot).t().float())
    return y


def lora_expand_cpu(
    y: torch.Tensor,  # [T, >= table.max_rank]
    buffer: torch.Tensor,  # 1-D
    table: LoraTable,
    plan: SegmentPlan,
    out: torch.Tensor,  # [T, d_out], updated in place
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:
    scales = slot_scales.tolist()
    for start, end, slot, rank in plan.segments:
        delta = torch.mm(y[start:end, :rank].float(), table.b_of(buffer, slot).float())  # [n, d_out] fp32
        out[start:end] = (out[start:end].float() + delta * scales[slot]).to(out.dtype)  # rounded once
    return out


class NativeLoraCall:
    """`add_lora_cpu`'s one native call for one projection of one step, with what every layer shares worked out
    once: the segment plan's pointers, the table's offsets, the scales, the scratch and the thread count.

    A step calls the LoRA term of each projection once per layer, and every call after the first differs only in
    x, out and the layer's weight buffer. The checked path (`kernels.add_lora`) costs tens of microseconds of
    Python and tensor accessors a call, and runs cold after each GEMM (kernels.cpu_native.StepKernels says why);
    this runs the same kernel on the same arguments with three pointers and two strides read per call. Build it
    with `native_lora_call` after a checked call of the same step and projection.
    """

    __slots__ = ("sgmv", "segments", "offsets", "tail", "_keep")

    def __init__(self, sgmv, segments: tuple, offsets: tuple, tail: tuple, keep: tuple) -> None:
        self.sgmv, self.segments, self.offsets, self.tail, self._keep = sgmv, segments, offsets, tail, keep

    def __call__(self, out: torch.Tensor, x: torch.Tensor, buffer_ptr: int) -> None:
        """A later layer's repeat of the call (`run`)."""
        self.run(out, x, buffer_ptr)

    def run(self, out: torch.Tensor, x: torch.Tensor, buffer_ptr: int) -> None:
        """out[t] += the term for x, with the layer's weights at buffer_ptr (out and x as the checked call had
        them: the same shapes, unit column stride; the buffer laid out by the same table)."""
        a_offs, b_offs = self.offsets
        self.sgmv(*self.segments, x.data_ptr(), x.stride(0), buffer_ptr, a_offs, b_offs, out.data_ptr(), out.stride(0),
                  *self.tail)


def native_lora_call(out: torch.Tensor, x: torch.Tensor, buffer: torch.Tensor, table: LoraTable,
                     mapping: LoraMapping, slot_scales: torch.Tensor) -> NativeLoraCall | None:
    """The call `add_lora_cpu` makes for these arguments, to repeat on other layers' x, out and buffer; None where
    it would not make exactly one native call (no native kernel, x or out it does not cover, long segments to
    BLAS, nothing to do)."""
    plan = mapping.plan(table)
    sgmv = cpu_native.sgmv_for(buffer.dtype) if _native_ok(out, x, buffer, slot_scales) else None
    if sgmv is None or plan.is_empty:
        return None
    cpu_plan = plan.cpu_plan(LONG_SEGMENT)
    if cpu_plan.long_segments or not cpu_plan.num_short:
        return None
    return _short_call(sgmv, cpu_plan, buffer, table, mapping, slot_scales)


def _short_call(sgmv, cpu_plan, buffer: torch.Tensor, table: LoraTable, mapping: LoraMapping,
                slot_scales: torch.Tensor) -> NativeLoraCall:
    """The native call over the plan's short segments (all but x, out and the weight buffer's address)."""
    y = mapping.scratch(max(table.max_rank, 1))  # [T, >= every rank] fp32 scratch for the shrink
    weight_bytes = cpu_plan.short_rank_sum * (table.d_in + table.d_out) * buffer.element_size()
    macs = cpu_plan.short_token_ranks * (table.d_in + table.d_out)
    threads = torch.get_num_threads() if weight_bytes >= PARALLEL_BYTES or macs >= PARALLEL_MACS else 1
    return NativeLoraCall(sgmv, (cpu_plan.num_short, *cpu_plan.short_ptrs), table.host_offset_ptrs,
                          (slot_scales.data_ptr(), y.data_ptr(), y.stride(0), table.d_in, table.d_out, threads),
                          (cpu_plan, y, slot_scales, table))


class FusedLoraGroup:
    """A decode step's LoRA term of one GEMM's projections (q, k and v of the fused q/k/v GEMM, gate and up, or the one
    projection of o and down), for `kernels.gemm_lora`, which runs the term inside the GEMM: every segment's shrink
    first, then each panel's expand right after the panel, its slices of B prefetched while the panel multiplies
    (csrc/gemm_f32.h, gemm_lora_f32). Built once a step and group; every layer reuses it with its own buffer.

    `desc` holds one int64 row per projection with adapters in the step: its first column in the GEMM's output, its
    d_out, its short segments (count, then the plan's starts / lens / slots / ranks addresses), its table's A and B
    offset rows and its fp32 shrink scratch [rows, sy] (the C struct gemm_lora_proj)."""

    __slots__ = ("desc", "desc_ptr", "nproj", "rows", "d_in", "sy", "scales_ptr", "_keep")

    def __init__(self, desc: torch.Tensor, rows: int, d_in: int, sy: int, slot_scales: torch.Tensor,
                 keep: tuple) -> None:
        self.desc, self.desc_ptr, self.nproj = desc, desc.data_ptr(), desc.shape[0]
        self.rows, self.d_in, self.sy = rows, d_in, sy
        self.scales_ptr = slot_scales.data_ptr()
        self._keep = (slot_scales, *keep)

    @classmethod
    def build(cls, parts: list[tuple[int, LoraTable]], mapping: LoraMapping, buffer_dtype: torch.dtype,
              slot_scales: torch.Tensor) -> FusedLoraGroup | None:
        """parts: (the projection's first column in the GEMM's output, its table) for each projection of the group
        that the step's adapters target. None where the fused call does not cover the step: no native GEMM here,
        16-bit adapter weights, scales the native kernel cannot read, more rows than one pass of the GEMM takes, or a
        segment the plan sends to BLAS (LORAFLEET_CPU_LONG_SEGMENT)."""
        if (not parts or buffer_dtype != torch.float32 or slot_scales.dtype != torch.float32
                or not slot_scales.is_contiguous() or not cpu_native.gemm_available()
                or mapping.num_tokens > cpu_native.GEMM_LORA_MAX_ROWS):
            return None
        d_in = parts[0][1].d_in
        sy = max(max(table.max_rank for _, table in parts), 1)
        y = torch.empty(len(parts), mapping.num_tokens, sy, dtype=torch.float32)
        rows: list[list[int]] = []
        keep: list = [y]
        for i, (col0, table) in enumerate(parts):
            if table.d_in != d_in:
                raise ValueError(f"a fused LoRA group's projections read one input: d_in {table.d_in} != {d_in}")
            plan = mapping.plan(table)
            if plan.is_empty:
                continue
            cpu_plan = plan.cpu_plan(LONG_SEGMENT)
            if cpu_plan.long_segments:
                return None
            a_offs, b_offs = table.host_offset_ptrs
            rows.append([col0, table.d_out, cpu_plan.num_short, *cpu_plan.short_ptrs, a_offs, b_offs,
                         y[i].data_ptr()])
            keep += [cpu_plan, table]
        if not rows:
            return None
        return cls(torch.tensor(rows, dtype=torch.int64), mapping.num_tokens, d_in, sy, slot_scales, tuple(keep))
