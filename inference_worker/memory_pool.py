"""One pool of device memory for KV blocks and resident adapter weights (S-LoRA's unified paging).

`data` is one tensor [layers, pages, page_elems]: page p of layer l is one KV block of that layer
(K and V: [2, kv_heads, block_size, head_dim]) or a slice of an adapter's matrices for that layer. A
page id is allocated across every layer at once, so one id is one KV block of the whole model, and an
adapter's run of pages holds its weights for every layer at the same offsets (so one offset table per
projection serves all layers; see lora.py).

Allocation:
- KV blocks are single pages, taken lowest id first, and reference-counted: the n sequences of one request
  (`n > 1`) share the full blocks of their prompt, which is computed once (`share_blocks`); a page goes back
  to the free list when its last holder frees it;
- an adapter is one contiguous run of pages, taken from the highest free run that fits (best placed
  away from the KV end, so KV churn fragments adapter space as little as possible).
Nothing here decides *who* gets pages: the engine (admission) and the adapter cache (residency) do.

Prefix cache (inference_worker/prefix_cache.py computes the keys): a full KV block may carry a key, the hash of
everything its KV depends on. A keyed page whose last holder frees it stays keyed: it is free (it counts in
`num_free`, and anything may take it) but remembers its contents until then, so a later request with the same
key takes it back instead of recomputing it. New KV blocks are taken from unkeyed free pages first and then
from keyed ones, least recently freed first: cached blocks are evicted (LRU) only when nothing else is free,
and always before anything running is preempted. An adapter extent laid over keyed pages drops their keys.

CPU memory comes from a private anonymous mapping: zero-filled by the kernel and committed only where pages
are touched, so a large `--memory-gb` costs what the workload uses (in 2 MB steps: see `_huge_pages`).
Pages are zero when first handed out; a page an adapter gave back holds finite weights, which is all the KV
gather needs (padded rows it reads are masked, and must only never be NaN).
"""
from __future__ import annotations

import mmap
import warnings
from collections import OrderedDict

import numpy as np
import torch


def _huge_pages(region: mmap.mmap) -> bool:
    """Ask the kernel to back the pool with transparent huge pages (2 MB) where it is configured to on request
    (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, the common default, or always).

    Every decode step streams the resident adapters' weights and every sequence's KV pages once, far more than
    the caches hold, so the pool is read at DRAM speed, and with 4 KB pages the read is bound by the TLB: on
    this project's 2-CPU machine (a VM: each miss is a nested page walk) a plain read of 645 MB, SmolLM2's
    fleet step, ran at 38.5 GB/s on 4 KB pages and 67.8 GB/s on 2 MB pages. The mapping must be private for
    this: a shared anonymous mapping is shmem, whose huge pages are off by default (`shmem_enabled` = never).
    Returns whether the advice was taken (False where the platform has no madvise or THP is off)."""
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):  # not Linux, or a kernel built without THP
        return False
    return True


Key = bytes  # a prefix-cache key (prefix_cache.py); named here because PagePool has a `bytes` property


class OutOfPages(RuntimeError):
    """An allocation asked for more pages than are free (nothing was allocated)."""


class PagePool:
    """The pool's tensor and its page allocator. Not thread-safe: the engine thread owns it."""

    def __init__(self, *, num_layers: int, num_pages: int, page_elems: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if num_pages <= 0:
            raise ValueError("the pool needs at least one page")
        self.num_layers, self.num_pages, self.page_elems = num_layers, num_pages, page_elems
        self.dtype, self.device = dtype, torch.device(device)
        numel = num_layers * num_pages * page_elems
        if self.device.type == "cpu":
            self._map = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.huge_pages = _huge_pages(self._map)  # before the first touch: pages are chosen on fault
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(self._map, dtype=dtype, count=numel)
        else:
            flat = torch.zeros(numel, dtype=dtype, device=self.device)
            self.huge_pages = False
        self.data = flat.view(num_layers, num_pages, page_elems)  # [L, P, E]
        self._free = np.ones(num_pages, dtype=bool)
        self._refs = np.zeros(num_pages, dtype=np.int32)  # holders of each KV page (0 = not a KV page)
        self._keyed = np.zeros(num_pages, dtype=bool)  # pages whose contents a prefix-cache key names
        self._key_of: dict[int, Key] = {}
        self._page_of: dict[Key, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # free keyed pages, least recently freed first
        self.cache_evictions = 0  # keyed pages whose contents were overwritten (taken for something else)
        self.kv_pages = 0
        self.adapter_pages = 0

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.page_elems * self.dtype.itemsize

    @property
    def bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def num_free(self) -> int:
        return self.num_pages - self.kv_pages - self.adapter_pages

    def layer_buffer(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s pages as one flat contiguous buffer [P * E] (what the LoRA kernels address)."""
        return self.data[layer].view(-1)

    # ---- KV blocks --------------------------------------------------------------------------------

    def allocate_blocks(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} KV blocks, {self.num_free} of {self.num_pages} pages free")
        ids = np.flatnonzero(self._free & ~self._keyed)[:n]
        if len(ids) < n:  # evict cached blocks, least recently freed first
            more = [self._lru.popitem(last=False)[0] for _ in range(n - len(ids))]
            self._unkey(more)
            self.cache_evictions += len(more)
            ids = np.concatenate((ids, np.asarray(more, dtype=np.int64)))
        self._free[ids] = False
        self._refs[ids] = 1
        self.kv_pages += n
        return ids.tolist()

    # ---- prefix cache ----------------------------------------------------------------------------

    def key_block(self, block: int, key: Key) -> bool:
        """Name an allocated, full KV block's contents by `key`. False (nothing changes) when the block already
        has a key or another page holds this key (two requests computed the same block at once)."""
        if self._refs[block] <= 0:
            raise ValueError(f"KV block {block} is not allocated")
        if self._keyed[block] or key in self._page_of:
            return False
        self._keyed[block] = True
        self._key_of[block], self._page_of[key] = key, block
        return True

    def cached_block(self, key: Key) -> int | None:
        """The page whose contents `key` names, allocated or free, or None."""
        return self._page_of.get(key)

    def take_cached(self, block: int) -> None:
        """One more holder of a keyed page: a free one is taken back from the cache, contents intact."""
        if not self._keyed[block]:
            raise ValueError(f"page {block} holds no cached block")
        if self._refs[block] == 0:
            del self._lru[block]
            self._free[block] = False
            self.kv_pages += 1
        self._refs[block] += 1

    def forget_blocks(self, blocks: list[int]) -> None:
        """Drop the keys of these allocated pages (their contents are about to change: a failed request's
        pages are zeroed)."""
        self._unkey([b for b in blocks if self._keyed[b] and self._refs[b] > 0])

    def block_key(self, block: int) -> Key | None:
        return self._key_of.get(block)

    @property
    def cached_free(self) -> int:
        """Free pages that still hold a cached block."""
        return len(self._lru)

    @property
    def cached_blocks(self) -> int:
        return len(self._key_of)

    def drop_cache(self) -> int:
        """Forget every cached block (the pages stay where they are); returns how many keys were dropped."""
        n = len(self._key_of)
        self._unkey(list(self._key_of))
        self._lru.clear()
        return n

    def _unkey(self, pages) -> None:
        for p in pages:
            key = self._key_of.pop(int(p), None)
            if key is not None:
                del self._page_of[key]
            self._keyed[p] = False

    def _check_kv(self, ids: np.ndarray, blocks) -> None:
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_pages or (self._refs[ids] <= 0).any()
                         or len(np.unique(ids)) != len(ids)):
            raise ValueError(f"KV blocks that are not allocated (double free?): {list(blocks)}")

    def share_blocks(self, blocks: list[int], holders: int = 1) -> None:
        """`holders` more holders of each of these allocated KV blocks (copy-on-write sharing: a shared
        block is only ever read; a holder that must write copies it into a block of its own)."""
        ids = np.asarray(blocks, dtype=np.int64)
        self._check_kv(ids, blocks)
        if holders < 0:
            raise ValueError("holders must be >= 0")
        self._refs[ids] += holders

    def block_refs(self, block: int) -> int:
        return int(self._refs[block])

    def free_blocks(self, blocks: list[int]) -> list[int]:
        """Drop one holder of each block; returns the blocks that became free (their last holder left)."""
        ids = np.asarray(blocks, dtype=np.int64)
        self._check_kv(ids, blocks)
        self._refs[ids] -= 1
        gone = ids[self._refs[ids] == 0]
        self._free[gone] = True
        self.kv_pages -= len(gone)
        for p in gone[self._keyed[gone]].tolist():  # cached: free, but remembered until the page is needed
            self._lru[p] = None
        return gone.tolist()

    # ---- adapter extents --------------------------------------------------------------------------

    def largest_free_run(self) -> int:
        runs = self._runs()
        return int(max((e - s for s, e in runs), default=0))

    def _runs(self) -> list[tuple[int, int]]:
        """Maximal runs of free pages as (start, end)."""
        padded = np.concatenate(([False], self._free, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))
        return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))

    def allocate_extent(self, n: int) -> int | None:
        """First page of a run of n free pages at the highest place that fits, or None."""
        if n <= 0:
            raise ValueError("an extent needs at least one page")
        if n > self.num_free:
            return None
        for s, e in reversed(self._runs()):
            if e - s >= n:
                start = e - n
                self._free[start:e] = False
                keyed = np.flatnonzero(self._keyed[start:e]) + start
                if len(keyed):  # cached blocks under the adapter are overwritten
                    for p in keyed.tolist():
                        del self._lru[p]
                    self._unkey(keyed.tolist())
                    self.cache_evictions += len(keyed)
                self.adapter_pages += n
                return start
        return None

    def free_extent(self, start: int, n: int) -> None:
        if self._free[start:start + n].any():
            raise ValueError(f"freeing pages {start}..{start + n - 1} that are not allocated")
        self._free[start:start + n] = True
        self.adapter_pages -= n


class BlockAllocator:
    """The KV side of the pool, with the interface the engine and tests use for KV blocks."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool

    @property
    def num_blocks(self) -> int:
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.kv_pages

    def allocate(self, n: int) -> list[int]:
        return self.pool.allocate_blocks(n)

    def free(self, blocks: list[int]) -> list[int]:
        """Drop one holder of each block; returns the blocks that became free."""
        return self.pool.free_blocks(blocks)

    def share(self, blocks: list[int], holders: int = 1) -> None:
        self.pool.share_blocks(blocks, holders)

    def refs(self, block: int) -> int:
        return self.pool.block_refs(block)

    # prefix cache (PagePool's docstring)
    def key(self, block: int, key: Key) -> bool:
        return self.pool.key_block(block, key)

    def cached(self, key: Key) -> int | None:
        return self.pool.cached_block(key)

    def take_cached(self, block: int) -> None:
        self.pool.take_cached(block)
