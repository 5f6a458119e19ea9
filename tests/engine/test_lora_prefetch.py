"""The native GEMMs prefetch the step's adapter matrices that the LoRA calls after them read (model.StepSides,
kernels.GemmSide): exactly those matrices, of the step's adapters only, in each layer; prefetching changes no
result."""
import ctypes

import pytest
import torch

from inference_worker.lora import GEMM_GROUPS
from inference_worker.model import ModelRunner
from kernels import gemm_available, gemm_side_helps
from protocol.lora_layout import TARGET_MODULES
from tests.engine.test_model_parity import PROMPT, Seq, load_peft_into
from tests.support.peft_factory import make_random_peft_adapter


def spans_read(lora, slot: int, group: str) -> list[tuple[int, int]]:
    """(byte offset, bytes) of each A and B^T the LoRA kernel reads for `slot` in `group`, from the offset tables
    the kernel itself is handed."""
    size, spans = lora.dtype.itemsize, []
    for proj in GEMM_GROUPS[group]:
        table = lora.tables.get(proj)
        rank = int(table.ranks[slot]) if table is not None else 0
        if rank:
            d_in, d_out = lora.projections[proj]
            spans.append((int(table.a_offsets[slot]) * size, rank * d_in * size))
            spans.append((int(table.b_offsets[slot]) * size, rank * d_out * size))
    return spans


def test_each_gemm_prefetches_exactly_the_step_adapters_matrices_of_its_projections(tiny_llama, tmp_path):
    runner = ModelRunner(tiny_llama, pool_pages=512, max_lora_rank=32)
    all_linear = load_peft_into(runner, make_random_peft_adapter(tiny_llama, tmp_path / "a", r=8,
                                                                 target_modules=TARGET_MODULES))
    attention = load_peft_into(runner, make_random_peft_adapter(tiny_llama, tmp_path / "b", r=16, seed=2,
                                                                target_modules=("q_proj", "v_proj")))
    mlp = load_peft_into(runner, make_random_peft_adapter(tiny_llama, tmp_path / "c", r=32, seed=3,
                                                          target_modules=("up_proj", "down_proj")))
    idle = load_peft_into(runner, make_random_peft_adapter(tiny_llama, tmp_path / "d", r=4, seed=4,
                                                           target_modules=TARGET_MODULES))
    lora = runner.lora
    step = lora.mapping([mlp, mlp, -1, attention, all_linear, all_linear])  # `idle` is resident, not in the step
    for group in GEMM_GROUPS:
        ranges = lora.group_ranges(step.residents, group)
        wanted = []
        for slot in (mlp, attention, all_linear):  # the order the step's segments read them
            spans = spans_read(lora, slot, group)
            if spans:  # one range from the first matrix to the end of the last: they lie side by side
                start = min(o for o, _ in spans)
                wanted.append((start, max(o + b for o, b in spans) - start))
        assert ranges == wanted, group
        assert not any(lo <= o < lo + size for o, _ in spans_read(lora, idle, group) for lo, size in ranges)
    assert len(wanted) == 2  # down_proj: the MLP adapter and the all-linear one, not the attention-only one


@pytest.mark.skipif(not gemm_available(), reason="the native GEMM needs AVX-512 or AVX2 + FMA (and gcc)")
def test_each_native_gemm_of_a_step_is_handed_its_adapters_matrices_in_each_layer(tiny_qwen2, tmp_path):
    # by default only where it was measured to help (AMD CPUs; on an Intel Xeon it cost the fleet 11%)
    assert ModelRunner(tiny_qwen2, pool_pages=8, packed_weights=True,
                       native_gemm=True).lora_side_prefetch is gemm_side_helps()
    runner = ModelRunner(tiny_qwen2, pool_pages=256, max_lora_rank=32, packed_weights=True, native_gemm=True,
                         lora_prefetch=True, fuse_lora=False)  # fused, a decode step's GEMMs fetch their own slices
    slot = load_peft_into(runner, make_random_peft_adapter(tiny_qwen2, tmp_path / "a", r=8, seed=1,
                                                           target_modules=("q_proj", "down_proj")))
    seqs = [Seq(runner, 64, s) for s in (slot, -1)]
    runner.forward([seq.step(PROMPT) for seq in seqs])
    steps = [seq.step([7]) for seq in seqs]
    _, ctx, _ = runner._context(steps)
    residents = [runner.lora._slots[slot]]
    for layer in range(runner.config.num_layers):
        for group, wanted in [("qkv", runner.lora.group_ranges(residents, "qkv")), ("o", []), ("gate_up", []),
                              ("down", runner.lora.group_ranges(residents, "down"))]:
            side = ctx.sides.at(layer, group)
            if not wanted:
                assert side is None
                continue
            base, ranges_ptr, n = side
            flat = list((ctypes.c_int64 * (2 * n)).from_address(ranges_ptr))
            assert base == runner.pool.data[layer].data_ptr()
            assert list(zip(flat[::2], flat[1::2], strict=True)) == wanted
    runner.lora_side_prefetch = False
    assert runner._context(steps)[1].sides is None
    base_only = [Seq(runner, 64, -1)]
    runner.lora_side_prefetch = True
    assert runner._context([base_only[0].step(PROMPT)])[1].sides is None  # no adapter in the step: nothing to fetch


@pytest.mark.skipif(not gemm_available(), reason="the native GEMM needs AVX-512 or AVX2 + FMA (and gcc)")
def test_prefetching_the_adapters_during_the_gemms_changes_no_logit(tiny_qwen2, tmp_path):
    """A mixed step (prefill and decode, base and two adapters) on the native GEMM, with the prefetch and without:
    the same bits."""
    runner = ModelRunner(tiny_qwen2, pool_pages=256, max_lora_rank=32, packed_weights=True, native_gemm=True,
                         fuse_lora=False)
    slots = [load_peft_into(runner, make_random_peft_adapter(tiny_qwen2, tmp_path / f"a{i}", r=r, seed=i,
                                                             target_modules=TARGET_MODULES))
             for i, r in enumerate((8, 32))]
    logits = []
    for prefetch in (True, False):
        runner.lora_side_prefetch = prefetch
        seqs = [Seq(runner, 64, s) for s in (*slots, -1)]
        first = runner.forward([seq.step(PROMPT) for seq in seqs])
        mixed = runner.forward([seqs[0].step([5]), seqs[1].step(PROMPT[:7]), seqs[2].step([9])])
        logits.append(torch.cat([first, mixed]))
        for seq in seqs:
            seq.free()
    assert torch.equal(logits[0], logits[1])
    assert not torch.equal(logits[0][0], logits[0][2])  # the adapters change the answer
