"""Small random Gemma 2 and Gemma 3 (text) checkpoints, built locally (nothing is downloaded), for the family tests and
bench/gpu/check_parity.py --arch gemma2|gemma3.

The folder is an ordinary Hugging Face checkpoint (config.json from transformers' Gemma2Config or Gemma3TextConfig,
model.safetensors, the tiny BPE tokenizer and chat template of demo.tiny_base, generation_config.json), so
`AutoModelForCausalLM.from_pretrained` gives Gemma2ForCausalLM / Gemma3ForCausalLM and our ModelRunner reads the same
bytes. Weights as demo.tiny_base draws them (std 1/sqrt(fan_in): O(1) activations, so a parity check cannot pass on
logits that are all ~0); Gemma's norm weights are stored as w in (1 + w), so they are drawn around 0 (std 0.1), which a
norm computed as w instead of (1 + w) could not survive. Every Gemma feature is on by default: soft-capping, sliding
layers beside global ones, query_pre_attn_scalar != head_dim, head_dim != hidden / heads, a tied head, and for Gemma 3
the q/k norms and two RoPE bases (the global one with linear scaling).

Django-free.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

GEMMA_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def gemma_config(arch: str, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, max_position: int, sliding_window: int, layer_types: list[str] | None,
                 query_pre_attn_scalar: int, attn_softcap: float | None, final_softcap: float | None,
                 rope_theta: float, local_rope_theta: float, rope_scaling: dict | None, tie_embeddings: bool,
                 ids: dict[str, int], dtype: str):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=max_position, rms_norm_eps=1e-6, tie_word_embeddings=tie_embeddings,
                  pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"], dtype=dtype,
                  hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=query_pre_attn_scalar,
                  sliding_window=sliding_window, layer_types=layer_types, attn_logit_softcapping=attn_softcap,
                  final_logit_softcapping=final_softcap, attention_bias=False)
    if arch == "gemma2":
        return transformers.Gemma2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    if arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
        return transformers.Gemma3TextConfig(**common, rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_rope_theta}})
    raise ValueError(f"arch must be one of {', '.join(GEMMA_ARCHITECTURES)}, not {arch!r}")


def build_tiny_gemma(out_dir, *, arch: str = "gemma2", seed: int = 0, hidden: int = 64, layers: int = 4,
                     heads: int = 4, kv_heads: int = 2, head_dim: int = 24, intermediate: int = 96, vocab: int = 512,
                     max_position: int = 512, sliding_window: int = 6, layer_types: list[str] | None = None,
                     query_pre_attn_scalar: int = 20, attn_softcap: float | None = 4.0,
                     final_softcap: float | None = 6.0, rope_theta: float = 1_000_000.0,
                     local_rope_theta: float = 10_000.0, rope_scaling: dict | None = None,
                     tie_embeddings: bool = True, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Path:
    """Write a Gemma checkpoint folder (arch "gemma2" or "gemma3", the latter Gemma3ForCausalLM, model_type
    gemma3_text) and return its path; deterministic for a seed. layer_types None: the config's own pattern (Gemma 2
    every other layer sliding, layer 0 first; Gemma 3 five sliding to one global). The soft-caps are small (4 and 6)
    so that they bite on these activations; rope_scaling (Gemma 3's global layers) e.g. {"rope_type": "linear",
    "factor": 8.0}, as the 4B-27B checkpoints have."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from demo.tiny_base import BOS, IM_END, PAD, SPECIAL_TOKENS, train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(min(vocab, 4096))
    tokenizer.save_pretrained(out)
    tok_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    ids = {"pad": tok_ids[PAD], "bos": tok_ids[BOS], "eos": tok_ids[IM_END]}
    vocab = max(vocab, len(tokenizer))
    config = gemma_config(arch, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                          head_dim=head_dim, intermediate=intermediate, max_position=max_position,
                          sliding_window=sliding_window, layer_types=layer_types,
                          query_pre_attn_scalar=query_pre_attn_scalar, attn_softcap=attn_softcap,
                          final_softcap=final_softcap, rope_theta=rope_theta, local_rope_theta=local_rope_theta,
                          rope_scaling=rope_scaling, tie_embeddings=tie_embeddings, ids=ids,
                          dtype=str(dtype).removeprefix("torch."))
    config.architectures = [GEMMA_ARCHITECTURES[arch]]
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(out)

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype).cpu()

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return randn(out_f, in_f, scale=1 / math.sqrt(in_f))

    def norm(n: int) -> torch.Tensor:  # Gemma multiplies by (1 + w): w around 0
        return randn(n, scale=0.1)

    # the embedding is multiplied by sqrt(hidden) on the way in: drawn at 1 / sqrt(hidden) to stay O(1)
    w = {"model.embed_tokens.weight": randn(vocab, hidden, scale=1 / math.sqrt(hidden))}
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            w[f"{p}.{name}.weight"] = norm(hidden)
        w[f"{p}.self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        w[f"{p}.self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        w[f"{p}.self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        if arch == "gemma3":
            w[f"{p}.self_attn.q_norm.weight"] = norm(head_dim)
            w[f"{p}.self_attn.k_norm.weight"] = norm(head_dim)
        w[f"{p}.self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        w[f"{p}.mlp.gate_proj.weight"] = linear(intermediate, hidden)
        w[f"{p}.mlp.up_proj.weight"] = linear(intermediate, hidden)
        w[f"{p}.mlp.down_proj.weight"] = linear(hidden, intermediate)
    w["model.norm.weight"] = norm(hidden)
    if not tie_embeddings:
        w["lm_head.weight"] = linear(vocab, hidden)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
