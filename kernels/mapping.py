"""Which LoRA slot each token of a batch uses, built once per forward step.

Every projection of every layer reuses the same mapping, so everything that can be computed once per
step (segments, Python lists for the CPU loop, index tensors for the Triton grid) is computed here and
not in the per-projection call, which runs 7 x layers times per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CpuPlan:
    """The CPU path's split of a step's segments, computed once per mapping and threshold."""

    num_short: int  # segments handled by the native kernel
    short_segs: torch.Tensor  # int32 [4, num_short] CPU: starts, lens, slots, ranks (kept alive for the ptrs)
    short_ptrs: tuple[int, int, int, int]  # data pointers of short_segs' rows
    short_rank_sum: int  # sum of the ranks of the distinct slots among short segments (sizes the traffic)
    long_segments: tuple[tuple[int, int, int, int], ...]  # (start, end, slot, rank) handed to BLAS
    _scratch: dict = field(default_factory=dict, repr=False)  # r_max -> fp32 [T, r_max] shrink output

    def scratch(self, num_tokens: int, r_max: int) -> torch.Tensor:
        """The shrink's scratch, allocated once per step and reused by every projection. Calls that
        share a mapping must not run concurrently (one forward pass uses one mapping at a time)."""
        y = self._scratch.get(r_max)
        if y is None:
            y = self._scratch[r_max] = torch.empty(num_tokens, r_max, dtype=torch.float32)
        return y


@dataclass(frozen=True, eq=False)
class LoraMapping:
    """Token -> slot mapping in both segment form (prefill) and per-token form (decode).

    Segments are maximal runs of equal slot. Only *active* segments (slot != -1 and real rank > 0) are
    kept: tokens without an adapter, and slots whose rank is 0, cost nothing downstream.
    """

    num_tokens: int
    token_slots: torch.Tensor  # int32 [T], -1 = no adapter
    slot_ranks: torch.Tensor  # int32 [S], real rank of each slot (0 = empty)
    seg_starts: torch.Tensor  # int32 [G], first token of each active segment
    seg_lens: torch.Tensor  # int32 [G], tokens in each active segment
    seg_slots: torch.Tensor  # int32 [G], slot of each active segment
    seg_ranks: torch.Tensor  # int32 [G], real rank of each active segment's slot
    segments: tuple[tuple[int, int, int, int], ...]  # (start, end, slot, rank) per active segment
    max_seg_len: int  # longest active segment (0 if none); sizes the Triton grid
    max_rank: int  # largest real rank among active segments (0 if none)
    _cpu_plans: dict = field(default_factory=dict, repr=False)  # (long segment, chunk) -> CpuPlan

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def is_empty(self) -> bool:
        """True when no token uses an adapter: the whole LoRA term is zero."""
        return not self.segments

    def cpu_plan(self, long_segment: int, chunk: int = 16) -> CpuPlan:
        """Short segments packed for the native CPU kernel, long ones listed for BLAS; cached.

        Short segments longer than `chunk` tokens are cut into chunks, the native kernel's unit of work
        across threads (each chunk re-reads its adapter's A and B, from cache after the first)."""
        plan = self._cpu_plans.get((long_segment, chunk))
        if plan is None:
            short = [(s0, min(s0 + chunk, e), slot, r)
                     for s, e, slot, r in self.segments if e - s < long_segment
                     for s0 in range(s, e, chunk)]
            packed = torch.tensor([[s for s, _, _, _ in short], [e - s for s, e, _, _ in short],
                                   [slot for _, _, slot, _ in short], [r for _, _, _, r in short]],
                                  dtype=torch.int32).reshape(4, len(short))
            plan = CpuPlan(
                num_short=len(short),
                short_segs=packed,
                short_ptrs=tuple(packed[i].data_ptr() for i in range(4)),
                short_rank_sum=sum({slot: r for _, _, slot, r in short}.values()),
                long_segments=tuple(seg for seg in self.segments if seg[1] - seg[0] >= long_segment),
            )
            self._cpu_plans[(long_segment, chunk)] = plan
        return plan

    @classmethod
    def build(
        cls,
        token_slots: torch.Tensor | list[int],
        slot_ranks: torch.Tensor | list[int],
        device: torch.device | str | None = None,
    ) -> "LoraMapping":
        """Build from a slot per token (-1 = no adapter) and the real rank of each slot.

        Tensors land on `device` (default: the device of `token_slots`, or CPU for lists). Slots need
        not be sorted; each maximal run of equal slot becomes one segment, so contiguous ordering by the
        caller only makes the segments longer (and the kernels faster), never changes the result.
        """
        if device is None:
            device = token_slots.device if isinstance(token_slots, torch.Tensor) else torch.device("cpu")
        slots = token_slots.tolist() if isinstance(token_slots, torch.Tensor) else list(token_slots)
        ranks = slot_ranks.tolist() if isinstance(slot_ranks, torch.Tensor) else list(slot_ranks)
        num_slots = len(ranks)
        for s in slots:
            if s < -1 or s >= num_slots:
                raise ValueError(f"token slot {s} out of range for {num_slots} slots")
        if any(r < 0 for r in ranks):
            raise ValueError("slot ranks must be >= 0")

        segments: list[tuple[int, int, int, int]] = []
        start = 0
        for t in range(1, len(slots) + 1):
            if t == len(slots) or slots[t] != slots[start]:
                slot = slots[start]
                if slot >= 0 and ranks[slot] > 0:
                    segments.append((start, t, slot, ranks[slot]))
                start = t

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            num_tokens=len(slots),
            token_slots=i32(slots),
            slot_ranks=i32(ranks),
            seg_starts=i32([s for s, _, _, _ in segments]),
            seg_lens=i32([e - s for s, e, _, _ in segments]),
            seg_slots=i32([slot for _, _, slot, _ in segments]),
            seg_ranks=i32([r for _, _, _, r in segments]),
            segments=tuple(segments),
            max_seg_len=max((e - s for s, e, _, _ in segments), default=0),
            max_rank=max((r for _, _, _, r in segments), default=0),
        )
