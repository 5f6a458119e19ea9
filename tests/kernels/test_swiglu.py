"""SwiGLU's gate in one native pass (kernels/csrc/sgmv_cpu.c, `swiglu`): torch's silu(gate) * up for the fused
gate/up GEMM's output — decode batches, prefill chunks big enough for the OpenMP team, rows of a wider buffer,
large and NaN inputs, and no rows at all. (tests/engine/test_native_attention.py: the runner's layers use it.) And
GeGLU's (`geglu_tanh`, Gemma's MLP): torch's gelu(gate, approximate="tanh") * up."""
import math

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_native, geglu_tanh, swiglu


@pytest.mark.parametrize("rows,n,extra", [(64, 1536, 0), (1, 128, 0), (576, 2816, 0), (33, 100, 24), (0, 64, 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_it_equals_torch_silu_times_up(rows, n, extra, threads):
    assert cpu_native.load() is not None, "the native CPU kernels did not build (is gcc installed?)"
    gen = torch.Generator().manual_seed(rows + n)
    gu = torch.randn(rows, 2 * n + extra, generator=gen) * 4  # extra: row stride wider than gate + up
    want = F.silu(gu[:, :n]) * gu[:, n:2 * n]
    got = swiglu(gu, n, threads=threads)
    assert got is not None and got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def test_extremes_are_torchs():
    """Gate values far beyond exp's range saturate as torch's do (silu(-100) = -0, silu(100) = 100); NaN stays NaN."""
    gate = torch.tensor([[-100.0, -30.0, 0.0, 30.0, 100.0, math.nan, 1e30, -1e30]])
    up = torch.full_like(gate, 2.0)
    got = swiglu(torch.cat([gate, up], dim=1), gate.shape[1], threads=1)
    want = F.silu(gate) * up
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_what_it_does_not_cover_is_left_to_torch():
    assert swiglu(torch.ones(2, 8, dtype=torch.float64), 4, threads=1) is None
    assert swiglu(torch.ones(8, 2).t(), 1, threads=1) is None  # columns not contiguous
    assert swiglu(torch.ones(2, 6), 4, threads=1) is None  # narrower than gate + up


@pytest.mark.parametrize("rows,n,extra", [(64, 1536, 0), (1, 128, 0), (576, 2816, 0), (33, 100, 24), (0, 64, 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_geglu_equals_torch_gelu_tanh_times_up(rows, n, extra, threads):
    gen = torch.Generator().manual_seed(rows + n + 1)
    gu = torch.randn(rows, 2 * n + extra, generator=gen) * 4
    want = F.gelu(gu[:, :n], approximate="tanh") * gu[:, n:2 * n]
    got = geglu_tanh(gu, n, threads=threads)
    assert got is not None and got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-6)  # gelu through one exp, not torch's tanh


def test_geglu_extremes_are_torchs():
    gate = torch.tensor([[-100.0, -30.0, -3.0, 0.0, 3.0, 30.0, 100.0]])
    up = torch.full_like(gate, 2.0)
    got = geglu_tanh(torch.cat([gate, up], dim=1), gate.shape[1], threads=1)
    torch.testing.assert_close(got, F.gelu(gate, approximate="tanh") * up, rtol=1e-6, atol=1e-6)
