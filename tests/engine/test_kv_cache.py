"""The paged KV cache: block accounting, one pool shared by sequences of any length, and exhaustion."""
import os

import pytest
import torch

from inference_worker.kv_cache import BlockAllocator, OutOfBlocks, blocks_needed
from inference_worker.memory_pool import PagePool
from inference_worker.model import ModelRunner, SeqStep

PROMPT = [17, 120, 45, 301, 9, 77, 250, 13, 88, 402, 5, 66, 140, 233]


def allocator(num_pages: int) -> BlockAllocator:
    return BlockAllocator(PagePool(num_layers=1, num_pages=num_pages, page_elems=16, dtype=torch.float32,
                                   device="cpu"))


def test_allocator_hands_out_distinct_blocks_and_takes_them_back():
    alloc = allocator(10)
    a, b = alloc.allocate(3), alloc.allocate(4)
    assert len(set(a) | set(b)) == 7 and all(0 <= x < 10 for x in a + b)
    assert (alloc.num_free, alloc.num_used) == (3, 7)
    alloc.free(a)
    assert alloc.num_free == 6
    c = alloc.allocate(6)
    assert set(c) >= set(a) and not set(c) & set(b)
    assert alloc.num_free == 0


def test_allocator_refuses_more_than_is_free_without_allocating_anything():
    alloc = allocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert alloc.allocate(1)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)


def test_double_free_and_foreign_blocks_are_refused():
    alloc = allocator(4)
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(ValueError):
        alloc.free(blocks)
    with pytest.raises(ValueError):
        alloc.free([99])
    assert alloc.num_free == 4


def test_blocks_needed_rounds_up():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_sequences_of_different_lengths_share_one_pool_with_interleaved_and_reused_blocks(tiny_llama):
    runner = ModelRunner(tiny_llama, pool_pages=14, block_size=4, enable_lora=False)
    alloc = runner.kv.allocator
    prompts = [PROMPT, PROMPT[:3], (PROMPT * 2)[:25]]

    def run_alone(prompt: list[int]) -> list[torch.Tensor]:
        blocks = alloc.allocate(blocks_needed(len(prompt) + 2, 4))
        out = [runner.forward([SeqStep(blocks, 0, prompt, -1)])[0]]
        out.append(runner.forward([SeqStep(blocks, len(prompt), [7], -1)])[0])
        out.append(runner.forward([SeqStep(blocks, len(prompt) + 1, [8], -1)])[0])
        alloc.free(blocks)
        return out

    expected = [run_alone(p) for p in prompts]
    assert alloc.num_free == 14

    # Interleaved block ids: the three sequences' blocks alternate through the pool, and the pool is
    # full of the previous runs' stale keys, which must not leak into anyone's attention.
    needs = [blocks_needed(len(p) + 2, 4) for p in prompts]
    tables: list[list[int]] = [[], [], []]
    while any(len(t) < n for t, n in zip(tables, needs, strict=True)):
        for t, n in zip(tables, needs, strict=True):
            if len(t) < n:
                t.extend(alloc.allocate(1))
    assert alloc.num_free == 14 - sum(needs) == 1
    logits = runner.forward([SeqStep(t, 0, p, -1) for t, p in zip(tables, prompts, strict=True)])
    for i in range(3):
        torch.testing.assert_close(logits[i], expected[i][0], atol=1e-4, rtol=0)
    for k, tok in enumerate((7, 8), start=1):
        logits = runner.forward([SeqStep(t, len(p) + k - 1, [tok], -1) for t, p in zip(tables, prompts, strict=True)])
        for i in range(3):
            torch.testing.assert_close(logits[i], expected[i][k], atol=1e-4, rtol=0)


def test_a_step_beyond_its_block_table_or_the_context_is_refused(tiny_llama):
    runner = ModelRunner(tiny_llama, pool_pages=8, block_size=4, enable_lora=False)
    blocks = runner.kv.allocator.allocate(2)  # room for 8 positions
    with pytest.raises(ValueError, match="block table"):
        runner.forward([SeqStep(blocks, 0, PROMPT[:9], -1)])
    with pytest.raises(ValueError, match="max_position"):
        runner.forward([SeqStep(blocks, runner.config.max_position_embeddings, [1], -1)])
    with pytest.raises(OutOfBlocks):
        runner.kv.allocator.allocate(7)


def test_whole_block_gather_equals_the_row_gather_of_the_same_positions():
    from inference_worker.kv_cache import PagedKVCache

    pool = PagePool(num_layers=1, num_pages=12, page_elems=2 * 2 * 4 * 3, dtype=torch.float32, device="cpu")
    kv = PagedKVCache(pool, block_size=4, num_kv_heads=2, head_dim=3)
    pool.data.copy_(torch.randn_like(pool.data))
    tables = torch.tensor([[7, 2, 9], [0, 11, 4]])
    k_b, v_b = kv.gather_blocks(0, tables)  # [2, 2, 12, 3]
    rows = torch.tensor([[int(t) * 4 + o for t in table for o in range(4)] for table in tables])
    k_r, v_r = kv.gather(0, rows)
    assert k_b.shape == (2, 2, 12, 3)
    assert torch.equal(k_b, k_r) and torch.equal(v_b, v_r)


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where there is none."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, in kB."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the pool")


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="the kernel has transparent huge pages off")
def test_the_cpu_pool_is_backed_by_huge_pages():
    """Every decode step streams the resident adapters and the KV pages once, more than the caches hold: on 4 KB
    pages that read is bound by the TLB (645 MB read at 38.5 GB/s against 67.8 on 2 MB pages, this project's
    2-CPU VM). The pool asks for huge pages, which a shared anonymous mapping (shmem) would not get."""
    pool = PagePool(num_layers=2, num_pages=256, page_elems=32 * 1024, dtype=torch.float32, device="cpu")  # 64 MB
    assert pool.huge_pages
    pool.data.fill_(1.0)  # every page touched: the kernel backs them now
    assert _anon_huge_kb(pool.data.data_ptr()) >= 16 * 1024  # at least a quarter on 2 MB pages


def test_a_forked_child_writing_the_pool_leaves_the_parents_pages_alone():
    """The pool is a private mapping: a worker process forked after the pool exists (a prefork pool's child) gets
    a copy on write, never a view of the parent's KV blocks and adapters."""
    pool = PagePool(num_layers=1, num_pages=8, page_elems=1024, dtype=torch.float32, device="cpu")
    pool.data.fill_(2.0)
    pid = os.fork()
    if pid == 0:  # the child: scribble on every page, then leave at once
        pool.data.fill_(-1.0)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert bool((pool.data == 2.0).all())
