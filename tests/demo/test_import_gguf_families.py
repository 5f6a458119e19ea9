"""`import_gguf` on the GGUF architectures llama.cpp writes for the families beyond Llama (issue 48): a Qwen3, a
Phi-3, a Gemma 2 and a Gemma 3 GGUF written here from tiny Hugging Face checkpoints, tensors and tokenizer under
llama.cpp's names, come back as folders the runner serves with the original's logits; what transformers' GGUF reader
would get wrong (a Qwen3 head width other than 128, Phi-3's LongRoPE factors) is refused before anything is
dequantized, and what it leaves at its defaults for Gemma (the soft-caps, Gemma 3's RoPE scaling) is put back from
the file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from demo.tiny_base import build_tiny_base

pytest.importorskip("gguf")

# Hugging Face module (in model.layers.N) -> llama.cpp's tensor name (blk.N.*)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # Phi-3's fused ones
# Gemma's four norms a layer: llama.cpp's ffn_norm is the pre-feedforward one there
GEMMA_GGUF_NAMES = {**GGUF_NAMES, "post_attention_layernorm": "post_attention_norm",
                    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(base: Path, path: Path, arch: str = "qwen3") -> Path:
    """An fp32 GGUF of the tiny checkpoint at `base` (qwen3 or phi3), as llama.cpp's converter lays it out (neither
    permutes q and k; a byte-level BPE tokenizer is its "gpt2" model)."""
    from gguf import GGUFWriter, TokenType
    from safetensors.torch import load_file

    cfg = json.loads((base / "config.json").read_text())
    tok = json.loads((base / "tokenizer.json").read_text())
    n = cfg["vocab_size"]
    tokens, types = [f"[PAD{i}]" for i in range(n)], [TokenType.UNUSED] * n
    for t, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = t, TokenType.NORMAL
    for added in tok["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], TokenType.CONTROL
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w = GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    gemma = arch in ("gemma2", "gemma3")
    if gemma:  # what llama.cpp's converter writes for Gemma
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        scaling = rope.get("full_attention", {})
        if scaling.get("rope_type") == "linear":
            from gguf import RopeScalingType

            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(scaling["factor"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    for name, t in load_file(str(base / "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{(GEMMA_GGUF_NAMES if gemma else GGUF_NAMES)[rest.rsplit('.', 1)[0]]}.weight"
        if gemma and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's norm weights as the (1 + w) they multiply by
        w.add_tensor(gguf_name, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_qwen3_gguf_imports_to_a_folder_the_runner_serves_with_the_originals_logits(tmp_path):
    from adapters.gguf_import import import_gguf
    from adapters.manifest import shape_manifest_from_checkpoint
    from inference_worker.model import ModelRunner, SeqStep

    # head_dim 128 beside hidden 64 / 2 heads: Qwen3's explicit head width (its published models all use 128)
    base = build_tiny_base(tmp_path / "base", arch="qwen3", seed=3, hidden=64, heads=2, kv_heads=1, head_dim=128)
    source = write_gguf(base, tmp_path / "tiny-qwen3.f32.gguf")
    report = import_gguf(source, tmp_path / "out", progress=False)
    assert (report.gguf_architecture, report.model_type) == ("qwen3", "qwen3")
    manifest = shape_manifest_from_checkpoint(tmp_path / "out")
    assert (manifest["architecture"], manifest["head_dim"]) == ("qwen3", 128)

    prompt = [5, 17, 99, 300, 42, 7, 8]
    logits = []
    for folder in (base, tmp_path / "out"):
        runner = ModelRunner(folder, pool_pages=16, enable_lora=False)
        logits.append(runner.forward([SeqStep(runner.kv.allocator.allocate(1), 0, prompt)])[0])
    assert logits[0].abs().max() > 1.0
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


def test_a_qwen3_gguf_whose_head_width_transformers_cannot_read_is_refused_before_converting(tmp_path):
    from adapters.gguf_import import GGUFImportError, import_gguf

    base = build_tiny_base(tmp_path / "base", arch="qwen3", seed=3, hidden=64, heads=2, kv_heads=1, head_dim=24)
    source = write_gguf(base, tmp_path / "odd-qwen3.f32.gguf")
    with pytest.raises(GGUFImportError, match=r"heads of 24 \(attention.key_length\) cannot be read from GGUF by "
                                              r"transformers for 'qwen3', which assumes 128.*Nothing was written"):
        import_gguf(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_phi3_gguf_with_its_fused_tensors_imports_to_a_folder_the_runner_serves(tmp_path):
    """llama.cpp keeps Phi-3's fusions: attn_qkv, and ffn_up holding gate and up."""
    from adapters.gguf_import import import_gguf
    from adapters.manifest import shape_manifest_from_checkpoint
    from inference_worker.model import ModelRunner, SeqStep

    base = build_tiny_base(tmp_path / "base", arch="phi3", seed=3, hidden=64, heads=4, kv_heads=2)
    report = import_gguf(write_gguf(base, tmp_path / "tiny-phi3.f32.gguf", "phi3"), tmp_path / "out", progress=False)
    assert (report.gguf_architecture, report.model_type) == ("phi3", "phi3")
    assert "qkv_proj" in shape_manifest_from_checkpoint(tmp_path / "out")["modules"]
    prompt = [5, 17, 99, 300, 42, 7, 8]
    logits = []
    for folder in (base, tmp_path / "out"):
        runner = ModelRunner(folder, pool_pages=16, enable_lora=False)
        logits.append(runner.forward([SeqStep(runner.kv.allocator.allocate(1), 0, prompt)])[0])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


def test_a_phi3_gguf_with_longrope_factors_is_refused_before_converting(tmp_path):
    """The 128k Phi-3 GGUFs: transformers would read them back without their LongRoPE."""
    from gguf import GGUFWriter

    from adapters.gguf_import import GGUFImportError, import_gguf

    source = tmp_path / "phi-3-mini-128k.Q4_0.gguf"
    w = GGUFWriter(str(source), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.add_tensor("rope_factors_long.weight", np.ones(4, dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFImportError, match="LongRoPE scaling .* cannot be read from GGUF.*Nothing was written"):
        import_gguf(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_imports_to_a_folder_the_runner_serves_with_the_originals_logits(tmp_path, arch):
    """Gemma's norms come back from llama.cpp's (1 + w), its four norms a layer from llama.cpp's names; the soft-caps
    (4 and 6 here, not transformers' defaults) and Gemma 3's linear RoPE scaling from the file's keys; the layers'
    kinds and the two RoPE bases as both readers assume them. query_pre_attn_scalar is head_dim, llama.cpp's rule (GGUF
    does not carry it)."""
    from adapters.gguf_import import import_gguf
    from adapters.manifest import shape_manifest_from_checkpoint
    from demo.tiny_gemma import build_tiny_gemma
    from inference_worker.model import ModelRunner, SeqStep

    extra = {"layers": 7, "rope_scaling": {"rope_type": "linear", "factor": 4.0}} if arch == "gemma3" else {}
    base = build_tiny_gemma(tmp_path / "base", arch=arch, seed=5, query_pre_attn_scalar=24, tie_embeddings=True,
                            **extra)
    report = import_gguf(write_gguf(base, tmp_path / f"tiny-{arch}.f32.gguf", arch), tmp_path / "out", progress=False)
    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
    assert (report.gguf_architecture, report.model_type) == (arch, model_type)
    assert shape_manifest_from_checkpoint(tmp_path / "out")["architecture"] == model_type
    prompt = (list(range(20, 60, 3)) * 2)[:20]  # past the window of 6
    runners = [ModelRunner(folder, pool_pages=16, enable_lora=False) for folder in (base, tmp_path / "out")]
    imported = runners[1].config
    assert (imported.attn_logit_softcapping, imported.final_logit_softcapping) == (
        (4.0 if arch == "gemma2" else None), 6.0)
    assert imported.sliding_windows == runners[0].config.sliding_windows and None in imported.sliding_windows
    logits = [r.forward([SeqStep(r.kv.allocator.allocate(2), 0, prompt)])[0] for r in runners]
    assert logits[0].abs().max() > 1.0
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


def test_a_gemma3_gguf_with_rope_scaling_other_than_linear_is_refused_before_converting(tmp_path):
    from gguf import GGUFWriter, RopeScalingType

    from adapters.gguf_import import GGUFImportError, import_gguf

    source = tmp_path / "gemma-3-yarn.Q4_0.gguf"
    w = GGUFWriter(str(source), "gemma3")
    w.add_block_count(1)
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFImportError, match="Gemma 3 RoPE scaling 'yarn' cannot be read from GGUF.*Nothing was written"):
        import_gguf(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
