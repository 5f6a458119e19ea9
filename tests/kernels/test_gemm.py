"""The native fp32 GEMM on packed weights (kernels/csrc/gemm_f32.h, `gemm_pack` / `gemm`): x @ W^T (+ bias)
(+ out, the residual) against a float64 reference, at decode batches, prefill chunks and the row counts between
(every row-block tail), output widths that end mid-panel and mid-vector (AVX2: mid-strip, in either ymm), rows of
wider buffers, one and two threads, and more rows than one pass over the weights takes.
(tests/engine/test_model_parity.py: the runner on it against transformers and PEFT.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_native, gemm, gemm_available, gemm_pack

pytestmark = pytest.mark.skipif(not gemm_available(), reason="the native GEMM needs AVX-512 or AVX2 + FMA (and gcc)")


def reference(x, w, bias=None, out=None):
    y = x.double() @ w.double().T
    if bias is not None:
        y += bias.double()
    if out is not None:
        y += out.double()
    return y


def close(got, want, k):
    """fp32 sums of k products of unit-scale terms: within a few ulps of sqrt(k)-sized partial sums."""
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert err <= 2e-6 * k ** 0.5 * max(1.0, want.abs().max().item() if want.numel() else 1.0), err


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 8, 9, 12, 13, 14, 15, 17, 64, 65, 512])  # blocks of 7 (AVX-512), 6 (AVX2)
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_block_tail_matches_the_reference(m, threads):
    g = torch.Generator().manual_seed(m)
    k, n = 96, 112  # two panels: AVX-512 64 + 48 (3 vectors), AVX2 48 + 64 left -> 48 + 16
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    got = gemm(x, gemm_pack(w), n, threads=threads)
    assert got.shape == (m, n) and got.is_contiguous()
    close(got, reference(x, w), k)


@pytest.mark.parametrize(("m", "n"), [(111, 576), (112, 576), (113, 960), (512, 576), (577, 960), (576, 200),
                                       (64, 576), (64, 960), (13, 160), (60, 528)])
@pytest.mark.parametrize("threads", [2, 3])
def test_rows_split_over_threads_where_the_panels_do_not_share_out(m, n, threads):
    """Prefill-sized and decode-sized row counts against widths of an odd number of panels (AVX-512: 9 and 15 of 64
    columns; AVX2 13 of 48 for 576 on 3 threads, 11 for 528), where each thread takes a run of whole panels and its
    rows of the panel the runs share (gemm_mixed_unit); a residual and a bias on top. The same bits as one thread's
    panel by panel."""
    g = torch.Generator().manual_seed(m * n + threads)
    k = 80
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    residual = torch.randn(m, n, generator=g)
    packed = gemm_pack(w)
    got = gemm(x, packed, n, bias, residual.clone(), threads=threads)
    close(got, reference(x, w, bias, residual), k)
    assert torch.equal(got, gemm(x, packed, n, bias, residual.clone(), threads=1))


@pytest.mark.parametrize("n", [1, 5, 12, 16, 33, 40, 47, 48, 49, 63, 64, 65, 95, 100, 127, 128, 960, 3072])
def test_output_widths_ending_mid_panel_and_mid_vector(n):
    g = torch.Generator().manual_seed(n)
    k = 576
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(64, k, generator=g), torch.randn(n, generator=g)
    packed = gemm_pack(w)
    assert packed.numel() == (n + 15) // 16 * 16 * k  # zero-padded to whole vectors, nothing more
    close(gemm(x, packed, n, bias, threads=2), reference(x, w, bias), k)


@pytest.mark.parametrize("k", [1, 3, 64, 1536, 2049, 2816])  # AVX2 takes K > 1024 in 2 or 3 chunks
def test_the_residual_add_and_bias_go_into_out_in_place(k):
    """Once each: the bias and the residual, also where K is summed in chunks (bias in the first, out accumulating)."""
    g = torch.Generator().manual_seed(k)
    m, n = 20, 200
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    residual = torch.randn(m, n, generator=g)
    out = residual.clone()
    got = gemm(x, gemm_pack(w), n, bias, out, threads=2)
    assert got.data_ptr() == out.data_ptr()
    close(got, reference(x, w, bias, residual), k)


def test_rows_of_wider_buffers_and_more_rows_than_one_pass():
    """x a column slice of a wider activation (rows ldx apart), out the rows of a wider buffer, and 1100 rows:
    the weights are streamed once per 1024 rows."""
    g = torch.Generator().manual_seed(7)
    m, k, n = 1100, 80, 130
    wide_x = torch.randn(m, k + 24, generator=g)
    x = wide_x[:, 8:8 + k]
    w = torch.randn(n, k, generator=g)
    wide_out = torch.randn(m, n + 10, generator=g)
    before = wide_out.clone()
    out = wide_out[:, :n]
    gemm(x, gemm_pack(w), n, out=out, threads=2)
    close(out, reference(x, w, out=before[:, :n]), k)
    assert torch.equal(wide_out[:, n:], before[:, n:])  # nothing written beyond the n columns


def test_agrees_with_torch_at_the_models_shapes():
    """SmolLM2's fused gate/up at the decode batch: within fp32 rounding of torch's own GEMM."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(3072, 576, generator=g) / 24, torch.randn(64, 576, generator=g)
    torch.testing.assert_close(gemm(x, gemm_pack(w), 3072, threads=2), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_no_rows_and_what_it_does_not_take():
    w = torch.randn(48, 16)
    packed = gemm_pack(w)
    assert gemm(torch.empty(0, 16), packed, 48, threads=2).shape == (0, 48)
    bias = torch.randn(40)  # K = 0: an empty sum, so each row is the bias (not whatever the new tensor held)
    assert torch.equal(gemm(torch.empty(3, 0), gemm_pack(torch.empty(40, 0)), 40, bias, threads=2), bias.expand(3, 40))
    assert gemm_pack(w.double()) is None
    assert gemm_pack(torch.randn(16, 48).t()) is None  # rows not contiguous
    with pytest.raises(ValueError, match="does not fit"):
        gemm(torch.randn(4, 17), packed, 48, threads=1)  # K differs from the packed weight's
    with pytest.raises(ValueError, match="contiguous rows"):
        gemm(torch.randn(4, 16), packed, 48, torch.zeros(48), torch.zeros(48, 4).t(), threads=1)
    assert cpu_native.load() is not None


@pytest.mark.parametrize("n", [200, 576])
@pytest.mark.parametrize("m", [1, 64, 560, 1100])
def test_prefetching_a_side_stream_leaves_every_result_bit_for_bit(m, n):
    """The side stream (kernels.GemmSide: the step's adapter matrices, fetched while the GEMM multiplies) is only
    prefetched: the results are the same bits with and without it, and the memory it names is left as it was,
    whether its lines are fewer than the GEMM's k steps, many times more, split over ranges of a line or less, or
    over more rows than one pass over the weights takes; with panels that share out over two threads and with 9
    (AVX-512) that do not, where a GEMM with a side stream splits its rows (gemm_row_unit)."""
    from kernels import GemmSide

    g = torch.Generator().manual_seed(m + n)
    k = 1100  # AVX2: K in two chunks
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    residual = torch.randn(m, n, generator=g)
    packed = gemm_pack(w)
    plain = gemm(x, packed, n, bias, residual.clone(), threads=2)
    side_buffer = torch.randn(4 << 20, generator=g)  # 16 MB
    before = side_buffer.clone()
    for ranges in ([(0, side_buffer.numel() * 4)], [(64 * i, 1 + i % 80) for i in range(0, 20000, 7)],
                   [(0, 0), (128, 64), (1 << 20, 3 << 20)]):
        side = GemmSide(ranges)
        for threads in (1, 2):
            got = gemm(x, packed, n, bias, residual.clone(), threads=threads, side=side.at(side_buffer.data_ptr()))
            assert torch.equal(got, plain)
    assert torch.equal(side_buffer, before)


_ROW_BLOCK_PROBE = """
import hashlib, torch
from kernels import gemm, gemm_pack
torch.manual_seed(0)
for m, n, k in ((1, 64, 96), (13, 160, 80), (64, 576, 96), (65, 960, 80), (577, 200, 64)):
    w, x, bias, out = torch.randn(n, k), torch.randn(m, k), torch.randn(n), torch.randn(m, n)
    for threads in (1, 2):
        got = gemm(x, gemm_pack(w), n, bias, out.clone(), threads=threads)
        print(m, n, threads, hashlib.sha256(got.numpy().tobytes()).hexdigest())
"""


_AVX512 = any("avx512f" in ln.split() for ln in cpu_native._cpuinfo_first("flags"))


@pytest.mark.skipif(not _AVX512, reason="the AVX-512 build picks its register block's rows")
def test_the_register_blocks_row_count_changes_no_bit():
    """The AVX-512 build takes 7 rows a register block, 6 on Zen 5 (gemm_mr_init), LORAFLEET_GEMM_MR to override:
    a row's sums are the same whichever block it falls in, so the same request gives the same bits on either CPU."""
    def probe(rows: str) -> str:
        env = {**os.environ, "LORAFLEET_GEMM_MR": rows}
        return subprocess.run([sys.executable, "-c", _ROW_BLOCK_PROBE], env=env, capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parents[2]).stdout

    seven = probe("7")
    assert len(seven.splitlines()) == 10
    assert probe("6") == seven
    assert probe("5") == seven
