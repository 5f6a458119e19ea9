"""The Triton kernels (interpreted on CPU), the CPU path and the float64 reference compute the same LoRA
term on random pooled layouts: each slot's A and B^T at random non-overlapping element offsets of one flat
buffer with finite garbage between them, ranks 1..128 with some slots at rank 0, tokens without adapter,
segments of 1..300 tokens, widths that are not multiples of any block size (and, in some draws, offsets
and widths aligned to 16 bytes, the Triton kernels' vector-load path), fp32, fp16 and bf16 (and fp32
activations beside bf16 or fp16 weights: the 16-bit adapter pool), `out` alone or as a column view of a
wider fused output."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import LoraMapping, LoraTable, add_lora, lora_expand, lora_shrink
from kernels.reference import add_lora_reference, expand_reference, shrink_reference
from kernels.testing import random_pool

BACKENDS = ("triton", "cpu")


@dataclass(frozen=True)
class Case:
    slots: list[int]  # slot per token, -1 = no adapter
    ranks: list[int]  # rank per slot in this projection's table, 0 = no weights
    d_in: int
    d_out: int
    dtype: torch.dtype
    seed: int
    aligned: bool  # offsets and widths multiples of 16 bytes
    fused: tuple[int, int]  # columns of a fused output left and right of `out` (0, 0: out is alone)
    w_dtype: torch.dtype | None = None  # the weight buffer's dtype when it is not `dtype` (16-bit beside fp32)


@st.composite
def layouts(draw, max_tokens: int = 512):
    num_slots = draw(st.integers(1, 5))
    ranks = draw(st.lists(st.one_of(st.integers(1, 16), st.integers(17, 128), st.just(0)),
                          min_size=num_slots, max_size=num_slots))
    runs = draw(st.lists(st.tuples(st.integers(-1, num_slots - 1), st.integers(1, 40)), min_size=1, max_size=6))
    if draw(st.booleans()):  # one long prefill run
        runs.insert(draw(st.integers(0, len(runs))), (draw(st.integers(-1, num_slots - 1)), draw(st.integers(41, 300))))
    slots = [s for s, n in runs for _ in range(n)][:max_tokens]
    aligned = draw(st.booleans())
    if aligned:
        d_in, d_out = 16 * draw(st.integers(1, 5)), 16 * draw(st.integers(1, 5))
    else:
        d_in, d_out = draw(st.integers(1, 80)), draw(st.integers(1, 80))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    fused = draw(st.sampled_from([(0, 0), (0, 16), (8, 0), (5, 7)]))
    w_dtype = draw(st.sampled_from([None, torch.bfloat16, torch.float16])) if dtype == torch.float32 else None
    return Case(slots, ranks, d_in, d_out, dtype, draw(st.integers(0, 2**16)), aligned, fused, w_dtype)


def make_inputs(case: Case):
    """The pooled buffer and table, x, scales, and `out` (a view into `fused` when the case says so)."""
    pool = random_pool({"p": (case.d_in, case.d_out)}, {"p": case.ranks}, dtype=case.w_dtype or case.dtype,
                       seed=case.seed, align=8 if case.aligned else 1)
    g = torch.Generator().manual_seed(case.seed)
    num_tokens = len(case.slots)
    x = torch.randn(num_tokens, case.d_in, generator=g).to(case.dtype)  # [T, d_in]
    scales = torch.rand(len(case.ranks), generator=g) + 0.1  # [S] fp32
    left, right = case.fused
    fused = torch.randn(num_tokens, left + case.d_out + right, generator=g).to(case.dtype)  # [T, ... | out | ...]
    return pool.buffer, pool.tables["p"], x, scales, fused


def out_of(fused: torch.Tensor, case: Case) -> torch.Tensor:  # [T, d_out] column view
    return fused[:, case.fused[0] : case.fused[0] + case.d_out]


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, *, tf32: bool = False) -> None:
    """Tolerances relative to the result's magnitude: bf16 keeps ~3 significant digits, fp16 ~3.3; `tf32`: the
    Triton expand's 16-bit-weight dot, y rounded once to tf32 (10 mantissa bits, tests/test_expand_precision.py)."""
    scale = max(expected.float().abs().max().item(), 1.0)
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(expected.dtype, 2e-3 if tf32 else None)
    if tol is not None:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * scale)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit, -0.0 and NaN payloads included."""
    assert torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))


def untouched_rows(case: Case) -> list[int]:
    return [t for t, s in enumerate(case.slots) if s == -1 or case.ranks[s] == 0]


RANDOM = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@RANDOM
@given(layouts())
def test_add_lora_agrees_with_reference_on_random_layouts(case):
    buffer, table, x, scales, fused = make_inputs(case)
    mapping = LoraMapping.build(torch.tensor(case.slots, dtype=torch.int32), len(case.ranks))
    expected = add_lora_reference(out_of(fused.clone(), case).clone(), x, buffer, table, mapping, scales)
    skipped, width = untouched_rows(case), fused.shape[1]
    outside = [c for c in range(width) if not case.fused[0] <= c < case.fused[0] + case.d_out]
    for backend in BACKENDS:
        got = fused.clone()
        add_lora(out_of(got, case), x, buffer, table, mapping, scales, backend=backend)
        assert_close_scaled(out_of(got, case), expected, tf32=backend == "triton" and case.w_dtype is not None)
        assert_bits_equal(got[:, outside], fused[:, outside])  # not a column outside the view
        assert_bits_equal(got[skipped], fused[skipped])  # not a token of slot -1 or of a rank-0 slot


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(max_tokens=300))
def test_shrink_then_expand_agree_with_reference(case):
    buffer, table, x, scales, fused = make_inputs(case)
    mapping = LoraMapping.build(case.slots, len(case.ranks))
    y_ref = shrink_reference(x, buffer, table, mapping)  # [T, max rank] fp32
    expected = expand_reference(y_ref, buffer, table, mapping, out_of(fused.clone(), case).clone(), scales)
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(x.dtype, 1e-4)
    for backend in BACKENDS:
        y = lora_shrink(x, buffer, table, mapping, backend=backend)
        assert y.shape == (len(case.slots), max(case.ranks))
        magnitude = max(y_ref.abs().max().item() if y_ref.numel() else 0.0, 1.0)
        torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * magnitude)
        got = fused.clone()
        lora_expand(y_ref, buffer, table, mapping, out_of(got, case), scales, backend=backend)
        assert_close_scaled(out_of(got, case), expected, tf32=backend == "triton" and case.w_dtype is not None)
        assert_bits_equal(got[untouched_rows(case)], fused[untouched_rows(case)])


@pytest.mark.parametrize("aligned", [False, True])
def test_a_single_token_with_the_largest_rank(aligned):
    case = Case([0], [128], 48 if aligned else 33, 128 if aligned else 130, torch.float32, 1, aligned, (0, 0))
    buffer, table, x, scales, fused = make_inputs(case)
    mapping = LoraMapping.build([0], 1)
    expected = add_lora_reference(fused.clone(), x, buffer, table, mapping, scales)
    for backend in BACKENDS:
        assert_close_scaled(add_lora(fused.clone(), x, buffer, table, mapping, scales, backend=backend), expected)


@pytest.mark.parametrize(("d_in", "d_out"), [(576, 576), (576, 192), (37, 100), (1536, 200), (64, 1040), (64, 120),
                                             (96, 56)])
def test_prompt_segments_on_real_widths(d_in, d_out):
    """The CPU path's long-segment blocks (AVX-512: 4 rows x 6 tokens for the shrink, 4 tokens x 96 columns for the
    expand) on projection widths the random layouts stay below: whole 96-column tiles, a tile of 1-5 vectors after
    them ending mid-vector, d_in short of a 16-float vector, prompt segments of every token-block tail and ranks
    that are not multiples of the row block, beside decode segments of 1 and 2 tokens, whose expand takes 64, 48,
    32, 16 and 8 columns at a time (120: 64 + 48 + 8 for one token, 3 x 32 + 16 + 8 for two; 56: 48 + 8, 32 + 16 + 8)."""
    runs = [(0, 38), (1, 1), (2, 13), (3, 2), (4, 7), (1, 3), (0, 5)]
    slots = [s for s, n in runs for _ in range(n)]
    case = Case(slots, [8, 5, 32, 1, 19], d_in, d_out, torch.float32, d_in + d_out, False, (3, 5))
    buffer, table, x, scales, fused = make_inputs(case)
    mapping = LoraMapping.build(torch.tensor(case.slots, dtype=torch.int32), len(case.ranks))
    expected = add_lora_reference(out_of(fused.clone(), case).clone(), x, buffer, table, mapping, scales)
    got = fused.clone()
    add_lora(out_of(got, case), x, buffer, table, mapping, scales, backend="cpu")
    assert_close_scaled(out_of(got, case), expected)
    assert_bits_equal(got[:, :3], fused[:, :3])  # the fused output's columns either side are left alone
    assert_bits_equal(got[:, 3 + d_out:], fused[:, 3 + d_out:])


@pytest.mark.parametrize("tokens", [17, 64, 576])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_batch_on_one_adapter_is_shared_by_the_threads(tokens, threads):
    """Every token on one adapter (one segment): the CPU plan cuts it into chunks of 16 tokens, which the threads
    share once the work is large enough (kernels/cpu.py, PARALLEL_MACS) though the weights are small; each chunk's
    rows of y and out its own. The result is the reference's: no row skipped or added twice."""
    case = Case([0] * tokens, [24], 96, 200, torch.float32, tokens + threads, False, (0, 0))
    buffer, table, x, scales, fused = make_inputs(case)
    mapping = LoraMapping.build(torch.tensor(case.slots, dtype=torch.int32), 1)
    expected = add_lora_reference(fused.clone(), x, buffer, table, mapping, scales)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = add_lora(fused.clone(), x, buffer, table, mapping, scales, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert_close_scaled(got, expected)


def test_the_reference_reads_each_matrix_where_the_table_says():
    """The oracle itself, against plain matmuls on the matrices before they were packed."""
    g = torch.Generator().manual_seed(7)
    d_in, d_out, ranks = 6, 5, [3, 0, 2]
    mats = [(torch.randn(r, d_in, generator=g, dtype=torch.float64),
             torch.randn(d_out, r, generator=g, dtype=torch.float64)) for r in ranks]
    buffer = torch.full((200,), 1e6, dtype=torch.float64)
    a_offsets, b_offsets = [101, 0, 7], [40, 0, 180]  # out of order, unaligned, slot 1 empty
    for (a, b), a_off, b_off in zip(mats, a_offsets, b_offsets, strict=True):
        buffer[a_off : a_off + a.numel()] = a.flatten()
        buffer[b_off : b_off + b.numel()] = b.t().flatten()  # B stored rank-major
    table = LoraTable.build(a_offsets, b_offsets, ranks, d_in=d_in, d_out=d_out, device="cpu")
    x = torch.randn(4, d_in, generator=g, dtype=torch.float64)
    slots, scales = [2, 0, 1, -1], torch.tensor([0.5, 2.0, 3.0])
    got = add_lora_reference(torch.zeros(4, d_out, dtype=torch.float64), x, buffer, table,
                             LoraMapping.build(slots, 3), scales)
    want = torch.zeros(4, d_out, dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0 and ranks[s]:
            a, b = mats[s]
            want[t] = float(scales[s]) * (b @ (a @ x[t]))
    torch.testing.assert_close(got, want)
