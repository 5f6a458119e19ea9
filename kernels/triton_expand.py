"""SGMV expand in Triton: out[t] += scale[slot] * B[slot(t), :, :r] @ y[t, :r] for every active segment.

The reduction is over the short rank axis and the parallelism is over d_out, so no split-K is needed:
each (token block, d_out block) of a segment belongs to exactly one program, which loads `out`, adds its
fp32 sum and stores it back. The rank loop stops at the slot's real rank.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mapping import LoraMapping


@triton.jit
def _expand_kernel(
    y_ptr,  # [T, r_max] fp32 (from the shrink)
    b_ptr,  # [S, d_out, r_max]
    out_ptr,  # [T, d_out], accumulated in place
    scales_ptr,  # [S] fp32
    seg_starts_ptr,  # [G] int32
    seg_lens_ptr,  # [G] int32
    seg_slots_ptr,  # [G] int32
    seg_ranks_ptr,  # [G] int32
    d_out,  # output width
    stride_ym, stride_yr,  # strides of y
    stride_bs, stride_bn, stride_br,  # strides of b_stack
    stride_om, stride_on,  # strides of out (a column view of a fused output is fine)
    BLOCK_M: tl.constexpr,  # tokens per program
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_R: tl.constexpr,  # rank elements per inner tile
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
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rank = tl.load(seg_ranks_ptr + seg)
    scale = tl.load(scales_ptr + slot)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < seg_len
    n_mask = offs_n < d_out
    rows = (seg_start + offs_m).to(tl.int64)
    b_slot = b_ptr + slot * stride_bs

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
            b_slot + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
            mask=n_mask[None, :] & r_mask[:, None],
            other=0.0,
        )  # [BLOCK_R, BLOCK_N]
        if UPCAST_DOT:
            acc += tl.dot(y, b.to(tl.float32), input_precision="ieee")
        elif FP32_IEEE:
            acc += tl.dot(y, b, input_precision="ieee")
        else:
            acc += tl.dot(y.to(b.dtype), b)  # half inputs, fp32 accumulation
    acc = acc * scale

    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    o_mask = m_mask[:, None] & n_mask[None, :]
    prev = tl.load(out_ptrs, mask=o_mask, other=0.0)
    tl.store(out_ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def triton_expand(
    y: torch.Tensor,  # [T, r_max] fp32
    b_stack: torch.Tensor,  # [S, d_out, r_max]
    mapping: LoraMapping,
    out: torch.Tensor,  # [T, d_out], accumulated in place
    slot_scales: torch.Tensor,  # [S] fp32
) -> torch.Tensor:
    assert y.dtype == torch.float32, "y is the fp32 output of the shrink"
    assert b_stack.dtype in (torch.float32, torch.float16, torch.bfloat16), b_stack.dtype
    assert out.dtype in (torch.float32, torch.float16, torch.bfloat16), out.dtype
    assert slot_scales.dtype == torch.float32 and slot_scales.is_contiguous()
    assert y.device == b_stack.device == out.device == slot_scales.device == mapping.seg_starts.device
    assert mapping.max_rank <= b_stack.shape[2] <= y.shape[1]
    if mapping.is_empty:
        return out
    d_out = out.shape[1]
    BLOCK_M = 16  # tl.dot's smallest tile
    BLOCK_N = 128 if d_out >= 128 else 32
    BLOCK_R = 16
    num_n = triton.cdiv(d_out, BLOCK_N)
    # grid: (token blocks of the longest segment x d_out blocks, active segments)
    grid = (triton.cdiv(mapping.max_seg_len, BLOCK_M) * num_n, mapping.num_segments)
    _expand_kernel[grid](
        y, b_stack, out, slot_scales,
        mapping.seg_starts, mapping.seg_lens, mapping.seg_slots, mapping.seg_ranks,
        d_out,
        y.stride(0), y.stride(1),
        b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
        FP32_IEEE=b_stack.dtype == torch.float32,
        UPCAST_DOT=out.device.type != "cuda",  # CPU tensors only run under TRITON_INTERPRET=1
    )
    return out
