"""Device-resident LoRA slot pools and the per-projection LoRA term.

Each of the seven target projections has, per layer, a padded pool of A and B matrices for every slot:
`a[proj][layer]` is `[S, r_max, d_in]` and `b[proj][layer]` is `[S, d_out, r_max]` (the shapes
`kernels.add_lora` consumes; B rank-major in memory). An adapter of rank r < r_max fills the first r
rows/columns; the rest stay zero and the kernels never read them (they use the slot's real rank). A
slot whose adapter does not target a projection keeps zeros there, and the projection is skipped for a
step in which no active slot targets it, so attention-only adapters do not pay for MLP LoRA.

Scale per slot is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (the caller computes it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kernels import LoraMapping, add_lora

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# PEFT names, saved ("...q_proj.lora_A.weight") or in memory ("...q_proj.lora_A.default.weight").
_PEFT_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    r"\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$"
)


def peft_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling: alpha/r, or alpha/sqrt(r) for rsLoRA."""
    return alpha / (rank ** 0.5) if use_rslora else alpha / rank


def parse_peft_key(name: str) -> tuple[int, str, str]:
    """'base_model.model.model.layers.3.mlp.up_proj.lora_B.weight' -> (3, 'up_proj', 'B')."""
    m = _PEFT_KEY.search(name)
    if m is None:
        raise ValueError(f"tensor {name!r} is not a LoRA A/B weight of a target projection")
    return int(m.group(1)), m.group(2), m.group(3)


@dataclass(frozen=True)
class ProjectionShape:
    d_in: int
    d_out: int


class LoraSlots:
    """The slot pools of one model, their ranks and scales, and the per-step mapping."""

    def __init__(self, shapes: dict[str, ProjectionShape], *, num_layers: int, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_layers, self.num_slots, self.max_rank = num_layers, num_slots, max_rank
        self.device = torch.device(device)
        self.shapes = shapes
        self.a = {p: [torch.zeros(num_slots, max_rank, s.d_in, dtype=dtype, device=device)
                      for _ in range(num_layers)] for p, s in shapes.items()}  # [S, r_max, d_in]
        # B is [S, d_out, r_max] by shape but rank-major in memory (a transposed [S, r_max, d_out]): the
        # expand then streams exactly rank x d_out contiguous values per adapter, whatever r_max is
        # (kernels/cpu.py measured column-major B as latency-bound for ranks below r_max).
        self.b = {p: [torch.zeros(num_slots, max_rank, s.d_out, dtype=dtype, device=device).transpose(1, 2)
                      for _ in range(num_layers)] for p, s in shapes.items()}  # [S, d_out, r_max] view
        self.ranks = [0] * num_slots
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)  # [S]
        self.targets: list[frozenset[str]] = [frozenset()] * num_slots

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for ts in d.values() for t in ts)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range (0..{self.num_slots - 1})")

    def clear(self, slot: int) -> None:
        """Empty a slot. Only the region the previous adapter wrote is zeroed (targets x [:rank]): a
        whole slot of a 7B-shaped pool is hundreds of MB, and cold loads must stay cheap."""
        self._check_slot(slot)
        r = self.ranks[slot]
        for proj in self.targets[slot]:
            for layer in range(self.num_layers):
                self.a[proj][layer][slot, :r].zero_()
                self.b[proj][layer][slot, :, :r].zero_()
        self.ranks[slot] = 0
        self.scales[slot] = 0.0
        self.targets[slot] = frozenset()

    def load(self, slot: int, weights: dict[str, torch.Tensor], *, rank: int, scale: float) -> None:
        """Copy a PEFT adapter's tensors into a slot. Validates everything before touching the slot."""
        self._check_slot(slot)
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} outside 1..{self.max_rank}")
        parsed: dict[tuple[int, str, str], torch.Tensor] = {}
        for name, tensor in weights.items():
            layer, proj, ab = parse_peft_key(name)
            if layer >= self.num_layers:
                raise ValueError(f"tensor {name!r}: the base has {self.num_layers} layers")
            if proj not in self.shapes:
                raise ValueError(f"tensor {name!r}: projection {proj} is not adaptable here")
            s = self.shapes[proj]
            r = tensor.shape[0] if ab == "A" else tensor.shape[-1]
            expected = (r, s.d_in) if ab == "A" else (s.d_out, r)
            if tensor.dim() != 2 or tuple(tensor.shape) != expected or r > rank:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{'[r, %d]' % s.d_in if ab == 'A' else '[%d, r]' % s.d_out} with r <= {rank}")
            parsed[(layer, proj, ab)] = tensor
        for (layer, proj, ab) in parsed:
            other = "B" if ab == "A" else "A"
            if (layer, proj, other) not in parsed:
                raise ValueError(f"layer {layer} {proj}: lora_{ab} without lora_{other}")
        if not parsed:
            raise ValueError("the adapter has no LoRA tensors")

        # Invariant: outside (targets x [:rank]) a slot is all zeros, so a module of smaller rank than
        # the slot's (PEFT rank_pattern) or one the adapter does not target contributes nothing. Only what
        # the new adapter will not overwrite is zeroed: zeroing first and then copying wrote the same
        # 160 MB twice for a 7B-shaped adapter (~10 ms of a cold load).
        old_rank, old_targets = self.ranks[slot], self.targets[slot]
        new_targets = frozenset(proj for (_, proj, _) in parsed)
        self.ranks[slot], self.scales[slot], self.targets[slot] = 0, 0.0, frozenset()
        try:
            for proj in old_targets:
                for layer in range(self.num_layers):
                    keep = parsed[(layer, proj, "A")].shape[0] if (layer, proj, "A") in parsed else 0
                    if keep < old_rank:
                        self.a[proj][layer][slot, keep:old_rank].zero_()
                        self.b[proj][layer][slot, :, keep:old_rank].zero_()
            for (layer, proj, ab), t in parsed.items():
                if ab == "A":
                    self.a[proj][layer][slot, : t.shape[0]].copy_(t)  # copy_ converts dtype and device
                else:
                    self.b[proj][layer][slot, :, : t.shape[1]].copy_(t)
        except BaseException:  # leave an empty, all-zero slot behind, whatever was half-written
            self.ranks[slot], self.targets[slot] = max(old_rank, rank), old_targets | new_targets
            self.clear(slot)
            raise
        self.ranks[slot] = rank
        self.scales[slot] = float(scale)
        self.targets[slot] = new_targets

    def mapping(self, token_slots: list[int]) -> "StepLora | None":
        """The step's LoRA state, or None when no token uses a loaded slot (the LoRA term is zero)."""
        active = {s for s in token_slots if s >= 0}
        for s in active:
            self._check_slot(s)
            if self.ranks[s] == 0:
                raise ValueError(f"slot {s} is empty")
        if not active:
            return None
        targeted = frozenset().union(*(self.targets[s] for s in active))
        mapping = LoraMapping.build(token_slots, self.ranks, device=self.device)
        return StepLora(self, mapping, targeted)


class StepLora:
    """One forward step's LoRA: the mapping (built once) applied to every projection of every layer."""

    def __init__(self, slots: LoraSlots, mapping: "LoraMapping", targeted: frozenset[str]) -> None:
        self.slots, self.mapping, self.targeted = slots, mapping, targeted

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """out += LoRA term of proj at layer. out: [T, d_out] (a column view is fine), x: [T, d_in]."""
        if proj not in self.targeted:
            return
        add_lora(out, x, self.slots.a[proj][layer], self.slots.b[proj][layer], self.mapping, self.slots.scales)
