"""The bases users bring beyond Llama (issue 48): the runner computes what transformers and PEFT compute.

Qwen3 on a tiny random checkpoint with every feature it has switched on: per-head RMSNorm on q and k before RoPE, a
head_dim that is not hidden / heads (q_dim 96 beside hidden 64), GQA, sliding-window layers beside full ones. Base-only
and a mixed batch of PEFT adapters (ranks 8-32, different targets, one rsLoRA) give PEFT's greedy tokens on every
request, logits within fp32 tolerance, and the same tokens in a batch as alone. Then RoPE yarn and dynamic NTK against
transformers, and what register_base, the upload validator and the capacity planner read of these bases. Phi-3 with
its fused modules and LongRoPE; Gemma 2 and Gemma 3 (text) with every feature on (demo/tiny_gemma.py): the same checks,
plus prefill in chunks across the sliding window, the tied head, Gemma 3's two RoPEs, and the named refusals.
"""
import io
import json
import shutil

import pytest
import torch

from demo.tiny_base import build_tiny_base
from inference_worker.model import ModelRunner, SeqStep
from kernels import gemm_available
from protocol.lora_layout import TARGET_MODULES as ALL_TARGETS
from tests.engine.test_model_parity import (
    NO_ONEDNN,
    PACKED,
    PACKED_IDS,
    PROMPT,
    Seq,
    greedy,
    hf_greedy,
    hf_model,
    load_peft_into,
)
from tests.support.peft_factory import make_random_peft_adapter


def _edit_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """3 layers, 4 heads of 24 over hidden 64, 2 KV heads, layers 1 and 2 attend to the last 8 positions only."""
    path = build_tiny_base(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", seed=11, hidden=64, heads=4,
                           kv_heads=2, head_dim=24, layers=3, intermediate=96)
    _edit_config(path, use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    return path


def test_the_tiny_qwen3_has_every_feature_switched_on(tiny_qwen3):
    """What the tests below rely on: transformers reads the checkpoint as we wrote it."""
    model = hf_model(tiny_qwen3)
    attn = model.model.layers[0].self_attn
    assert model.config.model_type == "qwen3" and attn.head_dim == 24 and attn.q_proj.out_features == 96
    assert attn.q_proj.bias is None and attn.q_norm.weight.shape == (24,)
    assert not torch.allclose(attn.q_norm.weight, torch.ones(24))  # jittered: a norm left out shows in the logits
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    runner = ModelRunner(tiny_qwen3, pool_pages=64, enable_lora=False)
    assert runner.config.sliding_windows == [None, 8, 8] and runner.config.head_dim == 24


def assert_logits_follow_transformers(runner, model, prompt, decode_steps: int) -> None:
    """The runner's logits equal transformers' (fp32 tolerance) on the prompt and on `decode_steps` greedy tokens."""
    seq = Seq(runner, len(prompt) + decode_steps + 1)
    ours = runner.forward([seq.step(prompt)])[0]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    theirs, past = out.logits[0, -1], out.past_key_values
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for _ in range(decode_steps):
        tok = int(theirs.argmax())
        ours = runner.forward([seq.step([tok])])[0]
        with torch.no_grad():
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        theirs, past = out.logits[0, -1], out.past_key_values
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("packed", PACKED, ids=PACKED_IDS)
def test_qwen3_prefill_and_decode_logits_match_transformers(tiny_qwen3, packed):
    runner = ModelRunner(tiny_qwen3, pool_pages=256, **packed)
    model = hf_model(tiny_qwen3)
    prompt = (PROMPT * 2)[:24]  # past the window of 8
    assert_logits_follow_transformers(runner, model, prompt, decode_steps=20)


def test_qwen3_chunked_prefill_gives_the_same_logits(tiny_qwen3):
    runner = ModelRunner(tiny_qwen3, pool_pages=256)
    prompt = (PROMPT * 3)[:40]
    whole = Seq(runner, 41)
    expected = runner.forward([whole.step(prompt)])
    chunked = Seq(runner, 41)
    for a, b in [(0, 7), (7, 20), (20, 33)]:
        runner.forward([chunked.step(prompt[a:b])])
    torch.testing.assert_close(runner.forward([chunked.step(prompt[33:])]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("packed", PACKED, ids=PACKED_IDS)
def test_qwen3_greedy_tokens_match_transformers_for_32_steps(tiny_qwen3, packed):
    runner = ModelRunner(tiny_qwen3, pool_pages=256, enable_lora=False, **packed)
    theirs = hf_greedy(hf_model(tiny_qwen3), PROMPT, 32)
    assert len(theirs) == 32
    assert greedy(runner, PROMPT, 32) == theirs


# rank, alpha, rsLoRA, targets: q/k only (what the q/k norms then normalise), the rest, everything
ADAPTERS = [(8, 16, False, ("q_proj", "k_proj")),
            (16, 32, True, ("v_proj", "o_proj", "gate_proj", "down_proj")),
            (32, 64, False, ALL_TARGETS)]
PROMPTS = [PROMPT, PROMPT[3:], (PROMPT * 2)[5:27], PROMPT[::-1]]  # the last one base-only


def greedy_batch(runner: ModelRunner, requests: list[tuple[list[int], int]], n: int
                 ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decode of every request in shared forward steps, request i starting at step i (so prompts go beside
    other requests' decode tokens); a request stops at EOS or n tokens. Returns each one's tokens and its
    first-step (prompt) logits."""
    seqs = [Seq(runner, len(p) + n, slot) for p, slot in requests]
    out: list[list[int]] = [[] for _ in requests]
    first: list[torch.Tensor] = [torch.empty(0)] * len(requests)
    done = [False] * len(requests)
    step = 0
    while not all(done):
        rows, batch = [], []
        for i, (prompt, _) in enumerate(requests):
            if done[i] or i > step:
                continue
            batch.append(seqs[i].step(prompt if i == step else [out[i][-1]]))
            rows.append(i)
        logits = runner.forward(batch)
        for row, i in enumerate(rows):
            if i == step:
                first[i] = logits[row]
            tok = int(logits[row].argmax())
            out[i].append(tok)
            done[i] = len(out[i]) == n or tok in runner.config.eos_token_ids
        step += 1
    for s in seqs:
        s.free()
    return out, first


@pytest.mark.parametrize("packed", PACKED, ids=PACKED_IDS)
def test_qwen3_mixed_batch_of_peft_adapters_matches_peft_on_every_request(tiny_qwen3, tmp_path, packed):
    from peft import PeftModel

    dirs = [make_random_peft_adapter(tiny_qwen3, tmp_path / f"a{r}", r=r, alpha=alpha, use_rslora=rs,
                                     target_modules=targets, seed=r)
            for r, alpha, rs, targets in ADAPTERS]
    runner = ModelRunner(tiny_qwen3, pool_pages=512, max_lora_rank=32, **packed)
    slots = [load_peft_into(runner, d) for d in dirs] + [-1]
    requests = list(zip(PROMPTS, slots, strict=True))
    n = 24
    together, first = greedy_batch(runner, requests, n)

    for i, (prompt, slot) in enumerate(requests):
        model = hf_model(tiny_qwen3) if slot < 0 else PeftModel.from_pretrained(hf_model(tiny_qwen3),
                                                                                str(dirs[i])).eval()
        assert together[i] == hf_greedy(model, prompt, n), f"request {i} (slot {slot})"
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(first[i], theirs, atol=1e-4, rtol=0)
        assert together[i] == greedy(runner, prompt, n, slot=slot)  # batch invariance: alone, the same tokens
    base_alone = [greedy(runner, p, n) for p in PROMPTS[:3]]
    assert all(together[i] != base_alone[i] for i in range(3))  # each adapter changes its answer


def assert_mixed_adapter_steps_equal_each_alone(base, tmp_path) -> None:
    """Batch invariance as for Llama: mixed steps (prompts beside decode tokens of two adapters and a base request)
    give each row the logits it gets alone."""
    runner = ModelRunner(base, pool_pages=512, max_lora_rank=32)
    s0 = load_peft_into(runner, make_random_peft_adapter(base, tmp_path / "a", r=8, target_modules=ALL_TARGETS))
    s1 = load_peft_into(runner, make_random_peft_adapter(base, tmp_path / "b", r=32, alpha=8, seed=5,
                                                         target_modules=("k_proj", "up_proj")))
    prompts = {s0: PROMPT[:9], s1: PROMPT[3:], -1: (PROMPT * 2)[:20]}

    def history(slot: int) -> tuple[Seq, list[SeqStep]]:
        seq = Seq(runner, 32, slot)
        return seq, [seq.step(prompts[slot])] + [seq.step([t]) for t in (11, 22, 33)]

    alone = {}
    for slot in prompts:
        seq, steps = history(slot)
        alone[slot] = [runner.forward([s])[0] for s in steps]
        seq.free()
    seqs = {slot: history(slot) for slot in prompts}
    plan = [[(s0, 0), (s1, 0)], [(s0, 1), (s1, 1), (-1, 0)], [(s1, 2), (-1, 1), (s0, 2)],
            [(-1, 2), (s0, 3), (s1, 3)], [(-1, 3)]]
    for batch in plan:
        logits = runner.forward([seqs[slot][1][i] for slot, i in batch])
        for row, (slot, i) in enumerate(batch):
            torch.testing.assert_close(logits[row], alone[slot][i], atol=1e-4, rtol=0)
    assert not torch.allclose(alone[s0][0], alone[-1][0])


def test_qwen3_requests_on_different_adapters_in_one_forward_equal_each_alone(tiny_qwen3, tmp_path):
    """Batch invariance as for Llama: a mixed step (prompts beside decode tokens of two adapters and a base token)
    gives each row the logits it gets alone."""
    assert_mixed_adapter_steps_equal_each_alone(tiny_qwen3, tmp_path)


# --- RoPE: yarn and dynamic NTK -------------------------------------------------------------------------------

YARN = [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 64,
     "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
     "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64,
     "attention_factor": 1.25},
]
YARN_IDS = ["default-mscale", "betas-untruncated", "mscale-ratio", "attention-factor"]


def _with_rope(src, dst, rope: dict, **changes):
    shutil.copytree(src, dst)
    _edit_config(dst, rope_parameters=rope, **changes)
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("rope", YARN, ids=YARN_IDS)
def test_yarn_matches_transformers(request, tmp_path, arch, rope):
    base = request.getfixturevalue(f"tiny_{arch}")
    path = _with_rope(base, tmp_path / "yarn", rope)
    runner = ModelRunner(path, pool_pages=256, enable_lora=False)
    model = hf_model(path)
    assert model.model.rotary_emb.rope_type == "yarn"
    assert runner.config.max_position_embeddings == json.loads((base / "config.json").read_text())[
        "max_position_embeddings"]  # yarn does not change the context served
    prompt = (PROMPT * 10)[:120]  # far past original_max_position_embeddings
    ours = runner.forward([Seq(runner, 120).step(prompt)])[0]
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert greedy(runner, prompt, 16) == hf_greedy(model, prompt, 16)


def test_yarn_changes_the_logits(tiny_llama, tmp_path):
    """The yarn test above is not vacuous: on this model and prompt the scaled RoPE gives other logits."""
    path = _with_rope(tiny_llama, tmp_path / "yarn", YARN[0])
    prompt = (PROMPT * 10)[:120]
    runs = [ModelRunner(p, pool_pages=256, enable_lora=False) for p in (tiny_llama, path)]
    plain, scaled = (r.forward([Seq(r, 120).step(prompt)])[0] for r in runs)
    assert (plain - scaled).abs().max() > 0.1


@pytest.fixture(scope="module")
def short_llama(tmp_path_factory):
    """A Llama whose config says 64 positions, so a dynamic-NTK sequence grows past it within a short test."""
    return build_tiny_base(tmp_path_factory.mktemp("short_llama"), arch="llama", seed=21, max_position=64)


@pytest.mark.parametrize("factor", [2.0, 3.0])
def test_dynamic_ntk_extends_the_context_and_matches_transformers_token_by_token(short_llama, tmp_path, factor):
    """Dynamic NTK: within max_position_embeddings the default frequencies; past it, each new token with the
    frequencies transformers computes for the sequence's length as it grows (generate, one token a step). The served
    context is max_position_embeddings x factor."""
    path = _with_rope(short_llama, tmp_path / "dynamic", {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                          "factor": factor})
    runner = ModelRunner(path, pool_pages=256, enable_lora=False)
    assert runner.config.max_position_embeddings == int(64 * factor)
    model = hf_model(path)
    prompt = (PROMPT * 4)[:50]
    seq = Seq(runner, 120)
    ours = runner.forward([seq.step(prompt)])[0]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    theirs, past = out.logits[0, -1], out.past_key_values
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for _ in range(60):  # positions 50..109: across the config's 64
        tok = int(theirs.argmax())
        ours = runner.forward([seq.step([tok])])[0]
        with torch.no_grad():
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        theirs, past = out.logits[0, -1], out.past_key_values
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert model.model.rotary_emb.max_seq_len_cached == 110  # transformers did grow its frequencies
    assert greedy(runner, prompt, 60) == hf_greedy(hf_model(path), prompt, 60)
    # and the scaling mattered: with the default RoPE the same positions give other logits
    plain = ModelRunner(short_llama, pool_pages=256, enable_lora=False)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        plain.forward([Seq(plain, 120).step((PROMPT * 8)[:100])])
    runner_long = runner.forward([Seq(runner, 120).step((PROMPT * 8)[:100])])[0]
    assert runner_long.isfinite().all()


def test_dynamic_ntk_keys_depend_on_their_position_only(short_llama, tmp_path):
    """Past max_position_embeddings a chunked prompt gives the logits of the whole prompt: a key's rotation depends
    on its position, not on the chunk or batch it was computed in (the prefix cache and preemption rely on it)."""
    path = _with_rope(short_llama, tmp_path / "dynamic", {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                          "factor": 2.0})
    runner = ModelRunner(path, pool_pages=256, enable_lora=False)
    prompt = (PROMPT * 8)[:100]
    whole = runner.forward([Seq(runner, 100).step(prompt)])
    chunked = Seq(runner, 100)
    for a, b in [(0, 30), (30, 70), (70, 99)]:
        runner.forward([chunked.step(prompt[a:b])])
    torch.testing.assert_close(runner.forward([chunked.step(prompt[99:])]), whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0], "long_factor": [1.0]}, "longrope"),
    ({"rope_type": "mrope", "factor": 4.0}, "mrope"),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 32}, "at least 1"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
], ids=["longrope", "mrope", "factor-below-1", "no-factor", "partial-rotary"])
def test_unserved_rope_is_refused_by_the_runner_and_by_register_base(tiny_llama, tmp_path, rope, match):
    from adapters.manifest import ManifestError, shape_manifest_from_checkpoint

    path = _with_rope(tiny_llama, tmp_path / "bad", {"rope_theta": 10000.0, **rope})
    with pytest.raises(ValueError, match=match):
        ModelRunner(path, pool_pages=64)
    with pytest.raises(ManifestError, match=match):
        shape_manifest_from_checkpoint(path)


def test_rope_scaling_in_transformers_v4_spelling_is_read_the_same(tiny_llama, tmp_path):
    """config.json written by transformers 4.x: rope_theta beside rope_scaling {"type": ...}."""
    v5 = _with_rope(tiny_llama, tmp_path / "v5", YARN[0])
    v4 = tmp_path / "v4"
    shutil.copytree(tiny_llama, v4)
    _edit_config(v4, rope_parameters=None, rope_theta=10000.0,
                 rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    a, b = (ModelRunner(p, pool_pages=64, enable_lora=False) for p in (v5, v4))
    assert (a.config.rope_scaling, a.config.rope_theta) == (b.config.rope_scaling, b.config.rope_theta)
    torch.testing.assert_close(a.rope_cos, b.rope_cos, atol=0, rtol=0)


# --- what the web side reads of these bases ----------------------------------------------------------------------

def test_register_base_reads_qwen3s_head_dim_and_its_parameter_count(tiny_qwen3):
    from adapters.capacity import base_parameter_count
    from adapters.manifest import shape_manifest_from_checkpoint

    m = shape_manifest_from_checkpoint(tiny_qwen3)
    assert (m["architecture"], m["head_dim"], m["rope_type"]) == ("qwen3", 24, "default")
    assert (m["modules"]["q_proj"]["out_features"], m["modules"]["o_proj"]["in_features"]) == (96, 96)
    assert (m["modules"]["k_proj"]["out_features"], m["modules"]["v_proj"]["out_features"]) == (48, 48)
    assert base_parameter_count(m) == m["num_parameters"]  # the formula counts the q/k norm weights too


def test_qwen3_8b_preset_gives_the_published_parameter_count():
    # Qwen3-8B: V=151936 h=4096 i=12288 L=36 H=32 KV=8 hd=128, untied, no biases, q/k norms [128] each.
    #   embeddings 2*151936*4096 = 1,244,659,712
    #   per layer  2*4096*4096 + 2*4096*1024 = 41,943,040; 3*4096*12288 = 150,994,944; q/k norms 256;
    #              norms 8,192 -> 192,946,432;  *36 = 6,946,071,552
    #   total 1,244,659,712 + 6,946,071,552 + 4,096 = 8,190,735,360 (the model card's 8.2B)
    from adapters.capacity import base_parameter_count, preset_manifest

    assert base_parameter_count(preset_manifest("qwen3-8b")) == 8_190_735_360


def test_dynamic_ntk_base_is_registered_with_its_extended_context(short_llama, tmp_path):
    from adapters.manifest import shape_manifest_from_checkpoint

    path = _with_rope(short_llama, tmp_path / "dynamic", {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                          "factor": 2.0})
    m = shape_manifest_from_checkpoint(path)
    assert (m["max_position_embeddings"], m["rope_type"]) == (128, "dynamic")  # what the gateway checks prompts against
    assert ModelRunner(path, pool_pages=64).config.max_position_embeddings == 128  # and what the engine serves


@pytest.mark.parametrize("model_type", ["gemma3", "gemma3n_text", "qwen3_moe", "mixtral"])
def test_unserved_model_types_are_refused_by_name(tiny_llama, tmp_path, model_type):
    from adapters.manifest import ManifestError, shape_manifest_from_checkpoint

    path = tmp_path / model_type
    shutil.copytree(tiny_llama, path)
    _edit_config(path, model_type=model_type)
    with pytest.raises(ManifestError, match=f"model_type '{model_type}' is not supported; lorafleet serves llama, "
                                            "mistral, qwen2, qwen3, phi3, gemma2, gemma3_text"):
        shape_manifest_from_checkpoint(path)
    with pytest.raises(ValueError, match=f"unsupported model_type '{model_type}'"):
        ModelRunner(path, pool_pages=64)


def test_a_qwen3_peft_adapter_passes_upload_validation_as_peft_saved_it(tiny_qwen3, tmp_path):
    """PEFT's own module names and shapes for Qwen3 (q_proj out 96 beside hidden 64): accepted without renaming;
    the same file against a Llama-shaped manifest of the same hidden size is refused."""
    from adapters.manifest import shape_manifest_from_checkpoint, shape_manifest_from_config
    from adapters.validation import AdapterValidationError, validate_adapter

    adapter = make_random_peft_adapter(tiny_qwen3, tmp_path / "a", r=16, target_modules=ALL_TARGETS)
    config = json.loads((adapter / "adapter_config.json").read_text())
    data = (adapter / "adapter_model.safetensors").read_bytes()
    spec = validate_adapter(config, io.BytesIO(data), len(data), shape_manifest_from_checkpoint(tiny_qwen3),
                            max_rank=64)
    assert spec.rank == 16 and set(spec.target_modules) == set(ALL_TARGETS)
    llama_shaped = shape_manifest_from_config({**json.loads((tiny_qwen3 / "config.json").read_text()),
                                               "model_type": "llama", "head_dim": None})
    with pytest.raises(AdapterValidationError):
        validate_adapter(config, io.BytesIO(data), len(data), llama_shaped, max_rank=64)


# --- Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, LongRoPE ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    """Phi-3 as transformers writes it: q/k/v and gate/up fused in the checkpoint, GQA, every layer windowed (8)."""
    path = build_tiny_base(tmp_path_factory.mktemp("tiny_phi3"), arch="phi3", seed=13, hidden=64, heads=4,
                           kv_heads=2, layers=2, intermediate=96)
    _edit_config(path, sliding_window=8)
    return path


def test_the_tiny_phi3_is_fused_as_phi3_checkpoints_are(tiny_phi3):
    model = hf_model(tiny_phi3)
    layer = model.model.layers[0]
    assert model.config.model_type == "phi3" and model.config.sliding_window == 8
    assert layer.self_attn.qkv_proj.out_features == 64 + 2 * 32 and layer.mlp.gate_up_proj.out_features == 2 * 96
    assert ModelRunner(tiny_phi3, pool_pages=64, enable_lora=False).config.sliding_windows == [8, 8]


@pytest.mark.parametrize("packed", PACKED, ids=PACKED_IDS)
def test_phi3_logits_and_greedy_tokens_match_transformers(tiny_phi3, packed):
    runner = ModelRunner(tiny_phi3, pool_pages=256, **packed)
    model = hf_model(tiny_phi3)
    prompt = (PROMPT * 2)[:24]  # past the window
    assert_logits_follow_transformers(runner, model, prompt, decode_steps=10)
    assert greedy(runner, PROMPT, 32) == hf_greedy(model, PROMPT, 32)


# PEFT's own names for Phi-3: the fused modules, as a user's adapter has them
PHI3_ADAPTERS = [(8, 16, False, ("qkv_proj",)),
                 (16, 32, True, ("o_proj", "gate_up_proj")),
                 (32, 64, False, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]


@pytest.mark.parametrize("packed", PACKED, ids=PACKED_IDS)
def test_phi3_mixed_batch_of_fused_peft_adapters_matches_peft_on_every_request(tiny_phi3, tmp_path, packed):
    from peft import PeftModel
    from safetensors.torch import load_file

    dirs = [make_random_peft_adapter(tiny_phi3, tmp_path / f"a{r}", r=r, alpha=alpha, use_rslora=rs,
                                     target_modules=targets, seed=r)
            for r, alpha, rs, targets in PHI3_ADAPTERS]
    assert any(".qkv_proj.lora_A." in k for k in load_file(str(dirs[0] / "adapter_model.safetensors")))
    runner = ModelRunner(tiny_phi3, pool_pages=512, max_lora_rank=32, **packed)
    slots = [load_peft_into(runner, d) for d in dirs] + [-1]
    requests = list(zip(PROMPTS, slots, strict=True))
    n = 24
    together, first = greedy_batch(runner, requests, n)
    for i, (prompt, slot) in enumerate(requests):
        model = hf_model(tiny_phi3) if slot < 0 else PeftModel.from_pretrained(hf_model(tiny_phi3),
                                                                               str(dirs[i])).eval()
        assert together[i] == hf_greedy(model, prompt, n), f"request {i} (slot {slot})"
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(first[i], theirs, atol=1e-4, rtol=0)
        assert together[i] == greedy(runner, prompt, n, slot=slot)  # batch invariance
    assert all(together[i] != greedy(runner, PROMPTS[i], n) for i in range(3))


def test_a_fused_adapter_takes_the_pages_of_its_parts(tiny_phi3, tmp_path):
    """The mapping (protocol.lora_layout.FUSED_MODULES): the planner's arithmetic for a qkv_proj/gate_up_proj adapter
    is that of q/k/v and gate/up adapters of the same rank, and the worker takes exactly that many pages."""
    from protocol.lora_layout import ModelShape
    from protocol.memory import adapter_pages

    shape = ModelShape.from_config(json.loads((tiny_phi3 / "config.json").read_text()))
    assert shape.fused and set(shape.peft_modules()) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    fused = adapter_pages(shape, 32, ["qkv_proj", "gate_up_proj"], 16)
    assert fused == adapter_pages(shape, 32, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], 16)
    runner = ModelRunner(tiny_phi3, pool_pages=512, max_lora_rank=32)
    free = runner.pool.num_free
    load_peft_into(runner, make_random_peft_adapter(tiny_phi3, tmp_path / "a", r=32,
                                                    target_modules=("qkv_proj", "gate_up_proj")))
    assert free - runner.pool.num_free == fused
    assert runner.lora.pages_for(32, ["qkv_proj", "gate_up_proj"]) == fused  # what the engine reserves before loading


def test_a_phi3_peft_adapter_passes_upload_validation_and_the_workers_check_as_peft_saved_it(tiny_phi3, tmp_path):
    from safetensors.torch import load_file

    from adapters.manifest import shape_manifest_from_checkpoint
    from adapters.validation import AdapterValidationError, validate_adapter
    from inference_worker.adapter_cache import LoraShapes, check_adapter_weights
    from protocol.jobs import AdapterRef

    adapter = make_random_peft_adapter(tiny_phi3, tmp_path / "a", r=16,
                                       target_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    data = (adapter / "adapter_model.safetensors").read_bytes()
    manifest = shape_manifest_from_checkpoint(tiny_phi3)
    assert manifest["modules"]["qkv_proj"]["out_features"] == 128 and "q_proj" not in manifest["modules"]
    spec = validate_adapter(config, io.BytesIO(data), len(data), manifest, max_rank=64)
    assert sorted(spec.target_modules) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    ref = AdapterRef(version_id=1, sha256="0" * 64, storage_key="k", rank=16, alpha=float(config["lora_alpha"]),
                     use_rslora=False, target_modules=spec.target_modules, name="a")
    check_adapter_weights(load_file(str(adapter / "adapter_model.safetensors")), ref,
                          LoraShapes.from_config(ModelRunner(tiny_phi3, pool_pages=64).config), max_rank=64)
    # an adapter with Llama's module names is not one of this base's (Phi3 has no q_proj module)
    llama_named = {k.replace("qkv_proj", "q_proj"): v for k, v in load_file(str(adapter / "adapter_model.safetensors"))
                   .items() if "qkv_proj" in k}
    from safetensors.torch import save as save_bytes
    blob = save_bytes(llama_named)
    with pytest.raises(AdapterValidationError, match="q_proj"):
        validate_adapter({**config, "target_modules": ["q_proj"]}, io.BytesIO(blob), len(blob), manifest, max_rank=64)


def _longrope(half: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1.0 + 0.5 * torch.rand(half, generator=gen)).tolist(),
            "long_factor": (1.0 + 8.0 * torch.rand(half, generator=gen)).tolist()}


@pytest.mark.parametrize("spelling", ["v5", "v4"])
def test_phi3_longrope_matches_transformers_token_by_token_across_the_original_context(tiny_phi3, tmp_path, spelling):
    """LongRoPE: the short factors within original_max_position_embeddings (48 here), the long ones past it, the
    attention factor sqrt(1 + ln(128 / 48) / ln 48) throughout; as transformers' forward computes them, token by
    token with its cache."""
    rope = _longrope(8, seed=1)
    path = tmp_path / "longrope"
    shutil.copytree(tiny_phi3, path)
    if spelling == "v5":
        _edit_config(path, rope_parameters=rope, original_max_position_embeddings=48, max_position_embeddings=128)
    else:  # transformers 4.x: rope_scaling {"type": ...}, rope_theta beside it
        _edit_config(path, rope_parameters=None, rope_theta=10000.0, original_max_position_embeddings=48,
                     max_position_embeddings=128, rope_scaling={"type": "longrope", "short_factor": rope["short_factor"],
                                                                "long_factor": rope["long_factor"]})
    runner = ModelRunner(path, pool_pages=256, enable_lora=False)
    assert runner.config.rope_scaling["rope_type"] == "longrope" and runner.config.max_position_embeddings == 128
    model = hf_model(path)
    assert model.model.rotary_emb.rope_type == "longrope"
    prompt = (PROMPT * 3)[:40]
    seq = Seq(runner, 100)
    ours = runner.forward([seq.step(prompt)])[0]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    theirs, past = out.logits[0, -1], out.past_key_values
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for _ in range(40):  # positions 40..79: across 48
        tok = int(theirs.argmax())
        ours = runner.forward([seq.step([tok])])[0]
        with torch.no_grad():
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        theirs, past = out.logits[0, -1], out.past_key_values
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # generate() agrees while a sequence stays within the original context (HF's Phi-3 generate recomputes the whole
    # cache with the long factors at the crossing, which the runner does not: protocol.rope)
    assert greedy(runner, prompt[:24], 24) == hf_greedy(hf_model(path), prompt[:24], 24)


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "not supported for phi3"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}, "short_factor: a list of 8"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8, "partial_rotary_factor": 0.75},
     "partial_rotary_factor"),
], ids=["dynamic", "short-factor-length", "phi4-mini-partial-rotary"])
def test_phi3_rope_that_transformers_or_the_runner_cannot_serve_is_refused(tiny_phi3, tmp_path, rope, match):
    from adapters.manifest import ManifestError, shape_manifest_from_checkpoint

    path = _with_rope(tiny_phi3, tmp_path / "bad", {"rope_theta": 10000.0, **rope})
    with pytest.raises(ValueError, match=match):
        ModelRunner(path, pool_pages=64)
    with pytest.raises(ManifestError, match=match):
        shape_manifest_from_checkpoint(path)


def test_the_capacity_planner_reads_a_phi3_base_in_its_own_module_names(tiny_phi3):
    """The presets name the base's modules (qkv_proj is attention, gate_up_proj MLP), and the pool arithmetic counts
    a fused module as its parts, as the worker stores it."""
    from adapters.capacity import capacity_table, parse_fleet_mix, resolve_targets
    from adapters.manifest import shape_manifest_from_checkpoint

    manifest = shape_manifest_from_checkpoint(tiny_phi3)
    assert resolve_targets("attention-only", manifest) == ("qkv_proj", "o_proj")
    assert resolve_targets("all-linear", manifest) == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert len(capacity_table(manifest, gpu_gb=1.0)) == 10
    mix = parse_fleet_mix("8:attention-only:5,16:gate_up_proj+down_proj:3", manifest)
    assert [e.targets for e in mix] == [("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")]


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_the_engine_serves_each_familys_peft_adapter_as_peft_does(request, tmp_path, arch):
    """The worker's whole adapter path (the blob read and checked by the adapter cache, placed by the runner, a
    fused adapter split on the way) and its scheduler: greedy tokens of an adapter request and a base request in one
    engine equal PEFT's and transformers' generate."""
    import hashlib

    from peft import PeftModel

    from inference_worker.engine import Engine
    from protocol.jobs import AdapterRef, GenerationJob

    base = request.getfixturevalue(f"tiny_{arch}")
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if arch == "phi3" else ALL_TARGETS
    adapter = make_random_peft_adapter(base, tmp_path / "a", r=16, alpha=32, target_modules=targets, seed=3)
    blob = (adapter / "adapter_model.safetensors").read_bytes()
    ref = AdapterRef(version_id=1, sha256=hashlib.sha256(blob).hexdigest(), storage_key="adapters/a", rank=16,
                     alpha=32.0, use_rslora=False, target_modules=sorted(targets), name="a")
    n = 16
    engine = Engine(ModelRunner(base, pool_pages=512, max_lora_rank=32), {"adapters/a": blob}.__getitem__,
                    max_running=4).start()
    try:
        handles = [engine.submit(GenerationJob(request_id=rid, adapter=adapter_ref, prompt_token_ids=list(PROMPT),
                                               max_tokens=n, temperature=0.0, ignore_eos=True))
                   for rid, adapter_ref in (("lora", ref), ("base", None))]
        results = [h.result(60) for h in handles]
    finally:
        engine.stop()
    assert all(r.ok for r in results), [(r.error_code, r.error_message) for r in results]
    peft_model = PeftModel.from_pretrained(hf_model(base), str(adapter)).eval()
    with torch.no_grad():
        theirs = peft_model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    assert results[0].token_ids == theirs[0, len(PROMPT):].tolist()
    assert results[1].token_ids == hf_greedy(hf_model(base), PROMPT, n)
    assert results[0].token_ids != results[1].token_ids


# --- Gemma 2 and Gemma 3 (text) ----------------------------------------------------------------------------------
#
# Every feature on, on 4 layers of hidden 64: heads of 24 (not hidden / heads), GQA, query_pre_attn_scalar 20 (not
# head_dim), sliding layers (window 6, shorter than every prompt below) beside global ones, the final logits
# soft-capped at 6 (small enough to bite on these logits). The head is untied here (a random model whose head is its
# embedding table mostly repeats its input token, which would make greedy comparisons weak); the tied head real
# Gemmas have is checked on its own below. Gemma 2: attention scores soft-capped at 4, layers
# 0 and 2 sliding (its default pattern). Gemma 3: q/k norms, layers 0, 1 and 3 sliding, those rotating with theta
# 10,000 and the global layer with theta 1,000,000 and linear scaling x4.

GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    from demo.tiny_gemma import build_tiny_gemma

    return build_tiny_gemma(tmp_path_factory.mktemp("tiny_gemma2"), arch="gemma2", seed=17, tie_embeddings=False)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from demo.tiny_gemma import build_tiny_gemma

    return build_tiny_gemma(tmp_path_factory.mktemp("tiny_gemma3"), arch="gemma3", seed=29, attn_softcap=None,
                            tie_embeddings=False,
                            layer_types=GEMMA3_LAYER_TYPES, rope_scaling={"rope_type": "linear", "factor": 4.0})


GEMMAS = ["gemma2", "gemma3"]


def test_the_tiny_gemmas_have_every_feature_switched_on(tiny_gemma2, tiny_gemma3):
    """What the tests below rely on: transformers reads the checkpoints as we wrote them, and so does the runner."""
    g2, g3 = hf_model(tiny_gemma2), hf_model(tiny_gemma3)
    assert type(g2).__name__ == "Gemma2ForCausalLM" and type(g3).__name__ == "Gemma3ForCausalLM"
    for model in (g2, g3):
        attn = model.model.layers[0].self_attn
        assert attn.head_dim == 24 and attn.q_proj.out_features == 96 and attn.scaling == 20 ** -0.5
        assert model.config.final_logit_softcapping == 6.0
        assert not torch.allclose(model.model.layers[1].pre_feedforward_layernorm.weight, torch.zeros(64))
    assert g2.config.attn_logit_softcapping == 4.0 and g2.config.layer_types[:2] == ["sliding_attention",
                                                                                     "full_attention"]
    assert g3.config.layer_types == GEMMA3_LAYER_TYPES and g3.model.layers[0].self_attn.q_norm.weight.shape == (24,)
    assert g3.config.rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}
    assert g3.config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0

    r2 = ModelRunner(tiny_gemma2, pool_pages=64, enable_lora=False)
    assert r2.config.sliding_windows == [6, None, 6, None] and r2.config.attn_logit_softcapping == 4.0
    assert r2.config.query_pre_attn_scalar == 20 and r2.config.local_rope is None
    assert r2.step_kernels is True and r2.attention_scale == 20 ** -0.5  # the native step kernels soft-cap too
    r3 = ModelRunner(tiny_gemma3, pool_pages=64, enable_lora=False)
    assert r3.config.sliding_windows == [6, 6, None, 6] and r3.config.attn_logit_softcapping is None
    assert (r3.config.rope_theta, r3.config.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 4.0})
    assert r3.config.local_rope.theta == 10_000.0 and r3.config.local_rope.rope_type == "default"


@pytest.mark.parametrize("packed", PACKED, ids=PACKED_IDS)
@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_prefill_and_decode_logits_and_greedy_tokens_match_transformers(request, arch, packed):
    base = request.getfixturevalue(f"tiny_{arch}")
    runner = ModelRunner(base, pool_pages=256, **packed)
    model = hf_model(base)
    assert_logits_follow_transformers(runner, model, (PROMPT * 2)[:24], decode_steps=16)  # 4x the window
    theirs = hf_greedy(model, PROMPT, 32)
    assert len(theirs) == 32 and len(set(theirs)) > 8
    assert greedy(runner, PROMPT, 32) == theirs


@pytest.mark.parametrize("packed", PACKED, ids=PACKED_IDS)
@pytest.mark.parametrize("arch", GEMMAS)
def test_a_tied_gemma_head_is_its_embedding_table_unscaled(tmp_path, arch, packed):
    """Real Gemmas tie the head to the embedding table; the head multiplies by the table as stored (the sqrt(hidden)
    scaling is the embedding lookup's only), packed as a copy where the projections are packed."""
    from demo.tiny_gemma import build_tiny_gemma

    base = build_tiny_gemma(tmp_path / arch, arch=arch, seed=23, tie_embeddings=True,
                            layer_types=GEMMA3_LAYER_TYPES if arch == "gemma3" else None)
    model = hf_model(base)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    runner = ModelRunner(base, pool_pages=256, **packed)
    assert_logits_follow_transformers(runner, model, (PROMPT * 2)[:24], decode_steps=8)


@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_chunked_prefill_then_decode_follows_transformers_across_the_window(request, arch):
    """A prompt read in chunks shorter and longer than the window (6), then decoded on the paged KV cache: every
    chunk's sliding layers see only the last 6 positions, some of them in earlier chunks' pages, and the logits are
    transformers' (one forward over the whole prompt, then its cache) at the end of each chunk and at every decode
    step."""
    base = request.getfixturevalue(f"tiny_{arch}")
    runner = ModelRunner(base, pool_pages=256)
    model = hf_model(base)
    prompt = (PROMPT * 3)[:37]
    with torch.no_grad():
        every = model(torch.tensor([prompt])).logits[0]  # [37, vocab]
    seq = Seq(runner, 64)
    for a, b in [(0, 4), (4, 5), (5, 14), (14, 17), (17, 30), (30, 37)]:
        ours = runner.forward([seq.step(prompt[a:b])])[0]
        torch.testing.assert_close(ours, every[b - 1], atol=1e-4, rtol=0)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    theirs, past = out.logits[0, -1], out.past_key_values
    for _ in range(12):
        tok = int(theirs.argmax())
        ours = runner.forward([seq.step([tok])])[0]
        with torch.no_grad():
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        theirs, past = out.logits[0, -1], out.past_key_values
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_gemma2_soft_capped_prompt_attention_in_query_blocks_gives_transformers_logits(tiny_gemma2, monkeypatch):
    """Off the native kernels (the path of CUDA and of a CPU without a C compiler) a long prompt's soft-capped
    attention on CPU goes in blocks of queries whose scores fit SOFTCAP_SCORES_BYTES; with blocks of a few rows (a
    budget of 4000 bytes here) the logits are still transformers'."""
    import inference_worker.model as model_module

    monkeypatch.setattr(model_module, "SOFTCAP_SCORES_BYTES", 4000)  # 4 heads x 21-30 keys: blocks of 8-11 rows
    runner = ModelRunner(tiny_gemma2, pool_pages=256, step_kernels=False)
    runner.native_attention = False  # torch's softcapped_attention, as on CUDA
    model = hf_model(tiny_gemma2)
    prompt = (PROMPT * 3)[:30]
    with torch.no_grad():
        every = model(torch.tensor([prompt])).logits[0]
    seq = Seq(runner, 40)
    torch.testing.assert_close(runner.forward([seq.step(prompt[:21])])[0], every[20], atol=1e-4, rtol=0)
    torch.testing.assert_close(runner.forward([seq.step(prompt[21:])])[0], every[29], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", GEMMAS)
def test_gemmas_soft_capping_norms_window_and_scalar_each_change_the_logits(request, tmp_path, arch):
    """The parity tests above are not vacuous: with any one of the features changed in the config, transformers'
    logits move (so the runner, which follows them, computes each)."""
    base = request.getfixturevalue(f"tiny_{arch}")
    prompt = (PROMPT * 2)[:24]
    with torch.no_grad():
        plain = hf_model(base)(torch.tensor([prompt])).logits[0, -1]
    changes = {"final_logit_softcapping": None, "sliding_window": 64, "query_pre_attn_scalar": 24}
    if arch == "gemma2":
        changes["attn_logit_softcapping"] = None
    else:
        changes["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}
    for key, value in changes.items():
        path = tmp_path / key
        shutil.copytree(base, path)
        cfg = json.loads((path / "config.json").read_text())
        cfg[key] = value
        (path / "config.json").write_text(json.dumps(cfg))
        runner = ModelRunner(path, pool_pages=64, enable_lora=False)
        ours = runner.forward([Seq(runner, 24).step(prompt)])[0]
        with torch.no_grad():
            theirs = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert (theirs - plain).abs().max() > 1e-2, key


GEMMA_ADAPTERS = [(8, 16, False, ("q_proj", "k_proj")),
                  (16, 32, True, ("v_proj", "o_proj", "gate_proj", "down_proj")),
                  (32, 64, False, ALL_TARGETS)]


# Gemma's layers on every path: torch's small ops and softcapped_attention (no native kernels: CUDA's path, run on
# CPU), and the native step kernels with the LoRA terms fused into the native GEMMs (what AMD hosts run by default)
GEMMA_PATHS = [*PACKED,
               pytest.param({"packed_weights": True, "native_gemm": True, "fuse_lora": True},
                            marks=pytest.mark.skipif(NO_ONEDNN or not gemm_available(), reason="no native GEMM")),
               {"packed_weights": False, "step_kernels": False, "native_attention": False}]
GEMMA_PATH_IDS = [*PACKED_IDS, "native-gemm-fused-lora", "torch-only"]


@pytest.mark.parametrize("packed", GEMMA_PATHS, ids=GEMMA_PATH_IDS)
@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_mixed_batch_of_peft_adapters_matches_peft_on_every_request(request, tmp_path, arch, packed):
    from peft import PeftModel

    base = request.getfixturevalue(f"tiny_{arch}")
    dirs = [make_random_peft_adapter(base, tmp_path / f"a{r}", r=r, alpha=alpha, use_rslora=rs,
                                     target_modules=targets, seed=r)
            for r, alpha, rs, targets in GEMMA_ADAPTERS]
    packed = dict(packed)
    native_attention = packed.pop("native_attention", True)
    runner = ModelRunner(base, pool_pages=512, max_lora_rank=32, **packed)
    runner.native_attention = native_attention and runner.native_attention
    slots = [load_peft_into(runner, d) for d in dirs] + [-1]
    requests = list(zip(PROMPTS, slots, strict=True))
    n = 24
    together, first = greedy_batch(runner, requests, n)
    for i, (prompt, slot) in enumerate(requests):
        model = hf_model(base) if slot < 0 else PeftModel.from_pretrained(hf_model(base), str(dirs[i])).eval()
        assert together[i] == hf_greedy(model, prompt, n), f"request {i} (slot {slot})"
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(first[i], theirs, atol=1e-4, rtol=0)
        assert together[i] == greedy(runner, prompt, n, slot=slot)  # batch invariance: alone, the same tokens
    assert all(together[i] != greedy(runner, PROMPTS[i], n) for i in range(3))  # each adapter changes its answer


@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_requests_on_different_adapters_in_one_forward_equal_each_alone(request, tmp_path, arch):
    """Batch invariance as for Llama: mixed steps (prompts beside decode tokens of two adapters and a base request,
    past the window) give each row the logits it gets alone."""
    assert_mixed_adapter_steps_equal_each_alone(request.getfixturevalue(f"tiny_{arch}"), tmp_path)


def test_gemma3_config_in_transformers_v4_spelling_is_read_the_same(tiny_gemma3, tmp_path):
    """Gemma 3's config.json as transformers 4.x wrote it (google/gemma-3-*): rope_theta, rope_local_base_freq and
    rope_scaling beside each other, sliding_window_pattern instead of layer_types. The same RoPE tables, layers and
    logits as the v5 spelling, and transformers' logits."""
    v4 = tmp_path / "v4"
    shutil.copytree(tiny_gemma3, v4)
    _edit_config(v4, rope_parameters=None, rope_theta=1e6, rope_local_base_freq=10_000.0,
                 rope_scaling={"rope_type": "linear", "factor": 4.0}, layer_types=None, sliding_window_pattern=3)
    a, b = (ModelRunner(p, pool_pages=64, enable_lora=False) for p in (tiny_gemma3, v4))
    assert b.config.sliding_windows == a.config.sliding_windows  # pattern 3: layers 0, 1, 3 sliding
    torch.testing.assert_close(a.rope_cos, b.rope_cos, atol=0, rtol=0)
    torch.testing.assert_close(a.local_rope[0], b.local_rope[0], atol=0, rtol=0)
    assert not torch.allclose(a.rope_cos, a.local_rope[0])  # the two bases do differ
    prompt = (PROMPT * 2)[:24]
    ours = b.forward([Seq(b, 24).step(prompt)])[0]
    with torch.no_grad():
        theirs = hf_model(v4)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rope", [YARN[0], {"rope_type": "dynamic", "factor": 2.0}], ids=["yarn", "dynamic"])
def test_gemma3_global_layers_take_any_served_rope_scaling_beside_the_local_base(tiny_gemma3, tmp_path, rope):
    """The global layers' RoPE is any served type (here yarn, and dynamic NTK past a 32-position config), the sliding
    layers' stays the default at their own base: transformers' logits token by token."""
    path = tmp_path / "scaled"
    shutil.copytree(tiny_gemma3, path)
    full = {**rope, "rope_theta": 1e6}
    _edit_config(path, max_position_embeddings=32 if rope["rope_type"] == "dynamic" else 512, rope_parameters={
        "full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    runner = ModelRunner(path, pool_pages=256, enable_lora=False)
    assert runner.config.rope_scaling["rope_type"] == rope["rope_type"] and runner.config.local_rope.theta == 1e4
    model = hf_model(path)
    assert model.model.rotary_emb.rope_type == {"full_attention": rope["rope_type"], "sliding_attention": "default"}
    assert_logits_follow_transformers(runner, model, (PROMPT * 3)[:30], decode_steps=20)  # past 32 positions


def test_gemma3_attention_soft_capping_is_not_applied_as_transformers_does_not(tiny_gemma3, tmp_path):
    """Gemma3TextConfig carries attn_logit_softcapping, but Gemma3Attention never applies it (Gemma 3's checkpoints
    leave it null): the runner follows transformers."""
    path = tmp_path / "capped"
    shutil.copytree(tiny_gemma3, path)
    _edit_config(path, attn_logit_softcapping=1.0)
    runner = ModelRunner(path, pool_pages=64, enable_lora=False)
    assert runner.config.attn_logit_softcapping is None
    prompt = (PROMPT * 2)[:24]
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(runner.forward([Seq(runner, 24).step(prompt)])[0], theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "vision-language"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]}, "layer_types"),
], ids=["gemma3-multimodal", "bidirectional", "activation", "layer-type"])
def test_gemma_configurations_not_served_are_refused_by_name(tiny_gemma3, tmp_path, change, match):
    path = tmp_path / "bad"
    shutil.copytree(tiny_gemma3, path)
    _edit_config(path, **change)
    with pytest.raises(ValueError, match=match):
        ModelRunner(path, pool_pages=64)


def test_a_gemma3_multimodal_folder_is_refused_at_register_base(tiny_gemma3, tmp_path):
    from adapters.manifest import ManifestError, shape_manifest_from_checkpoint

    path = tmp_path / "gemma3-4b"
    shutil.copytree(tiny_gemma3, path)
    _edit_config(path, model_type="gemma3")
    with pytest.raises(ManifestError, match="model_type 'gemma3' is not supported; lorafleet serves .*gemma3_text"):
        shape_manifest_from_checkpoint(path)


@pytest.mark.parametrize("arch", GEMMAS)
def test_a_gemma_peft_adapter_passes_upload_validation_and_takes_the_planned_pages(request, tmp_path, arch):
    """PEFT's own names for Gemma (the seven projections, q_proj out 96 beside hidden 64): accepted as PEFT saved
    them; the manifest names the family and its head width; the pool takes the pages the planner computes."""
    from adapters.manifest import shape_manifest_from_checkpoint
    from adapters.validation import validate_adapter
    from protocol.lora_layout import ModelShape
    from protocol.memory import adapter_pages

    base = request.getfixturevalue(f"tiny_{arch}")
    manifest = shape_manifest_from_checkpoint(base)
    assert (manifest["architecture"], manifest["head_dim"]) == ({"gemma3": "gemma3_text"}.get(arch, arch), 24)
    assert manifest["modules"]["q_proj"]["out_features"] == 96
    adapter = make_random_peft_adapter(base, tmp_path / "a", r=16, target_modules=ALL_TARGETS)
    config = json.loads((adapter / "adapter_config.json").read_text())
    data = (adapter / "adapter_model.safetensors").read_bytes()
    spec = validate_adapter(config, io.BytesIO(data), len(data), manifest, max_rank=64)
    assert spec.rank == 16 and set(spec.target_modules) == set(ALL_TARGETS)
    shape = ModelShape.from_config(json.loads((base / "config.json").read_text()))
    runner = ModelRunner(base, pool_pages=512, max_lora_rank=32)
    free = runner.pool.num_free
    load_peft_into(runner, adapter)
    assert free - runner.pool.num_free == adapter_pages(shape, 16, list(ALL_TARGETS), runner.block_size)
