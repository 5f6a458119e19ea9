"""What a caller of the kernels relies on beyond the arithmetic: tokens without adapter or of a slot
without weights untouched bit for bit, memory around each matrix never read, one table serving every
layer's buffer, offsets past 2^31 elements, segments built from any slot order, column views of fused
outputs, the native CPU kernel used (also on helper threads and after fork)."""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from kernels import LoraMapping, LoraTable, add_lora, lora_expand, lora_shrink
from kernels.reference import add_lora_reference
from kernels.testing import random_pool

BACKENDS = ("triton", "cpu", "reference")
D_IN, D_OUT = 40, 24


def pool(ranks=(4, 32, 9), d_in=D_IN, d_out=D_OUT, seed=0, garbage=1e3, dtype=torch.float32):
    """(buffer, table) of one projection, matrices at random offsets with `garbage` between them."""
    weights = random_pool({"p": (d_in, d_out)}, {"p": list(ranks)}, seed=seed, garbage=garbage, dtype=dtype)
    return weights.buffer, weights.tables["p"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_of_base_only_tokens_is_left_bit_for_bit(backend):
    buffer, table = pool()
    out = torch.randn(7, D_OUT)
    before = out.clone()
    mapping = LoraMapping.build([-1] * 7, 3)
    assert mapping.is_empty
    add_lora(out, torch.randn(7, D_IN), buffer, table, mapping, torch.ones(3), backend=backend)
    assert torch.equal(bits(out), bits(before))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokens_without_weights_inside_a_mixed_batch_are_left_bit_for_bit(backend):
    """Slot -1 (base request) and a slot whose adapter does not target this projection (rank 0 in its
    table) alike: not one bit of their rows changes, -0.0 and NaN included."""
    buffer, table = pool(ranks=(4, 0, 9))
    x = torch.randn(9, D_IN)
    out = torch.randn(9, D_OUT)
    out[2, :3] = torch.tensor([-0.0, float("nan"), 0.0])
    out[4, 5] = -0.0
    before = out.clone()
    slots = [0, 0, -1, 1, 1, -1, 2, 2, -1]
    add_lora(out, x, buffer, table, LoraMapping.build(slots, 3), torch.ones(3), backend=backend)
    skipped = [t for t, s in enumerate(slots) if s in (-1, 1)]
    computed = [t for t, s in enumerate(slots) if s not in (-1, 1)]
    assert torch.equal(bits(out[skipped]), bits(before[skipped]))
    assert not torch.allclose(out[computed], before[computed])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_projection_no_active_slot_targets_costs_nothing_and_changes_nothing(backend):
    buffer, table = pool(ranks=(0, 0, 0))
    mapping = LoraMapping.build([0, 1, 2, 2], 3)
    assert mapping.plan(table).is_empty and not mapping.is_empty
    out = torch.randn(4, D_OUT)
    before = out.clone()
    add_lora(out, torch.randn(4, D_IN), buffer, table, mapping, torch.ones(3), backend=backend)
    assert torch.equal(bits(out), bits(before))
    assert lora_shrink(torch.randn(4, D_IN), buffer, table, mapping, backend=backend).shape == (4, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_around_each_matrix_is_never_read(backend):
    """NaN between and around the matrices (a neighbour's KV block, a freed page): the result is finite
    and right, so no kernel reads a row past a slot's real rank or a column past its width."""
    clean_buffer, table = pool(garbage=0.0, seed=5)
    nan_buffer, _ = pool(garbage=float("nan"), seed=5)  # same seed: same offsets, same weights
    assert nan_buffer.isnan().any()
    x = torch.randn(6, D_IN)
    out = torch.randn(6, D_OUT)
    mapping = LoraMapping.build([0, 1, 1, 2, 0, 2], 3)
    expected = add_lora_reference(out.clone(), x, clean_buffer, table, mapping, torch.ones(3))
    got = add_lora(out.clone(), x, nan_buffer, table, mapping, torch.ones(3), backend=backend)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_table_serves_every_layer(backend):
    """The worker builds one table per projection and passes each layer's buffer: plans cached on the
    mapping must not remember a buffer."""
    layer0, table = pool(seed=1)
    layer1 = torch.randn_like(layer0)  # the next layer's pages: same layout, other values
    x = torch.randn(5, D_IN)
    mapping = LoraMapping.build([2, 2, 0, -1, 1], 3)
    for buffer in (layer0, layer1, layer0):
        expected = add_lora_reference(torch.zeros(5, D_OUT), x, buffer, table, mapping, torch.ones(3))
        got = add_lora(torch.zeros(5, D_OUT), x, buffer, table, mapping, torch.ones(3), backend=backend)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_may_be_a_column_slice_of_a_fused_projection(backend):
    """The caller handles fused q/k/v by passing each slice of the fused output as `out`."""
    buffer, table = pool()
    x = torch.randn(5, D_IN)
    fused = torch.randn(5, 16 + D_OUT + 16)  # [T, q | k | v], this table is k's
    before = fused.clone()
    mapping = LoraMapping.build([1, 1, 0, 2, 2], 3)
    expected = add_lora_reference(fused[:, 16:-16].clone(), x, buffer, table, mapping, torch.ones(3))
    add_lora(fused[:, 16:-16], x, buffer, table, mapping, torch.ones(3), backend=backend)
    torch.testing.assert_close(fused[:, 16:-16], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(bits(fused[:, :16]), bits(before[:, :16]))
    assert torch.equal(bits(fused[:, -16:]), bits(before[:, -16:]))


def test_offsets_past_2_31_elements(tmp_path):
    """Pools may exceed 2^31 elements. A sparse file mapped copy-on-write gives a real 8.6 GB fp32 buffer
    that costs only the pages written: slot 1's A and B lie past element 2^31, slot 0 near the start, and
    every backend (the native CPU kernel, Triton, the reference) finds them."""
    numel = (1 << 31) + (1 << 16)
    path = tmp_path / "pool.bin"
    with open(path, "wb") as f:
        f.truncate(numel * 4)
    buffer = torch.from_file(str(path), shared=False, size=numel, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    ranks, a_offsets, b_offsets = [3, 5], [17, (1 << 31) + 4099], [300, (1 << 31) - 1]  # B_1 straddles 2^31
    mats = []
    for r, a_off, b_off in zip(ranks, a_offsets, b_offsets, strict=True):
        a, b_t = torch.randn(r, D_IN, generator=g), torch.randn(r, D_OUT, generator=g)
        buffer[a_off : a_off + a.numel()] = a.flatten()
        buffer[b_off : b_off + b_t.numel()] = b_t.flatten()
        mats.append((a, b_t))
    table = LoraTable.build(a_offsets, b_offsets, ranks, d_in=D_IN, d_out=D_OUT, device="cpu")
    assert table.extent > 1 << 31
    x = torch.randn(4, D_IN, generator=g)
    slots, scales = [1, 1, 0, 1], torch.tensor([0.5, 2.0])
    want = torch.stack([float(scales[s]) * (mats[s][1].t().double() @ (mats[s][0].double() @ x[t].double()))
                        for t, s in enumerate(slots)]).float()
    mapping = LoraMapping.build(slots, 2)
    for backend in BACKENDS:
        got = add_lora(torch.zeros(4, D_OUT), x, buffer, table, mapping, scales, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_shrink_and_expand_take_the_same_table_and_buffer():
    buffer, table = pool(ranks=(4, 0, 9))
    mapping = LoraMapping.build([2, 0, 1, -1], 3)
    x = torch.randn(4, D_IN)
    y = lora_shrink(x, buffer, table, mapping)
    assert y.shape == (4, 9) and y.dtype == torch.float32
    assert torch.equal(y[2:], torch.zeros(2, 9)) and torch.equal(y[1, 4:], torch.zeros(5))
    expected = add_lora_reference(torch.zeros(4, D_OUT), x, buffer, table, mapping, torch.ones(3))
    got = lora_expand(y, buffer, table, mapping, torch.zeros(4, D_OUT), torch.ones(3))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_mapping_splits_runs_and_drops_base_tokens():
    mapping = LoraMapping.build(torch.tensor([2, 2, -1, 0, 0, 2, 1, 1], dtype=torch.int32), 3)
    # slot 2 appears as two runs; -1 tokens belong to no segment
    assert mapping.segments == ((0, 2, 2), (3, 5, 0), (5, 6, 2), (6, 8, 1))
    assert mapping.seg_starts.tolist() == [0, 3, 5, 6]
    assert mapping.seg_lens.tolist() == [2, 2, 1, 2]
    assert mapping.seg_slots.tolist() == [2, 0, 2, 1]
    assert mapping.max_seg_len == 2


def test_each_table_plans_the_segments_with_weights_in_it_once_per_step():
    """Slot 1 has rank 0 in q's table (its adapter targets only the MLP): its tokens cost nothing there."""
    mapping = LoraMapping.build([2, 2, -1, 0, 0, 2, 1, 1], 3)
    q = LoraTable.build([0, 0, 100], [50, 0, 300], [8, 0, 16], d_in=4, d_out=4, device="cpu")
    up = LoraTable.build([0, 100, 200], [50, 150, 250], [8, 8, 8], d_in=4, d_out=4, device="cpu")
    plan = mapping.plan(q)
    assert plan.segments == ((0, 2, 2, 16), (3, 5, 0, 8), (5, 6, 2, 16))
    assert plan.max_seg_len == 2 and plan.max_rank == 16
    assert mapping.plan(q) is plan  # cached per table: every layer reuses it
    assert mapping.plan(up).segments == ((0, 2, 2, 8), (3, 5, 0, 8), (5, 6, 2, 8), (6, 8, 1, 8))


def test_mapping_refuses_a_slot_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        LoraMapping.build([0, 3], 2)


def test_table_refuses_what_no_pool_can_hold():
    with pytest.raises(ValueError, match="one offset pair and rank per slot"):
        LoraTable.build([0, 10], [20], [1, 1], d_in=2, d_out=2, device="cpu")
    with pytest.raises(ValueError, match="ranks must be >= 0"):
        LoraTable.build([0], [20], [-1], d_in=2, d_out=2, device="cpu")
    with pytest.raises(ValueError, match="offsets"):
        LoraTable.build([-4], [20], [1], d_in=2, d_out=2, device="cpu")
    LoraTable.build([-4], [-1], [0], d_in=2, d_out=2, device="cpu")  # a rank-0 slot's offsets are never read


def test_add_lora_refuses_mismatched_shapes():
    buffer, table = pool()
    mapping = LoraMapping.build([0, 1], 3)
    scales = torch.ones(3)
    with pytest.raises(ValueError, match="out must be"):
        add_lora(torch.zeros(3, D_OUT), torch.zeros(2, D_IN), buffer, table, mapping, scales)
    with pytest.raises(ValueError, match="x must be"):
        add_lora(torch.zeros(2, D_OUT), torch.zeros(3, D_IN), buffer, table, mapping, scales)
    with pytest.raises(ValueError, match="x must be"):
        add_lora(torch.zeros(2, D_OUT), torch.zeros(2, D_IN + 1), buffer, table, mapping, scales)
    with pytest.raises(ValueError, match="reaches element"):  # the table points past the buffer
        add_lora(torch.zeros(2, D_OUT), torch.zeros(2, D_IN), buffer[: table.extent - 1], table, mapping, scales)
    with pytest.raises(ValueError, match="dtype"):  # 16-bit activations need weights of their own dtype
        add_lora(torch.zeros(2, D_OUT).half(), torch.zeros(2, D_IN).half(), buffer, table, mapping, scales)
    with pytest.raises(ValueError, match="dtype"):
        add_lora(torch.zeros(2, D_OUT).half(), torch.zeros(2, D_IN).half(), buffer.bfloat16(), table, mapping, scales)
    with pytest.raises(ValueError, match="flat contiguous"):
        add_lora(torch.zeros(2, D_OUT), torch.zeros(2, D_IN), buffer.view(1, -1), table, mapping, scales)
    with pytest.raises(ValueError, match="slots"):
        add_lora(torch.zeros(2, D_OUT), torch.zeros(2, D_IN), buffer, table, LoraMapping.build([0, 1], 4), scales)
    with pytest.raises(ValueError, match="slot_scales"):
        add_lora(torch.zeros(2, D_OUT), torch.zeros(2, D_IN), buffer, table, mapping, torch.ones(2))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")
def test_the_native_cpu_kernel_builds_and_serves_decode_batches(monkeypatch):
    """With a compiler present the CPU path must not silently fall back to per-segment torch calls."""
    from kernels import cpu, cpu_native

    assert cpu_native.load() is not None
    calls = []
    monkeypatch.setattr(cpu, "_add_lora_torch", lambda *args: calls.append(args))
    buffer, table = pool()
    out = torch.zeros(4, D_OUT)
    add_lora(out, torch.randn(4, D_IN), buffer, table, LoraMapping.build([0, 1, 1, 2], 3), torch.ones(3))
    assert calls == [] and out.abs().sum() > 0


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
def test_the_cpu_path_reads_16_bit_weights_beside_fp32_activations(monkeypatch, w_dtype):
    """The 16-bit adapter pool: the native kernel (not a torch fallback) widens bf16 and fp16 weights on the way in,
    so its answer is the fp32 computation on the stored weights: decode batches, prefill runs, and rows longer than
    what the fp16 path widens at once (2048 A weights, 1024 B weights) alike."""
    from kernels import cpu

    calls = []
    monkeypatch.setattr(cpu, "_add_lora_torch", lambda *args: calls.append(args))
    g = torch.Generator().manual_seed(5)
    cases = [([0, 1, 1, 2], 72, 140), ([2] * 70 + [-1] * 3 + [0] * 9, 72, 140), ([1], 72, 140),
             ([0, 1, 1, 2, 2, 2], 2100, 2053)]  # rows past the fp16 widening's 2048 and the expand's 1024-wide tiles
    for trial, (slots, d_in, d_out) in enumerate(cases):
        buffer, table = pool(ranks=(4, 32, 9), d_in=d_in, d_out=d_out, seed=trial, dtype=w_dtype)
        mapping = LoraMapping.build(slots, 3)
        x, out = torch.randn(len(slots), d_in, generator=g), torch.randn(len(slots), d_out, generator=g)
        scales = torch.tensor([0.5, 2.0, 1.0])
        expected = add_lora_reference(out.clone(), x, buffer, table, mapping, scales)
        got = add_lora(out, x, buffer, table, mapping, scales)
        assert got.dtype == torch.float32  # fp32 sums over up to 2100 terms: a few ulps of the largest value
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    assert calls == []


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")
def test_the_native_kernel_agrees_when_it_splits_segments_across_threads(monkeypatch):
    """Big batches run on several threads (the caller's OpenMP team, or helper threads); many back-to-back calls
    must neither race nor hang."""
    from kernels import cpu

    monkeypatch.setattr(cpu, "PARALLEL_BYTES", 0)  # go parallel even for these small shapes
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    g = torch.Generator().manual_seed(3)
    ranks = (1, 20, 7, 16, 0, 9)
    for trial in range(200):
        buffer, table = pool(ranks=ranks, d_in=72, d_out=140, seed=trial % 7)
        slots = torch.randint(-1, 6, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g)
        mapping = LoraMapping.build(slots.sort().values.int(), 6)
        x = torch.randn(len(slots), 72, generator=g)
        out = torch.randn(len(slots), 140, generator=g)
        expected = add_lora_reference(out.clone(), x, buffer, table, mapping, torch.ones(6))
        got = add_lora(out, x, buffer, table, mapping, torch.ones(6))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(shutil.which("gcc") is None or not hasattr(os, "fork"), reason="needs a C compiler and fork")
def test_a_forked_worker_process_still_computes_with_threads(monkeypatch):
    """Helper threads do not survive fork(): a child must neither hang nor compute garbage."""
    from kernels import cpu

    monkeypatch.setattr(cpu, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    buffer, table = pool()
    x = torch.randn(6, D_IN)
    mapping = LoraMapping.build([0, 0, 1, 1, 2, 2], 3)
    expected = add_lora_reference(torch.zeros(6, D_OUT), x, buffer, table, mapping, torch.ones(3))
    add_lora(torch.zeros(6, D_OUT), x, buffer, table, mapping, torch.ones(3))  # the parent starts its helpers
    pid = os.fork()
    if pid == 0:  # child: exit status says whether it got the right answer
        got = add_lora(torch.zeros(6, D_OUT), x, buffer, table, mapping, torch.ones(3))
        os._exit(0 if torch.allclose(got, expected, atol=1e-4) else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child hung in the native kernel")


def test_loading_the_native_library_leaves_the_float_environment_alone(tmp_path):
    """The library is compiled with -ffast-math; linked with it too, GCC's crtfastmath.o would set flush-to-zero and
    denormals-are-zero for the loading thread (subnormal results become 0 in torch's ops and the caller's own, and
    hypothesis refuses to draw floats). A fresh process, a fresh build: subnormals survive the load."""
    import subprocess
    import sys

    code = ("import torch\nfrom kernels import cpu_native\nassert cpu_native.load() is not None\n"
            "print(repr((torch.tensor([1e-40]) * 1.0).item()), repr(float.fromhex('0x1p-1040') * 1.0))")
    env = {**os.environ, "LORAFLEET_KERNELS_CACHE": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    assert float(out[0]) > 0.0 and float(out[1]) > 0.0, out
