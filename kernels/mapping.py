"""Which LoRA slot each token of a batch uses, built once per forward step.

Every projection of every layer reuses the same mapping, so everything that can be computed once per
step (segments, index tensors for the Triton grid, the CPU path's scratch) is computed here and not in
the per-projection call, which runs 7 x layers times per step. Ranks are not part of the mapping: each
projection's `LoraTable` says which slots have weights there and at what rank, and what depends on both
(the segments that carry weights, packed for the CPU kernel) is a `SegmentPlan`, computed on first use
and cached on the mapping keyed by the table object, so each table costs it once per step, not per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .table import LoraTable


@dataclass(frozen=True)
class CpuPlan:
    """The CPU path's split of one (step, table)'s active segments, computed once per threshold."""

    num_short: int  # segments handled by the native kernel
    short_segs: torch.Tensor  # int32 [4, num_short] CPU: starts, lens, slots, ranks (kept alive for the ptrs)
    short_ptrs: tuple[int, int, int, int]  # data pointers of short_segs' rows
    short_rank_sum: int  # sum of the ranks of the distinct slots among short segments (sizes the traffic)
    short_token_ranks: int  # sum over short segments of tokens x rank (sizes the arithmetic)
    long_segments: tuple[tuple[int, int, int, int], ...]  # (start, end, slot, rank) handed to BLAS


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """The segments of one step that carry weights in one projection's table (slot != -1, rank > 0)."""

    segments: tuple[tuple[int, int, int, int], ...]  # (start, end, slot, rank) per active segment
    max_seg_len: int  # longest active segment (0 if none); sizes the Triton grid
    max_rank: int  # largest rank among active segments (0 if none); sizes the Triton rank tile
    _cpu_plans: dict = field(default_factory=dict, repr=False)  # (long segment, chunk) -> CpuPlan

    @property
    def is_empty(self) -> bool:
        """True when no token has weights in this table: the projection's LoRA term is zero."""
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
                short_ptrs=(packed[0].data_ptr(), packed[1].data_ptr(), packed[2].data_ptr(), packed[3].data_ptr()),
                short_rank_sum=sum({slot: r for _, _, slot, r in short}.values()),
                short_token_ranks=sum((e - s) * r for s, e, _, r in short),
                long_segments=tuple(seg for seg in self.segments if seg[1] - seg[0] >= long_segment),
            )
            self._cpu_plans[(long_segment, chunk)] = plan
        return plan


@dataclass(frozen=True, eq=False)
class LoraMapping:
    """Token -> slot mapping in both segment form (prefill) and per-token form (decode).

    Segments are maximal runs of equal slot, kept only for slot != -1: tokens without an adapter cost
    nothing downstream. Which segments a projection computes depends on its table (`plan`).
    """

    num_tokens: int
    num_slots: int
    token_slots: torch.Tensor  # int32 [T], -1 = no adapter
    seg_starts: torch.Tensor  # int32 [G], first token of each segment
    seg_lens: torch.Tensor  # int32 [G], tokens in each segment
    seg_slots: torch.Tensor  # int32 [G], slot of each segment
    segments: tuple[tuple[int, int, int], ...]  # (start, end, slot) per segment
    max_seg_len: int  # longest segment (0 if none)
    _plans: dict = field(default_factory=dict, repr=False)  # LoraTable -> SegmentPlan
    _scratch: dict = field(default_factory=dict, repr=False)  # width -> fp32 [T, width] CPU shrink output

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def is_empty(self) -> bool:
        """True when no token uses an adapter: every LoRA term of the step is zero."""
        return not self.segments

    def plan(self, table: LoraTable) -> SegmentPlan:
        """This step's segments that have weights in `table`, with their ranks; cached per table object
        (the table holds no buffer, so one plan serves every layer)."""
        plan = self._plans.get(table)
        if plan is None:
            ranks = table.rank_list
            active = tuple((s, e, slot, ranks[slot]) for s, e, slot in self.segments if ranks[slot] > 0)
            plan = self._plans[table] = SegmentPlan(
                segments=active,
                max_seg_len=max((e - s for s, e, _, _ in active), default=0),
                max_rank=max((r for _, _, _, r in active), default=0),
            )
        return plan

    def scratch(self, width: int) -> torch.Tensor:
        """The CPU shrink's fp32 [T, width] scratch, allocated once per step and reused by every
        projection. Calls that share a mapping must not run concurrently (one forward pass uses one
        mapping at a time)."""
        y = self._scratch.get(width)
        if y is None:
            y = self._scratch[width] = torch.empty(self.num_tokens, width, dtype=torch.float32)
        return y

    @classmethod
    def build(
        cls,
        token_slots: torch.Tensor | list[int],
        num_slots: int,
        device: torch.device | str | None = None,
    ) -> LoraMapping:
        """Build from a slot per token (-1 = no adapter) and the number of slots of the tables.

        Tensors land on `device` (default: the device of `token_slots`, or CPU for lists). Slots need
        not be sorted; each maximal run of equal slot becomes one segment, so contiguous ordering by the
        caller only makes the segments longer (and the kernels faster), never changes the result.
        """
        if device is None:
            device = token_slots.device if isinstance(token_slots, torch.Tensor) else torch.device("cpu")
        slots = token_slots.tolist() if isinstance(token_slots, torch.Tensor) else [int(s) for s in token_slots]
        for s in slots:
            if s < -1 or s >= num_slots:
                raise ValueError(f"token slot {s} out of range for {num_slots} slots")

        segments: list[tuple[int, int, int]] = []
        start = 0
        for t in range(1, len(slots) + 1):
            if t == len(slots) or slots[t] != slots[start]:
                if slots[start] >= 0:
                    segments.append((start, t, slots[start]))
                start = t

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            num_tokens=len(slots),
            num_slots=num_slots,
            token_slots=i32(slots),
            seg_starts=i32([s for s, _, _ in segments]),
            seg_lens=i32([e - s for s, e, _ in segments]),
            seg_slots=i32([slot for _, _, slot in segments]),
            segments=tuple(segments),
            max_seg_len=max((e - s for s, e, _ in segments), default=0),
        )
