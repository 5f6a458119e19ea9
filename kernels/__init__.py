"""Batched multi-LoRA kernels (SGMV): the low-rank term of many adapters in one call per projection,
reading each adapter's weights where the memory pool put them.

Public surface: `LoraMapping.build` (token -> slot, once per step), `LoraTable.build` (where each slot's A and B of
one projection lie in a flat weight buffer, once per adapter load/evict), `add_lora`, `lora_shrink`, `lora_expand`;
and `paged_decode_attention` and `paged_prefill_attention` (CPU, fp32: decode and prompt-chunk attention read
straight from the paged KV cache, soft-capping the scores where asked, as Gemma 2), `rms_norm`, `rope_kv_write`,
`swiglu`, `geglu_tanh` and `argmax_rows` (CPU, fp32, one pass each), and `StepKernels` (those with a step's shapes
checked and its buffers allocated once for all layers), and `gemm_pack` / `gemm` (CPU, fp32, AVX-512 or AVX2: the
projections' GEMM on weights packed once, prefetching what `GemmSide` names meanwhile; `gemm_available`,
`gemm_side_helps`), and `gemm_lora` (the same GEMM with a decode step's LoRA term of its projections fused in,
described by `FusedLoraGroup`). Imports nothing of the project.
(Hugging Face publishes an unrelated PyPI package also named `kernels`; never install it here.)"""
from .cpu import FusedLoraGroup
from .cpu_native import (
    GemmSide,
    StepArena,
    StepKernels,
    argmax_rows,
    geglu_tanh,
    gemm,
    gemm_available,
    gemm_lora,
    gemm_pack,
    gemm_side_helps,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rope_kv_write,
    swiglu,
)
from .dispatch import add_lora, lora_expand, lora_shrink, repeatable_lora_call
from .mapping import LoraMapping
from .table import HALF_WEIGHTS, LoraTable

__all__ = ["HALF_WEIGHTS", "FusedLoraGroup", "GemmSide", "StepArena", "StepKernels", "LoraMapping", "LoraTable",
           "add_lora", "argmax_rows", "gemm", "gemm_available", "gemm_lora", "gemm_pack", "gemm_side_helps",
           "geglu_tanh",
           "lora_expand", "lora_shrink", "paged_decode_attention", "paged_prefill_attention",
           "repeatable_lora_call", "rms_norm", "rope_kv_write",
           "swiglu"]
