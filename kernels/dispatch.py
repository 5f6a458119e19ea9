"""The public LoRA ops: route CUDA tensors to Triton and CPU tensors to the CPU path.

Weights are read where the memory pool put them: `buffer` is one layer's flat weight buffer (for the
worker, pool[layer].view(-1)) and `table` says where each slot's A and B^T of this projection lie in it
(kernels/table.py). One `LoraMapping` per step serves every projection of every layer; each call looks up
the (mapping, table) plan it cached on first use, so the per-call overhead is a dict lookup and a few
integer checks.

Fused projections (q/k/v or gate/up) are the caller's job: call once per output slice, passing a column
view of the fused output as `out` (every backend accepts a row stride; columns outside the view are not
touched).

Forcing Triton on CPU tensors (`backend="triton"` or LORAFLEET_KERNELS_BACKEND=triton) only works under
TRITON_INTERPRET=1; the tests use it to check the Triton kernels on a machine without a GPU.
"""
from __future__ import annotations

import os

import torch

from . import cpu
from .mapping import LoraMapping, SegmentPlan
from .table import HALF_WEIGHTS, LoraTable

_BACKENDS = ("auto", "triton", "cpu", "reference")


_DEFAULT_BACKEND = os.environ.get("LORAFLEET_KERNELS_BACKEND", "auto")  # read once: this runs per projection


def _backend(x: torch.Tensor, backend: str | None) -> str:
    choice = backend or _DEFAULT_BACKEND
    if choice not in _BACKENDS:
        raise ValueError(f"unknown kernels backend {choice!r}; expected one of {_BACKENDS}")
    if choice == "auto":
        return "triton" if x.is_cuda else "cpu"
    return choice


def _plan(buffer: torch.Tensor, table: LoraTable, mapping: LoraMapping) -> SegmentPlan:
    """The checks every op shares, then the cached (mapping, table) plan."""
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"buffer must be a flat contiguous tensor, got shape {tuple(buffer.shape)}")
    if buffer.numel() < table.extent:
        raise ValueError(f"the table reaches element {table.extent} of a buffer of {buffer.numel()}")
    if table.num_slots != mapping.num_slots:
        raise ValueError(f"the table has {table.num_slots} slots, the mapping {mapping.num_slots}")
    return mapping.plan(table)


def _check_x(x: torch.Tensor, buffer: torch.Tensor, table: LoraTable, mapping: LoraMapping) -> None:
    if x.dim() != 2 or x.shape != (mapping.num_tokens, table.d_in):
        raise ValueError(f"x must be [T={mapping.num_tokens}, d_in={table.d_in}], got {tuple(x.shape)}")
    if buffer.dtype != x.dtype and not (x.dtype == torch.float32 and buffer.dtype in HALF_WEIGHTS):
        raise ValueError(f"buffer dtype {buffer.dtype} does not go with x's {x.dtype}: the weights share x's dtype, "
                         f"or are bf16 / fp16 beside fp32 activations")


def _check_out(out: torch.Tensor, table: LoraTable, mapping: LoraMapping, slot_scales: torch.Tensor) -> None:
    if out.dim() != 2 or out.shape != (mapping.num_tokens, table.d_out):
        raise ValueError(f"out must be [T={mapping.num_tokens}, d_out={table.d_out}], got {tuple(out.shape)}")
    if slot_scales.shape != (table.num_slots,) or slot_scales.dtype != torch.float32:
        raise ValueError(f"slot_scales must be float32 [S={table.num_slots}], got {slot_scales.dtype} "
                         f"{tuple(slot_scales.shape)}")


def add_lora(
    out: torch.Tensor,  # [T, d_out], accumulated in place; may be a column view of a wider output
    x: torch.Tensor,  # [T, d_in]
    buffer: torch.Tensor,  # 1-D contiguous, x's dtype (or bf16 / fp16 beside an fp32 x): every slot's A and B^T
    table: LoraTable,
    mapping: LoraMapping,
    slot_scales: torch.Tensor,  # float32 [S]
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """out[t] += scale[s] * B_s @ (A_s @ x[t]) for every token t with slot s != -1 and table rank r_s > 0.

    Work is proportional to each slot's real rank; fp32 accumulation, rounded once into `out`. Tokens of
    slot -1 or of a rank-0 slot are left untouched and cost nothing. Returns `out`.
    """
    plan = _plan(buffer, table, mapping)
    _check_x(x, buffer, table, mapping)
    _check_out(out, table, mapping, slot_scales)
    if plan.is_empty:
        return out
    which = _backend(x, backend)
    if which == "cpu":
        return cpu.add_lora_cpu(out, x, buffer, table, mapping, plan, slot_scales)
    if which == "reference":
        from .reference import add_lora_reference

        return add_lora_reference(out, x, buffer, table, mapping, slot_scales)
    # straight to the launchers: the checks above already cover what lora_shrink/lora_expand would redo
    from .triton_expand import triton_expand
    from .triton_shrink import triton_shrink

    y = torch.zeros(x.shape[0], plan.max_rank, dtype=torch.float32, device=x.device)  # [T, largest rank in this step]
    triton_shrink(x, buffer, table, mapping, plan, y)
    return triton_expand(y, buffer, table, mapping, plan, out, slot_scales)


def repeatable_lora_call(out: torch.Tensor, x: torch.Tensor, buffer: torch.Tensor, table: LoraTable,
                         mapping: LoraMapping, slot_scales: torch.Tensor) -> cpu.NativeLoraCall | None:
    """After `add_lora(out, x, buffer, table, mapping, slot_scales)` passed its checks: the one native call it made,
    to repeat on other layers' x, out and weight buffer of the same shapes and table (kernels.cpu.NativeLoraCall);
    None where the backend is not the CPU one or the call was not one native call."""
    if _backend(x, None) != "cpu":
        return None
    return cpu.native_lora_call(out, x, buffer, table, mapping, slot_scales)


def lora_shrink(
    x: torch.Tensor,  # [T, d_in]
    buffer: torch.Tensor,  # 1-D contiguous, x's dtype (or bf16 / fp16 beside an fp32 x)
    table: LoraTable,
    mapping: LoraMapping,
    out: torch.Tensor | None = None,  # float32 [T, table.max_rank]
    *,
    backend: str | None = None,
) -> torch.Tensor:  # float32 [T, table.max_rank]
    """y[t, :r_s] = A_s @ x[t] in fp32; columns >= r_s and tokens of slot -1 or rank 0 are 0."""
    plan = _plan(buffer, table, mapping)
    _check_x(x, buffer, table, mapping)
    shape = (mapping.num_tokens, table.max_rank)
    y = out if out is not None else torch.empty(shape, dtype=torch.float32, device=x.device)
    if y.shape != shape or y.dtype != torch.float32:
        raise ValueError(f"out must be float32 {shape}, got {y.dtype} {tuple(y.shape)}")
    y.zero_()
    if plan.is_empty:
        return y
    which = _backend(x, backend)
    if which == "triton":
        from .triton_shrink import triton_shrink

        return triton_shrink(x, buffer, table, mapping, plan, y)
    if which == "reference":
        from .reference import shrink_reference

        y.copy_(shrink_reference(x, buffer, table, mapping))
        return y
    return cpu.lora_shrink_cpu(x, buffer, table, plan, y)


def lora_expand(
    y: torch.Tensor,  # [T, table.max_rank] (fp32 from lora_shrink)
    buffer: torch.Tensor,  # 1-D contiguous
    table: LoraTable,
    mapping: LoraMapping,
    out: torch.Tensor,  # [T, d_out], accumulated in place
    slot_scales: torch.Tensor,  # float32 [S]
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """out[t] += scale[s] * B_s @ y[t, :r_s]; tokens of slot -1 or rank 0 are untouched. Returns `out`."""
    plan = _plan(buffer, table, mapping)
    _check_out(out, table, mapping, slot_scales)
    if y.dim() != 2 or y.shape[0] != mapping.num_tokens or y.shape[1] < plan.max_rank:
        raise ValueError(f"y must be [T={mapping.num_tokens}, >= {plan.max_rank}], got {tuple(y.shape)}")
    if plan.is_empty:
        return out
    which = _backend(y, backend)
    if which == "triton":
        from .triton_expand import triton_expand

        return triton_expand(y.float(), buffer, table, mapping, plan, out, slot_scales)
    if which == "reference":
        from .reference import expand_reference

        return expand_reference(y, buffer, table, mapping, out, slot_scales)
    return cpu.lora_expand_cpu(y, buffer, table, plan, out, slot_scales)
