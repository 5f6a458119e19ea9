"""The one arithmetic of the worker's memory: a budget split into base weights, an activation
workspace and ONE pool of pages that KV blocks and resident adapters share (S-LoRA's unified paging).

Read by the worker (inference_worker.memory_pool sizes itself with `split_budget`) and by the capacity
planner (adapters.capacity, `manage.py capacity`, the dashboard's capacity page), so the planner says
what the worker does. Pure Python: no torch, no Django.

    page                = one KV block of every layer:  layers x 2 (K, V) x kv_heads x head_dim x block_size
    pool pages          = floor((budget - weights - workspace) / page bytes)
    KV blocks of a seq  = ceil((prompt + max_tokens) / block_size)         one page each
    adapter pages       = ceil(rank x sum over its targets of (in + out) / page elements per layer)
                          (each matrix rounded up to ALIGN elements; a 16-bit adapter pool beside fp32
                          pages fits two adapter elements in each page element: half the pages)

An adapter's pages are one contiguous run; inside it, per layer, each targeted projection's A [r, in]
then B^T [r, out], in TARGET_MODULES order. So an adapter costs its real rank and its real targets, up
to less than one page of rounding: nothing is padded to the base's max rank or to all seven projections.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .lora_layout import TARGET_MODULES, ModelShape, expand_targets

GIB = 1 << 30
ALIGN = 16  # elements: every adapter matrix starts on a multiple of this (64 B in fp32), for vector loads


# A CPU worker in fp32 runs its GEMMs on oneDNN with weights packed once, for models at least this wide
# (inference_worker.model: narrower ones ran faster on F.linear). A tied LM head is the embedding table, which the
# token lookup reads row by row: packing it takes a second copy, paid from the budget like the weights.
PACK_MIN_HIDDEN = 512


def packed_head_copy_bytes(*, vocab_size: int, hidden_size: int, tied: bool, device: str, dtype_bytes: int) -> int:
    """The bytes of that copy as a worker makes it by default (ModelRunner's pack_tied_head): vocab x hidden on a
    CPU in fp32 for a tied model from PACK_MIN_HIDDEN on, else 0."""
    if device != "cpu" or dtype_bytes != 4 or not tied or hidden_size < PACK_MIN_HIDDEN:
        return 0
    return int(vocab_size) * int(hidden_size) * dtype_bytes


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks (= pages) that hold `tokens` positions."""
    return -(-int(tokens) // int(block_size))


def page_elements(shape: ModelShape, block_size: int) -> int:
    """Elements of one page *per layer*: one layer's K and V of one block."""
    return 2 * shape.num_kv_heads * shape.head_dim * block_size


def page_bytes(shape: ModelShape, block_size: int, dtype_bytes: int) -> int:
    return shape.num_layers * page_elements(shape, block_size) * dtype_bytes


def adapter_elements_per_layer(shape: ModelShape, rank: int, targets) -> int:
    """Elements of one layer's matrices; a fused target (qkv_proj, gate_up_proj) counts as its parts, as the worker
    stores it (protocol.lora_layout.FUSED_MODULES)."""
    proj = shape.projections()
    targets = expand_targets(targets)
    unknown = set(targets) - set(proj)
    if unknown:
        raise ValueError(f"unknown target modules {sorted(unknown)}; known: {list(TARGET_MODULES)}")
    return sum(_aligned(int(rank) * proj[t][0]) + _aligned(int(rank) * proj[t][1]) for t in set(targets))


def adapter_layout(shape: ModelShape, rank: int, targets) -> dict[str, tuple[int, int]]:
    """Offsets (elements, from the start of the adapter's run in one layer) of each target's A [r, in]
    and B^T [r, out], in TARGET_MODULES order (a fused target as its parts). The worker places matrices exactly
    here."""
    proj, out, o = shape.projections(), {}, 0
    targets = expand_targets(targets)
    for t in TARGET_MODULES:
        if t in targets:
            d_in, d_out = proj[t]
            a = o
            o += _aligned(int(rank) * d_in)
            out[t] = (a, o)
            o += _aligned(int(rank) * d_out)
    return out


def adapter_pages(shape: ModelShape, rank: int, targets, block_size: int, packing: int = 1) -> int:
    """Pages of one adapter of `rank` on `targets` (the worker allocates exactly this many). `packing`: adapter
    elements per pool element, 2 for a 16-bit adapter pool beside fp32 KV pages (half the pages)."""
    return -(-adapter_elements_per_layer(shape, rank, targets) // (page_elements(shape, block_size) * int(packing)))


# The CPU runner's copies of a step's small-op outputs, one a layer where they fit (kernels.cpu_native.StepArena): at
# most this many bytes (step_arena_bytes: what a model's steps take of it).
STEP_ARENA_BYTES = 32 << 20


def step_arena_bytes(shape: ModelShape, max_batch_tokens: int) -> int:
    """What the CPU runner's StepArena holds beyond the one copy of a step's small-op outputs that workspace_bytes
    counts anyway: it keeps a copy a layer of them (two norms [T, h], q and k rotated [T, q + kv], SwiGLU's [T, I],
    attention's [T, q]; fp32) within STEP_ARENA_BYTES, or one copy of the largest step where even that is more."""
    s = shape
    per_copy = 4 * int(max_batch_tokens) * (2 * s.hidden_size + 2 * s.q_dim + s.kv_dim + s.intermediate_size)
    return max(per_copy, min(STEP_ARENA_BYTES, s.num_layers * per_copy)) - per_copy


def workspace_bytes(shape: ModelShape, *, vocab_size: int, max_batch_tokens: int, max_running: int,
                    max_context: int, max_lora_rank: int, dtype_bytes: int, chunked_decode: bool = False) -> int:
    """The activation workspace of the largest step the engine runs, by arithmetic (the CPU figure; on
    CUDA the worker measures one forward pass at that size and takes the larger).

    Live at once in a step of T tokens: the residual stream and its norm [T, h] x2, fused q/k/v and its
    rotated copy [T, q + 2kv] x2, attention output [T, q], fused gate/up and the SiLU product [T, 3 I],
    the LoRA shrink scratch (fp32 [T, r_max]), the logits of the sampled rows (fp32 [running, vocab])
    and the decode batch's gathered K and V (2 x kv_dim x running x context; the CPU runner gathers in
    ~2 MiB chunks, `chunked_decode`, so there it is 4 MiB), plus the RoPE tables (2 x context x head_dim); on
    CPU (`chunked_decode`) also the small ops' per-layer copies (step_arena_bytes)."""
    s, T = shape, int(max_batch_tokens)
    act = T * (2 * s.hidden_size + 2 * (s.q_dim + 2 * s.kv_dim) + s.q_dim + 3 * s.intermediate_size)
    act += 2 * int(max_context) * s.head_dim
    if chunked_decode:
        return (act * dtype_bytes + (4 << 20) + step_arena_bytes(s, T)
                + 4 * (T * max_lora_rank + int(max_running) * vocab_size))
    gather = 2 * s.kv_dim * int(max_running) * int(max_context)
    return (act + gather) * dtype_bytes + 4 * (T * max_lora_rank + int(max_running) * vocab_size)


@dataclass(frozen=True)
class PoolSplit:
    """How a memory budget divides. weights + workspace + pages x page_bytes + unused == budget,
    with unused < page_bytes."""

    budget_bytes: int
    weights_bytes: int
    workspace_bytes: int
    page_bytes: int
    num_pages: int
    block_size: int

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def unused_bytes(self) -> int:
        return self.budget_bytes - self.weights_bytes - self.workspace_bytes - self.pool_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "pool_bytes": self.pool_bytes, "unused_bytes": self.unused_bytes}


class BudgetTooSmall(ValueError):
    """The budget does not hold the base, the workspace and one page."""


def split_budget(*, budget_bytes: int, weights_bytes: int, workspace_bytes: int, shape: ModelShape,
                 block_size: int, dtype_bytes: int) -> PoolSplit:
    pb = page_bytes(shape, block_size, dtype_bytes)
    left = int(budget_bytes) - int(weights_bytes) - int(workspace_bytes)
    if left < pb:
        raise BudgetTooSmall(
            f"a budget of {budget_bytes / GIB:.2f} GiB leaves {left / GIB:.2f} GiB after the base weights "
            f"({weights_bytes / GIB:.2f} GiB) and the activation workspace ({workspace_bytes / GIB:.2f} GiB): "
            f"not one {pb / 2**20:.2f} MiB page for KV cache or adapters")
    return PoolSplit(budget_bytes=int(budget_bytes), weights_bytes=int(weights_bytes),
                     workspace_bytes=int(workspace_bytes), page_bytes=pb, num_pages=left // pb,
                     block_size=int(block_size))


@dataclass(frozen=True)
class FleetEntry:
    """`count` adapters of `rank` on `targets`."""

    rank: int
    targets: tuple[str, ...]
    count: int


@dataclass(frozen=True)
class FleetPlan:
    """What a pool does with a fleet mix resident: pages per kind, pages left for KV, sequences."""

    pages_per_adapter: tuple[int, ...]  # per FleetEntry
    adapter_pages: int  # all resident together
    kv_pages: int  # pool pages left for KV blocks (negative: the fleet does not fit)
    context_len: int
    blocks_per_sequence: int
    concurrent_sequences: int  # of context_len tokens, with the whole fleet resident

    def to_dict(self) -> dict:
        return asdict(self)


def plan_fleet(split: PoolSplit, shape: ModelShape, fleet: list[FleetEntry], *, context_len: int,
               packing: int = 1) -> FleetPlan:
    """`packing`: adapter elements per pool element (2: a 16-bit adapter pool beside fp32 pages)."""
    per = tuple(adapter_pages(shape, e.rank, e.targets, split.block_size, packing) for e in fleet)
    used = sum(p * e.count for p, e in zip(per, fleet, strict=True))
    kv = split.num_pages - used
    per_seq = blocks_for(context_len, split.block_size)
    return FleetPlan(pages_per_adapter=per, adapter_pages=used, kv_pages=kv, context_len=int(context_len),
                     blocks_per_sequence=per_seq, concurrent_sequences=max(kv, 0) // per_seq)
