"""Plain-torch LoRA term, written to be obviously correct; the oracle of the kernel tests.

Per token t with slot s = token_slots[t] != -1 and real rank r = slot_ranks[s]:

    out[t] += slot_scales[s] * B[s, :, :r] @ (A[s, :r, :] @ x[t])

computed in float64 and added to `out` once, so its only rounding is the final cast to out's dtype.
"""
from __future__ import annotations

import torch

from .mapping import LoraMapping


def lora_delta_reference(
    x: torch.Tensor,  # [T, d_in]
    a_stack: torch.Tensor,  # [S, r_max, d_in]
    b_stack: torch.Tensor,  # [S, d_out, r_max]
    mapping: LoraMapping,
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:  # float64 [T, d_out]; zero rows for tokens without adapter
    num_tokens, d_out = x.shape[0], b_stack.shape[1]
    delta = torch.zeros(num_tokens, d_out, dtype=torch.float64, device=x.device)
    slots = mapping.token_slots.tolist()
    ranks = mapping.slot_ranks.tolist()
    for t, s in enumerate(slots):
        if s < 0 or ranks[s] == 0:
            continue
        r = ranks[s]
        a = a_stack[s, :r, :].double()  # [r, d_in]
        b = b_stack[s, :, :r].double()  # [d_out, r]
        delta[t] = float(slot_scales[s]) * (b @ (a @ x[t].double()))
    return delta


def shrink_reference(
    x: torch.Tensor,  # [T, d_in]
    a_stack: torch.Tensor,  # [S, r_max, d_in]
    mapping: LoraMapping,
) -> torch.Tensor:  # float32 [T, r_max]; columns >= the token's rank and tokens without adapter are 0
    r_max = a_stack.shape[1]
    y = torch.zeros(x.shape[0], r_max, dtype=torch.float64, device=x.device)
    ranks = mapping.slot_ranks.tolist()
    for t, s in enumerate(mapping.token_slots.tolist()):
        if s >= 0 and ranks[s] > 0:
            y[t, : ranks[s]] = a_stack[s, : ranks[s], :].double() @ x[t].double()
    return y.float()


def expand_reference(
    y: torch.Tensor,  # [T, r_max]
    b_stack: torch.Tensor,  # [S, d_out, r_max]
    mapping: LoraMapping,
    out: torch.Tensor,  # [T, d_out], updated in place
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:
    delta = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    ranks = mapping.slot_ranks.tolist()
    for t, s in enumerate(mapping.token_slots.tolist()):
        if s >= 0 and ranks[s] > 0:
            r = ranks[s]
            delta[t] = float(slot_scales[s]) * (b_stack[s, :, :r].double() @ y[t, :r].double())
    active = mapping.token_slots >= 0
    out[active] = (out[active].double() + delta[active]).to(out.dtype)
    return out


def add_lora_reference(
    out: torch.Tensor,  # [T, d_out], updated in place
    x: torch.Tensor,  # [T, d_in]
    a_stack: torch.Tensor,  # [S, r_max, d_in]
    b_stack: torch.Tensor,  # [S, d_out, r_max]
    mapping: LoraMapping,
    slot_scales: torch.Tensor,  # float32 [S]
) -> torch.Tensor:
    delta = lora_delta_reference(x, a_stack, b_stack, mapping, slot_scales)
    active = mapping.token_slots >= 0
    out[active] = (out[active].double() + delta[active]).to(out.dtype)
    return out
