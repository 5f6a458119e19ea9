"""SGMV expand in Triton: out[t] += scale[slot] * B_slot(t) @ y[t, :r] for every segment with weights.

B_s is read where the pool put it: stored rank-major as the [r_s, d_out] block (B^T) at w + b_offsets[s]
of the flat weight buffer, so each rank row is a contiguous run of output columns and loads along d_out
are coalesced.

The reduction is over the short rank axis and the parallelism is over d_out, so no split-K is needed:
each (token block, d_out block) of a segment belongs to exactly one program, which loads `out`, adds its
fp32 sum and stores it back. The rank loop stops at the slot's real rank (read from the table); the
programs of a rank-0 slot return before touching `out`.

Precision with fp16/bf16 weights: y (the shrink's fp32 output) is rounded once to tf32 — 10 mantissa bits
and fp32's exponent range — and multiplied with B converted exactly to fp32 on tf32 tensor cores, with
fp32 accumulation. Rounding y to B's dtype instead (the plain half-precision dot) would cost bf16 two more
bits and overflow fp16 to inf wherever |y| > 65504, a value the final output may well be able to hold.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mapping import LoraMapping, SegmentPlan
from .table import LoraTable


@triton.jit
def _round_to_tf32(v):
    """fp32 -> the nearest tf32 value (10 mantissa bits, ties to even; inf and NaN kept), still as fp32.

    Done by hand so the tensor-core tf32 dot multiplies exactly these values (its own handling of the
    low mantissa bits never comes into play) and the interpreter, whose dot is exact fp32, computes the
    same products: what the CPU tests check is what the GPU runs."""
    bits = v.to(tl.int32, bitcast=True)
    special = (bits & 0x7F800000) == 0x7F800000
    safe = tl.where(special, 0, bits)  # no carry out of inf/NaN patterns
    rounded = (safe + (((safe >> 13) & 1) + 0xFFF)) & -8192  # -8192 = 0xFFFFE000: clear the low 13 bits
    return tl.where(special, bits, rounded).to(tl.float32, bitcast=True)


@triton.jit
def _expand_kernel(
    y_ptr,  # [T, >= max rank] fp32 (from the shrink)
    w_ptr,  # flat weight buffer
    out_ptr,  # [T, d_out], accumulated in place
    scales_ptr,  # [S] fp32
    b_offsets_ptr,  # [S] int64, element offset of each slot's B^T ([r_s, d_out] row-major) in w
    ranks_ptr,  # [S] int32, real rank of each slot in this table (0 = no weights)
    seg_starts_ptr,  # [G] int32
    seg_lens_ptr,  # [G] int32
    seg_slots_ptr,  # [G] int32
    d_out,  # output width, also B^T's row stride
    stride_ym, stride_yr,  # strides of y
    stride_om, stride_on,  # strides of out (a column view of a fused output is fine)
    BLOCK_M: tl.constexpr,  # tokens per program
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_R: tl.constexpr,  # rank elements per inner tile
    ALIGN: tl.constexpr,  # every B offset is a multiple of ALIGN elements (vector loads when > 1)
    FP32_IEEE: tl.constexpr,  # fp32 weights: exact fp32 dot instead of tf32
    UPCAST_DOT: tl.constexpr,  # interpreter only: its numpy tl.dot garbles bf16, so dot in fp32
):
    pid = tl.program_id(axis=0)
    seg = tl.program_id(axis=1)
    num_n = tl.cdiv(d_out, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:  # the grid is sized by the longest segment
        return
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # no weights here: out stays bit for bit
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    scale = tl.load(scales_ptr + slot)
    b_off = tl.load(b_offsets_ptr + slot)  # int64: pools may exceed 2^31 elements
    b_off = (b_off // ALIGN) * ALIGN  # exact (checked by the launcher); tells the compiler the alignment

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < seg_len
    n_mask = offs_n < d_out
    rows = (seg_start + offs_m).to(tl.int64)
    b_slot = w_ptr + b_off

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # work stops at the real rank
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        y = tl.load(
            y_ptr + rows[:, None] * stride_ym + offs_r[None, :] * stride_yr,
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R] fp32
        b = tl.load(
            b_slot + offs_r[:, None] * d_out + offs_n[None, :],  # B^T_s[r, n]
            mask=n_mask[None, :] & r_mask[:, None],
            other=0.0,
        )  # [BLOCK_R, BLOCK_N]
        if FP32_IEEE:
            acc += tl.dot(y, b, input_precision="ieee")
        elif UPCAST_DOT:  # the interpreter's dot is exact fp32 whatever the flag: the same products as below
            acc += tl.dot(_round_to_tf32(y), b.to(tl.float32), input_precision="ieee")
        else:  # half weights: y rounded once to tf32 (fp32's range), B exact in tf32; fp32 accumulation
            acc += tl.dot(_round_to_tf32(y), b.to(tl.float32), input_precision="tf32")
    acc = acc * scale

    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    o_mask = m_mask[:, None] & n_mask[None, :]
    prev = tl.load(out_ptrs, mask=o_mask, other=0.0)
    tl.store(out_ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def triton_expand(
    y: torch.Tensor,  # [T, >= table.max_rank] fp32
    buffer: torch.Tensor,  # 1-D contiguous
    table: LoraTable,
    mapping: LoraMapping,
    plan: SegmentPlan,  # mapping.plan(table)
    out: torch.Tensor,  # [T, d_out], accumulated in place
    slot_scales: torch.Tensor,  # [S] fp32
) -> torch.Tensor:
    assert y.dtype == torch.float32, "y is the fp32 output of the shrink"
    assert buffer.dtype in (torch.float32, torch.float16, torch.bfloat16), buffer.dtype
    assert buffer.dim() == 1 and buffer.is_contiguous(), "the weight buffer is flat"
    assert out.dtype in (torch.float32, torch.float16, torch.bfloat16), out.dtype
    assert slot_scales.dtype == torch.float32 and slot_scales.is_contiguous()
    assert y.device == buffer.device == out.device == slot_scales.device == table.b_offsets.device
    assert mapping.seg_starts.device == y.device
    assert plan.max_rank <= y.shape[1]
    if plan.is_empty:
        return out
    d_out = out.shape[1]
    BLOCK_M = 16  # tl.dot's smallest tile
    BLOCK_N = 128 if d_out >= 128 else 32
    BLOCK_R = 16
    num_n = triton.cdiv(d_out, BLOCK_N)
    align = table.alignment(buffer.element_size()) if buffer.data_ptr() % 16 == 0 else 1
    # grid: (token blocks of the longest segment with weights x d_out blocks, every segment of the step;
    # those of rank-0 slots return at once)
    grid = (triton.cdiv(plan.max_seg_len, BLOCK_M) * num_n, mapping.num_segments)
    _expand_kernel[grid](
        y, buffer, out, slot_scales,
        table.b_offsets, table.ranks,
        mapping.seg_starts, mapping.seg_lens, mapping.seg_slots,
        d_out,
        y.stride(0), y.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, ALIGN=align,
        FP32_IEEE=buffer.dtype == torch.float32,
        UPCAST_DOT=out.device.type != "cuda",  # CPU tensors only run under TRITON_INTERPRET=1
    )
    return out
