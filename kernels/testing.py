"""Random pooled weight layouts for the kernel tests and benches (not used when serving).

`random_pool` packs the A and B^T of every (projection, slot) into one flat buffer, in random order with
random gaps, as a pool that has served many loads and evictions leaves them. The gaps hold finite garbage
so that a kernel reading outside a matrix gives a wrong answer instead of a lucky zero.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .table import LoraTable


@dataclass(frozen=True)
class PooledWeights:
    buffer: torch.Tensor  # 1-D: every matrix of every table, with garbage between them
    tables: dict[str, LoraTable]  # one per projection, all into `buffer`


def random_offsets(sizes: list[int], *, rng: random.Random, max_gap: int = 8, align: int = 1,
                   start: int = 0) -> tuple[list[int], int]:
    """Non-overlapping element offsets for blocks of `sizes` elements, placed in random order with
    0..max_gap elements of gap before each, every offset a multiple of `align`; and the end of the last."""
    order = list(range(len(sizes)))
    rng.shuffle(order)
    offsets = [0] * len(sizes)
    pos = start
    for i in order:
        pos += rng.randint(0, max_gap)
        pos = -(-pos // align) * align
        offsets[i] = pos
        pos += sizes[i]
    return offsets, pos


def random_pool(
    shapes: dict[str, tuple[int, int]],  # projection -> (d_in, d_out)
    ranks: dict[str, list[int]],  # projection -> rank per slot (0 = no weights there)
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = 1.0,  # of the weights
    garbage: float = 1e3,  # magnitude of the values between matrices (finite, and large enough to show)
    max_gap: int = 8,
    align: int = 1,
    device: torch.device | str = "cpu",
) -> PooledWeights:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks = [(name, s, which) for name in shapes for s in range(len(ranks[name])) for which in "ab"]
    sizes = [ranks[name][s] * shapes[name][0 if which == "a" else 1] for name, s, which in blocks]
    offsets, end = random_offsets(sizes, rng=rng, max_gap=max_gap, align=align, start=rng.randint(0, max_gap))
    end += rng.randint(0, max_gap)
    buffer = torch.randn(end, generator=gen).mul_(std).to(dtype)  # [N] weights everywhere ...
    pos = 0
    for off, size in sorted(zip(offsets, sizes, strict=True)):  # ... then garbage in every gap
        if off > pos:
            buffer[pos:off] = ((torch.rand(off - pos, generator=gen) * 2 - 1) * garbage).to(dtype)
        pos = max(pos, off + size)
    if end > pos:
        buffer[pos:end] = ((torch.rand(end - pos, generator=gen) * 2 - 1) * garbage).to(dtype)
    where = dict(zip(blocks, offsets, strict=True))
    tables = {
        name: LoraTable.build(
            [where[(name, s, "a")] for s in range(len(ranks[name]))],
            [where[(name, s, "b")] for s in range(len(ranks[name]))],
            ranks[name], d_in=d_in, d_out=d_out, device=device)
        for name, (d_in, d_out) in shapes.items()
    }
    return PooledWeights(buffer.to(device), tables)
