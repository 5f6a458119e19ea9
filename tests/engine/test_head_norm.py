"""Qwen3's per-head q/k RMSNorm on the native kernel (inference_worker.model.head_rms_norm_in_place): the same numbers
as the torch ops it replaces, written into the q and k heads of the fused q/k/v output in place, the values untouched.
(Its effect on served tokens: tests/engine/test_model_families.py's Qwen3 tests against transformers.)"""
from __future__ import annotations

import pytest
import torch

from inference_worker.model import head_rms_norm, head_rms_norm_in_place
from kernels.cpu_native import load

pytestmark = pytest.mark.skipif(load() is None, reason="the native kernel library cannot be built here")


@pytest.mark.parametrize("T", [1, 64, 300])
def test_native_head_norm_equals_the_torch_ops_on_q_and_k_and_leaves_v_alone(T):
    H, KV, hd = 6, 2, 24
    gen = torch.Generator().manual_seed(T)
    qkv = torch.randn(T, (H + 2 * KV) * hd, generator=gen) * 3
    weight = torch.cat([torch.randn(hd, generator=gen).expand(H, hd),
                        torch.randn(hd, generator=gen).expand(KV, hd)]).contiguous()
    expected = qkv.clone()
    heads = expected[:, :(H + KV) * hd].view(T, H + KV, hd)
    heads.copy_(head_rms_norm(heads, weight, 1e-6))

    ours = qkv.clone()
    assert head_rms_norm_in_place(ours, weight, 1e-6) is True
    torch.testing.assert_close(ours[:, :(H + KV) * hd], expected[:, :(H + KV) * hd], atol=1e-6, rtol=1e-5)
    assert torch.equal(ours[:, (H + KV) * hd:], qkv[:, (H + KV) * hd:])  # the values are not normalised


def test_tensors_the_kernel_does_not_cover_are_left_to_the_torch_ops():
    weight = torch.ones(2, 8)
    for qkv in (torch.randn(4, 32, dtype=torch.float64), torch.randn(32, 4).t()):  # fp64; rows not contiguous
        before = qkv.clone()
        assert head_rms_norm_in_place(qkv, weight.to(qkv.dtype), 1e-6) is False
        assert torch.equal(qkv, before)
