"""Where each slot's A and B of one projection lie inside a flat weight buffer (a pool page range).

The worker keeps adapter weights in one memory pool shared with the KV cache (S-LoRA style): an adapter
occupies exactly its real rank on exactly its real targets, at whatever element offset the pool gave it.
A `LoraTable` is the "pointer per adapter" view of one projection (vLLM's lora_ptr arrays, as offsets):

    A of slot s: buffer[a_offsets[s] : a_offsets[s] + r_s * d_in ].view(r_s, d_in)   row-major
    B of slot s: buffer[b_offsets[s] : b_offsets[s] + r_s * d_out].view(r_s, d_out)  rank-major (B^T)

r_s = 0 means the slot has no weights for this projection (its offsets are ignored; its tokens are
skipped at no cost). Offsets are in elements of the buffer's dtype, int64 (pools may exceed 2^31
elements), and need no alignment; offsets and row lengths that are multiples of 16 bytes let the Triton
kernels use vector loads (see `alignment`). The kernels only read: two slots may share one adapter's
matrices. The table holds no buffer: the worker reuses one table for every layer, passing each layer's
buffer (pool[layer].view(-1)) per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# The 16-bit weight dtypes a buffer may have beside fp32 activations (the worker's 16-bit adapter pool); otherwise
# a buffer has its activations' dtype. Every backend widens them to fp32 as it reads them.
HALF_WEIGHTS = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)
class LoraTable:
    """Where each slot's A and B of ONE projection lie inside a flat 1-D weight buffer."""

    a_offsets: torch.Tensor  # int64 [S] on the kernels' device: first element of A_s
    b_offsets: torch.Tensor  # int64 [S] on the kernels' device: first element of B_s^T
    ranks: torch.Tensor  # int32 [S] on the kernels' device: real rank r_s, 0 = no weights here
    d_in: int
    d_out: int
    max_rank: int  # max of ranks (0 if every slot is empty)
    # host-side copies, made once per table (tables change when adapters load or evict, not per step)
    rank_list: tuple[int, ...] = field(repr=False)
    a_offset_list: tuple[int, ...] = field(repr=False)
    b_offset_list: tuple[int, ...] = field(repr=False)
    host_offsets: torch.Tensor = field(repr=False)  # int64 [2, S] CPU, contiguous: A row, B row (for ctypes)
    extent: int  # the buffer must hold at least this many elements
    offset_gcd: int  # gcd of the non-empty slots' offsets (0 if none): their common alignment

    @property
    def num_slots(self) -> int:
        return len(self.rank_list)

    @property
    def host_offset_ptrs(self) -> tuple[int, int]:
        """Addresses of the host A and B offset rows (int64 [S] each), for the native CPU kernel."""
        ptr = self.host_offsets.data_ptr()
        return ptr, ptr + 8 * self.num_slots

    def alignment(self, element_size: int, bytes_: int = 16) -> int:
        """`bytes_ / element_size` if every non-empty matrix starts on a multiple of `bytes_` bytes from
        the buffer's start and its rows are multiples of it too, else 1 (elements)."""
        elems = max(bytes_ // element_size, 1)
        aligned = self.offset_gcd % elems == 0 and self.d_in % elems == 0 and self.d_out % elems == 0
        return elems if aligned else 1

    @classmethod
    def build(
        cls,
        a_offsets: list[int],
        b_offsets: list[int],
        ranks: list[int],
        *,
        d_in: int,
        d_out: int,
        device: torch.device | str,
    ) -> LoraTable:
        """A table from host lists (one entry per slot). Three small host-to-device copies; build one per
        projection when an adapter loads or evicts, and reuse it for every layer and step until then."""
        a_offs, b_offs, rks = [int(v) for v in a_offsets], [int(v) for v in b_offsets], [int(v) for v in ranks]
        if not len(a_offs) == len(b_offs) == len(rks):
            raise ValueError(f"one offset pair and rank per slot: got {len(a_offs)}, {len(b_offs)}, {len(rks)}")
        if d_in < 1 or d_out < 1:
            raise ValueError(f"d_in and d_out must be positive, got {d_in}, {d_out}")
        if any(r < 0 for r in rks):
            raise ValueError("ranks must be >= 0")
        live = [s for s, r in enumerate(rks) if r > 0]
        if any(a_offs[s] < 0 or b_offs[s] < 0 for s in live):
            raise ValueError("offsets of non-empty slots must be >= 0")
        host = torch.tensor([a_offs, b_offs], dtype=torch.int64).reshape(2, len(rks))  # [2, S]
        return cls(
            a_offsets=host[0].to(device, copy=True),
            b_offsets=host[1].to(device, copy=True),
            ranks=torch.tensor(rks, dtype=torch.int32, device=device),
            d_in=d_in,
            d_out=d_out,
            max_rank=max(rks, default=0),
            rank_list=tuple(rks),
            a_offset_list=tuple(a_offs),
            b_offset_list=tuple(b_offs),
            host_offsets=host,
            extent=max((max(a_offs[s] + rks[s] * d_in, b_offs[s] + rks[s] * d_out) for s in live), default=0),
            offset_gcd=math.gcd(*(a_offs[s] for s in live), *(b_offs[s] for s in live)) if live else 0,
        )

    def a_of(self, buffer: torch.Tensor, slot: int) -> torch.Tensor:  # [r_s, d_in], a view of buffer
        r, off = self.rank_list[slot], self.a_offset_list[slot]
        return buffer[off : off + r * self.d_in].view(r, self.d_in)

    def b_of(self, buffer: torch.Tensor, slot: int) -> torch.Tensor:  # [r_s, d_out] (B^T), a view of buffer
        r, off = self.rank_list[slot], self.b_offset_list[slot]
        return buffer[off : off + r * self.d_out].view(r, self.d_out)
