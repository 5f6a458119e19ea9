"""The Triton kernels (interpreted on CPU), the CPU path and the plain-torch reference compute the same
LoRA term on random batch layouts: mixed ranks 1..128, empty segments, tokens without adapter, a single
token, up to 512 tokens, widths that are not multiples of any block size, fp32 and bf16."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import LoraMapping, add_lora, lora_expand, lora_shrink
from kernels.reference import add_lora_reference, expand_reference, shrink_reference

BACKENDS = ("triton", "cpu")


@st.composite
def layouts(draw, max_tokens: int = 512):
    """A batch: slots with mixed real ranks (0 = empty slot) and runs of tokens per slot or -1."""
    num_slots = draw(st.integers(1, 5))
    ranks = draw(st.lists(st.one_of(st.integers(1, 16), st.integers(17, 128), st.just(0)),
                          min_size=num_slots, max_size=num_slots))
    r_max = max(max(ranks), 1) + draw(st.integers(0, 3))  # a pool padded past the largest rank
    runs = draw(st.lists(st.tuples(st.integers(-1, num_slots - 1), st.integers(0, 40)),
                         min_size=1, max_size=6))  # length 0 = an empty segment
    if draw(st.booleans()):  # one long prefill run
        runs.append((draw(st.integers(-1, num_slots - 1)), draw(st.integers(41, max_tokens - 240))))
    slots = [s for s, n in runs for _ in range(n)][:max_tokens] or [draw(st.integers(-1, num_slots - 1))]
    d_in = draw(st.integers(1, 80))
    d_out = draw(st.integers(1, 80))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**16))
    rank_major_b = draw(st.booleans())
    return slots, ranks, r_max, d_in, d_out, dtype, seed, rank_major_b


def make_tensors(slots, ranks, r_max, d_in, d_out, dtype, seed, rank_major_b=False):
    """rank_major_b: B allocated [S, r_max, d_out] and passed as a transposed view (the CPU layout)."""
    g = torch.Generator().manual_seed(seed)
    num_slots, num_tokens = len(ranks), len(slots)
    x = torch.randn(num_tokens, d_in, generator=g).to(dtype)  # [T, d_in]
    a = torch.randn(num_slots, r_max, d_in, generator=g).to(dtype)  # [S, r_max, d_in]
    if rank_major_b:
        b = torch.randn(num_slots, r_max, d_out, generator=g).to(dtype).transpose(1, 2)  # [S, d_out, r_max]
    else:
        b = torch.randn(num_slots, d_out, r_max, generator=g).to(dtype)  # [S, d_out, r_max]
    scales = torch.rand(num_slots, generator=g) + 0.1  # [S] fp32
    out = torch.randn(num_tokens, d_out, generator=g).to(dtype)  # [T, d_out]
    return x, a, b, scales, out


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Tolerances relative to the result's magnitude: bf16 keeps ~3 significant digits."""
    scale = max(expected.float().abs().max().item(), 1.0)
    if expected.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * scale)


RANDOM = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@RANDOM
@given(layouts())
def test_add_lora_agrees_with_reference_on_random_layouts(case):
    slots, ranks, *_ = case
    x, a, b, scales, out = make_tensors(*case)
    mapping = LoraMapping.build(torch.tensor(slots, dtype=torch.int32), torch.tensor(ranks, dtype=torch.int32))
    expected = add_lora_reference(out.clone(), x, a, b, mapping, scales)
    for backend in BACKENDS:
        got = add_lora(out.clone(), x, a, b, mapping, scales, backend=backend)
        assert_close_scaled(got, expected)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(max_tokens=300))
def test_shrink_then_expand_agree_with_reference(case):
    slots, ranks, *_ = case
    x, a, b, scales, out = make_tensors(*case)
    mapping = LoraMapping.build(slots, ranks)
    y_ref = shrink_reference(x, a, mapping)  # [T, r_max] fp32
    expected = expand_reference(y_ref, b, mapping, out.clone(), scales)
    for backend in BACKENDS:
        y = lora_shrink(x, a, mapping, backend=backend)
        tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * max(y_ref.abs().max().item(), 1.0))
        got = lora_expand(y_ref, b, mapping, out.clone(), scales, backend=backend)
        assert_close_scaled(got, expected)


@pytest.mark.parametrize("rank_major_b", [False, True])
def test_a_single_token_with_the_largest_rank(rank_major_b):
    case = ([0], [128], 128, 33, 130, torch.float32, 1, rank_major_b)
    x, a, b, scales, out = make_tensors(*case)
    mapping = LoraMapping.build([0], [128])
    expected = add_lora_reference(out.clone(), x, a, b, mapping, scales)
    for backend in BACKENDS:
        assert_close_scaled(add_lora(out.clone(), x, a, b, mapping, scales, backend=backend), expected)
