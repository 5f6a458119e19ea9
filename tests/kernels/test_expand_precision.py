"""The Triton expand's arithmetic with fp16/bf16 weights, pinned in the interpreter: y is rounded once to
tf32 (fp32's exponent range, 10 mantissa bits) and multiplied with B exactly, in fp32. This is the
arithmetic the compiled kernel runs on tensor cores, so an fp16 LoRA whose intermediate |y| exceeds
65504 stays finite, as it does in the reference, instead of overflowing to inf."""
from __future__ import annotations

import pytest
import torch

from kernels import LoraMapping, add_lora, lora_expand
from kernels.reference import add_lora_reference, expand_reference
from kernels.testing import random_pool


def round_tf32(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest tf32 value, ties to even (finite values)."""
    bits = v.float().contiguous().view(torch.int32).to(torch.int64)
    rounded = (bits + ((bits >> 13) & 1) + 0xFFF) & ~0x1FFF
    return rounded.to(torch.int32).view(torch.float32)


def test_round_tf32_helper_keeps_ten_mantissa_bits():
    assert round_tf32(torch.tensor([1.0 + 2.0**-10]))[0] == 1.0 + 2.0**-10  # representable: kept
    assert round_tf32(torch.tensor([1.0 + 2.0**-11]))[0] == 1.0  # a tie: to even
    assert round_tf32(torch.tensor([1.0 + 3 * 2.0**-11]))[0] == 1.0 + 2.0**-9  # a tie: to even, upwards
    assert round_tf32(torch.tensor([-(1.0 + 2.0**-11 + 2.0**-20)]))[0] == -(1.0 + 2.0**-10)
    assert round_tf32(torch.tensor([1e30]))[0] == pytest.approx(1e30, rel=2.0**-11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_expand_multiplies_y_rounded_to_tf32_exactly(dtype):
    d_out, ranks = 96, [16, 5, 32]
    pool = random_pool({"p": (32, d_out)}, {"p": ranks}, dtype=dtype, seed=3, align=8)
    buffer, table = pool.buffer, pool.tables["p"]
    slots = [0] * 5 + [1] * 3 + [-1] * 2 + [2] * 7
    mapping = LoraMapping.build(slots, len(ranks))
    g = torch.Generator().manual_seed(0)
    y = torch.randn(len(slots), max(ranks), generator=g) * 3  # full fp32 mantissas
    scales = torch.tensor([0.5, 2.0, 1.25])
    got = lora_expand(y, buffer, table, mapping, torch.zeros(len(slots), d_out), scales, backend="triton")

    tf32 = expand_reference(round_tf32(y).double(), buffer, table, mapping,
                            torch.zeros(len(slots), d_out, dtype=torch.float64), scales)
    exact = expand_reference(y.double(), buffer, table, mapping,
                             torch.zeros(len(slots), d_out, dtype=torch.float64), scales)
    # |y| @ |B^T| bounds every term of the sum: the fp32 accumulation error is a few ulps of it
    bound = expand_reference(y.abs().double(), buffer.abs(), table, mapping,
                             torch.zeros(len(slots), d_out, dtype=torch.float64), scales).max().item()
    assert (got.double() - tf32).abs().max().item() <= 1e-6 * bound
    # the rounding is real (a kernel that skipped it, or rounded to bf16, would not match the line above)
    assert (exact - tf32).abs().max().item() > 1e-5 * bound
    assert (got.double() - exact).abs().max().item() <= 2.0**-11 * bound


def test_fp16_lora_with_intermediate_beyond_fp16_range_stays_finite():
    """x and A large enough that y = A x reaches ~3e5 (> fp16's 65504), B small enough that the
    delta B y fits fp16 comfortably: the result is the reference's, not inf."""
    d_in, d_out, ranks = 64, 48, [8, 16]
    pool = random_pool({"p": (d_in, d_out)}, {"p": ranks}, dtype=torch.float32, seed=1, align=8)
    buffer, table = pool.buffer.clone(), pool.tables["p"]
    for s in range(len(ranks)):  # A_s *= 200 and B_s *= 1e-3, in place in the pooled buffer
        table.a_of(buffer, s).mul_(200.0)
        table.b_of(buffer, s).mul_(1e-3)
    buffer = buffer.to(torch.float16)
    g = torch.Generator().manual_seed(2)
    slots = [0] * 4 + [1] * 5
    mapping = LoraMapping.build(slots, len(ranks))
    x = (torch.randn(len(slots), d_in, generator=g) * 60).to(torch.float16)
    scales = torch.tensor([1.0, 0.5])
    out = torch.zeros(len(slots), d_out, dtype=torch.float16)

    y = torch.zeros(len(slots), max(ranks))
    for t, s in enumerate(slots):
        y[t, : ranks[s]] = table.a_of(buffer, s).double() @ x[t].double()
    assert y.abs().max().item() > 65504 * 2  # the case this test is about

    expected = add_lora_reference(out.clone(), x, buffer, table, mapping, scales)
    assert torch.isfinite(expected).all() and expected.abs().max().item() < 60000
    magnitude = expected.float().abs().max().item()
    got = add_lora(out.clone(), x, buffer, table, mapping, scales, backend="triton")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-3, atol=2e-3 * magnitude)
    got = lora_expand(y, buffer, table, mapping, out.clone(), scales, backend="triton")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-3, atol=2e-3 * magnitude)
