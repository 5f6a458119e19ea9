"""The LoRA term on CPU tensors: one pair of BLAS calls per active segment.

(v1 — to be replaced by the measured-fastest path.)
"""
from __future__ import annotations

import torch

from .mapping import LoraMapping


def add_lora_cpu(
    out: torch.Tensor,  # [T, d_out], updated in place
    x: torch.Tensor,  # [T, d_in]
    a_stack: torch.Tensor,  # [S, r_max, d_in]
    b_stack: torch.Tensor,  # [S, d_out, r_max]
    mapping: LoraMapping,
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:
    scales = slot_scales.tolist()
    for start, end, slot, rank in mapping.segments:
        y = torch.mm(x[start:end], a_stack[slot, :rank].t())  # [n, r]
        out[start:end].addmm_(y.to(out.dtype), b_stack[slot, :, :rank].t().to(out.dtype), alpha=scales[slot])
    return out


def lora_shrink_cpu(
    x: torch.Tensor,  # [T, d_in]
    a_stack: torch.Tensor,  # [S, r_max, d_in]
    mapping: LoraMapping,
    y: torch.Tensor,  # float32 [T, r_max], written for active tokens
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
        b = b_stack[slot, :, :rank].t()  # [r, d_out]
        out[start:end].addmm_(y[start:end, :rank].to(b.dtype), b, alpha=scales[slot])
    return out
