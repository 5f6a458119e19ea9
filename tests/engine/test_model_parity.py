"""The model runner computes what Hugging Face transformers and PEFT compute, on every architecture.

transformers is the oracle for the base model (logits within 1e-4 in fp32, identical greedy tokens) and
PEFT for LoRA semantics (scaling, rsLoRA, target names). A tiny greedy loop drives the runner here; the
engine's real scheduler is tested elsewhere.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from inference_worker.model import ModelRunner, SeqStep, onednn_packing_available
from kernels import gemm_available
from protocol.lora_layout import TARGET_MODULES as ALL_TARGETS
from protocol.lora_layout import peft_scale
from tests.support.peft_factory import make_random_peft_adapter

PROMPT = [17, 120, 45, 301, 9, 77, 250, 13, 88, 402, 5, 66, 140, 233]


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


class Seq:
    """One sequence's KV blocks and position, for driving the runner by hand."""

    def __init__(self, runner: ModelRunner, max_len: int, slot: int = -1) -> None:
        self.runner, self.slot, self.pos = runner, slot, 0
        self.blocks = runner.kv.allocator.allocate(-(-max_len // runner.block_size))

    def step(self, tokens: list[int]) -> SeqStep:
        s = SeqStep(block_table=self.blocks, start_pos=self.pos, token_ids=list(tokens), slot=self.slot)
        self.pos += len(tokens)
        return s

    def free(self) -> None:
        self.runner.kv.allocator.free(self.blocks)


def greedy(runner: ModelRunner, prompt: list[int], n: int, slot: int = -1) -> list[int]:
    """Greedy decode that stops at EOS, as `generate(do_sample=False)` does."""
    seq = Seq(runner, len(prompt) + n, slot)
    logits = runner.forward([seq.step(prompt)])
    out: list[int] = []
    for _ in range(n):
        tok = int(logits[0].argmax())
        out.append(tok)
        if tok in runner.config.eos_token_ids:
            break
        logits = runner.forward([seq.step([tok])])
    seq.free()
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def load_peft_into(runner: ModelRunner, adapter_dir) -> int:
    """Place a PEFT adapter folder in the runner's pool; returns its slot."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    return runner.load_adapter(weights, rank=cfg["r"], scale=peft_scale(cfg["lora_alpha"], cfg["r"], cfg["use_rslora"]))


# The tiny models are below PACK_MIN_HIDDEN, so by default they run F.linear; the other two run the same checks on
# the GEMMs wider models take by default: the native GEMM on packed panels (kernels.gemm; AVX-512 or AVX2) where it runs,
# oneDNN's pre-packed GEMM elsewhere.
NO_ONEDNN = not onednn_packing_available(torch.device("cpu"), torch.float32)
PACKED = [{"packed_weights": False},
          pytest.param({"packed_weights": True, "native_gemm": False},
                       marks=pytest.mark.skipif(NO_ONEDNN, reason="torch without oneDNN linear ops")),
          pytest.param({"packed_weights": True, "native_gemm": True},
                       marks=pytest.mark.skipif(NO_ONEDNN or not gemm_available(), reason="no native GEMM (AVX-512 / AVX2)"))]
PACKED_IDS = ["F.linear", "onednn-packed", "native-gemm"]


@pytest.mark.parametrize("packed", PACKED, ids=PACKED_IDS)
def test_prefill_and_decode_logits_match_transformers(tiny_base, packed):
    runner = ModelRunner(tiny_base, pool_pages=256, **packed)
    model = hf_model(tiny_base)
    seq = Seq(runner, len(PROMPT) + 21)
    ours = runner.forward([seq.step(PROMPT)])[0]
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), use_cache=True)
    theirs, past = out.logits[0, -1], out.past_key_values
    assert theirs.abs().max() > 1.0  # logits with real spread, so the comparison means something
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for _ in range(20):
        tok = int(theirs.argmax())
        ours = runner.forward([seq.step([tok])])[0]
        with torch.no_grad():
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        theirs, past = out.logits[0, -1], out.past_key_values
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("packed", PACKED, ids=PACKED_IDS)
def test_greedy_tokens_match_transformers_for_32_steps(tiny_base, packed):
    runner = ModelRunner(tiny_base, pool_pages=256, enable_lora=False, **packed)
    theirs = hf_greedy(hf_model(tiny_base), PROMPT, 32)
    assert len(theirs) == 32
    assert greedy(runner, PROMPT, 32) == theirs


PEFT_CASES = [
    # arch, r, alpha, rsLoRA, targets
    ("llama", 4, 8, False, ("q_proj", "v_proj")),
    ("llama", 64, 16, True, ALL_TARGETS),
    ("mistral", 16, 32, False, ("o_proj", "gate_proj", "down_proj")),
    ("mistral", 8, 8, True, ("k_proj", "up_proj")),
    ("qwen2", 32, 64, False, ALL_TARGETS),
    ("qwen2", 12, 16, True, ("q_proj", "k_proj", "v_proj", "o_proj")),
]


@pytest.mark.parametrize("arch,r,alpha,rslora,targets", PEFT_CASES,
                         ids=[f"{c[0]}-r{c[1]}-a{c[2]}{'-rs' if c[3] else ''}-{len(c[4])}t" for c in PEFT_CASES])
def test_peft_adapter_greedy_tokens_match_peft_generate(request, tmp_path, arch, r, alpha, rslora, targets):
    from peft import PeftModel

    base = request.getfixturevalue(f"tiny_{arch}")
    adapter = make_random_peft_adapter(base, tmp_path / "adapter", r=r, alpha=alpha, target_modules=targets,
                                       use_rslora=rslora, seed=r)
    peft_model = PeftModel.from_pretrained(hf_model(base), str(adapter)).eval()
    theirs = hf_greedy(peft_model, PROMPT, 32)

    runner = ModelRunner(base, pool_pages=256, max_lora_rank=64)
    slot = load_peft_into(runner, adapter)
    ours = greedy(runner, PROMPT, 32, slot=slot)
    assert ours == theirs
    # The adapter really changes the output (a zero adapter would pass the line above vacuously).
    assert ours != greedy(runner, PROMPT, 32, slot=-1)


@pytest.mark.parametrize("packed", PACKED[1:], ids=PACKED_IDS[1:])
def test_peft_adapter_on_packed_weights_matches_peft_generate(tiny_qwen2, tmp_path, packed):
    """LoRA adds into column views of the fused q/k/v and gate/up outputs (and Qwen2's q/k/v biases): on oneDNN's
    packed GEMMs and the native GEMM too."""
    from peft import PeftModel

    adapter = make_random_peft_adapter(tiny_qwen2, tmp_path / "adapter", r=32, alpha=64, target_modules=ALL_TARGETS,
                                       seed=32)
    theirs = hf_greedy(PeftModel.from_pretrained(hf_model(tiny_qwen2), str(adapter)).eval(), PROMPT, 32)
    runner = ModelRunner(tiny_qwen2, pool_pages=256, max_lora_rank=64, **packed)
    assert runner.pack_rows is not None and runner.native_gemm == packed["native_gemm"]
    slot = load_peft_into(runner, adapter)
    ours = greedy(runner, PROMPT, 32, slot=slot)
    assert ours == theirs and ours != greedy(runner, PROMPT, 32, slot=-1)


@pytest.mark.skipif(not onednn_packing_available(torch.device("cpu"), torch.float32), reason="torch without oneDNN")
def test_tied_head_packed_as_a_copy_is_counted_and_gives_the_same_logits(tiny_qwen2, tiny_llama):
    """A tied LM head is the embedding table: packing it for oneDNN makes a second copy, which the memory budget
    pays for (the pool is that much smaller), and the logits do not change."""
    budget = 64 << 20
    packed = ModelRunner(tiny_qwen2, memory_bytes=budget, packed_weights=True)
    as_stored = ModelRunner(tiny_qwen2, memory_bytes=budget, packed_weights=True, pack_tied_head=False)
    table = packed.embed.numel() * packed.embed.element_size()
    assert packed.head_copy_bytes == table > 0 and as_stored.head_copy_bytes == 0
    assert packed.weights_bytes == as_stored.weights_bytes + table
    assert packed.memory_report()["head_copy_bytes"] == table
    assert packed.pool.bytes <= as_stored.pool.bytes - table + packed.pool.page_bytes  # the pool gave the copy up
    a, b = Seq(packed, len(PROMPT) + 1), Seq(as_stored, len(PROMPT) + 1)
    torch.testing.assert_close(packed.forward([a.step(PROMPT)]), as_stored.forward([b.step(PROMPT)]),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="pack_tied_head"):  # nothing to pack: an untied head is packed anyway
        ModelRunner(tiny_llama, pool_pages=64, packed_weights=True, pack_tied_head=True)
    with pytest.raises(ValueError, match="pack_tied_head"):
        ModelRunner(tiny_qwen2, pool_pages=64, packed_weights=False, pack_tied_head=True)


def test_chunked_prefill_gives_the_same_logits(tiny_base):
    runner = ModelRunner(tiny_base, pool_pages=256)
    prompt = (PROMPT * 3)[:40]
    whole = Seq(runner, 41)
    expected = runner.forward([whole.step(prompt)])
    chunked = Seq(runner, 41)
    for a, b in [(0, 7), (7, 20), (20, 33), (33, 34)]:  # chunk edges off the 16-token block edges
        runner.forward([chunked.step(prompt[a:b])])
    got = runner.forward([chunked.step(prompt[34:])])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # and decoding after either continues identically
    tok = [int(expected.argmax())]
    torch.testing.assert_close(runner.forward([chunked.step(tok)]), runner.forward([whole.step(tok)]),
                               atol=1e-4, rtol=0)


def test_sequences_on_different_slots_in_one_forward_equal_each_alone(tiny_llama, tmp_path):
    runner = ModelRunner(tiny_llama, pool_pages=512, max_lora_rank=32)
    s0 = load_peft_into(runner, make_random_peft_adapter(tiny_llama, tmp_path / "a", r=8, target_modules=ALL_TARGETS))
    s1 = load_peft_into(runner, make_random_peft_adapter(tiny_llama, tmp_path / "b", r=32, alpha=8, seed=5,
                                                         target_modules=("q_proj", "down_proj")))
    assert (s0, s1) == (0, 1)
    prompts = {0: PROMPT[:9], 1: PROMPT[3:], -1: PROMPT[::-1]}

    def history(slot: int) -> tuple[Seq, list[SeqStep]]:
        """A fresh sequence and its steps: prefill, then 3 decode tokens (fixed ids)."""
        seq = Seq(runner, 32, slot)
        steps = [seq.step(prompts[slot])] + [seq.step([t]) for t in (11, 22, 33)]
        return seq, steps

    alone = {}
    for slot in prompts:
        seq, steps = history(slot)
        alone[slot] = [runner.forward([s])[0] for s in steps]
        seq.free()

    # Together: slot 0 and 3 start decoding while slot -1 is still prefilling (mixed prefill + decode).
    seqs = {slot: history(slot) for slot in prompts}
    plan = [[(0, 0), (1, 0)], [(0, 1), (1, 1), (-1, 0)], [(1, 2), (-1, 1), (0, 2)], [(-1, 2), (0, 3), (1, 3)],
            [(-1, 3)]]
    for batch in plan:
        logits = runner.forward([seqs[slot][1][i] for slot, i in batch])
        for row, (slot, i) in enumerate(batch):
            torch.testing.assert_close(logits[row], alone[slot][i], atol=1e-4, rtol=0)
    assert not torch.allclose(alone[0][0], alone[-1][0])


def test_base_tokens_on_an_adapter_runner_equal_a_lora_free_runner(tiny_qwen2, tmp_path):
    with_lora = ModelRunner(tiny_qwen2, pool_pages=256)
    load_peft_into(with_lora, make_random_peft_adapter(tiny_qwen2, tmp_path / "a", target_modules=ALL_TARGETS))
    without = ModelRunner(tiny_qwen2, pool_pages=256, enable_lora=False)
    assert greedy(with_lora, PROMPT, 16) == greedy(without, PROMPT, 16)
    with pytest.raises(RuntimeError):
        without.load_adapter({}, rank=8, scale=1.0)


def test_bad_adapters_are_refused_and_leave_the_pool_untouched(tiny_llama, tmp_path):
    runner = ModelRunner(tiny_llama, pool_pages=256, max_lora_rank=16)
    adapter = make_random_peft_adapter(tiny_llama, tmp_path / "a", r=8)
    slot = load_peft_into(runner, adapter)
    before = greedy(runner, PROMPT, 8, slot=slot)
    free = runner.pool.num_free
    good = load_file(str(adapter / "adapter_model.safetensors"))
    name = next(k for k in good if "lora_A" in k)
    bad_cases = [
        {**good, name: torch.zeros(8, 65)},  # wrong d_in
        {k: v for k, v in good.items() if k != name},  # A without B
        {**good, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)},  # not a target projection
        {**good, name.replace("layers.0", "layers.7"): good[name]},  # layer the base does not have
    ]
    for bad in bad_cases:
        with pytest.raises(ValueError):
            runner.load_adapter(bad, rank=8, scale=2.0)
    with pytest.raises(ValueError):
        runner.load_adapter(good, rank=32, scale=2.0)  # over max_lora_rank
    assert runner.pool.num_free == free  # nothing allocated by a refused adapter
    assert greedy(runner, PROMPT, 8, slot=slot) == before
    runner.unload_adapter(slot)
    with pytest.raises(ValueError, match="holds no adapter"):
        runner.forward([Seq(runner, 16, slot=slot).step(PROMPT)])


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
], ids=["linear", "llama3"])
def test_rope_scaling_matches_transformers(tiny_llama, tmp_path, rope):
    path = tmp_path / "scaled"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(cfg))
    runner = ModelRunner(path, pool_pages=256, enable_lora=False)
    prompt = (PROMPT * 10)[:120]  # positions far enough for low frequencies to matter
    ours = runner.forward([Seq(runner, 120).step(prompt)])[0]
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_unsupported_rope_scaling_is_a_clear_error(tiny_llama, tmp_path):
    path = tmp_path / "longrope"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="longrope"):
        ModelRunner(path)


def test_mistral_sliding_window_matches_transformers(tiny_mistral, tmp_path):
    path = tmp_path / "windowed"
    shutil.copytree(tiny_mistral, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    runner = ModelRunner(path, pool_pages=256, enable_lora=False)
    model = hf_model(path)
    prompt = (PROMPT * 3)[:30]
    seq = Seq(runner, 40)
    runner.forward([seq.step(prompt[:12])])
    ours = runner.forward([seq.step(prompt[12:])])[0]  # a chunk that starts past the window
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    ours = runner.forward([seq.step([5])])[0]  # and a decode step
    with torch.no_grad():
        theirs = model(torch.tensor([prompt + [5]])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_make_tiny_base_writes_a_deterministic_checkpoint_that_transformers_loads(tmp_path):
    from django.core.management import call_command
    from transformers import AutoTokenizer

    args = ["--arch", "qwen2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--layers", "3",
            "--intermediate", "48", "--vocab", "400"]
    call_command("make_tiny_base", str(tmp_path / "a"), "--seed", "5", *args)
    call_command("make_tiny_base", str(tmp_path / "b"), "--seed", "5", *args)
    call_command("make_tiny_base", str(tmp_path / "c"), "--seed", "6", *args)
    weights = {n: (tmp_path / n / "model.safetensors").read_bytes() for n in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]

    model = hf_model(tmp_path / "a")
    assert (model.config.model_type, model.config.hidden_size, model.config.num_hidden_layers) == ("qwen2", 32, 3)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    text = "Hello, how are you? I am going to the park."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None and tok.bos_token is not None
    assert tok.eos_token_id in ModelRunner(tmp_path / "a", pool_pages=256).config.eos_token_ids


def test_reused_pages_leave_nothing_of_their_previous_owner(tiny_mistral, tmp_path):
    """Pages go from adapter to adapter and from KV cache to adapter: an adapter placed on them computes
    exactly what it computes on a fresh pool (every byte it does not write is zeroed)."""
    big = make_random_peft_adapter(tiny_mistral, tmp_path / "big", r=32, target_modules=ALL_TARGETS, seed=1)
    small = make_random_peft_adapter(tiny_mistral, tmp_path / "small", r=4, target_modules=("v_proj",), seed=2)
    other = make_random_peft_adapter(tiny_mistral, tmp_path / "other", r=8, target_modules=ALL_TARGETS, seed=3)

    def run(runner: ModelRunner, a: int, b: int) -> torch.Tensor:
        # `a` targets every projection, so every projection runs for `b`'s tokens too
        seqs = [Seq(runner, 16, slot=a), Seq(runner, 16, slot=b)]
        out = runner.forward([seqs[0].step(PROMPT), seqs[1].step(PROMPT)])
        for s in seqs:
            s.free()
        return out

    fresh = ModelRunner(tiny_mistral, pool_pages=160, max_lora_rank=32)
    expected = run(fresh, load_peft_into(fresh, other), load_peft_into(fresh, small))

    reused = ModelRunner(tiny_mistral, pool_pages=160, max_lora_rank=32)
    # Fill the pool's pages with KV data, then with a big adapter, then give them back.
    kv = Seq(reused, reused.pool.num_pages * reused.block_size)
    reused.forward([kv.step((PROMPT * 40)[:reused.config.max_position_embeddings - 1])])
    kv.free()
    s_other = load_peft_into(reused, other)
    s_big = load_peft_into(reused, big)
    run(reused, s_other, s_big)
    reused.unload_adapter(s_big)
    s_small = load_peft_into(reused, small)
    assert s_small == s_big  # the slot and (highest run first) the pages the big adapter held
    torch.testing.assert_close(run(reused, s_other, s_small), expected, atol=1e-5, rtol=0)


def test_llama_with_attention_bias_matches_transformers(tiny_llama, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "biased"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["attention_bias"] = True  # biases on q, k, v and o
    (path / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for i in range(cfg["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out_features = weights[f"model.layers.{i}.self_attn.{proj}.weight"].shape[0]
            weights[f"model.layers.{i}.self_attn.{proj}.bias"] = 0.5 * torch.randn(out_features, generator=gen)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    runner = ModelRunner(path, pool_pages=256, enable_lora=False)
    ours = runner.forward([Seq(runner, 16).step(PROMPT)])[0]
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_later_layers_repeat_the_first_layers_checked_lora_call_with_the_same_result(tiny_llama, tmp_path,
                                                                                    monkeypatch):
    """A step's LoRA term: the first layer's call of each projection goes through kernels.add_lora and its checks;
    the later layers repeat that native call on their own x, out and weights (kernels.repeatable_lora_call). The
    logits of a mixed step (a prompt beside decode tokens of two adapters of different ranks and targets, and a base
    token) and of the decode step after it are the same with the repeat on and off."""
    import inference_worker.lora as lora_mod
    from kernels.cpu import NativeLoraCall

    results, repeats = [], []
    for repeat in (True, False):
        runner = ModelRunner(tiny_llama, pool_pages=512, max_lora_rank=32)
        s0 = load_peft_into(runner, make_random_peft_adapter(tiny_llama, tmp_path / f"a{repeat}", r=8,
                                                             target_modules=ALL_TARGETS))
        s1 = load_peft_into(runner, make_random_peft_adapter(tiny_llama, tmp_path / f"b{repeat}", r=32, alpha=8, seed=5,
                                                             target_modules=("q_proj", "down_proj")))
        steps = [[SeqStep([0, 1], 0, PROMPT[:9], s0), SeqStep([2, 3], 0, PROMPT[3:], s1)],
                 [SeqStep([0, 1], 9, [11], s0), SeqStep([2, 3], 11, [12], s1), SeqStep([4, 5], 0, PROMPT, -1)],
                 [SeqStep([0, 1], 10, [13], s0), SeqStep([2, 3], 12, [14], s1), SeqStep([4, 5], 14, [15], -1)]]
        calls = []
        with monkeypatch.context() as m:
            real = NativeLoraCall.__call__
            m.setattr(NativeLoraCall, "__call__",
                      lambda self, *a, calls=calls, real=real: calls.append(1) or real(self, *a))
            if not repeat:
                m.setattr(lora_mod, "repeatable_lora_call", lambda *a: None)
            results.append([runner.forward(s) for s in steps])
        repeats.append(len(calls))
    layers = runner.config.num_layers
    assert repeats == [3 * len(ALL_TARGETS) * (layers - 1), 0]  # every projection of every layer after the first
    for on, off in zip(*results, strict=True):
        torch.testing.assert_close(on, off, rtol=0, atol=0)  # the same kernel on the same arguments: bit for bit
