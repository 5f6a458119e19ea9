"""A decode step's LoRA term inside the native GEMMs (kernels.gemm_lora, kernels.FusedLoraGroup): every segment's
shrink first, then each panel's expand right after the panel. The logits are the same bits as the GEMM followed by one
LoRA call a projection, whatever the adapters target, their ranks, the tokens each one has in the step, the threads,
and wherever a projection's columns start and end inside a GEMM panel; steps it does not cover take the calls after."""
import pytest
import torch

from demo.tiny_base import build_tiny_base
from inference_worker.model import ModelRunner
from kernels import gemm_available, gemm_side_helps
from protocol.lora_layout import TARGET_MODULES
from tests.engine.test_model_parity import PROMPT, Seq, load_peft_into
from tests.support.peft_factory import make_random_peft_adapter

pytestmark = pytest.mark.skipif(not gemm_available(), reason="the native GEMM needs AVX-512 or AVX2 + FMA (and gcc)")


@pytest.fixture(scope="module")
def ragged_base(tmp_path_factory):
    """q 96, k and v 32 columns (q/k/v: 160 = panels of 64 + 64 + 32, or 48 x 3 + 16 on AVX2), intermediate 200 (gate
    and up each end mid-panel), a q/k/v bias (qwen2): every projection boundary inside a panel."""
    return build_tiny_base(tmp_path_factory.mktemp("ragged"), arch="qwen2", seed=5, hidden=96, heads=6, kv_heads=2,
                           intermediate=200, layers=2)


@pytest.fixture(scope="module")
def ragged(ragged_base, tmp_path_factory):
    """A runner on the native GEMM and four adapters: all seven projections at r 8, q and v at r 16, up and down at
    r 32, all seven at r 4."""
    tmp = tmp_path_factory.mktemp("ragged_adapters")
    runner = ModelRunner(ragged_base, pool_pages=512, max_lora_rank=32, packed_weights=True, native_gemm=True,
                         fuse_lora=True)
    slots = [load_peft_into(runner, make_random_peft_adapter(ragged_base, tmp / f"a{i}", r=r, seed=10 + i,
                                                             target_modules=targets))
             for i, (r, targets) in enumerate([(8, TARGET_MODULES), (16, ("q_proj", "v_proj")),
                                               (32, ("up_proj", "down_proj")), (4, TARGET_MODULES)])]
    return runner, slots


def decode_logits(runner, order: list[int], fuse: bool) -> tuple[torch.Tensor, dict]:
    """Prefill each sequence of `order` (one slot each), then one decode step of all of them; -> that step's logits
    and the fused groups the step built."""
    runner.fuse_lora = fuse
    seqs = [Seq(runner, 64, slot) for slot in order]
    try:
        runner.forward([seq.step(PROMPT) for seq in seqs])
        steps = [seq.step([5 + i]) for i, seq in enumerate(seqs)]
        contexts = []
        build = runner._context

        def keep(steps):  # the step's context, as its forward pass used it
            built = build(steps)
            contexts.append(built[1])
            return built

        runner._context = keep
        try:
            logits = runner.forward(steps)
        finally:
            del runner._context
        return logits, contexts[0]
    finally:
        for seq in seqs:
            seq.free()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_segments_of_every_length_give_the_same_bits_fused(ragged, threads):
    runner, (every, attention, mlp, small) = ragged
    # segments of 1, 2, 3 and 5 tokens (the short and the 16-wide long expand), base tokens between them
    order = [every, -1, attention, attention, mlp, mlp, mlp, small, -1, every, every, every, every]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, ctx = decode_logits(runner, order, True)
        after, _ = decode_logits(runner, order, False)
    finally:
        torch.set_num_threads(before)
    assert ctx.fuse_lora
    built = {group: f for group, f in ctx.lora._fused.items()}
    assert set(built) == {"qkv", "o", "gate_up", "down"} and all(f is not None for f in built.values())
    assert built["qkv"].nproj == 3 and built["gate_up"].nproj == 2  # each projection of the group that is targeted
    assert torch.equal(fused, after)
    base, _ = decode_logits(runner, [-1] * len(order), True)
    assert not torch.equal(fused[0], base[0])  # the adapters change the answer


def test_projections_no_adapter_of_the_step_targets_are_left_out(ragged):
    runner, (_, attention, mlp, _) = ragged
    fused, ctx = decode_logits(runner, [attention, mlp, attention], True)
    groups = ctx.lora._fused
    assert groups["o"] is None  # neither adapter targets o_proj: the plain GEMM
    assert groups["qkv"].nproj == 2  # q and v, not k
    assert groups["gate_up"].nproj == 1 and groups["down"].nproj == 1
    after, _ = decode_logits(runner, [attention, mlp, attention], False)
    assert torch.equal(fused, after)


def test_steps_it_does_not_cover_take_the_lora_calls_after_the_gemms(ragged, ragged_base, tmp_path):
    runner, (every, *_rest) = ragged
    seqs = [Seq(runner, 64, slot) for slot in (every, every)]
    try:  # a step with a prompt in it: not fused (a prompt's GEMMs may split their rows)
        runner.forward([seqs[0].step(PROMPT)])
        _, ctx, _ = runner._context([seqs[0].step([3]), seqs[1].step(PROMPT)])
        assert not ctx.fuse_lora and not ctx.lora._fused
    finally:
        for seq in seqs:
            seq.free()
    # 16-bit adapter weights: the fused call takes fp32 only, so each group builds none and the calls run after
    half = ModelRunner(ragged_base, pool_pages=512, max_lora_rank=32, packed_weights=True, native_gemm=True,
                       adapter_dtype=torch.float16)
    slot = load_peft_into(half, make_random_peft_adapter(ragged_base, tmp_path / "h", r=8, seed=3,
                                                         target_modules=TARGET_MODULES))
    fused, ctx = decode_logits(half, [slot, -1, slot], True)
    assert ctx.fuse_lora and all(f is None for f in ctx.lora._fused.values())
    after, _ = decode_logits(half, [slot, -1, slot], False)
    assert torch.equal(fused, after)


def test_where_it_runs_by_default(ragged_base):
    # by default where a GEMM's prefetch of adapter lines was measured to pay (AMD CPUs; it cost an Intel Xeon 2-5%),
    # on or off on request, off without the native GEMM
    assert ModelRunner(ragged_base, pool_pages=8, packed_weights=True, native_gemm=True).fuse_lora is gemm_side_helps()
    assert ModelRunner(ragged_base, pool_pages=8, packed_weights=True, native_gemm=True, fuse_lora=True).fuse_lora
    assert not ModelRunner(ragged_base, pool_pages=8, packed_weights=True, native_gemm=True, fuse_lora=False).fuse_lora
    assert not ModelRunner(ragged_base, pool_pages=8, packed_weights=False, fuse_lora=True).fuse_lora  # no native GEMM


def test_a_step_of_more_rows_than_one_gemm_pass_takes_the_calls_after(ragged):
    from kernels import FusedLoraGroup, LoraMapping
    from kernels.cpu_native import GEMM_LORA_MAX_ROWS

    runner, (every, *_rest) = ragged
    lora = runner.lora
    parts = [(0, lora.tables["o_proj"])]
    for rows, built in ((GEMM_LORA_MAX_ROWS, True), (GEMM_LORA_MAX_ROWS + 1, False)):
        mapping = LoraMapping.build([every] * rows, len(lora._slots), device=runner.device)
        group = FusedLoraGroup.build(parts, mapping, lora.dtype, lora.scales)
        assert (group is not None) is built
