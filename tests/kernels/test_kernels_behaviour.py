"""What a caller of the kernels relies on beyond the arithmetic: tokens without adapter untouched,
padded rank columns never read, segments built from any slot order, column views of fused outputs."""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from kernels import LoraMapping, add_lora
from kernels.reference import add_lora_reference

BACKENDS = ("triton", "cpu", "reference")


def stacks(num_slots=3, r_max=32, d_in=40, d_out=24, seed=0, rank_major_b=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, r_max, d_in, generator=g)  # [S, r_max, d_in]
    if rank_major_b:  # allocated [S, r_max, d_out], passed as a transposed view
        b = torch.randn(num_slots, r_max, d_out, generator=g).transpose(1, 2)  # [S, d_out, r_max]
    else:
        b = torch.randn(num_slots, d_out, r_max, generator=g)  # [S, d_out, r_max]
    return a, b


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_of_base_only_tokens_is_left_bit_for_bit(backend):
    a, b = stacks()
    x = torch.randn(7, 40)
    out = torch.randn(7, 24)
    before = out.clone()
    mapping = LoraMapping.build([-1] * 7, [8, 8, 8])
    assert mapping.is_empty
    add_lora(out, x, a, b, mapping, torch.ones(3), backend=backend)
    assert torch.equal(out, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_base_only_tokens_inside_a_mixed_batch_are_left_bit_for_bit(backend):
    a, b = stacks()
    x = torch.randn(9, 40)
    out = torch.randn(9, 24)
    before = out.clone()
    slots = [0, 0, -1, 1, -1, -1, 2, 2, -1]
    add_lora(out, x, a, b, LoraMapping.build(slots, [4, 32, 9]), torch.ones(3), backend=backend)
    base_rows = [t for t, s in enumerate(slots) if s == -1]
    lora_rows = [t for t, s in enumerate(slots) if s != -1]
    assert torch.equal(out[base_rows], before[base_rows])
    assert not torch.allclose(out[lora_rows], before[lora_rows])


@pytest.mark.parametrize("rank_major_b", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_padding_past_the_real_rank_is_never_read(backend, rank_major_b):
    """A slot that held a rank-32 adapter and now holds a rank-4 one keeps stale columns: ignored."""
    a, b = stacks(rank_major_b=rank_major_b)
    ranks = [4, 32, 9]
    clean_a, clean_b = a.clone(), b.clone()
    for s, r in enumerate(ranks):
        clean_a[s, r:] = 0
        clean_b[s, :, r:] = 0
        a[s, r:] = float("nan")
        b[s, :, r:] = float("nan")
    x = torch.randn(6, 40)
    out = torch.randn(6, 24)
    mapping = LoraMapping.build([0, 1, 1, 2, 0, 2], ranks)
    expected = add_lora_reference(out.clone(), x, clean_a, clean_b, mapping, torch.ones(3))
    got = add_lora(out.clone(), x, a, b, mapping, torch.ones(3), backend=backend)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_may_be_a_column_slice_of_a_fused_projection(backend):
    """The caller handles fused q/k/v by passing each slice of the fused output as `out`."""
    a, b = stacks(d_out=24)
    x = torch.randn(5, 40)
    fused = torch.randn(5, 24 + 16 + 16)  # [T, q | k | v]
    before = fused.clone()
    mapping = LoraMapping.build([1, 1, 0, 2, 2], [4, 32, 9])
    expected = add_lora_reference(fused[:, :24].clone(), x, a, b, mapping, torch.ones(3))
    add_lora(fused[:, :24], x, a, b, mapping, torch.ones(3), backend=backend)
    torch.testing.assert_close(fused[:, :24], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused[:, 24:], before[:, 24:])


def test_mapping_splits_runs_and_drops_base_tokens_and_empty_slots():
    mapping = LoraMapping.build(torch.tensor([2, 2, -1, 0, 0, 2, 1, 1], dtype=torch.int32),
                                torch.tensor([8, 0, 16], dtype=torch.int32))
    # slot 1 has rank 0 (empty): its tokens cost nothing, like -1; slot 2 appears as two runs.
    assert mapping.segments == ((0, 2, 2, 16), (3, 5, 0, 8), (5, 6, 2, 16))
    assert mapping.seg_starts.tolist() == [0, 3, 5]
    assert mapping.seg_lens.tolist() == [2, 2, 1]
    assert mapping.max_seg_len == 2 and mapping.max_rank == 16


def test_mapping_refuses_a_slot_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        LoraMapping.build([0, 3], [8, 8])


def test_add_lora_refuses_mismatched_shapes():
    a, b = stacks()
    mapping = LoraMapping.build([0, 1], [4, 8, 8])
    with pytest.raises(ValueError):
        add_lora(torch.zeros(3, 24), torch.zeros(2, 40), a, b, mapping, torch.ones(3))
    with pytest.raises(ValueError):
        add_lora(torch.zeros(2, 24), torch.zeros(3, 40), a, b, mapping, torch.ones(3))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")
def test_the_native_cpu_kernel_builds_and_serves_decode_batches(monkeypatch):
    """With a compiler present the CPU path must not silently fall back to per-segment torch calls."""
    from kernels import cpu, cpu_native

    assert cpu_native.load() is not None
    calls = []
    monkeypatch.setattr(cpu, "_add_lora_torch", lambda *args: calls.append(args))
    a, b = stacks()
    out = torch.zeros(4, 24)
    add_lora(out, torch.randn(4, 40), a, b, LoraMapping.build([0, 1, 1, 2], [4, 32, 9]), torch.ones(3))
    assert calls == [] and out.abs().sum() > 0


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")
def test_the_native_kernel_agrees_when_it_splits_segments_across_threads(monkeypatch):
    """Big batches run on helper threads; many back-to-back calls must neither race nor hang."""
    from kernels import cpu

    monkeypatch.setattr(cpu, "PARALLEL_BYTES", 0)  # use the helpers even for these small shapes
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    g = torch.Generator().manual_seed(3)
    ranks = [1, 20, 7, 16, 0, 9]
    for trial in range(200):
        a, b = stacks(num_slots=6, r_max=20, d_in=72, d_out=140, seed=3, rank_major_b=trial % 2 == 1)
        slots = torch.randint(-1, 6, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g)
        mapping = LoraMapping.build(slots.sort().values.int(), ranks)
        x = torch.randn(len(slots), 72, generator=g)
        out = torch.randn(len(slots), 140, generator=g)
        expected = add_lora_reference(out.clone(), x, a, b, mapping, torch.ones(6))
        torch.testing.assert_close(add_lora(out, x, a, b, mapping, torch.ones(6)), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(shutil.which("gcc") is None or not hasattr(os, "fork"), reason="needs a C compiler and fork")
def test_a_forked_worker_process_still_computes_with_threads(monkeypatch):
    """Helper threads do not survive fork(): a child must neither hang nor compute garbage."""
    from kernels import cpu

    monkeypatch.setattr(cpu, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    a, b = stacks(num_slots=3, rank_major_b=True)
    x = torch.randn(6, 40)
    mapping = LoraMapping.build([0, 0, 1, 1, 2, 2], [4, 32, 9])
    expected = add_lora_reference(torch.zeros(6, 24), x, a, b, mapping, torch.ones(3))
    add_lora(torch.zeros(6, 24), x, a, b, mapping, torch.ones(3))  # the parent starts its helpers
    pid = os.fork()
    if pid == 0:  # child: exit status says whether it got the right answer
        ok = torch.allclose(add_lora(torch.zeros(6, 24), x, a, b, mapping, torch.ones(3)), expected, atol=1e-4)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child hung in the native kernel")
