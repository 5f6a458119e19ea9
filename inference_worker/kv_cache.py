"""Paged KV cache: one pool of fixed-size blocks shared by every sequence, addressed by block tables.

Why paged (vLLM's PagedAttention): sequences of any length share one preallocated pool without
fragmentation, so admission is a question of free blocks, and finishing a sequence returns its blocks
at once. The allocator is plain bookkeeping; the engine owns block tables and decides who gets blocks.

Layout per layer: `k[layer]` and `v[layer]` are `[kv_heads, num_blocks * block_size, head_dim]`. Token
position p of a sequence lives at flat row `block_table[p // block_size] * block_size + p % block_size`.
kv-head-major so that gathering the rows of a batch yields `[kv_heads, B, L, head_dim]` with no further
copy: exactly the operand the batched attention matmul wants.
"""
from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (nothing is allocated then)."""


class BlockAllocator:
    """Free-list allocator of block ids 0..num_blocks-1. Not thread-safe: the engine thread owns it."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        # Popped from the end, so low ids are handed out first (easier to read in tests and logs).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """Return n distinct free block ids, or raise OutOfBlocks and allocate nothing."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool. Freeing a block that is not allocated is a bug and raises."""
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free?)")
        for b in blocks:
            self._used.remove(b)
            self._free.append(b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold num_tokens positions."""
    return -(-num_tokens // block_size)


class PagedKVCache:
    """The KV tensors of every layer plus the allocator that hands out their blocks."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        rows = num_blocks * block_size
        # K and V of a layer in one tensor so that one gather fetches both (one op fewer per chunk
        # and layer on the decode path). Zero-filled: padded gathers read arbitrary rows and mask
        # them, so they must never hold NaN.
        self.kv = [torch.zeros(2, num_kv_heads, rows, head_dim, dtype=dtype, device=device)
                   for _ in range(num_layers)]  # [2 (k, v), kv_heads, rows, head_dim] per layer
        self.k = [t[0] for t in self.kv]  # [kv_heads, rows, head_dim] views
        self.v = [t[1] for t in self.kv]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def rows_for(self, block_table: list[int], start: int, n: int) -> list[int]:
        """Flat pool rows of positions start..start+n-1 of a sequence."""
        bs = self.block_size
        end = start + n
        if blocks_needed(end, bs) > len(block_table):
            raise ValueError(f"block table of {len(block_table)} blocks cannot hold {end} positions")
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values. rows: int64 [T]; k, v: [T, kv_heads, head_dim]."""
        self.k[layer].index_copy_(1, rows, k.transpose(0, 1))
        self.v[layer].index_copy_(1, rows, v.transpose(0, 1))

    def gather(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values at flat rows (any shape [*R]) -> two [kv_heads, *R, head_dim] tensors."""
        kv = self.kv[layer].index_select(2, rows.reshape(-1))  # [2, kv_heads, R, head_dim]
        shape = (kv.shape[1], *rows.shape, kv.shape[-1])
        return kv[0].view(shape), kv[1].view(shape)

    def gather_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of whole blocks: blocks int64 [B, nb] -> two [kv_heads, B, nb * block_size, head_dim].

        The same result as `gather` over every row of those blocks, but each copy is a block of
        block_size x head_dim contiguous values instead of one row (measured 1.7x faster on CPU for a
        64-sequence decode batch); positions past a sequence's length are the caller's to mask."""
        two, heads, _, hd = self.kv[layer].shape
        B, nb = blocks.shape
        kv = self.kv[layer].view(two * heads, self.num_blocks, self.block_size * hd).index_select(1, blocks.reshape(-1))
        shape = (heads, B, nb * self.block_size, hd)
        kv = kv.view(two, heads, B * nb, self.block_size * hd)
        return kv[0].view(shape), kv[1].view(shape)
