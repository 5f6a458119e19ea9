"""The greedy pick in one native pass (kernels/csrc/sgmv_cpu.c, `argmax_rows`): torch.argmax(x, dim=-1) for a
step's logits — decode batches of real vocabulary sizes, on one thread and on the team, ties (the first index
wins, as torch's), rows of a wider buffer, -inf-masked rows; and sampling's greedy tokens through it."""
import pytest
import torch

from inference_worker.sampling import GREEDY_NATIVE_MIN, greedy_tokens
from kernels import argmax_rows, cpu_native


@pytest.mark.parametrize("rows,n,extra", [(64, 49152, 0), (1, 32000, 0), (7, 100, 0), (33, 1000, 24), (3, 1, 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_it_equals_torch_argmax(rows, n, extra, threads):
    assert cpu_native.load() is not None, "the native CPU kernels did not build (is gcc installed?)"
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n + extra, generator=gen)[:, :n]  # extra: row stride wider than the row
    got = argmax_rows(x, threads=threads)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x, dim=-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_ties_go_to_the_first_index(threads):
    """A greedy decode must not depend on the kernel: on equal logits torch.argmax takes the first one."""
    x = torch.zeros(64, 49152)
    for r in range(64):  # the max at two or three places; the first of them anywhere, lane or block edges too
        first = (r * 769) % 49000
        x[r, first] = x[r, first + 1 + r] = x[r, 49151] = 5.0
    x[0] = 1.0  # a whole row tied: index 0
    got = argmax_rows(x, threads=threads)
    assert torch.equal(got, torch.argmax(x, dim=-1))
    assert got[0] == 0 and got[5] == (5 * 769) % 49000


def test_masked_rows():
    """A logits processor may set everything but a few tokens to -inf, or all of them."""
    x = torch.full((4, 5000), float("-inf"))
    x[0, 4321] = -3.0
    x[1, 17] = x[1, 18] = 0.0
    got = argmax_rows(x, threads=2)
    assert got.tolist() == torch.argmax(x, dim=-1).tolist() == [4321, 17, 0, 0]


def test_what_it_does_not_cover_is_left_to_torch():
    assert argmax_rows(torch.ones(2, 8, dtype=torch.float64), threads=1) is None
    assert argmax_rows(torch.ones(8, 2).t(), threads=1) is None  # columns not contiguous
    assert argmax_rows(torch.ones(2, 0), threads=1) is None


def test_sampling_greedy_tokens_are_torchs_on_both_paths():
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(64, 49152, generator=gen)  # the native pass
    small = torch.randn(4, 100, generator=gen)  # below GREEDY_NATIVE_MIN: torch.argmax
    assert big.numel() >= GREEDY_NATIVE_MIN > small.numel()
    for x in (big, small):
        assert greedy_tokens(x) == torch.argmax(x, dim=-1).tolist()
