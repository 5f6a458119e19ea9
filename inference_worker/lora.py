"""Resident LoRA adapters in the worker's memory pool, and the per-projection LoRA term.

An adapter is one contiguous run of pool pages (memory_pool.PagePool), sized by its real rank and its
real targets (protocol.memory.adapter_pages): an r=8 attention-only adapter costs ~1/19 of an r=64
all-linear one. Inside the run, per layer, each targeted projection's A [r, d_in] and B^T [r, d_out] lie
at the offsets `protocol.memory.adapter_layout` gives — the same for every layer, so one offset table per
projection (`kernels.LoraTable`) serves all layers; the kernels are handed layer l's pages as a flat
buffer. A *slot* is only a row of those tables (an index for the per-token mapping), not memory.

Scale per slot is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (the caller computes it).

`fixed_slots` reproduces the layout this replaced, for benchmarks only: N runs reserved up front, each
the size of a max-rank all-linear adapter, whatever the adapters placed in them need.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kernels import HALF_WEIGHTS, LoraMapping, LoraTable, add_lora, repeatable_lora_call
from kernels.cpu import FusedLoraGroup, NativeLoraCall
from protocol.lora_layout import TARGET_MODULES, ModelShape, expand_targets, parse_peft_name
from protocol.memory import adapter_layout, adapter_pages

from .memory_pool import PagePool

TARGETS = TARGET_MODULES
# The runner's GEMMs (q/k/v and gate/up fused) and the projections whose LoRA term follows each; an adapter's
# matrices of one group lie side by side in its run (TARGET_MODULES order: protocol.memory.adapter_layout).
GEMM_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
               "down": ("down_proj",)}

def parse_peft_key(name: str) -> tuple[int, str, str]:
    """'base_model.model.model.layers.3.mlp.up_proj.lora_B.weight' -> (3, 'up_proj', 'B'); in-memory PEFT
    names ('...lora_B.default.weight') too."""
    parsed = parse_peft_name(name, saved=False)
    if parsed is None:
        raise ValueError(f"tensor {name!r} is not a LoRA A/B weight of a target projection")
    return parsed


@dataclass(frozen=True)
class Resident:
    """One adapter in the pool."""

    key: str  # the caller's name for it (the adapter identity in the worker)
    start: int  # first page of its run
    pages: int
    rank: int
    scale: float
    targets: frozenset[str]
    offsets: dict  # proj -> (A offset, B offset) from the start of the run, in elements
    reserved: bool = False  # the run is a fixed slot's (given back to the reserve, not the pool)


class NoRoom(RuntimeError):
    """No run of free pages is long enough for the adapter right now (evict or wait, then retry)."""


class LoraPool:
    """The adapters resident in the memory pool, their offset tables and scales, and the per-step mapping."""

    def __init__(self, pool: PagePool, shape: ModelShape, *, max_rank: int, block_size: int,
                 fixed_slots: int = 0, dtype: torch.dtype | None = None) -> None:
        self.pool, self.shape, self.max_rank, self.block_size = pool, shape, max_rank, block_size
        self.num_layers = shape.num_layers
        self.device = pool.device
        self.projections = shape.projections()  # proj -> (d_in, d_out)
        # The adapters' element type: the pool's (the model's), or 16-bit beside an fp32 pool, two adapter elements
        # in each pool element (run_worker --adapter-dtype: half the pages, half the bytes a decode step reads).
        self.dtype = dtype or pool.dtype
        if self.dtype != pool.dtype and not (pool.dtype == torch.float32 and self.dtype in HALF_WEIGHTS):
            raise ValueError(f"adapters in {self.dtype} beside a {pool.dtype} pool: adapters are stored in the model's "
                             f"dtype, or in bfloat16 / float16 beside a float32 model")
        self.packing = pool.dtype.itemsize // self.dtype.itemsize  # adapter elements per pool element
        self.page_elems = pool.page_elems * self.packing  # adapter elements of one page, per layer
        self._buffers = [pool.layer_buffer(layer).view(self.dtype) for layer in range(pool.num_layers)]
        self.buffer_ptrs = [b.data_ptr() for b in self._buffers]  # each layer's buffer's address, for native calls
        self._slots: list[Resident | None] = []
        self._reserve: list[int] = []  # free fixed-slot runs (first pages)
        self.fixed_pages = 0
        if fixed_slots:
            self.fixed_pages = adapter_pages(shape, max_rank, TARGET_MODULES, block_size, self.packing)
            for _ in range(fixed_slots):
                start = pool.allocate_extent(self.fixed_pages)
                if start is None:
                    raise ValueError(f"{fixed_slots} fixed slots of {self.fixed_pages} pages do not fit a pool of "
                                     f"{pool.num_pages} pages")
                self._reserve.append(start)
        self._rebuild()

    # ---- inspection -------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def residents(self) -> list[Resident]:
        return [r for r in self._slots if r is not None]

    @property
    def ranks(self) -> list[int]:
        return [r.rank if r is not None else 0 for r in self._slots]

    def pages_for(self, rank: int, targets) -> int:
        """Pages an adapter of `rank` on `targets` takes here (a fixed slot's size in fixed-slot mode)."""
        if self.fixed_pages:
            return self.fixed_pages
        return adapter_pages(self.shape, rank,  # a fused target (Phi-3's qkv_proj) as its parts, as place stores it
                             [t for t in expand_targets(targets) if t in self.projections] or TARGET_MODULES,
                             self.block_size, self.packing)

    @property
    def resident_bytes(self) -> int:
        """Bytes of pool pages that adapters hold (in fixed-slot mode: every reserved slot)."""
        pages = self.fixed_pages * (len(self._reserve) + len(self.residents())) if self.fixed_pages else \
            sum(r.pages for r in self.residents())
        return pages * self.pool.page_bytes

    def resident_by_rank(self) -> dict[int, int]:
        return dict(sorted(Counter(r.rank for r in self.residents()).items()))

    # ---- placing and removing ---------------------------------------------------------------------

    def place(self, key: str, weights: dict[str, torch.Tensor], *, rank: int, scale: float) -> int:
        """Copy a PEFT adapter (PEFT tensor names, any dtype) into pages of the pool; returns its slot.

        Validates everything before touching the pool. Raises ValueError when the adapter does not fit
        this base, NoRoom when no run of free pages is long enough now."""
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} outside 1..{self.max_rank}")
        parsed: dict[tuple[int, str, str], torch.Tensor] = {}
        for name, tensor in weights.items():
            layer, proj, ab = parse_peft_key(name)
            if layer >= self.num_layers:
                raise ValueError(f"tensor {name!r}: the base has {self.num_layers} layers")
            d_in, d_out = self.projections[proj]
            r = tensor.shape[0] if ab == "A" else tensor.shape[-1]
            expected = (r, d_in) if ab == "A" else (d_out, r)
            if tensor.dim() != 2 or tuple(tensor.shape) != expected or r > rank:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{f'[r, {d_in}]' if ab == 'A' else f'[{d_out}, r]'} with r <= {rank}")
            parsed[(layer, proj, ab)] = tensor
        for (layer, proj, ab) in parsed:
            other = "B" if ab == "A" else "A"
            if (layer, proj, other) not in parsed:
                raise ValueError(f"layer {layer} {proj}: lora_{ab} without lora_{other}")
        if not parsed:
            raise ValueError("the adapter has no LoRA tensors")
        targets = frozenset(proj for (_, proj, _) in parsed)

        if self.fixed_pages:
            if not self._reserve:
                raise NoRoom("every fixed slot holds an adapter")
            pages, start, reserved = self.fixed_pages, self._reserve.pop(), True
        else:
            pages, reserved = adapter_pages(self.shape, rank, targets, self.block_size, self.packing), False
            extent = self.pool.allocate_extent(pages)
            if extent is None:
                raise NoRoom(f"no run of {pages} free pages (largest {self.pool.largest_free_run()}, "
                             f"{self.pool.num_free} free)")
            start = extent
        offsets = adapter_layout(self.shape, rank, targets)
        base = start * self.page_elems
        try:
            for layer in range(self.num_layers):
                buf = self._buffers[layer]
                for proj in targets:
                    d_in, d_out = self.projections[proj]
                    a_off, b_off = base + offsets[proj][0], base + offsets[proj][1]
                    a_dst = buf[a_off:a_off + rank * d_in].view(rank, d_in)
                    bt_dst = buf[b_off:b_off + rank * d_out].view(rank, d_out)
                    a, b = parsed.get((layer, proj, "A")), parsed.get((layer, proj, "B"))  # both or neither
                    r = 0 if a is None or b is None else a.shape[0]
                    # Pages are reused (KV blocks, other adapters): whatever this adapter does not write
                    # (a layer it skips, rows past a module's smaller rank) must be zero.
                    if r < rank:
                        a_dst[r:].zero_()
                        bt_dst[r:].zero_()
                    if a is not None and b is not None and r:
                        a_dst[:r].copy_(a)  # copy_ converts dtype (rounds to nearest) and device
                        bt_dst[:r].copy_(b.t())
        except BaseException:
            self._give_back(start, pages, reserved)
            raise
        resident = Resident(key=key, start=start, pages=pages, rank=rank, scale=float(scale), targets=targets,
                            offsets=offsets, reserved=reserved)
        slot = next((i for i, r in enumerate(self._slots) if r is None), len(self._slots))
        if slot == len(self._slots):
            self._slots.append(resident)
        else:
            self._slots[slot] = resident
        self._rebuild()
        return slot

    def remove(self, slot: int) -> None:
        """Give an adapter's pages back to the pool (or its fixed slot back to the reserve)."""
        resident = self._slots[slot] if 0 <= slot < len(self._slots) else None
        if resident is None:
            raise ValueError(f"slot {slot} holds no adapter")
        self._slots[slot] = None
        while self._slots and self._slots[-1] is None:
            self._slots.pop()
        self._give_back(resident.start, resident.pages, resident.reserved)
        self._rebuild()

    def _give_back(self, start: int, pages: int, reserved: bool) -> None:
        if reserved:
            self._reserve.append(start)
        else:
            self.pool.free_extent(start, pages)

    def _rebuild(self) -> None:
        """New offset tables and scales after a change (adapters load and evict; steps only read)."""
        E = self.page_elems
        self.tables: dict[str, LoraTable] = {}
        for proj, (d_in, d_out) in self.projections.items():
            a, b, ranks = [], [], []
            for r in self._slots:
                if r is not None and proj in r.targets:
                    a.append(r.start * E + r.offsets[proj][0])
                    b.append(r.start * E + r.offsets[proj][1])
                    ranks.append(r.rank)
                else:  # an empty slot, or an adapter that does not target this projection
                    a.append(0)
                    b.append(0)
                    ranks.append(0)
            self.tables[proj] = LoraTable.build(a, b, ranks, d_in=d_in, d_out=d_out, device=self.device)
        self.scales = torch.tensor([r.scale if r is not None else 0.0 for r in self._slots], dtype=torch.float32,
                                   device=self.device)  # [S]

    # ---- per step ---------------------------------------------------------------------------------

    def mapping(self, token_slots: list[int]) -> StepLora | None:
        """The step's LoRA state, or None when no token uses an adapter (the LoRA term is zero)."""
        active = dict.fromkeys(s for s in token_slots if s >= 0)  # in the order the step's segments read them
        residents = []
        for s in active:
            resident = self._slots[s] if s < len(self._slots) else None
            if resident is None:
                raise ValueError(f"slot {s} holds no adapter")
            residents.append(resident)
        if not active:
            return None
        targeted = frozenset().union(*(r.targets for r in residents))
        mapping = LoraMapping.build(token_slots, len(self._slots), device=self.device)
        return StepLora(self, mapping, targeted, residents)

    def group_ranges(self, residents: list[Resident], group: str) -> list[tuple[int, int]]:
        """(byte offset, bytes) in a layer's buffer of each adapter's matrices of a GEMM group (GEMM_GROUPS): what
        the LoRA calls after that GEMM read, the same offsets in every layer."""
        ranges, size = [], self.dtype.itemsize
        for r in residents:
            projs = [p for p in GEMM_GROUPS[group] if p in r.targets]
            if projs:
                lo = r.offsets[projs[0]][0]
                hi = r.offsets[projs[-1]][1] + r.rank * self.projections[projs[-1]][1]
                ranges.append(((r.start * self.page_elems + lo) * size, (hi - lo) * size))
        return ranges


class StepLora:
    """One forward step's LoRA: the mapping (built once) applied to every projection of every layer."""

    def __init__(self, lora: LoraPool, mapping: LoraMapping, targeted: frozenset[str],
                 residents: list[Resident]) -> None:
        self.lora, self.mapping, self.targeted = lora, mapping, targeted
        self.residents = residents  # the step's adapters, in the order its segments read them
        # proj -> the native call every later layer repeats (kernels.cpu.NativeLoraCall), or None: the checked path
        self._calls: dict[str, NativeLoraCall | None] = {}
        # GEMM group -> its term fused into the GEMM (kernels.FusedLoraGroup), or None: GEMM, then `add` per projection
        self._fused: dict[str, FusedLoraGroup | None] = {}

    def fused(self, group: str) -> FusedLoraGroup | None:
        """The step's LoRA term of a GEMM group's projections (GEMM_GROUPS) for `kernels.gemm_lora`, built on the first
        layer's call and reused by every later layer; None where that call does not cover the step
        (kernels.FusedLoraGroup.build) or no adapter of the step targets the group."""
        if group not in self._fused:
            parts, col = [], 0
            for proj in GEMM_GROUPS[group]:
                if proj in self.targeted:
                    parts.append((col, self.lora.tables[proj]))
                col += self.lora.projections[proj][1]
            self._fused[group] = FusedLoraGroup.build(parts, self.mapping, self.lora.dtype, self.lora.scales)
        return self._fused[group]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """out += LoRA term of proj at layer. out: [T, d_out] (a column view is fine), x: [T, d_in].

        The step's first call of a projection goes through `kernels.add_lora` and its checks; on CPU, where that
        was one native call, the later layers' calls of the projection repeat it on their own x, out and weights
        (every layer's x and out of a projection have the same shapes and strides: the runner's own activations
        and GEMM outputs)."""
        if proj not in self.targeted:
            return
        lora = self.lora
        if proj not in self._calls:
            buffer, table = lora._buffers[layer], lora.tables[proj]
            add_lora(out, x, buffer, table, self.mapping, lora.scales)
            self._calls[proj] = repeatable_lora_call(out, x, buffer, table, self.mapping, lora.scales)
            return
        call = self._calls[proj]
        if call is None:
            add_lora(out, x, lora._buffers[layer], lora.tables[proj], self.mapping, lora.scales)
            return
        call(out, x, lora.buffer_ptrs[layer])
