"""The LoRA layout of the served bases, written once: which model_types are served, which projections an adapter
may target and their shapes. vLLM keeps this in one module; so do we — register_base, the GGUF importer, the upload
validator, the capacity planner, the worker's adapter cache and its LoRA layers all read it from here.

Every served family is a pre-norm decoder with the seven projections below under Hugging Face's (and PEFT's) names;
what sets one apart from another is written in its `Family` row, and the runner (inference_worker.model) reads it
from there. Gemma 2 and Gemma 3 (text) add norms and soft-capping around the same seven projections: their adapters
take the same pages, the same LoRA kernels and the same upload checks as Llama's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES  # canonical order: also the order of an adapter's pages
# Phi-3's checkpoints (and so PEFT's adapters for them) hold q/k/v as one qkv_proj [q + 2 kv, hidden] and gate/up as
# one gate_up_proj [2 intermediate, hidden] (gate rows first, as Phi3MLP chunks them).
#
# Decision (issue 48): MAP, not serve fused. An adapter on a fused module, A [r, hidden] and B [sum of the parts, r],
# computes exactly what adapters on its parts compute when they share that A and take B's rows part by part
# (B[:q], B[q:q + kv], B[q + kv:]). The worker splits it so as it loads it (split_fused_adapter), so every family has
# one layout in the pool (the seven parts, TARGET_MODULES order), one memory arithmetic and one set of LoRA kernels;
# the web side checks uploads against the family's own module names (ModelShape.peft_modules), so a PEFT adapter for
# Phi-3 uploads as PEFT saved it. The cost: A is stored (and multiplied) once per part, 3x for qkv_proj and 2x for
# gate_up_proj: an all-linear adapter on Phi-3-mini's shapes takes 1.19x the elements of the fused form.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
BLOCK_OF = {**{m: "self_attn" for m in ATTENTION_MODULES}, **{m: "mlp" for m in MLP_MODULES},
            "qkv_proj": "self_attn", "gate_up_proj": "mlp"}


@dataclass(frozen=True)
class Family:
    """What a served model_type adds to the Llama decoder (pre-norm, RoPE, GQA, SwiGLU, the seven projections)."""

    model_type: str
    qkv_bias: bool = False  # q, k and v carry biases (Qwen2); Llama's attention_bias=True adds them to o too
    qk_norm: bool = False  # per-head RMSNorm on q and k after their projections, before RoPE (Qwen3): the weights
    # self_attn.q_norm / k_norm [head_dim]; an adapter on q_proj or k_proj changes what is normalised
    sliding_windows: str = "none"  # "all": every layer attends to the last sliding_window positions (Mistral,
    # Phi-3); "per_layer": layer_types (or max_window_layers) picks the layers, when use_sliding_window (Qwen2, Qwen3);
    # "pattern": layer_types picks them, or without it window_pattern (Gemma 2, Gemma 3)
    fused: bool = False  # qkv_proj and gate_up_proj in the checkpoint and in adapters (FUSED_MODULES)
    gemma: bool = False  # Gemma 2 / 3's decoder (inference_worker.model.GemmaBlock): the embedding times sqrt(hidden)
    # (in the model's dtype), every RMSNorm by (1 + weight), norms after attention and after the MLP as well as before
    # (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm), GeGLU (the
    # gate through hidden_activation, gelu-tanh), scores scaled by query_pre_attn_scalar ** -0.5 instead of
    # head_dim ** -0.5, the final logits soft-capped (tanh(x / c) * c) where final_logit_softcapping is set. The
    # seven projections keep Llama's (and PEFT's) names and shapes, so adapters need no mapping.
    attn_softcap: bool = False  # attention scores soft-capped by attn_logit_softcapping where set (Gemma 2). Gemma 3's
    # config has the key too, but transformers' Gemma3Attention does not apply it, and neither does the runner
    window_pattern: int = 0  # sliding_windows "pattern": without layer_types, layer i is sliding unless (i + 1) is a
    # multiple of this (Gemma 2: 2, every other layer; Gemma 3: 6, or the config's sliding_window_pattern)
    local_rope: bool = False  # sliding layers rotate with their own RoPE (Gemma 3: rope_local_base_freq, default
    # RoPE), global ones with rope_theta and its scaling (protocol.rope.local_rope_from_config)
    norms_per_layer: int = 2  # RMSNorm weights [hidden] per layer (Gemma: 4), for the parameter count

    @property
    def norm_offset(self) -> float:
        """What an RMSNorm adds to its weight before multiplying: 1 for Gemma's (1 + weight), 0 otherwise."""
        return 1.0 if self.gemma else 0.0


# Gemma 2 and Gemma 3's text decoder (Gemma3ForCausalLM; its model_type is gemma3_text). A "gemma3" folder is the
# vision-language model (Gemma3ForConditionalGeneration, its text decoder's weights under language_model and a PEFT
# adapter's names with it): refused by name, see UNSERVED_HINTS.
GEMMA2 = Family("gemma2", sliding_windows="pattern", gemma=True, attn_softcap=True, window_pattern=2,
                norms_per_layer=4)
GEMMA3 = Family("gemma3_text", qk_norm=True, sliding_windows="pattern", gemma=True, window_pattern=6,
                local_rope=True, norms_per_layer=4)

FAMILIES = {
    "llama": Family("llama"),
    "mistral": Family("mistral", sliding_windows="all"),
    "qwen2": Family("qwen2", qkv_bias=True, sliding_windows="per_layer"),
    "qwen3": Family("qwen3", qk_norm=True, sliding_windows="per_layer"),
    "phi3": Family("phi3", sliding_windows="all", fused=True),  # Phi-3 and Phi-4 (their model_type is phi3)
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
}
SERVED_MODEL_TYPES = tuple(FAMILIES)


# What the refusal adds for a model_type close to a served one
UNSERVED_HINTS = {
    "gemma3": "Gemma 3's vision-language checkpoint (Gemma3ForConditionalGeneration) is not served; its text decoder "
              "is, as model_type 'gemma3_text' (Gemma3ForCausalLM: gemma-3-1b, or a text-only export)",
}


class UnservedBase(ValueError):
    """The config names a model_type the runner does not serve."""


def family_of(config) -> Family:
    """The Family of a Hugging Face config (dict) or anything with model_type; UnservedBase otherwise."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    family = FAMILIES.get(str(model_type))
    if family is None:
        hint = UNSERVED_HINTS.get(str(model_type))
        raise UnservedBase(f"unsupported model_type {model_type!r}; lorafleet serves {', '.join(SERVED_MODEL_TYPES)}"
                           + (f". {hint}" if hint else ""))
    return family


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder that LoRA and the memory arithmetic depend on."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    fused: bool = False  # the family's adapters name qkv_proj and gate_up_proj (FUSED_MODULES)

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a Hugging Face config (dict), the runner's ModelConfig, or a shape manifest (all names read)."""

        def get(*names, default=None):
            for n in names:
                v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
                if v is not None:
                    return v
            return default

        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads", "num_heads"))
        family = FAMILIES.get(str(get("model_type", "architecture")))
        return cls(
            num_layers=int(get("num_hidden_layers", "num_layers")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", "num_kv_heads", default=heads)),
            head_dim=int(get("head_dim", default=hidden // heads)),
            fused=bool(get("fused", default=family is not None and family.fused)),
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every target projection, in TARGET_MODULES order."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def peft_modules(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the modules an adapter for this family names: the seven projections, or
        for a fused family qkv_proj, o_proj, gate_up_proj and down_proj (what upload validation checks)."""
        proj = self.projections()
        if not self.fused:
            return proj
        h, i = self.hidden_size, self.intermediate_size
        return {"qkv_proj": (h, self.q_dim + 2 * self.kv_dim), "o_proj": proj["o_proj"], "gate_up_proj": (h, 2 * i),
                "down_proj": proj["down_proj"]}

    def part_rows(self, fused_module: str) -> list[tuple[str, int, int]]:
        """(part, first row, end row) of each part's rows in a fused module's output (and so in its lora_B)."""
        sizes = {"qkv_proj": (self.q_dim, self.kv_dim, self.kv_dim),
                 "gate_up_proj": (self.intermediate_size, self.intermediate_size)}[fused_module]
        out, at = [], 0
        for part, n in zip(FUSED_MODULES[fused_module], sizes, strict=True):
            out.append((part, at, at + n))
            at += n
        return out


def expand_targets(targets) -> set[str]:
    """Target module names with each fused one replaced by its parts: what an adapter occupies in the pool."""
    out: set[str] = set()
    for t in targets:
        out.update(FUSED_MODULES.get(t, (t,)))
    return out


def split_fused_adapter(weights: dict, shape: ModelShape) -> dict:
    """PEFT weights (name -> tensor) with every fused module's lora_A / lora_B replaced by its parts' (the same A for
    each part, B's rows of that part): the mapping decided above. Other tensors pass through; names keep their form
    (saved or in-memory). The tensors are views, not copies."""
    out = {}
    for name, t in weights.items():
        m = _PEFT_NAME.match(name)
        if m is None or m.group("module") not in FUSED_MODULES:
            out[name] = t
            continue
        module = m.group("module")
        head, tail = name[:m.start("module")], name[m.end("module"):]
        for part, lo, hi in shape.part_rows(module):
            out[f"{head}{part}{tail}"] = t if m.group("ab") == "A" else t[lo:hi]
    return out


def peft_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's LoRA scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / (rank ** 0.5) if use_rslora else alpha / rank


# PEFT's tensor names: saved "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight"; in memory PEFT adds
# the adapter's name ("...up_proj.lora_B.default.weight"). One pattern for both, used by upload validation
# (saved names only), the worker's adapter cache (saved names only) and the LoRA layers (either).
_PEFT_NAME = re.compile(
    r"^(?P<prefix>.*?)(?:^|\.)layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\."
    r"(?P<module>" + "|".join(TARGET_MODULES + tuple(FUSED_MODULES)) + r")"
    r"\.lora_(?P<ab>[AB])(?P<adapter>\.[A-Za-z0-9_]+)?\.weight$"
)
SAVED_PREFIX = "base_model.model.model"


def peft_tensor_name(layer: int, module: str, ab: str) -> str:
    """The saved PEFT name of lora_A / lora_B of `module` in `layer`."""
    return f"{SAVED_PREFIX}.layers.{layer}.{BLOCK_OF[module]}.{module}.lora_{ab}.weight"


def parse_peft_name(name: str, *, saved: bool = True) -> tuple[int, str, str] | None:
    """(layer, module, 'A' | 'B') of a PEFT LoRA weight name, or None when it is not one. `saved`: only
    the exact names PEFT saves (the interchange format); otherwise in-memory names are accepted too."""
    m = _PEFT_NAME.match(name)
    if m is None or BLOCK_OF[m.group("module")] != m.group("block"):
        return None
    if saved and (m.group("adapter") or m.group("prefix") != SAVED_PREFIX):
        return None
    return int(m.group("layer")), m.group("module"), m.group("ab")
