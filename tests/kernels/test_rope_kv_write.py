"""RoPE and the KV write in one native pass (kernels/csrc/sgmv_cpu.c, `rope_kv_write`): the Hugging Face
rotate-half rotation of every query and key head, and the rotated keys and the values stored at each token's
row of the paged cache, for decode batches and prefill chunks (big enough to run on the OpenMP team too), with
grouped-query heads and projection outputs wider than q, k and v (a row stride past them); a row outside the
pages writes nothing."""
import pytest
import torch

from kernels import cpu_native, rope_kv_write


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("T,H,KV,hd,bs,extra", [(64, 9, 3, 64, 16, 0), (1, 4, 4, 16, 8, 0), (512, 16, 4, 64, 16, 24),
                                                (700, 8, 2, 128, 32, 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_it_rotates_like_transformers_and_stores_keys_and_values_at_their_rows(T, H, KV, hd, bs, extra, threads):
    assert cpu_native.load() is not None, "the native CPU kernels did not build (is gcc installed?)"
    gen = torch.Generator().manual_seed(T + H + hd)
    P = T // bs + 40
    qkv = torch.randn(T, (H + 2 * KV) * hd + extra, generator=gen)
    angles = torch.rand(T, hd // 2, generator=gen) * 20
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    sin_signed = torch.cat((-angles.sin(), angles.sin()), -1)
    rows = torch.randperm(P * bs, generator=gen)[:T]  # any pages, any offsets
    pages = torch.randn(P, 2 * KV, bs * hd, generator=gen)
    before = pages.clone()

    qk = rope_kv_write(qkv, cos.unsqueeze(1), sin_signed.unsqueeze(1), pages, rows, heads=H, kv_heads=KV,
                       block_size=bs, threads=threads)

    x = qkv[:, :(H + KV) * hd].view(T, H + KV, hd)
    want = x * cos[:, None] + _rotate_half(x) * sin[:, None]  # transformers' apply_rotary_pos_emb
    torch.testing.assert_close(qk, want, rtol=1e-5, atol=1e-5)
    v = qkv[:, (H + KV) * hd:(H + 2 * KV) * hd].view(T, KV, hd)
    expect = before.view(P, 2, KV, bs, hd).clone()
    expect[rows // bs, 0, :, rows % bs] = want[:, H:]
    expect[rows // bs, 1, :, rows % bs] = v
    torch.testing.assert_close(pages.view(P, 2, KV, bs, hd), expect, rtol=1e-5, atol=1e-5)


def test_a_row_outside_the_pages_is_refused_and_nothing_is_written():
    pages = torch.zeros(4, 2, 8 * 16)
    qkv = torch.ones(3, 3 * 16)
    cs = torch.ones(3, 16)
    with pytest.raises(IndexError, match="outside the layer's 4 pages"):
        rope_kv_write(qkv, cs, cs, pages, torch.tensor([0, 5, 4 * 8]), heads=1, kv_heads=1, block_size=8, threads=1)
    assert not pages.any()


def test_what_it_does_not_cover_is_left_to_torch():
    pages, rows, cs = torch.zeros(4, 2, 8 * 16), torch.tensor([0]), torch.ones(1, 16)
    for qkv, pg in ((torch.ones(1, 48, dtype=torch.float64), pages), (torch.ones(48, 2).t()[:1], pages),
                    (torch.ones(1, 32), pages), (torch.ones(1, 48), torch.zeros(4, 2, 4 * 16))):
        assert rope_kv_write(qkv, cs, cs, pg, rows, heads=1, kv_heads=1, block_size=8, threads=1) is None
