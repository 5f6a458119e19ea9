"""SGMV shrink in Triton: y[t, :r] = A_slot(t) @ x[t] for every segment with weights in the table.

A_s is read where the pool put it: the [r_s, d_in] row-major block at w + a_offsets[s] of the flat
weight buffer (one base pointer, an int64 element offset per slot, like vLLM's lora_ptr arrays).

The shrink reads each adapter's A once per block of tokens and reduces over the long d_in axis, so with
few tokens (decode) there is little parallelism across tokens: split-K spreads d_in across programs that
add their partial sums into the fp32 output with atomics.

Heterogeneous ranks: the rank loop stops at the slot's real rank (read from the table) and rank columns
past it are masked, so memory traffic is proportional to the real rank; a rank-0 slot's programs return
at once. The grid covers every segment of the step's mapping, so no per-projection index tensors exist.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mapping import LoraMapping, SegmentPlan
from .table import HALF_WEIGHTS, LoraTable


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, d_in], any float dtype
    w_ptr,  # flat weight buffer, x's dtype (or 16-bit beside an fp32 x: widened before the dot)
    y_ptr,  # [T, >= max rank] fp32, zeroed when SPLIT_K > 1
    a_offsets_ptr,  # [S] int64, element offset of each slot's A ([r_s, d_in] row-major) in w
    ranks_ptr,  # [S] int32, real rank of each slot in this table (0 = no weights)
    seg_starts_ptr,  # [G] int32, first token of each segment
    seg_lens_ptr,  # [G] int32, tokens in each segment
    seg_slots_ptr,  # [G] int32, slot of each segment
    d_in,  # reduction length, also A's row stride
    stride_xm, stride_xk,  # strides of x
    stride_ym, stride_yr,  # strides of y
    BLOCK_M: tl.constexpr,  # tokens per program
    BLOCK_R: tl.constexpr,  # rank columns per inner tile
    BLOCK_K: tl.constexpr,  # d_in elements per inner tile
    SPLIT_K: tl.constexpr,  # programs sharing one reduction along d_in
    ALIGN: tl.constexpr,  # every A offset is a multiple of ALIGN elements (vector loads when > 1)
    FP32_IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dot instead of tf32
    UPCAST_DOT: tl.constexpr,  # interpreter only: its numpy tl.dot garbles bf16, so dot in fp32
):
    pid_m = tl.program_id(axis=0)
    pid_k = tl.program_id(axis=1)
    seg = tl.program_id(axis=2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:  # the grid is sized by the longest segment
        return
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # the slot has no weights in this projection
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    a_off = tl.load(a_offsets_ptr + slot)  # int64: pools may exceed 2^31 elements
    a_off = (a_off // ALIGN) * ALIGN  # exact (checked by the launcher); tells the compiler the alignment

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = (seg_start + offs_m).to(tl.int64)
    a_slot = w_ptr + a_off

    for r0 in range(0, rank, BLOCK_R):  # work stops at the real rank
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, d_in, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < d_in
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            a = tl.load(
                a_slot + offs_r[None, :] * d_in + offs_k[:, None],  # A_s[r, k]
                mask=r_mask[None, :] & k_mask[:, None],
                other=0.0,
            )  # [BLOCK_K, BLOCK_R]
            if UPCAST_DOT:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            elif FP32_IEEE:  # fp32 x: 16-bit weights are widened (exactly) to meet it
                acc += tl.dot(x, a.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_r[None, :] * stride_yr
        y_mask = m_mask[:, None] & r_mask[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc, mask=y_mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=y_mask)


def _split_k(num_programs: int, d_in: int, block_k: int) -> int:
    """Enough d_in splits to give a GPU ~512 programs, never more splits than K tiles."""
    split = 1
    while num_programs * split < 512 and split * 2 <= triton.cdiv(d_in, block_k) and split < 64:
        split *= 2
    return split


def triton_shrink(
    x: torch.Tensor,  # [T, d_in]
    buffer: torch.Tensor,  # 1-D contiguous, x's dtype (or 16-bit beside an fp32 x)
    table: LoraTable,
    mapping: LoraMapping,
    plan: SegmentPlan,  # mapping.plan(table)
    y: torch.Tensor,  # [T, >= table.max_rank] fp32, zeroed by the caller
) -> torch.Tensor:
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert buffer.dtype == x.dtype or (x.dtype == torch.float32 and buffer.dtype in HALF_WEIGHTS), \
        "the weight buffer shares x's dtype, or is 16-bit beside an fp32 x"
    assert buffer.dim() == 1 and buffer.is_contiguous(), "the weight buffer is flat"
    assert y.dtype == torch.float32 and y.stride(1) == 1 and y.shape[1] >= plan.max_rank
    assert x.stride(1) == 1, "the reduction axis must be contiguous"
    assert x.device == buffer.device == y.device == table.a_offsets.device == mapping.seg_starts.device
    if plan.is_empty:
        return y
    d_in = x.shape[1]
    BLOCK_M = 16  # tl.dot's smallest tile; decode segments of 1-2 tokens waste the rest, reads don't
    BLOCK_R = max(16, min(64, triton.next_power_of_2(plan.max_rank)))
    BLOCK_K = 64 if d_in >= 64 else 32
    m_blocks = triton.cdiv(plan.max_seg_len, BLOCK_M)
    split_k = _split_k(m_blocks * len(plan.segments), d_in, BLOCK_K)
    align = table.alignment(x.element_size()) if buffer.data_ptr() % 16 == 0 else 1
    # grid: (token blocks of the longest segment with weights, d_in splits, every segment of the step;
    # those of rank-0 slots return at once)
    grid = (m_blocks, split_k, mapping.num_segments)
    _shrink_kernel[grid](
        x, buffer, y,
        table.a_offsets, table.ranks,
        mapping.seg_starts, mapping.seg_lens, mapping.seg_slots,
        d_in,
        x.stride(0), x.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, SPLIT_K=split_k, ALIGN=align,
        FP32_IEEE=x.dtype == torch.float32,
        UPCAST_DOT=x.device.type != "cuda",  # CPU tensors only run under TRITON_INTERPRET=1
    )
    return y
