"""kernels.StepArena: the runner's copies of a step's small-op outputs, one a layer where they fit in
protocol.memory.STEP_ARENA_BYTES (a decode step), fewer where not, kept from step to step.
(tests/engine/test_model_parity.py and test_native_attention.py: the runner's steps on them against transformers.)"""
import torch

from kernels import StepArena
from protocol.memory import STEP_ARENA_BYTES


def spans(copies):
    """(start, end) byte addresses of every buffer of every copy."""
    return [(b.data_ptr(), b.data_ptr() + b.numel() * 4) for c in copies for b in c]


def test_a_decode_step_gets_a_copy_a_layer_none_overlapping():
    arena = StepArena(STEP_ARENA_BYTES)
    widths = [576, 576, 768, 1536, 576]  # SmolLM2: two norms, q/k rotated, SwiGLU, attention
    copies = arena.carve(30, widths, 64)
    assert len(copies) == 30 and all([tuple(b.shape) for b in c] == [(64, w) for w in widths] for c in copies)
    s = sorted(spans(copies))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(s, s[1:], strict=False))  # disjoint
    for i, c in enumerate(copies):  # writing one layer's buffers leaves every other layer's as it was
        for b in c:
            b.fill_(float(i))
    assert all(torch.all(b == float(i)) for i, c in enumerate(copies) for b in c)


def test_big_steps_get_fewer_copies_and_the_buffer_is_kept_between_steps():
    arena = StepArena(STEP_ARENA_BYTES)
    widths = [1024, 1024, 1280, 2816, 1024]  # the mid model
    per_copy = 4 * 512 * sum(widths)
    prefill = arena.carve(8, widths, 512)
    assert len(prefill) == max(1, min(8, STEP_ARENA_BYTES // per_copy)) < 8
    assert sum(b.numel() * 4 for c in prefill for b in c) <= max(STEP_ARENA_BYTES, per_copy)
    decode = arena.carve(8, widths, 64)  # smaller: cut from the same buffer, no new allocation
    assert len(decode) == 8
    lo = min(a for a, _ in spans(prefill))
    assert min(a for a, _ in spans(decode)) == lo
    assert arena.carve(8, widths, 64) is decode  # the same step shape again: the same views
    huge = arena.carve(8, widths, 8192)  # one copy beyond the cap still works
    assert len(huge) == 1 and huge[0][3].shape == (8192, 2816)
