"""A base's RoPE, read once from its config.json: the type, theta, the scaling parameters, and the context it is
served at. Read by the runner (inference_worker.model computes the frequencies from it, with torch, as transformers'
modeling_rope_utils does), by register_base (adapters.manifest refuses an unserved type before a base is
registered, and records the served context the gateway checks prompts against), and by the capacity planner.
Pure Python: no torch, no Django.

Both spellings are read: transformers v5 writes `rope_parameters` ({"rope_type", "rope_theta", ...}), v4 wrote
`rope_theta` beside `rope_scaling` ({"type" or "rope_type", "factor", ...}).

Served types and what the runner computes (transformers 5.x, modeling_rope_utils):
- default, linear, llama3: one set of frequencies.
- yarn: one set of frequencies (interpolation blended with extrapolation by the ramp between beta_fast and
  beta_slow) and cos/sin multiplied by the attention factor (0.1 ln(factor) + 1, or mscale / mscale_all_dim, or
  the config's attention_factor). Served up to max_position_embeddings, as transformers does.
- dynamic (dynamic NTK): a position p is rotated with the frequencies transformers computes for a sequence of
  max(p + 1, max_position_embeddings) tokens. That is what transformers does for every token it generates one at a
  time (it grows the frequencies as the sequence grows), and the default frequencies for every sequence within
  max_position_embeddings. Served up to max_position_embeddings x factor (vLLM's limit for this type). Where this
  differs from transformers: a single forward over a prompt longer than max_position_embeddings rotates all of the
  prompt's tokens with the frequencies of its full length there (and, batched, with those of the batch's longest
  sequence), which would make a token's keys depend on the chunk and the batch it was computed in; here a key
  depends on its position only, so chunked prefill, the prefix cache and batching give the same result.
- longrope (Phi-3's LongRoPE; a Phi-3 config's "su" and "yarn" are read as longrope, as transformers reads them):
  inv_freq divided by short_factor or long_factor per frequency, cos/sin times the attention factor
  (sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), factor max_position_embeddings / original unless
  given). Position p takes the long factors when p + 1 > original_max_position_embeddings, the short ones otherwise:
  what transformers' forward does for every token it is given one at a time with its cache. So every sequence that
  stays within the original context (most chats on a 128k Phi-3) gets exactly transformers' short-factor result.
  Past it there are two differences: a single forward over a longer prompt rotates all of it with the long factors
  there (as for dynamic), and Phi-3's generate() throws its cache away at the crossing and recomputes the whole
  sequence with the long factors, where here the keys before the crossing keep their short rotation. Matching
  generate() exactly there needs the engine to re-prefill a sequence once when it crosses (not done). Served up to
  max_position_embeddings.
- Gemma 3 (gemma3_text) has two RoPEs: its sliding-window layers rotate with rope_local_base_freq (default RoPE,
  theta 10,000 unless the config says otherwise), its global layers with rope_theta (1,000,000 by default) and
  rope_scaling (linear x8 on the 4B-27B checkpoints). Both spellings are read: v5's rope_parameters nested per layer
  type ({"sliding_attention": {...}, "full_attention": {...}}), v4's rope_theta / rope_local_base_freq /
  rope_scaling. rope_from_config gives the global one (it sets the context served), local_rope_from_config the
  local one; each is any of the served types above.
Refused, named: any other type, partial_rotary_factor below 1 (Phi-4-mini), per-layer-type (nested)
rope_parameters except Gemma 3's, and for phi3 any type but default and longrope (transformers refuses those too).
"""
from __future__ import annotations

from dataclasses import dataclass, field

SERVED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
PHI3_ROPE_TYPES = ("default", "longrope")  # Phi3Config's own check


class RopeError(ValueError):
    """The config's RoPE cannot be served; the message says which part and what is served."""


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str  # one of SERVED_ROPE_TYPES
    theta: float
    max_position_embeddings: int  # the config's own
    params: dict = field(default_factory=dict)  # the scaling parameters as the config gives them, with
    # original_max_position_embeddings filled in for llama3 and yarn as transformers' standardize_rope_params does

    @property
    def factor(self) -> float:
        return float(self.params["factor"])

    @property
    def context(self) -> int:
        """The longest sequence (prompt and answer) served on this base."""
        if self.rope_type == "dynamic":
            return int(self.max_position_embeddings * self.factor)
        return self.max_position_embeddings


GEMMA3_MODEL_TYPES = ("gemma3_text", "gemma3")
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")
GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig's


def _gemma3_view(cfg: dict, layer_type: str) -> dict:
    """A Gemma 3 config seen as a one-RoPE config for one layer type, as Gemma3TextConfig reads it: v5 nests
    rope_parameters per layer type; v4 wrote rope_theta (and rope_scaling) for the global layers and
    rope_local_base_freq for the sliding ones (their RoPE is then the default)."""
    nested = cfg.get("rope_parameters")
    if nested:
        if not (isinstance(nested, dict) and all(isinstance(nested.get(t), dict) for t in GEMMA3_LAYER_TYPES)):
            raise RopeError("Gemma 3's rope_parameters must name both layer types (sliding_attention and "
                            f"full_attention), not {nested!r}")
        params = dict(nested[layer_type])
    elif layer_type == "full_attention":
        params = {**(cfg.get("rope_scaling") or {})}
        if cfg.get("rope_theta") is not None:
            params["rope_theta"] = cfg["rope_theta"]
    else:
        params = {"rope_type": "default"}
        if cfg.get("rope_local_base_freq") is not None:
            params["rope_theta"] = cfg["rope_local_base_freq"]
    params.setdefault("rope_theta", GEMMA3_DEFAULT_THETA[layer_type])
    view = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta", "rope_local_base_freq")}
    return {**view, "rope_parameters": params}


def local_rope_from_config(cfg: dict) -> RopeSpec | None:
    """The RoPE of a base's sliding-window layers where it has one of their own (Gemma 3: rope_local_base_freq), else
    None (every layer rotates with rope_from_config's). RopeError as for rope_from_config."""
    if cfg.get("model_type") not in GEMMA3_MODEL_TYPES:
        return None
    return _rope_spec(_gemma3_view(cfg, "sliding_attention"))


def rope_from_config(cfg: dict) -> RopeSpec:
    """The RopeSpec of a Hugging Face config dict, or RopeError saying what is not served. For Gemma 3, that of its
    global (full-attention) layers, which sets the context served; local_rope_from_config gives the sliding ones'."""
    if cfg.get("model_type") in GEMMA3_MODEL_TYPES:
        cfg = _gemma3_view(cfg, "full_attention")
    return _rope_spec(cfg)


def _rope_spec(cfg: dict) -> RopeSpec:
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise RopeError(f"rope_parameters must be an object, not {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise RopeError("RoPE parameters per layer type (nested rope_parameters) are not supported for this "
                        "model_type")
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta") or params.get("rope_theta")
                  or cfg.get("rope_theta") or 10000.0)
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    phi3 = cfg.get("model_type") == "phi3"
    if phi3 and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config's backward compatibility: older Phi-3 configs name LongRoPE so
    if phi3 and rope_type not in PHI3_ROPE_TYPES:
        raise RopeError(f"RoPE scaling type {rope_type!r} is not supported for phi3; supported: "
                        f"{', '.join(PHI3_ROPE_TYPES)}")
    if rope_type not in SERVED_ROPE_TYPES:
        raise RopeError(f"RoPE scaling type {rope_type!r} is not supported; supported: "
                        f"{', '.join(SERVED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise RopeError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
    params = {k: v for k, v in params.items() if k not in ("type", "rope_type", "rope_theta")}
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers' standardize_rope_params: a top-level original_max_position_embeddings wins (Phi3Config always
        # has one, 4096 by default), else the parameters' own, else max_position_embeddings
        original = cfg.get("original_max_position_embeddings", 4096 if phi3 else None) \
            or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(original or max_pos)
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = max_pos / params["original_max_position_embeddings"]
    if rope_type == "longrope":
        heads = int(cfg.get("num_attention_heads") or 1)
        half = int(cfg.get("head_dim") or int(cfg.get("hidden_size") or 0) // heads) // 2
        for key in ("short_factor", "long_factor"):
            value = params.get(key)
            if not (isinstance(value, list) and len(value) == half
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)):
                raise RopeError(f"RoPE scaling 'longrope' needs {key}: a list of {half} numbers (head_dim / 2)")
    if rope_type != "default":
        try:
            factor = float(params["factor"])
        except (KeyError, TypeError, ValueError):
            raise RopeError(f"RoPE scaling {rope_type!r} needs a numeric 'factor'") from None
        if factor < 1.0 and rope_type != "longrope":  # LongRoPE's factor only sets its attention factor
            raise RopeError(f"RoPE scaling factor must be at least 1, not {factor}")
    if rope_type == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if params.get(k) is None]
        if missing:
            raise RopeError(f"RoPE scaling 'llama3' needs {', '.join(missing)}")
    return RopeSpec(rope_type=rope_type, theta=theta, max_position_embeddings=max_pos, params=params)
