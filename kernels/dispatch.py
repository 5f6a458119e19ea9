"""The public LoRA ops: route CUDA tensors to Triton and CPU tensors to the CPU path.

Fused projections (q/k/v or gate/up) are the caller's job: call once per output slice, passing a column
view of the fused output as `out` (every backend accepts a row stride; columns outside the view are not
touched).

`b_stack` is [S, d_out, r_max] by shape in either memory order. Allocate it rank-major
(`torch.zeros(S, r_max, d_out).transpose(1, 2)`): the CPU expand then reads exactly rank x d_out floats
per adapter, so a rank-4 adapter costs ~1/10 of a rank-64 one instead of ~1/3, and the Triton expand's
loads along d_out are contiguous. A plain contiguous [S, d_out, r_max] works everywhere too.

Forcing Triton on CPU tensors (`backend="triton"` or LORAFLEET_KERNELS_BACKEND=triton) only works under
TRITON_INTERPRET=1; the tests use it to check the Triton kernels on a machine without a GPU.
"""
from __future__ import annotations

import os

import torch

from . import cpu
from .mapping import LoraMapping

_BACKENDS = ("auto", "triton", "cpu", "reference")


_DEFAULT_BACKEND = os.environ.get("LORAFLEET_KERNELS_BACKEND", "auto")  # read once: this runs per projection


def _backend(x: torch.Tensor, backend: str | None) -> str:
    choice = backend or _DEFAULT_BACKEND
    if choice not in _BACKENDS:
        raise ValueError(f"unknown kernels backend {choice!r}; expected one of {_BACKENDS}")
    if choice == "auto":
        return "triton" if x.is_cuda else "cpu"
    return choice


def _check_shapes(x: torch.Tensor, stack: torch.Tensor, mapping: LoraMapping) -> None:
    if x.dim() != 2 or x.shape[0] != mapping.num_tokens:
        raise ValueError(f"x must be [T={mapping.num_tokens}, d], got {tuple(x.shape)}")
    if stack.dim() != 3 or stack.shape[0] != mapping.slot_ranks.shape[0]:
        raise ValueError(f"stack must be [S={mapping.slot_ranks.shape[0]}, ., .], got {tuple(stack.shape)}")
    if mapping.max_rank > stack.shape[1]:
        raise ValueError(f"a slot's rank {mapping.max_rank} exceeds the A stack's r_max {stack.shape[1]}")


def add_lora(
    out: torch.Tensor,  # [T, d_out], accumulated in place
    x: torch.Tensor,  # [T, d_in]
    a_stack: torch.Tensor,  # [S, r_max, d_in]
    b_stack: torch.Tensor,  # [S, d_out, r_max]
    mapping: LoraMapping,
    slot_scales: torch.Tensor,  # float32 [S]
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """out[t] += scale[s] * B[s, :, :r] @ (A[s, :r] @ x[t]) for every token t with slot s != -1.

    r is the slot's real rank (work is proportional to it, not to r_max). Tokens with slot -1 are left
    untouched and cost nothing. Returns `out`.
    """
    _check_shapes(x, a_stack, mapping)
    if out.shape != (mapping.num_tokens, b_stack.shape[1]) or b_stack.shape[2] != a_stack.shape[1]:
        raise ValueError(f"out must be [T, d_out={b_stack.shape[1]}] and B [S, d_out, r_max={a_stack.shape[1]}], "
                         f"got out {tuple(out.shape)}, B {tuple(b_stack.shape)}")
    if mapping.is_empty:
        return out
    which = _backend(x, backend)
    if which == "cpu":
        return cpu.add_lora_cpu(out, x, a_stack, b_stack, mapping, slot_scales)
    if which == "reference":
        from .reference import add_lora_reference

        return add_lora_reference(out, x, a_stack, b_stack, mapping, slot_scales)
    # straight to the launchers: the checks above already cover what lora_shrink/lora_expand would redo
    from .triton_expand import triton_expand
    from .triton_shrink import triton_shrink

    y = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)  # [T, r_max]
    return triton_expand(triton_shrink(x, a_stack, mapping, y), b_stack, mapping, out, slot_scales)


def lora_shrink(
    x: torch.Tensor,  # [T, d_in]
    a_stack: torch.Tensor,  # [S, r_max, d_in]
    mapping: LoraMapping,
    out: torch.Tensor | None = None,  # float32 [T, r_max]
    *,
    backend: str | None = None,
) -> torch.Tensor:  # float32 [T, r_max]
    """y[t, :r] = A[s, :r] @ x[t] in fp32; columns past a token's rank and tokens with slot -1 are 0."""
    _check_shapes(x, a_stack, mapping)
    y = out if out is not None else torch.empty(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    y.zero_()
    if mapping.is_empty:
        return y
    which = _backend(x, backend)
    if which == "triton":
        from .triton_shrink import triton_shrink

        return triton_shrink(x, a_stack, mapping, y)
    if which == "reference":
        from .reference import shrink_reference

        y.copy_(shrink_reference(x, a_stack, mapping))
        return y
    return cpu.lora_shrink_cpu(x, a_stack, mapping, y)


def lora_expand(
    y: torch.Tensor,  # [T, r_max] (fp32 from lora_shrink)
    b_stack: torch.Tensor,  # [S, d_out, r_max]
    mapping: LoraMapping,
    out: torch.Tensor,  # [T, d_out], accumulated in place
    slot_scales: torch.Tensor,  # float32 [S]
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """out[t] += scale[s] * B[s, :, :r] @ y[t, :r]; tokens with slot -1 are untouched. Returns `out`."""
    if out.shape != (mapping.num_tokens, b_stack.shape[1]):
        raise ValueError(f"out must be [T, d_out={b_stack.shape[1]}], got {tuple(out.shape)}")
    if mapping.max_rank > b_stack.shape[2]:
        raise ValueError(f"a slot's rank {mapping.max_rank} exceeds the B stack's r_max {b_stack.shape[2]}")
    if mapping.is_empty:
        return out
    which = _backend(y, backend)
    if which == "triton":
        from .triton_expand import triton_expand

        return triton_expand(y, b_stack, mapping, out, slot_scales)
    if which == "reference":
        from .reference import expand_reference

        return expand_reference(y, b_stack, mapping, out, slot_scales)
    return cpu.lora_expand_cpu(y, b_stack, mapping, out, slot_scales)
