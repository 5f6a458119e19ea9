"""Decode attention read in place from the paged KV cache (kernels/csrc/sgmv_cpu.c, `paged_decode_attention`):
the same numbers as gathering each sequence's keys and values and running softmax attention over them, for
every shape the models here use — grouped-query heads, sliding windows, sequences ending mid-block, pages in
any order, Gemma 2's soft-capped scores — on one thread and on helper threads. The prompt-chunk kernel
(`paged_prefill_attention`) against the same reference, soft-capped or not."""
import math

import pytest
import torch

from kernels import cpu_native, paged_decode_attention, paged_prefill_attention


def _reference(q, pages, blocks, lens, kv_heads, window, scale, softcap=None):
    B, H, hd = q.shape
    g = H // kv_heads
    bs = pages.shape[2] // hd
    out = torch.empty(B, H * hd, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        start = max(0, n - window) if window else 0
        pos = torch.arange(start, n)
        pg = blocks[b, pos // bs]
        rows = pages.view(pages.shape[0], 2 * kv_heads, bs, hd)[pg, :, pos % bs].double()  # [n, 2 KV, hd]
        for h in range(H):
            k, v = rows[:, h // g], rows[:, kv_heads + h // g]
            scores = (k @ q[b, h].double()) * scale
            if softcap:  # transformers' Gemma 2: scores / cap, tanh, * cap, then the softmax
                scores = torch.tanh(scores / softcap) * softcap
            w = torch.softmax(scores, dim=0)
            out[b, h * hd:(h + 1) * hd] = w @ v
    return out


# head_dim 64 and 128 run on the vector path (AVX-512: query heads in register groups of at most 4 and 2, rows
# in groups of 16; AVX2 alone: one query head at a time, rows in groups of 4; blocks of 8 and 64 positions and
# windows that start mid-block too), other head sizes on the scalar loops; 16 KV heads of 5 x 128
# do not fit one unit's accumulators and take one unit per (sequence, KV head).
@pytest.mark.parametrize("kv_heads,g,hd,bs,window", [
    (4, 1, 32, 16, None), (2, 3, 64, 16, None), (3, 3, 64, 16, 40), (1, 8, 16, 8, 5), (2, 4, 128, 32, None),
    (2, 7, 64, 16, 21), (1, 1, 64, 8, None), (2, 4, 64, 64, 70), (1, 5, 128, 16, None), (16, 5, 128, 16, 33),
])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("softcap", [None, 50.0, 3.0])  # 3: most scores deep in tanh's saturation
def test_it_equals_softmax_attention_over_the_gathered_cache(kv_heads, g, hd, bs, window, threads, softcap):
    assert cpu_native.load() is not None, "the native CPU kernels did not build (is gcc installed?)"
    gen = torch.Generator().manual_seed(kv_heads * 100 + g * 10 + hd)
    B, P = 7, 200
    lens = torch.tensor([1, 5, bs, bs + 1, 3 * bs - 1, 77, 130], dtype=torch.int64)
    nb = -(-int(lens.max()) // bs)
    blocks = torch.randperm(P, generator=gen)[:B * nb].view(B, nb).contiguous()  # pages in any order
    pages = torch.randn(P, 2 * kv_heads, bs * hd, generator=gen) * 2
    # Rows a sequence must not attend (past its length, before its window) hold NaN: a kernel that read one
    # into a score or an accumulator would answer NaN.
    rows = pages.view(P, 2 * kv_heads, bs, hd)
    for b in range(B):
        n = int(lens[b])
        start = max(0, n - window) if window else 0
        for pos in [*range(start), *range(n, nb * bs)]:
            rows[blocks[b, pos // bs], :, pos % bs] = float("nan")
    q = torch.randn(B, kv_heads * g, hd, generator=gen) * 2
    scale = 1 / math.sqrt(hd)
    got = paged_decode_attention(q, pages, blocks, lens, kv_heads=kv_heads, window=window, scale=scale,
                                 threads=threads, softcap=softcap)
    assert got is not None and got.shape == (B, kv_heads * g * hd)
    want = _reference(q, pages, blocks, lens, kv_heads, window, scale, softcap)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_shapes_it_does_not_cover_are_left_to_the_gather_path():
    blocks, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    pages = torch.zeros(4, 2, 16 * 8)
    not_fp32 = torch.zeros(1, 1, 8, dtype=torch.float64), pages.double()
    heads_strided = torch.zeros(1, 8, 1).transpose(1, 2), pages  # [1, 1, 8] with head stride 1
    for q, pg in (not_fp32, heads_strided):
        assert paged_decode_attention(q, pg, blocks, lens, kv_heads=1, window=None, scale=1.0, threads=1) is None


@pytest.mark.parametrize("start,n,window,softcap", [
    (0, 37, None, 50.0), (0, 37, None, None), (45, 9, None, 20.0), (100, 64, 30, 50.0), (0, 130, 40, 5.0),
])
def test_a_prompt_chunk_equals_softmax_attention_over_its_positions(start, n, window, softcap):
    """A chunk of n queries at positions start..start+n-1 of one sequence: each the decode reference over the
    positions up to its own (causal, windowed), soft-capped or not; from the first position too (a soft-capped
    model reads every prompt chunk on the pages, Gemma 2)."""
    gen = torch.Generator().manual_seed(start + n)
    kv_heads, g, hd, bs, P = 2, 4, 64, 16, 40
    nb = -(-(start + n) // bs)
    table = torch.randperm(P, generator=gen)[:nb].contiguous()
    pages = torch.randn(P, 2 * kv_heads, bs * hd, generator=gen) * 2
    q = torch.randn(n, kv_heads * g, hd, generator=gen) * 2
    got = paged_prefill_attention(q, pages, table, start, kv_heads=kv_heads, window=window, scale=0.125, threads=2,
                                  softcap=softcap)
    assert got is not None and got.shape == (n, kv_heads * g * hd)
    lens = torch.arange(start + 1, start + n + 1, dtype=torch.int64)
    want = _reference(q, pages, table.expand(n, nb), lens, kv_heads, window, 0.125, softcap)
    # the kernel's tanh is 1 - 2 / (1 + exp(2y)): a few fp32 ulps of the cap in a score (1e-5 of 50)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=3e-5 if softcap else 1e-5)
