"""The runner's decode attention on CPU reads K/V in place from the pages (kernels.paged_decode_attention);
with it switched off the runner gathers them for SDPA. A decode step of sequences of different lengths gives
the same logits either way, with full attention and with a sliding window (set on the runner: the tiny bases
have none)."""
import dataclasses

import pytest
import torch

from inference_worker.model import ModelRunner, SeqStep


@pytest.mark.parametrize("base,window", [("tiny_llama", None), ("tiny_mistral", None), ("tiny_llama", 20)])
def test_decode_logits_are_the_same_read_in_place_or_gathered(base, window, request):
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

    calls = []
    import inference_worker.model as model

    real = model.paged_decode_attention
    model.paged_decode_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        in_place = runner.forward(decode)
    finally:
        model.paged_decode_attention = real
    assert len(calls) == runner.config.num_layers  # every layer read the pages in place
    runner.native_attention = False
    gathered = runner.forward(decode)  # the same step again: writes the same K/V, reads them by gathering
    torch.testing.assert_close(in_place, gathered, rtol=1e-4, atol=1e-4)


def test_the_runners_layers_normalise_natively(tiny_llama):
    import inference_worker.model as model

    runner = ModelRunner(tiny_llama, pool_pages=16, enable_lora=False)
    calls = []
    real = model.native_rms_norm
    model.native_rms_norm = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        runner.forward([SeqStep([0, 1], 0, [3, 5, 7])])
    finally:
        model.native_rms_norm = real
    assert len(calls) == 2 * runner.config.num_layers + 1  # two per layer and the final norm


def test_the_runners_layers_rotate_and_store_keys_natively(tiny_llama):
    """The native pass (kernels.rope_kv_write) stores what the torch path stores: the same prompt's next-token
    logits with the kernel on and off."""
    import inference_worker.model as model

    calls = []
    real = model.rope_kv_write
    results = []
    for native in (True, False):
        runner = ModelRunner(tiny_llama, pool_pages=16, enable_lora=False)
        model.rope_kv_write = (lambda *a, **k: calls.append(1) or real(*a, **k)) if native else (lambda *a, **k: None)
        try:
            runner.forward([SeqStep([0, 1], 0, [3, 5, 7, 9, 11])])
            results.append(runner.forward([SeqStep([0, 1], 5, [13])]))  # attends to the stored keys and values
        finally:
            model.rope_kv_write = real
    assert len(calls) == 2 * runner.config.num_layers  # every layer of both steps
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
