"""Builds small Llama-family checkpoints locally, so that tests, benches and the demo never download.

The folder written is an ordinary Hugging Face checkpoint (config.json, model.safetensors, tokenizer
files with a chat template, generation_config.json): `AutoModelForCausalLM.from_pretrained(out_dir)` and
`AutoTokenizer.from_pretrained(out_dir)` load it offline, and so does our own ModelRunner.

Weights are written directly (no transformers model is instantiated) because that is fast and lets us
choose an init with O(1) activations: HF's default std=0.02 makes every logit ~0, which would let a
parity test pass even when the model code is wrong. Norm weights and biases are jittered for the same
reason (a missing norm weight or bias must change the logits).

Django-free on purpose: tests and benches import it without settings.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

CORPUS_DIR = Path(__file__).parent / "corpus"
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

PAD, BOS, EOS = "<|pad|>", "<|startoftext|>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order

# ChatML, as Qwen2 uses: the model answers after "<|im_start|>assistant\n" and ends its turn with
# <|im_end|>, which is therefore the tokenizer's eos (generation stops at the end of the turn).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus_text() -> list[str]:
    """The shipped training text, one string per file (sorted, so the tokenizer is deterministic)."""
    return [p.read_text(encoding="utf-8") for p in sorted(CORPUS_DIR.glob("*.txt"))]


def train_tokenizer(vocab_size: int):
    """A byte-level BPE over the shipped corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab must be at least {min_vocab} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[EOS, IM_START],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(arch: str, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
            intermediate: int, max_position: int, tie_embeddings: bool, ids: dict[str, int],
            head_dim: int | None = None):
    import transformers

    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position,
        rms_norm_eps=1e-6, tie_word_embeddings=tie_embeddings, pad_token_id=ids[PAD],
        bos_token_id=ids[BOS], eos_token_id=ids[IM_END], dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":
        # sliding_window=None: the window would only matter beyond max_position anyway.
        return transformers.MistralConfig(**common, sliding_window=None)
    if arch == "qwen3":
        # head_dim as given (Qwen3 writes it explicitly; it may differ from hidden / heads), no q/k/v bias
        return transformers.Qwen3Config(**common, head_dim=head_dim or hidden // heads, attention_bias=False,
                                        use_sliding_window=False)
    if arch == "phi3":
        # q/k/v and gate/up fused in the checkpoint (qkv_proj, gate_up_proj); original context = max_position, so a
        # LongRoPE config added later has its factors to switch between
        return transformers.Phi3Config(**common, original_max_position_embeddings=max_position, sliding_window=None)
    return transformers.Qwen2Config(**common, use_sliding_window=False)


def _weights(arch: str, *, seed: int, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
             intermediate: int, tie_embeddings: bool, head_dim: int | None = None) -> dict[str, torch.Tensor]:
    """Random weights under HF's tensor names; std 1/sqrt(fan_in) keeps activations O(1)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = head_dim or hidden // heads

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(hidden)
        w[f"{p}.self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        w[f"{p}.self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        w[f"{p}.self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        if arch == "qwen2":  # Qwen2 has biases on q/k/v (and only there)
            for name, n in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                            ("v_proj", kv_heads * head_dim)):
                w[f"{p}.self_attn.{name}.bias"] = 0.1 * torch.randn(n, generator=gen)
        if arch == "qwen3":  # per-head RMSNorm weights on q and k (jittered: a missing norm must show)
            w[f"{p}.self_attn.q_norm.weight"] = norm(head_dim)
            w[f"{p}.self_attn.k_norm.weight"] = norm(head_dim)
        w[f"{p}.self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        w[f"{p}.post_attention_layernorm.weight"] = norm(hidden)
        w[f"{p}.mlp.gate_proj.weight"] = linear(intermediate, hidden)
        w[f"{p}.mlp.up_proj.weight"] = linear(intermediate, hidden)
        w[f"{p}.mlp.down_proj.weight"] = linear(hidden, intermediate)
    if arch == "phi3":  # Phi-3's checkpoint holds q/k/v and gate/up as one weight each (rows in that order)
        for i in range(layers):
            p = f"model.layers.{i}"
            w[f"{p}.self_attn.qkv_proj.weight"] = torch.cat([w.pop(f"{p}.self_attn.{n}.weight")
                                                             for n in ("q_proj", "k_proj", "v_proj")])
            w[f"{p}.mlp.gate_up_proj.weight"] = torch.cat([w.pop(f"{p}.mlp.{n}.weight") for n in ("gate_proj", "up_proj")])
    w["model.norm.weight"] = norm(hidden)
    if not tie_embeddings:
        w["lm_head.weight"] = linear(vocab, hidden)
    return {k: v.contiguous() for k, v in w.items()}


def build_tiny_base(out_dir, *, arch: str = "llama", seed: int = 0, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 128, vocab: int = 512,
                    max_position: int = 512, tie_embeddings: bool = False, head_dim: int | None = None) -> Path:
    """Write a loadable HF checkpoint folder and return its path. Deterministic for a given seed. `head_dim`
    (qwen3 only): the width of a head, when it is not hidden / heads."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, not {arch!r}")
    if head_dim is not None and arch != "qwen3":
        raise ValueError("head_dim is only written for qwen3")
    if (hidden % heads and head_dim is None) or heads % kv_heads:
        raise ValueError("hidden must be divisible by heads, and heads by kv_heads")
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab)
    tokenizer.save_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    # BPE may stop merging early on a small corpus: the real vocabulary can be below the request.
    # The embedding keeps the requested size so shapes are what the caller asked for.
    vocab = max(vocab, len(tokenizer))

    shape = dict(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                 intermediate=intermediate)
    config = _config(arch, **shape, max_position=max_position, tie_embeddings=tie_embeddings, ids=ids,
                     head_dim=head_dim)
    config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "phi3": "Phi3ForCausalLM"}[arch]]
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=ids[BOS], eos_token_id=[ids[IM_END], ids[EOS]],
                     pad_token_id=ids[PAD]).save_pretrained(out)
    save_file(_weights(arch, seed=seed, tie_embeddings=tie_embeddings, head_dim=head_dim, **shape),
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
