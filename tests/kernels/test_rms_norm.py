"""RMSNorm in one native pass (kernels/csrc/sgmv_cpu.c, `rms_norm`): transformers' LlamaRMSNorm's numbers for
decode batches, prefill chunks (a chunk big enough to run on the OpenMP team too), rows that are column views
of a wider activation, and none at all. (tests/engine/test_native_attention.py: the runner's layers use it.)"""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels import cpu_native, rms_norm


@pytest.mark.parametrize("rows,width,view", [(64, 576, False), (1, 64, False), (512, 1024, True), (700, 1536, False),
                                             (0, 64, False)])
@pytest.mark.parametrize("threads", [1, 2])
def test_it_equals_transformers_rmsnorm(rows, width, view, threads):
    assert cpu_native.load() is not None, "the native CPU kernels did not build (is gcc installed?)"
    gen = torch.Generator().manual_seed(rows + width)
    wide = torch.randn(rows, width + 40, generator=gen) * 3
    x = wide[:, 17:17 + width] if view else wide[:, :width].contiguous()  # a view: row stride width + 40
    oracle = LlamaRMSNorm(width, eps=1e-6)
    with torch.no_grad():
        oracle.weight.copy_(torch.randn(width, generator=gen))
        want = oracle(x)
    got = rms_norm(x, oracle.weight.detach(), 1e-6, threads=threads)
    assert got is not None and got.shape == (rows, width) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def test_what_it_does_not_cover_is_left_to_torch():
    w = torch.ones(8)
    for x in (torch.ones(2, 8, dtype=torch.float64), torch.ones(8, 2).t(), torch.ones(2, 2, 8)):
        assert rms_norm(x, w, 1e-6, threads=1) is None
    assert rms_norm(torch.ones(2, 8), torch.ones(4), 1e-6, threads=1) is None  # weight of another width

