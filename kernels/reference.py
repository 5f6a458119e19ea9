"""Plain-torch LoRA term, written to be obviously correct; the oracle of the kernel tests.

Per token t with slot s = token_slots[t] != -1 and real rank r = table.ranks[s] > 0, reading A_s
[r, d_in] and B_s^T [r, d_out] out of the flat buffer at the table's offsets:

    out[t] += slot_scales[s] * B_s @ (A_s @ x[t])

computed in float64 and added to `out` once, so its only rounding is the final cast to out's dtype.
Tokens of slot -1 or of a rank-0 slot are not written at all.
"""
from __future__ import annotations

import torch

from .mapping import LoraMapping
from .table import LoraTable


def _active_tokens(table: LoraTable, mapping: LoraMapping) -> list[tuple[int, int]]:
    """(token, slot) for every token with weights in this table."""
    return [(t, s) for t, s in enumerate(mapping.token_slots.tolist()) if s >= 0 and table.rank_list[s] > 0]


def _add_once(out: torch.Tensor, delta: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if rows:
        out[rows] = (out[rows].double() + delta[rows]).to(out.dtype)
    return out


def lora_delta_reference(
    x: torch.Tensor,  # [T, d_in]
    buffer: torch.Tensor,  # 1-D, A and B of every slot at the table's offsets
    table: LoraTable,
    mapping: LoraMapping,
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:  # float64 [T, d_out]; zero rows for tokens without weights
    delta = torch.zeros(x.shape[0], table.d_out, dtype=torch.float64, device=x.device)
    for t, s in _active_tokens(table, mapping):
        a = table.a_of(buffer, s).double()  # [r, d_in]
        b_t = table.b_of(buffer, s).double()  # [r, d_out]
        delta[t] = float(slot_scales[s]) * (b_t.t() @ (a @ x[t].double()))
    return delta


def shrink_reference(
    x: torch.Tensor,  # [T, d_in]
    buffer: torch.Tensor,  # 1-D
    table: LoraTable,
    mapping: LoraMapping,
) -> torch.Tensor:  # float32 [T, table.max_rank]; columns >= the token's rank and skipped tokens are 0
    y = torch.zeros(x.shape[0], table.max_rank, dtype=torch.float64, device=x.device)
    for t, s in _active_tokens(table, mapping):
        y[t, : table.rank_list[s]] = table.a_of(buffer, s).double() @ x[t].double()
    return y.float()


def expand_reference(
    y: torch.Tensor,  # [T, >= table.max_rank]
    buffer: torch.Tensor,  # 1-D
    table: LoraTable,
    mapping: LoraMapping,
    out: torch.Tensor,  # [T, d_out], updated in place
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:
    delta = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    active = _active_tokens(table, mapping)
    for t, s in active:
        r = table.rank_list[s]
        delta[t] = float(slot_scales[s]) * (table.b_of(buffer, s).double().t() @ y[t, :r].double())
    return _add_once(out, delta, [t for t, _ in active])


def add_lora_reference(
    out: torch.Tensor,  # [T, d_out], updated in place
    x: torch.Tensor,  # [T, d_in]
    buffer: torch.Tensor,  # 1-D
    table: LoraTable,
    mapping: LoraMapping,
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:
    delta = lora_delta_reference(x, buffer, table, mapping, slot_scales)
    return _add_once(out, delta, [t for t, _ in _active_tokens(table, mapping)])
