"""The model runner: a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3/Phi-4, Gemma 2 and Gemma 3's text
decoder: protocol.lora_layout.FAMILIES) over a paged KV cache, with LoRA.

One `forward(steps)` runs one engine iteration: any mix of prefill chunks and decode tokens, of any
adapters, as one batch. Every projection is one GEMM over all tokens of the step (q/k/v and gate/up are
fused), plus the batched LoRA term from `kernels.add_lora` with one mapping per step. Attention is
batched too: all decode tokens of the step attend in one call — on CPU in fp32 a native kernel reading K/V
in place from the pages (`kernels.paged_decode_attention`), elsewhere SDPA over a padded gather of their
KV blocks (`[kv_heads, B, L, head_dim]`); prefill chunks attend one sequence at a time through SDPA (a
chunk is already a big matrix, and prefill is rarer than decode). On CPU in fp32 the small ops between a layer's
GEMMs (RMSNorm, RoPE with the KV write, decode attention, SwiGLU's gate) go through one `kernels.StepKernels` per
step: buffers and shapes set up once for all layers, each call one ctypes call on integers.

Gemma (GemmaBlock) takes torch for those small ops (its (1 + weight) norms, gelu-tanh gate and soft-capped scores are
not in the native kernels), and a plain softmax attention, scores soft-capped, on its soft-capped layers (SDPA cannot
soft-cap); its GEMMs and LoRA terms are the same as every family's.

nanoGPT shape: a config dataclass, one block class, one model class; weights read straight from the
checkpoint's *.safetensors with Hugging Face's tensor names. Django-free.
"""
from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import (
    GemmSide,
    StepArena,
    StepKernels,
    geglu_tanh,
    gemm_available,
    gemm_side_helps,
    paged_decode_attention,
    paged_prefill_attention,
    rope_kv_write,
)
from kernels import gemm as native_gemm
from kernels import gemm_lora as native_gemm_lora
from kernels import gemm_pack as native_gemm_pack
from kernels import rms_norm as native_rms_norm
from kernels.cpu_native import load as native_library
from protocol.lora_layout import FAMILIES, SERVED_MODEL_TYPES, Family, ModelShape, family_of, split_fused_adapter
from protocol.memory import (
    PACK_MIN_HIDDEN,
    STEP_ARENA_BYTES,
    PoolSplit,
    page_elements,
    split_budget,
    workspace_bytes,
)
from protocol.rope import SERVED_ROPE_TYPES, RopeSpec, local_rope_from_config, rope_from_config

from .huge_pages import Collapse, collapse_resident_memory
from .kv_cache import PagedKVCache, blocks_needed
from .lora import GEMM_GROUPS, LoraPool, StepLora
from .memory_pool import PagePool

SUPPORTED_ARCHITECTURES = set(SERVED_MODEL_TYPES)  # protocol.lora_layout.FAMILIES
SUPPORTED_ROPE_TYPES = set(SERVED_ROPE_TYPES)  # protocol.rope


@dataclass
class ModelConfig:
    """The Hugging Face config values the runner needs, normalised across architectures and versions."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int  # the context served (protocol.rope.RopeSpec.context): the config's own, or
    # more where the RoPE scaling extends it (dynamic)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "linear"|"llama3"|"yarn"|"dynamic"|"longrope", ...}
    tie_word_embeddings: bool
    sliding_windows: list[int | None]  # per layer: attend to the last N positions only, or None
    bos_token_id: int | None = None
    eos_token_id: int | None = None  # the first of eos_token_ids
    eos_token_ids: list[int] = field(default_factory=list)  # config.json + generation_config.json
    pad_token_id: int | None = None
    family: Family = FAMILIES["llama"]
    rope: RopeSpec | None = None
    # Gemma (protocol.lora_layout.Family.gemma); None / defaults elsewhere
    query_pre_attn_scalar: float | None = None  # scores scaled by its ** -0.5 instead of head_dim's
    attn_logit_softcapping: float | None = None  # scores -> tanh(scores / c) * c before the mask (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits
    gelu_approximate: str = "tanh"  # the GeGLU gate: F.gelu(approximate=...), from hidden_activation
    sliding_layers: list[bool] = field(default_factory=list)  # per layer: a sliding-window layer (Gemma's layer_types)
    local_rope: RopeSpec | None = None  # the sliding layers' own RoPE (Gemma 3), None: every layer rotates with `rope`

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        family = family_of(cfg)  # UnservedBase (a ValueError) names the model_type
        arch = family.model_type
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        rope = rope_from_config(cfg)  # RopeError (a ValueError) names what is not served
        rope_scaling = None if rope.rope_type == "default" else {**rope.params, "rope_type": rope.rope_type}

        window = cfg.get("sliding_window")
        sliding = [False] * layers
        if family.sliding_windows == "all":
            windows = [window] * layers
        elif family.sliding_windows == "pattern":  # Gemma: layer_types, else every window_pattern-th layer is global
            window = cfg["sliding_window"] if "sliding_window" in cfg else 4096  # Gemma2Config / Gemma3TextConfig's
            pattern = family.window_pattern
            if family.local_rope:  # Gemma3TextConfig reads an older config's sliding_window_pattern (Gemma2's does not)
                pattern = int(cfg.get("sliding_window_pattern") or pattern)
            types = cfg.get("layer_types") or [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
            if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
                raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the {layers} "
                                 f"layers, not {types!r}")
            sliding = [t == "sliding_attention" for t in types]
            windows = [window if s else None for s in sliding]
        elif family.sliding_windows == "per_layer" and cfg.get("use_sliding_window") and window:
            types = cfg.get("layer_types") or [
                "sliding_attention" if i >= cfg.get("max_window_layers", layers) else "full_attention"
                for i in range(layers)]
            windows = [window if t == "sliding_attention" else None for t in types]
        else:
            windows = [None] * layers

        gemma = _gemma_fields(cfg, family) if family.gemma else {}

        eos = _as_list(cfg.get("eos_token_id"))
        gen_path = path / "generation_config.json"
        if gen_path.exists():
            eos += [e for e in _as_list(json.loads(gen_path.read_text()).get("eos_token_id")) if e not in eos]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=rope.context,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_windows=windows,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if eos else None,
            eos_token_ids=eos,
            pad_token_id=cfg.get("pad_token_id"),
            family=family,
            rope=rope,
            sliding_layers=sliding,
            **gemma,
        )


# hidden_activation -> F.gelu's approximate: transformers' ACT2FN["gelu_pytorch_tanh"] is F.gelu(approximate="tanh"),
# ACT2FN["gelu"] the exact one; Gemma 2 and 3 ship gelu_pytorch_tanh
GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def _gemma_fields(cfg: dict, family: Family) -> dict:
    """The ModelConfig fields of a Gemma config (transformers' Gemma2Config / Gemma3TextConfig defaults where the
    config is silent), or ValueError naming what is not served."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True (an encoder, such as EmbeddingGemma) is not served: "
                         "lorafleet's runner generates, causally")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for Gemma")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(f"hidden_activation {act!r} is not supported for {family.model_type}; supported: "
                         f"{', '.join(GEMMA_ACTIVATIONS)}")
    defaults = {"gemma2": (50.0, 30.0)}.get(family.model_type, (None, None))  # attn, final soft-capping
    attn_cap = cfg["attn_logit_softcapping"] if "attn_logit_softcapping" in cfg else defaults[0]
    final_cap = cfg["final_logit_softcapping"] if "final_logit_softcapping" in cfg else defaults[1]
    return dict(query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
                attn_logit_softcapping=float(attn_cap) if attn_cap and family.attn_softcap else None,
                final_logit_softcapping=float(final_cap) if final_cap else None,
                gelu_approximate=GEMMA_ACTIVATIONS[act],
                local_rope=local_rope_from_config(cfg) if family.local_rope else None)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] with the config's theta and scaling, as transformers computes them at init
    (for dynamic: those of a sequence within max_position_embeddings, the default ones)."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] == "dynamic":
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(config.rope_theta, hd, factor, scaling)
    if scaling["rope_type"] == "longrope":  # the short factors; rope_tables takes the long ones past the original
        return _longrope_inv_freq(config.rope_theta, hd, scaling["short_factor"])
    # llama3: long wavelengths are divided by factor, short ones kept, the band between interpolated.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, factor: float, scaling: dict) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters, op for op): the interpolated frequencies (divided by factor)
    below the correction range, the original ones above it, a linear ramp between."""
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: divided by factor (interpolation)
    return interpolation * (1 - keep) + extrapolation * keep


def _longrope_inv_freq(base: float, dim: int, ext_factors: list[float]) -> torch.Tensor:
    """LongRoPE (transformers' _compute_longrope_parameters): each frequency divided by its factor."""
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base ** shape)


def rope_attention_factor(config: ModelConfig) -> float:
    """What transformers multiplies cos and sin by: YaRN's and LongRoPE's attention factors, 1 for the other types."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    factor, mscale, mscale_all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (apply_rope's [-sin, sin]) of every served position, fp32 [P, head_dim], as
    transformers computes them (cos/sin of position x inv_freq, times the attention factor).

    LongRoPE (protocol.rope): position p takes the long factors when p + 1 > original_max_position_embeddings.

    Dynamic NTK (protocol.rope): position p takes the frequencies of a sequence of max(p + 1, max_position_embeddings)
    tokens, computed as transformers' dynamic update computes them (seq_len a tensor, so the new base in fp32)."""
    hd, P = config.head_dim, config.max_position_embeddings
    pos = torch.arange(P, dtype=torch.float32)
    inv_freq = rope_inv_freq(config)
    freqs = torch.outer(pos, inv_freq)  # [P, hd/2]
    scaling = config.rope_scaling
    rope = config.rope
    if scaling is not None and scaling["rope_type"] == "dynamic" and rope is not None:
        original = rope.max_position_embeddings
        if P > original:
            factor = float(scaling["factor"])
            seq_len = torch.arange(original + 1, P + 1, dtype=torch.int64)  # of positions original..P-1
            base = config.rope_theta * ((factor * seq_len / original) - (factor - 1)) ** (hd / (hd - 2))  # [N]
            exponent = torch.arange(0, hd, 2, dtype=torch.int64).to(dtype=torch.float) / hd  # [hd/2]
            grown = 1.0 / (base.unsqueeze(1) ** exponent.unsqueeze(0))  # [N, hd/2]
            freqs[original:] = pos[original:].unsqueeze(1) * grown
    if scaling is not None and scaling["rope_type"] == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        if P > original:  # past the original context: the long factors (transformers' longrope_frequency_update)
            freqs[original:] = torch.outer(pos[original:], _longrope_inv_freq(config.rope_theta, hd,
                                                                               scaling["long_factor"]))
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
    scale = rope_attention_factor(config)
    return emb.cos() * scale, torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * scale


def local_rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rope_tables of the sliding layers' own RoPE (Gemma 3's rope_local_base_freq), or None where they have none."""
    local = config.local_rope
    if local is None:
        return None
    scaling = None if local.rope_type == "default" else {**local.params, "rope_type": local.rope_type}
    return rope_tables(replace(config, rope_theta=local.theta, rope_scaling=scaling, rope=local))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, like transformers' LlamaRMSNorm. On CPU in fp32 one native pass
    (kernels.rms_norm) instead of six torch ops."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        y = native_rms_norm(x, weight, eps, threads=torch.get_num_threads())
        if y is not None:
            return y
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm as transformers computes it (Gemma2RMSNorm, Gemma3RMSNorm): in fp32, times (1 + weight) in fp32,
    then cast back. weight: 1 + the checkpoint's weight, fp32 (gemma_norm_weight), broadcast over x's last
    dim (or [heads, hd] for the per-head q/k norms)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def gemma_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """1 + weight in fp32, what Gemma's RMSNorm multiplies by ((1.0 + self.weight.float()) in transformers)."""
    return 1.0 + weight.float()


def gemma_attention_scale(cfg: ModelConfig) -> float:
    """Gemma's attention scale, query_pre_attn_scalar ** -0.5 (transformers' Gemma2Attention.scaling)."""
    return float(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(x / cap) * cap, in x's dtype: Gemma's attention and final logit soft-capping, op for op."""
    return torch.tanh(x / cap) * cap


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, cap: float,
                         mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(tanh(q k^T scale / cap) cap + mask) v, as transformers' eager attention computes it for Gemma 2 (SDPA
    cannot soft-cap): the softmax in fp32, cast back before v. q [..., n, hd], k and v [..., L, hd] (broadcast over
    the leading dims), mask bool (True: may attend) or additive, broadcast to [..., n, L]."""
    scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)) * scale, cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, heads, hd] by weight [heads, hd] (each head's norm weight), in fp32 and cast
    back, like transformers' Qwen3RMSNorm on q and k."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def head_rms_norm_in_place(qkv: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """head_rms_norm of the first heads of every row of qkv [T, >= heads * hd] (fp32 CPU, rows contiguous) by weight
    [heads, hd], written back in place, on the native RMSNorm (kernels.rms_norm's rms_norm_f32, one call a head over
    its T rows at the row stride, on the calling thread); False, nothing written, where the library or these tensors
    are not covered (the caller then uses head_rms_norm).

    Why (Qwen3's q/k norms, bench/RESULTS.md 2026-12-07): head_rms_norm is eight torch ops over [T, H + KV, hd], each
    above torch's grain, so each a parallel region of its own after the native kernels' team; on this project's
    shared 2-CPU hosts every such region waited for a descheduled thread, and the mid shape's mixed decode step
    (64 tokens) took 1.75 s as Qwen3 against Llama's 0.36 s, 1.1 s of it in those ops (torch.profiler). Here no
    parallel region at all: a head's T rows are 64 x 64 floats at a decode step, and a whole prompt chunk's norm
    is a small fraction of its GEMMs."""
    heads, hd = weight.shape
    lib = native_library()
    if (lib is None or qkv.dtype != torch.float32 or weight.dtype != torch.float32 or qkv.device.type != "cpu"
            or weight.device.type != "cpu" or qkv.dim() != 2 or qkv.stride(1) != 1 or not weight.is_contiguous()
            or qkv.shape[1] < heads * hd):
        return False
    T, stride, x, w, step = qkv.shape[0], qkv.stride(0), qkv.data_ptr(), weight.data_ptr(), hd * qkv.element_size()
    for j in range(heads):  # in place: each row's sum of squares is read before the row is written
        lib.rms_norm_f32(T, hd, x + j * step, stride, w + j * step, x + j * step, stride, eps, 1)
    return True


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos, sin_signed: [T, 1, hd]. HF's rotate-half convention:
    x * cos + rotate_half(x) * sin, with rotate_half's negation folded into sin_signed = [-sin, sin]
    (exactly equal, one op fewer)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin_signed)


@dataclass
class SeqStep:
    """One sequence's share of a forward step (see interfaces: the engine builds these)."""

    block_table: list[int]  # KV blocks of this sequence (enough for start_pos + len(token_ids))
    start_pos: int  # tokens of this sequence already in the KV cache
    token_ids: list[int]  # new tokens this step: a prefill chunk, or one decode token
    slot: int = -1  # LoRA slot, -1 = base only


@dataclass
class _Prefill:
    """A multi-token step: attends alone, through SDPA with a causal mask offset by start_pos."""

    first: int  # index of its first token in the step's flat token list
    n: int  # tokens in this chunk
    rows: torch.Tensor | None  # int64 [start_pos + n], KV rows of positions 0..start_pos+n-1; None when the
    # chunk is a whole prompt (start_pos 0): it attends to its own new keys, no gather; or when it reads the pages
    # in place (`paged`)
    masks: dict[int | None, torch.Tensor]  # window -> bool [1, 1, n, start_pos + n], True = may attend
    start: int = 0  # positions of the sequence already in the cache
    paged: torch.Tensor | None = None  # int64 [nb] the sequence's blocks, when the chunk attends on the pages in
    # place (CPU fp32, a short chunk after cached positions: kernels.paged_prefill_attention)

    def gather_rows(self, kv: PagedKVCache) -> None:
        """Set `rows` from `paged`, for a path that gathers after all (no kernel for these shapes, soft-capping)."""
        if self.rows is None and self.paged is not None:
            self.rows = torch.tensor(kv.rows_for(self.paged.tolist(), 0, self.start + self.n), dtype=torch.int64,
                                     device=self.paged.device)


@dataclass
class _Decode:
    """All single-token steps of a forward, attending together in one padded batch."""

    index: torch.Tensor | None  # int64 [B] their token indices, None when the whole step is decode
    blocks: torch.Tensor  # int64 [B, nb] KV blocks; L = nb * block_size positions (padding masked)
    lens: torch.Tensor  # int64 [B] positions in the cache per sequence, the new token's included
    # window -> additive float [1, B, 1, L] (0 / -inf), or None. 4-D because SDPA on CPU takes its fast
    # (flash) kernel only for 4-D masks and falls back to the unfused math path otherwise.
    masks: dict[int | None, torch.Tensor | None]


class StepSides:
    """What each of a step's native GEMMs prefetches while it multiplies (kernels.GemmSide): the step's adapters'
    matrices of its projections, which the LoRA calls right after it read. At the decode batch a GEMM is bound by its
    arithmetic and leaves the memory bus mostly idle, while the LoRA kernel is bound by its reads. The ranges are byte
    offsets in a layer's pool buffer, the same in every layer (memory_pool.PagePool: [L, P, E]).

    Tried and not kept (bench/RESULTS.md, 2026-12-04): the decode tokens' KV pages for decode attention, prefetched
    during the q/k/v GEMM before it (SmolLM2 base-only passes at 0.77 of the speed without) or during the previous
    layer's gate/up GEMM (0.85)."""

    __slots__ = ("groups", "bases")

    def __init__(self, ranges: dict[str, list[tuple[int, int]]], bases: list[int]) -> None:
        self.groups = {g: GemmSide(r) for g, r in ranges.items() if r}
        self.bases = bases  # each layer's pool buffer's address

    def at(self, layer: int, group: str) -> tuple[int, int, int] | None:
        side = self.groups.get(group)
        return None if side is None else side.at(self.bases[layer])


@dataclass
class StepContext:
    """Everything computed once per forward and reused by every layer."""

    cos: torch.Tensor  # [T, 1, hd]
    sin: torch.Tensor  # [T, 1, hd], signed: [-sin, sin] (see apply_rope)
    write_rows: torch.Tensor  # int64 [T] KV row of each new token
    decode: _Decode | None
    prefills: list[_Prefill]
    lora: StepLora | None
    native: StepKernels | None = None  # CPU fp32: the layers' small ops on buffers allocated once for the step
    sides: StepSides | None = None  # what the native GEMMs prefetch for the calls after them
    fuse_lora: bool = False  # a decode step: the LoRA term runs inside the native GEMMs (Projection.with_lora)
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of the sliding layers' own RoPE (Gemma 3)


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's fp32 GEMM on pre-packed weights: CPU, fp32, and a torch built with oneDNN's linear ops."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# A prompt chunk attends on the step's kernels (each of its tokens a query over the sequence's pages, as a decode
# token does) when its context is at most this long; a longer one goes through SDPA, whose blocked kernel reads
# each key once per block of queries rather than once per query. The benches' prompts (64 tokens on the mid model,
# 34-41 on SmolLM2) took an SDPA call per prompt and layer: ~0.2 ms each, several times their arithmetic.
NATIVE_PROMPT_CONTEXT = 128

# A prompt chunk of at most this many tokens after cached positions (a long prompt read a little a step beside
# other tenants' decodes, issue 46) attends on the pages in place (kernels.paged_prefill_attention, CPU fp32): the
# SDPA path first gathers the K/V of every earlier position, a copy as long as the context for every chunk.
PAGED_PREFILL_TOKENS = 64


# Below this many bytes of weights the runner leaves its memory's page size alone (the tiny test and fallback-demo
# models: their weights stay in the caches, and collapsing costs ~1 s of a test's time).
HUGE_PAGES_MIN_WEIGHTS = 64 << 20


# PACK_MIN_HIDDEN (protocol.memory, where the capacity planner reads it too): oneDNN's packed GEMM against F.linear
# at 64 rows, bench/limits.py on this project's CPUs (2026-11-30): 246 vs 207 GFLOP/s on the mid model (hidden
# 1024), mixed on SmolLM2 (576; it wins at 512 rows), 54 vs 133 on the tiny test and fallback-demo models (64):
# below this width the runner keeps F.linear unless asked to pack.


class Projection:
    """A projection's weight [out, in] (and bias), and the GEMM that multiplies by it.

    On CPU in fp32 the GEMMs run on oneDNN (brgemm) through `torch.ops.mkldnn._linear_pointwise` instead of
    F.linear's MKL sgemm (which on this project's AMD CPUs ran 2-4x slower at the model's shapes; bench/limits.py
    measures both). `pack_rows` given: the weight is reordered ONCE into oneDNN's blocked layout (AB16b64a on
    AVX-512), what inductor's CPU freezing pass emits and vLLM-CPU's onednn_mm does; the layout does not depend on
    the row count (the hint only picks it), so one packed copy serves decode and prefill. `onednn` without
    `pack_rows`: oneDNN on the weight as stored (a tied LM head with pack_tied_head=False: the embedding table,
    which must stay a plain tensor for the token lookup, so packing it means a second copy). The output is an
    ordinary dense tensor, so LoRA's column views of fused outputs work as before. `native`: the weight packed
    once into panels of 64 output columns (AVX2: 48) for kernels.gemm (csrc/gemm_f32.h; AVX-512, or AVX2 and FMA), which
    prefetches each panel while the one before it is multiplied: SmolLM2's projections and head at 64 rows ran
    267-270 GFLOP/s on it against packed oneDNN's 193-198 on the Intel Xeon host (bench/limits.py; the same at 512
    rows, ~290), and the base-only pass 1.17x (bench/peers.py --gemm-ab); on the AVX2 Zen 3 host 94.7 against
    torch's best 76.9 at 64 rows. The runner takes it wherever it runs (native_gemm). Neither:
    F.linear / addmm_ (other devices and dtypes, or packed_weights=False).
    """

    __slots__ = ("weight", "bias", "onednn", "native", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack_rows: int | None = None,
                 onednn: bool = False, native: bool = False):
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.native = native
        self.onednn = not native and (onednn or pack_rows is not None)
        if native:
            packed = native_gemm_pack(weight.contiguous())
            if packed is None:
                raise ValueError("native=True needs the native fp32 GEMM (kernels.gemm_available()) and a fp32 CPU weight")
            self.weight = packed
        elif pack_rows is not None:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, pack_rows)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor, side: tuple[int, int, int] | None = None) -> torch.Tensor:
        """x @ W^T + b. `side`: memory to prefetch meanwhile (kernels.GemmSide; the native GEMM only)."""
        if self.native:
            return native_gemm(x, self.weight, self.out_features, self.bias, threads=torch.get_num_threads(),
                               side=side)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def with_lora(self, x: torch.Tensor, lora, buffer_ptr: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + b (+ out, in place, when given) plus the LoRA term of the projections this GEMM computes, in one
        native call (kernels.gemm_lora; `lora` a kernels.FusedLoraGroup, buffer_ptr the layer's adapter buffer).
        Native GEMM only; out with contiguous rows."""
        return native_gemm_lora(x, self.weight, self.out_features, self.bias, out, lora, buffer_ptr,
                                threads=torch.get_num_threads())

    def add_to(self, out: torch.Tensor, x: torch.Tensor, side: tuple[int, int, int] | None = None) -> torch.Tensor:
        """out + x @ W^T + b, the residual add fused into the GEMM: oneDNN's binary-add post-op (a new tensor),
        or BLAS beta = 1 into `out` in place (and the native GEMM too). Use the returned tensor."""
        if self.native and out.stride(1) == 1:
            return native_gemm(x, self.weight, self.out_features, self.bias, out, threads=torch.get_num_threads(),
                               side=side)
        if self.native:
            return out.add_(self(x))
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise.binary(x, out, self.weight, self.bias, "add")
        out.addmm_(x, self.weight.t())
        if self.bias is not None:
            out.add_(self.bias)
        return out


class Block:
    """One decoder layer: pre-norm attention and SwiGLU MLP, each with a residual."""

    _head_norm = staticmethod(head_rms_norm)  # the per-head q/k norm off the native kernel (Qwen3's)

    def __init__(self, runner: ModelRunner, layer: int, w: dict[str, torch.Tensor]) -> None:
        cfg = runner.config
        self.runner, self.layer, self.cfg = runner, layer, cfg
        self.q_dim = cfg.num_heads * cfg.head_dim
        self.kv_dim = cfg.num_kv_heads * cfg.head_dim
        self.input_norm = w["input_layernorm.weight"]  # [hidden]
        self.post_norm = w["post_attention_layernorm.weight"]  # [hidden]
        if cfg.family.fused:  # Phi-3: q/k/v and gate/up already fused in the checkpoint, in the order used here
            w_qkv = w["self_attn.qkv_proj.weight"].contiguous()  # [q_dim + 2 kv_dim, hidden]
        else:
            w_qkv = torch.cat([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"],
                               w["self_attn.v_proj.weight"]]).contiguous()  # [q_dim + 2 kv_dim, hidden]
        if tuple(w_qkv.shape) != (self.q_dim + 2 * self.kv_dim, cfg.hidden_size):
            raise ValueError(f"layer {layer}: q/k/v weights of shape {list(w_qkv.shape)}, the config needs "
                             f"{[self.q_dim + 2 * self.kv_dim, cfg.hidden_size]}")
        biases = [w.get(f"self_attn.{p}.bias") for p in ("q_proj", "k_proj", "v_proj")]
        b_qkv = None
        if any(b is not None for b in biases):  # Qwen2 (or Llama with attention_bias)
            dims = (self.q_dim, self.kv_dim, self.kv_dim)
            b_qkv = torch.cat([b if b is not None else torch.zeros(d, dtype=w_qkv.dtype, device=w_qkv.device)
                               for b, d in zip(biases, dims, strict=True)])
        if any(f"mlp.{p}.bias" in w for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError("MLP biases (mlp_bias=True) are not supported")
        pack, native = runner.pack_rows, runner.native_gemm
        self.qkv = Projection(w_qkv, b_qkv, pack_rows=pack, native=native)  # fused q/k/v
        self.o = Projection(w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"), pack_rows=pack,
                            native=native)
        w_gate_up = (w["mlp.gate_up_proj.weight"] if cfg.family.fused
                     else torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        self.gate_up = Projection(w_gate_up.contiguous(), pack_rows=pack, native=native)  # [2 intermediate, hidden]
        self.down = Projection(w["mlp.down_proj.weight"], pack_rows=pack, native=native)  # [hidden, intermediate]
        self.window = cfg.sliding_windows[layer]
        self.scale = runner.attention_scale  # the attention scores' (Gemma: query_pre_attn_scalar's)
        self.local = False  # rotates with its own RoPE table (GemmaBlock: Gemma 3's sliding layers)
        # the LoRA targets each GEMM computes, (name, output width) in column order (Block._project)
        inter = cfg.intermediate_size
        self._qkv_parts = (("q_proj", self.q_dim), ("k_proj", self.kv_dim), ("v_proj", self.kv_dim))
        self._o_parts = (("o_proj", cfg.hidden_size),)
        self._gate_up_parts = (("gate_proj", inter), ("up_proj", inter))
        self._down_parts = (("down_proj", cfg.hidden_size),)
        # Qwen3: q and k normalised per head before RoPE, one weight [head_dim] each, repeated here to [H + KV, hd]
        # so both go in one pass over the q and k columns of the fused output
        self.qk_norm: torch.Tensor | None = None
        if cfg.family.qk_norm:
            hd = cfg.head_dim
            self.qk_norm = torch.cat([w["self_attn.q_norm.weight"].expand(cfg.num_heads, hd),
                                      w["self_attn.k_norm.weight"].expand(cfg.num_kv_heads, hd)]).contiguous()

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        cfg, layer, native = self.cfg, self.layer, ctx.native
        # --- attention ---
        if native is not None:  # [T, hidden]
            h = native.norm(x, self.input_norm, layer)
        else:
            h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = self._project(self.qkv, "qkv", h, ctx, self._qkv_parts)  # [T, q_dim + 2 kv_dim]
        self._norm_qk_in_place(qkv)
        y = self._rope_and_attend(qkv, ctx)  # [T, q_dim]
        # Residual adds fused into the GEMMs (x + y @ W_o^T): no [T, hidden] temporary and no separate add pass.
        # x is this forward's own activation (never a weight).
        x = self._project(self.o, "o", y, ctx, self._o_parts, residual=x)
        # --- MLP ---
        if native is not None:
            h = native.norm(x, self.post_norm, layer, post=True)
        else:
            h = rms_norm(x, self.post_norm, cfg.rms_norm_eps)
        gu = self._project(self.gate_up, "gate_up", h, ctx, self._gate_up_parts)  # [T, 2 * intermediate]
        if native is not None:
            a = native.swiglu(gu, layer)  # [T, intermediate]
        else:
            inter = cfg.intermediate_size
            a = F.silu(gu[:, :inter]).mul_(gu[:, inter:])
        return self._project(self.down, "down", a, ctx, self._down_parts, residual=x)  # x + a @ W_down^T

    def _project(self, proj: Projection, group: str, x: torch.Tensor, ctx: StepContext,
                 parts: tuple[tuple[str, int], ...], residual: torch.Tensor | None = None) -> torch.Tensor:
        """proj(x) (+ residual, in place where the GEMM can) with the LoRA terms of the projections it computes,
        `parts` ((name, output width) in column order): inside the native GEMM on a step whose LoRA the runner fuses
        (kernels.gemm_lora), else the GEMM (prefetching what ctx.sides names) and then lora.add for each part."""
        lora, layer = ctx.lora, self.layer
        if lora is not None and ctx.fuse_lora and (residual is None or residual.stride(1) == 1):
            fused = lora.fused(group)
            if fused is not None:
                return proj.with_lora(x, fused, lora.lora.buffer_ptrs[layer], residual)
        side = ctx.sides.at(layer, group) if ctx.sides is not None else None
        y = proj(x, side) if residual is None else proj.add_to(residual, x, side)
        if lora is not None:
            if len(parts) == 1:
                lora.add(y, x, layer, parts[0][0])
            else:
                start = 0
                for name, width in parts:
                    lora.add(y[:, start:start + width], x, layer, name)
                    start += width
        return y

    def _norm_qk_in_place(self, qkv: torch.Tensor) -> None:
        """The per-head q/k norms where the family has them (Qwen3, Gemma 3), after the projections and their LoRA
        terms, as PEFT wraps q_proj / k_proj: natively where it can, else `_head_norm` (the family's RMSNorm)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        if self.qk_norm is not None and not head_rms_norm_in_place(qkv, self.qk_norm, eps):
            qk_heads = qkv[:, :self.q_dim + self.kv_dim].view(qkv.shape[0], cfg.num_heads + cfg.num_kv_heads,
                                                               cfg.head_dim)
            qk_heads.copy_(self._head_norm(qk_heads, self.qk_norm, eps))

    def _rope_and_attend(self, qkv: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """RoPE of q and k in one go ([T, H + KV, hd]; the layer's own RoPE where it has one, Gemma 3's sliding
        layers), the rotated keys and the values written to the KV cache, then attention -> [T, q_dim]: on the step
        kernels where every token is on them, else `attend`."""
        cfg, kv, layer, native = self.cfg, self.runner.kv, self.layer, ctx.native
        T, k_end = qkv.shape[0], self.q_dim + self.kv_dim
        qk = y = None
        if native is not None:
            qk = native.rope_kv(qkv, layer, local=self.local)
            if qk is not None:
                y = native.attention(layer, self.window)  # None: not every token on it
        if qk is None:
            cos, sin = ctx.local_rope if self.local and ctx.local_rope is not None else (ctx.cos, ctx.sin)
            if self.runner.native_attention:  # CPU fp32: one native pass for both
                qk = rope_kv_write(qkv, cos, sin, kv.pages(layer), ctx.write_rows, heads=cfg.num_heads,
                                   kv_heads=cfg.num_kv_heads, block_size=kv.block_size,
                                   threads=torch.get_num_threads())
            if qk is None:
                qk = apply_rope(qkv[:, :k_end].view(T, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
                kv.write(layer, ctx.write_rows, qk[:, cfg.num_heads:],
                         qkv[:, k_end:].view(T, cfg.num_kv_heads, cfg.head_dim))
        if y is None:
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]  # [T, H, hd], [T, KV, hd]
            v = qkv[:, k_end:].view(T, cfg.num_kv_heads, cfg.head_dim)  # [T, KV, hd]
            y = self.attend(q, k, v, ctx)
        return y

    def attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """q: [T, H, hd], k_new/v_new: [T, KV, hd] (the step's own, already written to the cache) -> [T, H * hd]."""
        cfg = self.cfg
        T, H, hd = q.shape
        g = cfg.num_heads // cfg.num_kv_heads
        scale = self.scale
        kv = self.runner.kv
        if ctx.decode is not None and ctx.decode.index is None:  # index is None: the whole step is decode
            return self._attend_decode(q, ctx.decode, scale)
        out = torch.empty(T, H * hd, dtype=q.dtype, device=q.device)
        if ctx.decode is not None and ctx.decode.index is not None:
            idx = ctx.decode.index
            out.index_copy_(0, idx, self._attend_decode(q.index_select(0, idx), ctx.decode, scale))
        for p in ctx.prefills:
            if p.paged is not None:  # a short chunk deep in a prompt: read the pages in place, no gather
                y = paged_prefill_attention(q[p.first:p.first + p.n], kv.pages(self.layer), p.paged, p.start,
                                            kv_heads=cfg.num_kv_heads, window=self.window, scale=scale,
                                            threads=torch.get_num_threads())
                if y is not None:
                    out[p.first:p.first + p.n] = y
                    continue
                p.gather_rows(kv)
            if p.rows is None:  # a whole-prompt chunk: its keys are all in hand, no gather needed
                k = k_new[p.first:p.first + p.n].transpose(0, 1)  # [KV, n, hd]
                v = v_new[p.first:p.first + p.n].transpose(0, 1)
            else:
                k, v = kv.gather(self.layer, p.rows)  # [KV, L, hd]
            qp = q[p.first:p.first + p.n].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            yp = F.scaled_dot_product_attention(qp, k.unsqueeze(0), v.unsqueeze(0),
                                                attn_mask=p.masks[self.window], scale=scale,
                                                enable_gqa=g > 1)  # [1, H, n, hd]
            out[p.first:p.first + p.n] = yp[0].transpose(0, 1).reshape(p.n, H * hd)
        return out

    def _attend_decode(self, q: torch.Tensor, d: _Decode, scale: float) -> torch.Tensor:
        """q: [B, H, hd], one query per sequence -> [B, H * hd].

        GQA as SDPA over [KV, B, g, hd] queries (the g heads sharing a KV head are its "query length"),
        so K/V are never repeated. Sequences go in chunks whose gathered K/V stay in cache (about 2 MiB
        on CPU): the gather's output is then read back by SDPA from cache rather than from memory.
        """
        cfg = self.cfg
        B, H, hd = q.shape
        KV, g = cfg.num_kv_heads, H // cfg.num_kv_heads
        if self.runner.native_attention:  # CPU fp32: read K/V in place from the pages, no gather
            y = paged_decode_attention(q, self.runner.kv.pages(self.layer), d.blocks, d.lens, kv_heads=KV,
                                       window=self.window, scale=scale, threads=torch.get_num_threads())
            if y is not None:
                return y
        L = d.blocks.shape[1] * self.runner.block_size
        q4 = q.view(B, KV, g, hd).transpose(0, 1)  # [KV, B, g, hd]
        mask = d.masks[self.window]  # [1, B, 1, L] or None
        chunk = B if q.is_cuda else max(1, (2 << 20) // (2 * KV * L * hd * q.element_size()))
        ys = []
        for c in range(0, B, chunk):
            k, v = self.runner.kv.gather_blocks(self.layer, d.blocks[c:c + chunk])  # [KV, C, L, hd]
            m = None if mask is None else mask[:, c:c + chunk]
            ys.append(F.scaled_dot_product_attention(q4[:, c:c + chunk], k, v, attn_mask=m,
                                                     scale=scale))  # [KV, C, g, hd]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)  # [KV, B, g, hd]
        return y.transpose(0, 1).reshape(B, H * hd)


# Gemma's soft-capped prefill attention on CPU: a prompt chunk's queries in blocks whose scores (fp32 [heads, rows,
# context]) take at most this much, so a long prompt's attention needs no more memory than the workspace allows
SOFTCAP_SCORES_BYTES = 8 << 20


class GemmaBlock(Block):
    """A Gemma 2 / Gemma 3 decoder layer (Gemma2DecoderLayer, Gemma3DecoderLayer): RMSNorms by (1 + weight) before
    and after attention and before and after the MLP, per-head q/k norms by (1 + weight) before RoPE (Gemma 3),
    scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped where the config says (Gemma 2), GeGLU (the gate
    through gelu-tanh). Sliding layers attend to the last sliding_window positions and, in Gemma 3, rotate with their
    own RoPE (ctx.local_rope). The projections and their LoRA terms are Block's (fused into the GEMMs on a decode
    step where the runner fuses them). On CPU in fp32 the small ops between them are the native step kernels'
    (ctx.native): the norms are plain RMSNorms by the precomputed 1 + weight, the GeGLU gate and the soft-capped
    attention have kernels of their own (kernels.geglu_tanh; the paged attention kernels' softcap); elsewhere (CUDA,
    bf16, no C compiler) torch's, and softcapped_attention for soft-capped layers (SDPA cannot soft-cap)."""

    _head_norm = staticmethod(gemma_rms_norm)  # Gemma 3's q/k norms off the native kernel, by (1 + weight)

    def __init__(self, runner: ModelRunner, layer: int, w: dict[str, torch.Tensor]) -> None:
        super().__init__(runner, layer, w)
        cfg = runner.config
        self.input_norm = gemma_norm_weight(self.input_norm)
        self.post_norm = gemma_norm_weight(self.post_norm)  # post_attention_layernorm: after attention in Gemma
        self.pre_ff_norm = gemma_norm_weight(w["pre_feedforward_layernorm.weight"])
        self.post_ff_norm = gemma_norm_weight(w["post_feedforward_layernorm.weight"])
        if self.qk_norm is not None:  # Gemma 3's q_norm / k_norm, repeated per head as Block does, by (1 + weight)
            self.qk_norm = gemma_norm_weight(self.qk_norm)
        self.softcap = cfg.attn_logit_softcapping
        self.local = cfg.local_rope is not None and cfg.sliding_layers[layer]  # this layer rotates with the local RoPE

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, ctx: StepContext, post: bool) -> torch.Tensor:
        """Gemma's RMSNorm of x [T, hidden]: the step kernels' (one of the layer's two norm buffers: `post` picks
        which, so that an output is read before the same buffer is written again), else gemma_rms_norm."""
        if ctx.native is not None:
            return ctx.native.norm(x, weight, self.layer, post=post)
        return gemma_rms_norm(x, weight, self.cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        cfg, native = self.cfg, ctx.native
        # --- attention ---
        h = self._norm(x, self.input_norm, ctx, post=False)
        qkv = self._project(self.qkv, "qkv", h, ctx, self._qkv_parts)  # [T, q_dim + 2 kv_dim]
        self._norm_qk_in_place(qkv)
        y = self._rope_and_attend(qkv, ctx)  # [T, q_dim]; soft-capped where the layer is
        o = self._project(self.o, "o", y, ctx, self._o_parts)
        x = x + self._norm(o, self.post_norm, ctx, post=True)
        # --- MLP: GeGLU ---
        h = self._norm(x, self.pre_ff_norm, ctx, post=False)
        gu = self._project(self.gate_up, "gate_up", h, ctx, self._gate_up_parts)  # [T, 2 * intermediate]
        inter = cfg.intermediate_size
        a = None
        if cfg.gelu_approximate == "tanh":  # the native gate where the tensors are on it (CPU, fp32)
            a = native.geglu(gu, self.layer) if native is not None else geglu_tanh(gu, inter,
                                                                                   threads=torch.get_num_threads())
        if a is None:
            a = F.gelu(gu[:, :inter], approximate=cfg.gelu_approximate).mul_(gu[:, inter:])
        d = self._project(self.down, "down", a, ctx, self._down_parts)
        return x + self._norm(d, self.post_ff_norm, ctx, post=True)

    def attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.softcap is None:
            return super().attend(q, k_new, v_new, ctx)
        y = self._attend_paged_softcapped(q, ctx) if self.runner.native_attention else None
        return y if y is not None else self._attend_softcapped(q, k_new, v_new, ctx)

    def _attend_paged_softcapped(self, q: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """CPU fp32: every token on the paged attention kernels, which soft-cap the scores (the runner gives a
        soft-capped model's prompt chunks their pages, _Prefill.paged, whatever their start and length); None where a
        kernel does not cover the shapes (the caller then takes softcapped_attention for all of them)."""
        cfg, kv, threads = self.cfg, self.runner.kv, torch.get_num_threads()
        T, H, hd = q.shape
        pages = kv.pages(self.layer)
        out = torch.empty(T, H * hd, dtype=q.dtype, device=q.device)
        d = ctx.decode
        if d is not None:
            qd = q if d.index is None else q.index_select(0, d.index)
            y = paged_decode_attention(qd, pages, d.blocks, d.lens, kv_heads=cfg.num_kv_heads, window=self.window,
                                       scale=self.scale, threads=threads, softcap=self.softcap)
            if y is None or d.index is None:
                return y
            out.index_copy_(0, d.index, y)
        for p in ctx.prefills:
            y = None if p.paged is None else paged_prefill_attention(
                q[p.first:p.first + p.n], pages, p.paged, p.start, kv_heads=cfg.num_kv_heads, window=self.window,
                scale=self.scale, threads=threads, softcap=self.softcap)
            if y is None:
                return None
            out[p.first:p.first + p.n] = y
        return out

    def _attend_softcapped(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                           ctx: StepContext) -> torch.Tensor:
        """Block.attend's batching (the decode tokens together over their gathered blocks, each prefill chunk alone)
        with softcapped_attention in place of SDPA. GQA without repeating K/V: the g query heads of a KV head are a
        dimension of their own ([KV, ..., g, hd] against [KV, ..., L, hd])."""
        cfg, kv, cap = self.cfg, self.runner.kv, float(self.softcap or 0.0)
        T, H, hd = q.shape
        KV, g = cfg.num_kv_heads, H // cfg.num_kv_heads
        out = torch.empty(T, H * hd, dtype=q.dtype, device=q.device)
        d = ctx.decode
        if d is not None:
            qd = q if d.index is None else q.index_select(0, d.index)
            B, L = qd.shape[0], d.blocks.shape[1] * kv.block_size
            q4 = qd.view(B, KV, g, hd).transpose(0, 1)  # [KV, B, g, hd]
            mask = d.masks[self.window]  # [1, B, 1, L] or None
            chunk = B if q.is_cuda else max(1, (2 << 20) // (2 * KV * L * hd * q.element_size()))  # as _attend_decode
            ys = []
            for c in range(0, B, chunk):
                k, v = kv.gather_blocks(self.layer, d.blocks[c:c + chunk])  # [KV, C, L, hd]
                ys.append(softcapped_attention(q4[:, c:c + chunk], k, v, scale=self.scale, cap=cap,
                                               mask=None if mask is None else mask[:, c:c + chunk]))  # [KV, C, g, hd]
            y = (ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)).transpose(0, 1).reshape(B, H * hd)
            if d.index is None:
                return y
            out.index_copy_(0, d.index, y)
        for p in ctx.prefills:
            if p.paged is not None:  # no paged kernel soft-caps: gather
                p.gather_rows(kv)
            if p.rows is None:  # a whole-prompt chunk: its keys are all in hand
                k, v = k_new[p.first:p.first + p.n].transpose(0, 1), v_new[p.first:p.first + p.n].transpose(0, 1)
            else:
                k, v = kv.gather(self.layer, p.rows)  # [KV, L, hd]
            L, mask = k.shape[1], p.masks[self.window]  # mask [1, 1, n, L]
            # on CPU the chunk's queries go in blocks whose fp32 scores stay within SOFTCAP_SCORES_BYTES (the
            # workspace arithmetic, protocol.memory, counts no [H, n, L] scores); on CUDA the workspace is measured
            rows = p.n if q.is_cuda else max(1, SOFTCAP_SCORES_BYTES // (H * L * 4))
            for a in range(0, p.n, rows):
                b = min(p.n, a + rows)
                qp = q[p.first + a:p.first + b].view(b - a, KV, g, hd).permute(1, 2, 0, 3)  # [KV, g, rows, hd]
                y = softcapped_attention(qp, k.unsqueeze(1), v.unsqueeze(1), scale=self.scale, cap=cap,
                                         mask=mask[:, :, a:b])  # [KV, g, rows, hd]
                out[p.first + a:p.first + b] = y.permute(2, 0, 1, 3).reshape(b - a, H * hd)
        return out



class ModelRunner:
    """Holds one base model and its memory pool (KV blocks and resident adapters); runs batched forward steps.

    Memory: give either `memory_bytes`, the budget for the base weights, the activation workspace and the
    pool (protocol.memory.split_budget sizes the pool from it), or `pool_pages` directly (tests, benches).

    `adapter_dtype`: how resident adapters are stored, the model's dtype by default. Beside an fp32 model,
    float16 or bfloat16 halves an adapter's pages and the bytes the LoRA term reads each step; the kernels
    widen the weights to fp32 in registers, so only the stored weights are rounded (exact for adapters
    uploaded in that dtype, to nearest for fp32 ones).
    """

    def __init__(self, checkpoint_dir: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, block_size: int = 16, max_lora_rank: int = 64,
                 enable_lora: bool = True, memory_bytes: int | None = None, pool_pages: int | None = None,
                 max_running: int = 64, max_batch_tokens: int | None = None, fixed_lora_slots: int = 0,
                 packed_weights: bool | None = None, adapter_dtype: torch.dtype | None = None,
                 pack_tied_head: bool | None = None, step_kernels: bool = True, huge_pages: bool = True,
                 native_gemm: bool | None = None, lora_prefetch: bool | None = None,
                 fuse_lora: bool | None = None) -> None:
        from transformers import AutoTokenizer

        self.checkpoint_dir = Path(checkpoint_dir)
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.config = cfg = ModelConfig.from_dir(self.checkpoint_dir)
        if (memory_bytes is None) == (pool_pages is None):
            raise ValueError("give the runner exactly one of memory_bytes (a budget) or pool_pages")
        self.shape = ModelShape.from_config(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.checkpoint_dir))
        self.block_size = block_size
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens or (256 + max_running)

        # The projections' and LM head's GEMMs on oneDNN, weights pre-packed (see Projection): by default wherever
        # it is available and the model is wide enough to gain from it; packed_weights=False keeps F.linear,
        # True packs whatever the width (A/B in bench/peers.py --packing-ab).
        if packed_weights is None:
            packed_weights = (onednn_packing_available(self.device, self.dtype)
                              and cfg.hidden_size >= PACK_MIN_HIDDEN)
        elif packed_weights and not onednn_packing_available(self.device, self.dtype):
            raise ValueError("packed_weights=True needs a CPU runner in fp32 and a torch built with oneDNN")
        self.pack_rows: int | None = max_running if packed_weights else None  # the layout hint: the decode batch
        # Packed weights go to the native fp32 GEMM (kernels.gemm, csrc/gemm_f32.h) instead of oneDNN wherever it runs
        # (AVX-512 or AVX2 + FMA, and a C compiler): at the decode batch it streams the weights ~1.4x as fast (see Projection).
        # native_gemm=False keeps oneDNN (A/B: bench/peers.py --gemm-ab).
        if native_gemm is None:
            native_gemm = bool(packed_weights) and gemm_available()
        elif native_gemm and not (packed_weights and gemm_available()):
            raise ValueError("native_gemm=True needs packed weights and the native GEMM "
                             "(AVX-512 or AVX2 + FMA, and a C compiler)")
        self.native_gemm = native_gemm
        # Each native GEMM of a step with adapters prefetches the adapters' matrices that the LoRA calls right after it
        # read (StepSides), so those come from the caches instead of DRAM. False leaves them to the LoRA kernel (A/B:
        # bench/peers.py --lora-prefetch-ab); an attribute, so an A/B can flip it between passes. None: where it was
        # measured to help (kernels.gemm_side_helps: AMD CPUs; on an Intel Xeon it cost the fleet 11%).
        self.lora_side_prefetch = gemm_side_helps() if lora_prefetch is None else lora_prefetch
        # A decode step's LoRA term inside the native GEMMs (kernels.gemm_lora: every segment's shrink first, then
        # each panel's expand right after the panel, its slices of B fetched while the panel multiplies) instead of a
        # call after each GEMM (with or without the side stream above, which a fused step does not use); fp32 adapters
        # only. Measured, passes alternating (bench/peers.py --fused-lora-ab, bench/RESULTS.md, 2026-12-06): fleet 1.12x
        # on SmolLM2 and 1.02x on mid on a Zen 3 EPYC (medians of 5, against the calls after with the side stream); 1.02x
        # on both on an Intel Xeon of model 207 (median of 5, calls after without the side stream) and 0.95x and 0.98x on
        # one of model 167 (medians of 3). None: where that was measured to help, as for the side stream
        # (kernels.gemm_side_helps: AMD CPUs). Not measured on Zen 4, where the side stream was.
        # False keeps the calls after; an attribute, as above.
        self.fuse_lora = bool((gemm_side_helps() if fuse_lora is None else fuse_lora) and native_gemm)
        # Decode attention on CPU in fp32 reads K/V in place from the pages (kernels/csrc/sgmv_cpu.c) instead of
        # gathering them for SDPA; False (or LORAFLEET_KERNELS_NATIVE=0, or no C compiler) keeps the gather.
        self.native_attention = self.device.type == "cpu" and self.dtype == torch.float32
        # ...and with it each layer's RMSNorms, RoPE + KV write, decode attention and SwiGLU's gate go through one
        # kernels.StepKernels per step (buffers and shapes set up once for all layers, each call a ctypes call on
        # integers); False keeps the per-call wrappers and torch's silu * up (A/B: bench/peers.py --step-kernels-ab).
        self.step_kernels = step_kernels
        # the scores' scale, as every layer has it (Block.scale, GemmaBlock.scale), for the step kernels' attention
        self.attention_scale = gemma_attention_scale(cfg) if cfg.family.gemma else 1.0 / math.sqrt(cfg.head_dim)
        self._step_arena = StepArena(STEP_ARENA_BYTES)  # the small ops' outputs, a copy a layer, from step to step
        w = self._read_weights()
        self.weights_bytes = sum(t.numel() * t.element_size() for t in w.values())
        self.embed = w.pop("model.embed_tokens.weight")  # [vocab, hidden]
        self.final_norm = w.pop("model.norm.weight")
        # Gemma: the embedding times sqrt(hidden) in the model's dtype (transformers' Gemma2TextScaledWordEmbedding:
        # a fp32 scalar cast to the weight's dtype), the final norm by (1 + weight)
        self.embed_scale: torch.Tensor | None = None
        if cfg.family.gemma:
            self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype=self.dtype, device=self.device)
            self.final_norm = gemma_norm_weight(self.final_norm)
        head = w.pop("lm_head.weight", None)
        # The LM head [vocab, hidden], packed like the projections. A tied head is the embedding table itself, which
        # the token lookup reads row by row and so must stay a plain tensor: packing it makes a second copy
        # (pack_tied_head, by default whenever the projections are packed), counted in weights_bytes so the pool
        # gives up that much (protocol.memory.packed_head_copy_bytes: the planner's count of the same copy);
        # pack_tied_head=False runs oneDNN on the table as stored instead. SmolLM2's tied head at 64 rows,
        # bench/RESULTS.md: 171 against 140 GFLOP/s for 113 MB.
        tied = head is None or cfg.tie_word_embeddings
        if pack_tied_head and not (tied and packed_weights):
            raise ValueError("pack_tied_head=True needs packed weights and a model whose LM head is its embedding table")
        self.head_copy_bytes = 0
        if head is not None and not tied:
            self.head = Projection(head, pack_rows=self.pack_rows, native=native_gemm)
        elif packed_weights and pack_tied_head is not False:
            self.head = Projection(self.embed, pack_rows=self.pack_rows, native=native_gemm)
            self.head_copy_bytes = self.embed.numel() * self.embed.element_size()
            self.weights_bytes += self.head_copy_bytes
        else:
            self.head = Projection(self.embed, onednn=packed_weights)
        self.blocks: list[Block] = []
        block_class = GemmaBlock if cfg.family.gemma else Block
        for i in range(cfg.num_layers):
            prefix = f"model.layers.{i}."
            self.blocks.append(block_class(self, i, {k[len(prefix):]: t for k, t in w.items() if k.startswith(prefix)}))
        del w
        if native_gemm:  # its panels round each projection's outputs up to 16: those zeros are weights' bytes too
            projections = [self.head] + [p for b in self.blocks for p in (b.qkv, b.o, b.gate_up, b.down)]
            self.weights_bytes += sum((p.weight.numel() - p.out_features * p.in_features) * p.weight.element_size()
                                      for p in projections if p.native)

        cos, sin_signed = rope_tables(cfg)  # [P, hd]
        self.rope_cos = cos.to(self.dtype).to(self.device)
        self.rope_sin = sin_signed.to(self.dtype).to(self.device)
        local = local_rope_tables(cfg)  # Gemma 3's sliding layers: their own base
        self.local_rope = None if local is None else (local[0].to(self.dtype).to(self.device),
                                                     local[1].to(self.dtype).to(self.device))

        self.memory: PoolSplit | None = None
        self.workspace_measured: int | None = None
        if memory_bytes is not None:
            self.memory = self._split_budget(int(memory_bytes))
        pages = self.memory.num_pages if self.memory is not None else int(pool_pages or 0)  # one of them is given
        self.pool = PagePool(num_layers=cfg.num_layers, num_pages=pages,
                             page_elems=page_elements(self.shape, block_size), dtype=self.dtype, device=self.device)
        self.kv = PagedKVCache(self.pool, block_size=block_size, num_kv_heads=cfg.num_kv_heads,
                               head_dim=cfg.head_dim)
        self.lora: LoraPool | None = None
        if enable_lora:
            self.lora = LoraPool(self.pool, self.shape, max_rank=max_lora_rank, block_size=block_size,
                                 fixed_slots=fixed_lora_slots, dtype=adapter_dtype)
        # The weights on 2 MB pages (inference_worker.huge_pages): every decode step streams all of them, and on 4 KB
        # pages SmolLM2's 64-row GEMMs ran 147-164 GFLOP/s in the engine against 170-177 on 2 MB pages (2026-12-03).
        # The pool is already advised (memory_pool._huge_pages); this covers what torch's allocator holds.
        self.huge_pages: Collapse | None = None
        if huge_pages and self.device.type == "cpu" and self.weights_bytes >= HUGE_PAGES_MIN_WEIGHTS:
            self.huge_pages = collapse_resident_memory()

    def workspace_estimate(self) -> int:
        """The activation workspace of the largest step, by the shared arithmetic (protocol.memory)."""
        return workspace_bytes(self.shape, vocab_size=self.config.vocab_size, max_batch_tokens=self.max_batch_tokens,
                               max_running=self.max_running, max_context=self.config.max_position_embeddings,
                               max_lora_rank=self.max_lora_rank, dtype_bytes=self.dtype.itemsize,
                               chunked_decode=self.device.type != "cuda")

    def _split_budget(self, budget: int) -> PoolSplit:
        workspace = self.workspace_estimate()
        if self.device.type == "cuda":  # measure: one forward pass at the largest step, peak allocation
            self.workspace_measured = self._measure_workspace()
            workspace = max(workspace, self.workspace_measured)
        return split_budget(budget_bytes=budget, weights_bytes=self.weights_bytes, workspace_bytes=workspace,
                            shape=self.shape, block_size=self.block_size, dtype_bytes=self.dtype.itemsize)

    def _measure_workspace(self) -> int:
        """Peak CUDA memory of a prefill of max_batch_tokens tokens beside a decode batch of max_running
        sequences, on a scratch pool just large enough, minus what was allocated before and the scratch
        pool itself."""
        bs, T, B = self.block_size, self.max_batch_tokens, self.max_running
        prefill = min(max(T - B, 1), self.config.max_position_embeddings - 1)
        pages = blocks_needed(prefill, bs) + B
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.pool = PagePool(num_layers=self.config.num_layers, num_pages=pages,
                             page_elems=page_elements(self.shape, bs), dtype=self.dtype, device=self.device)
        self.kv = PagedKVCache(self.pool, block_size=bs, num_kv_heads=self.config.num_kv_heads,
                               head_dim=self.config.head_dim)
        self.lora = None
        scratch = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        steps = [SeqStep(block_table=list(range(blocks_needed(prefill, bs))), start_pos=0, token_ids=[0] * prefill)]
        first = blocks_needed(prefill, bs)
        steps += [SeqStep(block_table=[first + i], start_pos=0, token_ids=[0]) for i in range(B)]
        self.forward(steps)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch
        del self.pool, self.kv
        torch.cuda.empty_cache()
        return max(0, peak) + max(0, torch.cuda.memory_allocated(self.device) - before)

    @property
    def adapter_dtype_name(self) -> str | None:
        """How resident adapters are stored ("float32", "float16", "bfloat16"); None without LoRA."""
        return str(self.lora.dtype).removeprefix("torch.") if self.lora is not None else None

    def memory_report(self) -> dict:
        """What the pool holds now (worker_status, Prometheus, the operator page)."""
        pool = self.pool
        report = {
            "page_bytes": pool.page_bytes, "pages": pool.num_pages, "pool_bytes": pool.bytes,
            "block_size": self.block_size, "weights_bytes": self.weights_bytes,
            "head_copy_bytes": self.head_copy_bytes,
            "kv_blocks_used": pool.kv_pages, "free_pages": pool.num_free, "largest_free_run": pool.largest_free_run(),
            "adapter_pages": pool.adapter_pages,
            "adapter_dtype": self.adapter_dtype_name,
            "adapter_bytes_resident": self.lora.resident_bytes if self.lora is not None else 0,
            "resident_adapters_by_rank": {str(k): v for k, v in self.lora.resident_by_rank().items()}
            if self.lora is not None else {},
        }
        if self.memory is not None:
            report.update(budget_bytes=self.memory.budget_bytes, workspace_bytes=self.memory.workspace_bytes,
                          unused_bytes=self.memory.unused_bytes)
        if self.workspace_measured is not None:
            report["workspace_measured_bytes"] = self.workspace_measured
        return report

    def _read_weights(self) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        files = sorted(self.checkpoint_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.checkpoint_dir}")
        w: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    w[name] = fh.get_tensor(name).to(device=self.device, dtype=self.dtype)
        return w

    # --- adapters ---

    def load_adapter(self, weights: dict[str, torch.Tensor], *, rank: int, scale: float, key: str = "") -> int:
        """Place a PEFT adapter (PEFT tensor names, any dtype) in the pool; returns its slot. Raises ValueError
        if it does not fit this base, lora.NoRoom if the pool has no run of pages for it now."""
        if self.lora is None:
            raise RuntimeError("this runner was built with enable_lora=False")
        if self.shape.fused:  # Phi-3's qkv_proj / gate_up_proj adapters become their parts' (protocol.lora_layout)
            weights = split_fused_adapter(weights, self.shape)
        return self.lora.place(key, weights, rank=rank, scale=scale)

    def unload_adapter(self, slot: int) -> None:
        if self.lora is None:
            raise RuntimeError("this runner was built with enable_lora=False")
        self.lora.remove(slot)

    # --- forward ---

    def _context(self, steps: list[SeqStep]) -> tuple[torch.Tensor, StepContext, list[int]]:
        """Flatten the steps into one token batch and precompute what every layer shares."""
        cfg, bs, dev = self.config, self.block_size, self.device
        tokens: list[int] = []
        positions: list[int] = []
        write_rows: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        decode_idx: list[int] = []
        decode_steps: list[SeqStep] = []
        prefill_specs: list[tuple[int, SeqStep]] = []
        for s in steps:
            n = len(s.token_ids)
            if n == 0:
                raise ValueError("a step must carry at least one token")
            end = s.start_pos + n
            if end > cfg.max_position_embeddings:
                raise ValueError(f"position {end} exceeds max_position_embeddings "
                                 f"{cfg.max_position_embeddings}")
            new_rows = self.kv.rows_for(s.block_table, s.start_pos, n)  # raises if the table is too short
            first = len(tokens)
            if n == 1:
                decode_idx.append(first)
                decode_steps.append(s)
            else:
                prefill_specs.append((first, s))
            tokens.extend(s.token_ids)
            positions.extend(range(s.start_pos, end))
            write_rows.extend(new_rows)
            slots.extend([s.slot] * n)
            last.append(len(tokens) - 1)

        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        cos = self.rope_cos.index_select(0, pos_t).unsqueeze(1)  # [T, 1, hd]
        sin = self.rope_sin.index_select(0, pos_t).unsqueeze(1)
        windows = set(cfg.sliding_windows)

        decode = None
        if decode_steps:
            lens = [s.start_pos + 1 for s in decode_steps]
            nb = blocks_needed(max(lens), bs)
            table = torch.tensor([s.block_table[:nb] + [0] * (nb - min(nb, len(s.block_table)))
                                  for s in decode_steps], dtype=torch.int64, device=dev)  # [B, nb]
            p = torch.arange(nb * bs, device=dev)  # whole blocks are gathered; the mask hides the tail
            q_pos = torch.tensor(lens, device=dev).unsqueeze(1) - 1  # [B, 1]
            masks: dict[int | None, torch.Tensor | None] = {}
            for wdw in windows:
                ok = p.unsqueeze(0) <= q_pos
                if wdw is not None:
                    ok &= p.unsqueeze(0) > q_pos - wdw
                # None when nothing is masked (equal lengths, no window): SDPA then skips its mask checks.
                if bool(ok.all()):
                    masks[wdw] = None
                else:
                    additive = torch.zeros(ok.shape, dtype=self.dtype, device=dev).masked_fill_(~ok, float("-inf"))
                    masks[wdw] = additive[None, :, None]  # [1, B, 1, L]
            whole = not prefill_specs
            index = None if whole else torch.tensor(decode_idx, dtype=torch.int64, device=dev)
            decode = _Decode(index=index, blocks=table, lens=torch.tensor(lens, dtype=torch.int64, device=dev),
                             masks=masks)

        prefills = []
        for first, s in prefill_specs:
            n, L = len(s.token_ids), s.start_pos + len(s.token_ids)
            rows = paged = None  # a whole-prompt chunk attends to its own keys (Block.attend)
            # soft-capped layers (Gemma 2) read every chunk on the pages: the paged kernel soft-caps, SDPA cannot
            if self.native_attention and (s.start_pos and n <= PAGED_PREFILL_TOKENS
                                          or cfg.attn_logit_softcapping is not None):
                paged = torch.tensor(s.block_table[:blocks_needed(L, bs)], dtype=torch.int64, device=dev)
            elif s.start_pos:
                rows = torch.tensor(self.kv.rows_for(s.block_table, 0, L), dtype=torch.int64, device=dev)
            k_pos = torch.arange(L, device=dev).unsqueeze(0)  # [1, L]
            q_pos = torch.arange(s.start_pos, L, device=dev).unsqueeze(1)  # [n, 1]
            prefill_masks: dict[int | None, torch.Tensor] = {}
            for wdw in windows:
                ok = k_pos <= q_pos
                if wdw is not None:
                    ok = ok & (k_pos > q_pos - wdw)
                prefill_masks[wdw] = ok[None, None]  # [1, 1, n, L], 4-D for SDPA's fast path
            prefills.append(_Prefill(first=first, n=n, rows=rows, masks=prefill_masks, start=s.start_pos, paged=paged))

        lora = self.lora.mapping(slots) if self.lora is not None else None
        if self.lora is None and any(s >= 0 for s in slots):
            raise ValueError("LoRA slot requested but the runner was built with enable_lora=False")
        rows_t = torch.tensor(write_rows, dtype=torch.int64, device=dev)
        local = self._local_rope(pos_t)  # Gemma 3's sliding layers' RoPE, or None
        native = None
        if self.native_attention and self.step_kernels:  # CPU fp32 (None where the native library is not there)
            attend_blocks = attend_lens = None  # every token's KV blocks and positions, when it attends on the kernel
            if decode is not None and decode.index is None:
                attend_blocks, attend_lens = decode.blocks, decode.lens
            elif all(s.start_pos + len(s.token_ids) <= NATIVE_PROMPT_CONTEXT for _, s in prefill_specs):
                lens_all = [p + 1 for p in positions]
                nb = blocks_needed(max(lens_all), bs)
                tables: list[list[int]] = []
                for s in steps:
                    tables += [s.block_table[:nb] + [0] * (nb - min(nb, len(s.block_table)))] * len(s.token_ids)
                attend_blocks = torch.tensor(tables, dtype=torch.int64, device=dev)
                attend_lens = torch.tensor(lens_all, dtype=torch.int64, device=dev)
            native = StepKernels.build(
                rows=len(tokens), hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_heads,
                kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=bs, eps=cfg.rms_norm_eps, cos=cos,
                sin_signed=sin, write_rows=rows_t, layer_pages=[self.kv.pages(i) for i in range(cfg.num_layers)],
                attend_blocks=attend_blocks, attend_lens=attend_lens, scale=self.attention_scale,
                threads=torch.get_num_threads(), layers=cfg.num_layers, arena=self._step_arena,
                softcap=cfg.attn_logit_softcapping, local_cos=None if local is None else local[0],
                local_sin_signed=None if local is None else local[1])
        sides = None
        # decode steps only: a prompt's GEMMs split their rows where the panels do not share out (gemm_f32), and its
        # LoRA term is bound by arithmetic, not by reads the GEMM could hide
        fuse_lora = bool(self.fuse_lora and lora is not None and decode is not None and not prefill_specs)
        if self.native_gemm and self.lora_side_prefetch and lora is not None and not fuse_lora:
            sides = StepSides({g: lora.lora.group_ranges(lora.residents, g) for g in GEMM_GROUPS},
                              lora.lora.buffer_ptrs)
        ctx = StepContext(cos=cos, sin=sin, write_rows=rows_t, decode=decode, prefills=prefills, lora=lora,
                          native=native, sides=sides, fuse_lora=fuse_lora, local_rope=local)
        return torch.tensor(tokens, dtype=torch.int64, device=dev), ctx, last

    def _local_rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin [T, 1, hd] of the sliding layers' own RoPE at the step's positions (Gemma 3), or None."""
        if self.local_rope is None:
            return None
        return (self.local_rope[0].index_select(0, positions).unsqueeze(1),
                self.local_rope[1].index_select(0, positions).unsqueeze(1))

    def forward(self, steps: list[SeqStep]) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(steps), vocab] at each step's last token."""
        return self.forward_all_positions(steps, ())[0]

    @torch.inference_mode()
    def forward_all_positions(self, steps: list[SeqStep], every: Collection[int]
                              ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`forward`, plus fp32 logits at *every* token of the steps whose indices are in `every`
        ({index: [len(token_ids), vocab]}): what prompt logprobs need (completions with echo). Only those
        steps pay for the extra rows of the LM head."""
        if not steps:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device), {}
        tokens, ctx, last = self._context(steps)
        x = self.embed.index_select(0, tokens)  # [T, hidden]
        if self.embed_scale is not None:  # Gemma
            x = x * self.embed_scale
        for block in self.blocks:
            x = block.forward(x, ctx)
        extra = {}
        for i in every:
            n = len(steps[i].token_ids)
            extra[i] = self._head(x[last[i] - n + 1: last[i] + 1])  # [n, vocab]
        x = x.index_select(0, torch.tensor(last, dtype=torch.int64, device=self.device))  # [steps, hidden]
        return self._head(x), extra  # [steps, vocab]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if not cfg.family.gemma:
            return self.head(rms_norm(x, self.final_norm, cfg.rms_norm_eps)).float()
        logits = self.head(gemma_rms_norm(x, self.final_norm, cfg.rms_norm_eps))
        if cfg.final_logit_softcapping is not None:  # in the model's dtype, as transformers caps them
            logits = soft_cap(logits, cfg.final_logit_softcapping)
        return logits.float()
