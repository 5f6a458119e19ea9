"""The runner's decode attention on CPU reads K/V in place from the pages (kernels.paged_decode_attention, or the
step's kernels.StepKernels); with it switched off the runner gathers them for SDPA. A decode step of sequences of
different lengths gives the same logits either way, with full attention and with a sliding window (set on the
runner: the tiny bases have none). The layers' other small ops (RMSNorm, RoPE with the KV write, SwiGLU's gate)
run natively too, through the step's kernels, and give what the per-call wrappers and torch give."""
import dataclasses

import pytest
import torch

import inference_worker.model as model
from inference_worker.model import ModelRunner, SeqStep
from kernels import StepKernels


def count_calls(monkeypatch, owner, name: str, *, non_none: bool = False) -> list:
    """Wrap owner.name so each call (each call that returned something, with non_none) appends to the list."""
    calls, real = [], getattr(owner, name)

    def wrapper(*a, **k):
        out = real(*a, **k)
        if out is not None or not non_none:
            calls.append(1)
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return calls


@pytest.mark.parametrize("base,window", [("tiny_llama", None), ("tiny_mistral", None), ("tiny_llama", 20)])
@pytest.mark.parametrize("step_kernels", [True, False])
def test_decode_logits_are_the_same_read_in_place_or_gathered(base, window, step_kernels, request, monkeypatch):
    if not step_kernels:  # the per-call wrapper (kernels.paged_decode_attention) instead
        monkeypatch.setattr(model.StepKernels, "build", classmethod(lambda cls, **kw: None))
    runner = ModelRunner(request.getfixturevalue(base), pool_pages=128, enable_lora=False)
    assert runner.native_attention
    if window is not None:
        runner.config = dataclasses.replace(runner.config, sliding_windows=[window] * runner.config.num_layers)
        for block in runner.blocks:
            block.window = window
    lengths = [3, 16, 17, 45, 70]  # within a block, a full block, one past, several blocks
    tables, next_page = [], 0
    for n in lengths:
        nb = n // runner.block_size + 1
        tables.append(list(range(next_page, next_page + nb)))
        next_page += nb
    prompts = [[(7 * i + 3 * k) % 200 + 1 for k in range(n)] for i, n in enumerate(lengths)]
    runner.forward([SeqStep(t, 0, p) for t, p in zip(tables, prompts, strict=True)])
    decode = [SeqStep(t, n, [5 + i]) for i, (t, n) in enumerate(zip(tables, lengths, strict=True))]

    with monkeypatch.context() as m:
        if step_kernels:
            calls = count_calls(m, StepKernels, "attention", non_none=True)
        else:
            calls = count_calls(m, model, "paged_decode_attention", non_none=True)
        in_place = runner.forward(decode)
    assert len(calls) == runner.config.num_layers  # every layer read the pages in place
    runner.native_attention = False
    gathered = runner.forward(decode)  # the same step again: writes the same K/V, reads them by gathering
    torch.testing.assert_close(in_place, gathered, rtol=1e-4, atol=1e-4)


def test_the_runners_layers_normalise_natively(tiny_llama, monkeypatch):
    runner = ModelRunner(tiny_llama, pool_pages=16, enable_lora=False)
    in_layers = count_calls(monkeypatch, StepKernels, "norm")
    per_call = count_calls(monkeypatch, model, "native_rms_norm")
    runner.forward([SeqStep([0, 1], 0, [3, 5, 7])])
    assert len(in_layers) == 2 * runner.config.num_layers  # two per layer, on the step's kernels
    assert len(per_call) == 1  # and the final norm

    monkeypatch.setattr(model.StepKernels, "build", classmethod(lambda cls, **kw: None))
    runner.forward([SeqStep([2, 3], 0, [3, 5, 7])])
    assert len(per_call) == 1 + 2 * runner.config.num_layers + 1  # without them, the wrapper for every norm


def test_the_runners_layers_rotate_and_store_keys_natively(tiny_llama, monkeypatch):
    """The native pass (the step's kernels, or kernels.rope_kv_write) stores what the torch path stores: the same
    prompt's next-token logits with the kernel on and off."""
    calls = count_calls(monkeypatch, StepKernels, "rope_kv")
    results = []
    for native in (True, False):
        runner = ModelRunner(tiny_llama, pool_pages=16, enable_lora=False)
        with monkeypatch.context() as m:
            if not native:  # neither the step's kernels nor the per-call wrapper: torch's RoPE and index_put
                m.setattr(model.StepKernels, "build", classmethod(lambda cls, **kw: None))
                m.setattr(model, "rope_kv_write", lambda *a, **k: None)
            runner.forward([SeqStep([0, 1], 0, [3, 5, 7, 9, 11])])
            results.append(runner.forward([SeqStep([0, 1], 5, [13])]))  # attends to the stored keys and values
    assert len(calls) == 2 * runner.config.num_layers  # every layer of both native steps
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base", ["tiny_llama", "tiny_mistral"])
def test_mixed_steps_and_a_decode_step_are_the_same_with_the_steps_kernels_or_without(base, request, monkeypatch):
    """Steps carrying prompt chunks beside decode tokens, then a decode-only step: the same logits from the step's
    kernels (buffers shared by the layers, SwiGLU's gate native, short prompt chunks attending on the kernel, the
    second half of a prompt over the pages its first half wrote) as from the per-call wrappers, SDPA and torch's
    silu * up, so a buffer a layer reuses never leaks into the next layer's result. A chunk whose context is longer
    than NATIVE_PROMPT_CONTEXT still goes through SDPA."""
    long = model.NATIVE_PROMPT_CONTEXT + 22
    tables = [list(range(0, 3)), list(range(3, 6)), list(range(6, 9)), list(range(9, 9 + long // 16 + 2))]
    prompts = [[(5 * i + 7 * k) % 300 + 1 for k in range(n)] for i, n in enumerate([9, 20, 33, long])]
    steps = [
        [SeqStep(tables[0], 0, prompts[0]), SeqStep(tables[1], 0, prompts[1][:12])],  # prompts only
        [SeqStep(tables[0], 9, [11]), SeqStep(tables[1], 12, prompts[1][12:]),  # a prompt's second chunk
         SeqStep(tables[2], 0, prompts[2])],
        [SeqStep(tables[0], 10, [13]), SeqStep(tables[1], 20, [14]), SeqStep(tables[2], 33, [15]),
         SeqStep(tables[3], 0, prompts[3])],  # too long a chunk for the kernel: this step attends through SDPA
        [SeqStep(tables[0], 11, [16]), SeqStep(tables[1], 21, [17]), SeqStep(tables[2], 34, [18]),
         SeqStep(tables[3], long, [19])],  # decode only
    ]
    results, on_kernel = [], []
    for step_kernels in (True, False):
        runner = ModelRunner(request.getfixturevalue(base), pool_pages=32, enable_lora=False)
        with monkeypatch.context() as m:
            attended = count_calls(m, StepKernels, "attention", non_none=True)
            swiglus = count_calls(m, StepKernels, "swiglu")
            if not step_kernels:
                m.setattr(model.StepKernels, "build", classmethod(lambda cls, **kw: None))
            results.append([runner.forward(s) for s in steps])
            on_kernel.append((len(attended), len(swiglus)))
    layers = runner.config.num_layers
    assert on_kernel == [(3 * layers, 4 * layers), (0, 0)]  # every step but the long chunk's attended on the kernel
    for with_kernels, without in zip(*results, strict=True):
        torch.testing.assert_close(with_kernels, without, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base,window", [("tiny_llama", None), ("tiny_mistral", None), ("tiny_llama", 20)])
def test_short_chunks_deep_in_a_prompt_read_the_pages_in_place(base, window, request, monkeypatch):
    """A long prompt read a few tokens a step (issue 46: beside other tenants' decodes) attends on its pages in place
    (kernels.paged_prefill_attention) instead of gathering the K/V of every earlier position each layer: chunks of
    2, 5, 17 and 64 tokens after more than NATIVE_PROMPT_CONTEXT cached positions, crossing page boundaries, beside
    decode rows, give the logits of the gathering path, with full attention and with a sliding window."""
    start = model.NATIVE_PROMPT_CONTEXT + 13
    sizes = [2, 5, 17, model.PAGED_PREFILL_TOKENS]
    total = start + sum(sizes)
    prompt = [(11 * k + 5) % 300 + 1 for k in range(total)]
    other = [(3 * k + 1) % 200 + 2 for k in range(9)]
    results, calls_seen = [], []
    for paged in (True, False):
        monkeypatch.setattr(model, "PAGED_PREFILL_TOKENS", max(sizes) if paged else 0)
        runner = ModelRunner(request.getfixturevalue(base), pool_pages=48, enable_lora=False)
        if window is not None:
            runner.config = dataclasses.replace(runner.config, sliding_windows=[window] * runner.config.num_layers)
            for block in runner.blocks:
                block.window = window
        long_table, short_table = list(range(0, total // 16 + 1)), list(range(40, 42))
        runner.forward([SeqStep(long_table, 0, prompt[:start]), SeqStep(short_table, 0, other)])
        out, pos = [], start
        with monkeypatch.context() as m:
            calls = count_calls(m, model, "paged_prefill_attention", non_none=True)
            for i, n in enumerate(sizes):
                out.append(runner.forward([SeqStep(short_table, len(other) + i, [7 + i]),
                                           SeqStep(long_table, pos, prompt[pos:pos + n])]))
                pos += n
        results.append(out)
        calls_seen.append(len(calls))
    assert calls_seen == [len(sizes) * runner.config.num_layers, 0]
    for paged, gathered in zip(*results, strict=True):
        torch.testing.assert_close(paged, gathered, rtol=1e-4, atol=1e-4)
