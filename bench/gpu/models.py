"""Random Llama checkpoints with Llama-2-7B layer shapes (or tiny ones) and PEFT-made random adapters,
built where the check runs (nothing is downloaded).

The base is an ordinary Hugging Face folder (config.json from transformers' LlamaConfig, bf16 safetensors,
the tiny BPE tokenizer of demo/tiny_base.py), so `AutoModelForCausalLM.from_pretrained` and our
`ModelRunner` load the same bytes. Weights are drawn on the device: std 1/sqrt(fan_in) keeps activations
O(1) (HF's std=0.02 init makes every logit ~0, which would let a parity check pass on wrong code), norm
weights are jittered around 1. The tokenizer stops at a few hundred merges on the shipped corpus; the
embedding keeps the requested vocabulary (ids past the tokenizer decode to nothing, which the engine's
detokenizer handles).

Adapters are made the way tests/support/peft_factory.py makes them — PEFT's own `get_peft_model` and
`save_pretrained`, with lora_A and lora_B both redrawn at std 1/sqrt(fan_in) so an adapter changes the
output — but several in one PEFT model (`add_adapter`), since reloading a 7B-shaped base once per adapter
would cost the check its time budget. The draws are rounded to bf16 values, so PEFT (whatever dtype it
keeps adapter weights in) and the worker's bf16 pool use the same numbers. The PEFT model that made them
is returned: it is the oracle for LoRA semantics and the `generate(adapter_names=...)` peer.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

SEVEN_B = dict(hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000)
TINY = dict(hidden=64, heads=4, kv_heads=4, intermediate=176, vocab=512)
# Qwen3 (arch="qwen3"): Qwen3-8B's layer shapes (GQA 4, head_dim 128 written in the config), Llama-2's vocabulary to
# keep the check's time; tiny: heads of 24 beside hidden 64, so q_dim (96) is not hidden
QWEN3_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=32000)
QWEN3_TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=24, intermediate=176, vocab=512)
# Gemma (arch="gemma2" / "gemma3", demo/tiny_gemma.py): every Gemma feature on. GPU: Gemma-2-9B's layer shapes (heads
# of 256 beside hidden 3584, GQA 2, query_pre_attn_scalar 256) and Gemma-3-4B's (hidden 2560, 8 heads of 256, GQA 2),
# Llama-2's vocabulary; the sliding window (32) shorter than most prompts, so sliding layers do slide; soft-capping at
# 4 (attention, Gemma 2) and 6 (final), where it bites on random weights; Gemma 3's global layers with linear x8 RoPE
# scaling as the 4B-27B checkpoints have. With 4 layers: Gemma 2 sliding, global, sliding, global; Gemma 3 sliding,
# global, sliding, sliding (2 layers, the rehearsal's: sliding, global). Tiny: heads of 24 beside hidden 64,
# query_pre_attn_scalar 20, window 6.
_GEMMA_GPU = dict(vocab=32000, sliding_window=32)
_GEMMA_TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=24, intermediate=176, vocab=512, sliding_window=6,
                   query_pre_attn_scalar=20)
GEMMA_SHAPES = {
    "gemma2": {"gpu": dict(hidden=3584, heads=16, kv_heads=8, head_dim=256, intermediate=14336,
                           query_pre_attn_scalar=256, **_GEMMA_GPU), "tiny": _GEMMA_TINY},
    "gemma3": {"gpu": dict(hidden=2560, heads=8, kv_heads=4, head_dim=256, intermediate=10240,
                           query_pre_attn_scalar=256, **_GEMMA_GPU), "tiny": _GEMMA_TINY},
}
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_random_llama(out_dir, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                       vocab: int, max_position: int = 1024, seed: int = 0, device: str = "cpu", arch: str = "llama",
                       head_dim: int | None = None, sliding_window: int | None = None,
                       query_pre_attn_scalar: int | None = None) -> Path:
    """Write config.json, generation_config.json, tokenizer files and model.safetensors (bf16) to out_dir.
    arch="qwen3": a Qwen3 (per-head q/k RMSNorm weights, jittered like the other norms; `head_dim` as given);
    arch="phi3": a Phi-3 (qkv_proj and gate_up_proj fused in the checkpoint); arch="gemma2" / "gemma3": a Gemma
    (demo.tiny_gemma.build_tiny_gemma, GEMMA_SHAPES above; sliding_window and query_pre_attn_scalar for Gemma only)."""
    import transformers
    from safetensors.torch import save_file

    if arch in GEMMA_SHAPES:
        from demo.tiny_gemma import build_tiny_gemma

        period = 3 if arch == "gemma3" else 2  # layer i is global when i % period == 1
        types = ["full_attention" if i % period == 1 else "sliding_attention" for i in range(layers)]
        return build_tiny_gemma(out_dir, arch=arch, seed=seed, hidden=hidden, layers=layers, heads=heads,
                                kv_heads=kv_heads, head_dim=head_dim or hidden // heads, intermediate=intermediate,
                                vocab=vocab, max_position=max_position, sliding_window=sliding_window or 32,
                                layer_types=types,
                                query_pre_attn_scalar=query_pre_attn_scalar or 256,
                                attn_softcap=4.0 if arch == "gemma2" else None, final_softcap=6.0,
                                rope_scaling={"rope_type": "linear", "factor": 8.0} if arch == "gemma3" else None,
                                tie_embeddings=False, dtype=torch.bfloat16, device=device)

    from demo.tiny_base import BOS, IM_END, PAD, SPECIAL_TOKENS, train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(min(vocab, 4096))
    tokenizer.save_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = max(vocab, len(tokenizer))
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=ids[PAD], bos_token_id=ids[BOS],
        eos_token_id=ids[IM_END], rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="bfloat16")
    head_dim = head_dim or hidden // heads
    if arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=head_dim, attention_bias=False, use_sliding_window=False)
        config.architectures = ["Qwen3ForCausalLM"]
    elif arch == "phi3" and head_dim == hidden // heads:  # q/k/v and gate/up fused in the checkpoint
        config = transformers.Phi3Config(**common, original_max_position_embeddings=max_position, sliding_window=None)
        config.architectures = ["Phi3ForCausalLM"]
    elif arch == "llama" and head_dim == hidden // heads:
        config = transformers.LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
    else:
        raise ValueError(f"arch must be llama, qwen3 or phi3 (head_dim for qwen3 only), not {arch!r}")
    config.save_pretrained(out)
    transformers.GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[IM_END],
                                  pad_token_id=ids[PAD]).save_pretrained(out)

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=device).mul_(scale).add_(shift)
        return t.to(torch.bfloat16).cpu()

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return randn(out_f, in_f, scale=1 / math.sqrt(in_f))

    w = {"model.embed_tokens.weight": randn(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = randn(hidden, scale=0.1, shift=1.0)
        w[f"{p}.self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        w[f"{p}.self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        w[f"{p}.self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        if arch == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = randn(head_dim, scale=0.1, shift=1.0)
            w[f"{p}.self_attn.k_norm.weight"] = randn(head_dim, scale=0.1, shift=1.0)
        w[f"{p}.self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        w[f"{p}.post_attention_layernorm.weight"] = randn(hidden, scale=0.1, shift=1.0)
        w[f"{p}.mlp.gate_proj.weight"] = linear(intermediate, hidden)
        w[f"{p}.mlp.up_proj.weight"] = linear(intermediate, hidden)
        w[f"{p}.mlp.down_proj.weight"] = linear(hidden, intermediate)
    if arch == "phi3":
        for i in range(layers):
            p = f"model.layers.{i}"
            w[f"{p}.self_attn.qkv_proj.weight"] = torch.cat([w.pop(f"{p}.self_attn.{n}.weight")
                                                             for n in ("q_proj", "k_proj", "v_proj")])
            w[f"{p}.mlp.gate_up_proj.weight"] = torch.cat([w.pop(f"{p}.mlp.{n}.weight") for n in ("gate_proj", "up_proj")])
    w["model.norm.weight"] = randn(hidden, scale=0.1, shift=1.0)
    w["lm_head.weight"] = linear(vocab, hidden)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_hf(base_dir, *, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype).to(device).eval()


def make_peft_adapters(model, out_root, specs: list[dict], *, device: str):
    """Add one LoRA adapter per spec (name, r, alpha, targets, rslora, seed) to `model` with PEFT, draw
    its weights, save each with PEFT's save_pretrained; returns (peft_model, {name: folder})."""
    from peft import LoraConfig, get_peft_model

    out_root = Path(out_root)
    peft_model = None
    for spec in specs:
        cfg = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], target_modules=list(spec["targets"]),
                         lora_dropout=0.0, use_rslora=spec["rslora"], bias="none", task_type="CAUSAL_LM")
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=spec["name"])
        else:
            peft_model.add_adapter(spec["name"], cfg)
        gen = torch.Generator(device=device).manual_seed(spec["seed"])
        marker = f".{spec['name']}."
        with torch.no_grad():
            for pname, param in peft_model.named_parameters():
                if marker in pname and (".lora_A." in pname or ".lora_B." in pname):
                    draw = torch.randn(param.shape, generator=gen, device=device) / math.sqrt(param.shape[1])
                    param.copy_(draw.to(torch.bfloat16).to(param.dtype))  # bf16 values, whatever PEFT keeps
    dirs = {}
    for spec in specs:
        target = out_root / spec["name"]
        peft_model.save_pretrained(str(target), selected_adapters=[spec["name"]])
        found = sorted(target.rglob("adapter_model.safetensors"))
        if len(found) != 1:
            raise RuntimeError(f"PEFT saved {len(found)} adapter files under {target}")
        dirs[spec["name"]] = found[0].parent
    peft_model.eval()
    return peft_model, dirs


def adapter_ref(folder: Path, version_id: int, name: str):
    """(AdapterRef, blob bytes) for a PEFT adapter folder, as the gateway would describe its upload."""
    from protocol.jobs import AdapterRef

    cfg = json.loads((folder / "adapter_config.json").read_text())
    blob = (folder / "adapter_model.safetensors").read_bytes()
    targets = cfg["target_modules"]
    targets = sorted(targets) if isinstance(targets, (list, tuple, set)) else [targets]
    ref = AdapterRef(version_id=version_id, sha256=hashlib.sha256(blob).hexdigest(), storage_key=f"adapters/{name}",
                     rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), use_rslora=bool(cfg.get("use_rslora")),
                     target_modules=list(targets), name=name)
    return ref, blob


def load_into_runner(runner, folder: Path, ref) -> int:
    """Place a PEFT adapter folder in the runner's pool directly (no engine); returns its slot."""
    from safetensors.torch import load_file

    return runner.load_adapter(load_file(str(folder / "adapter_model.safetensors")), rank=ref.rank,
                               scale=ref.scale, key=ref.identity)


def free_all_adapters(runner) -> None:
    for slot, rank in enumerate(runner.lora.ranks):
        if rank:
            runner.unload_adapter(slot)
