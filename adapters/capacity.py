"""Capacity planner: adapter rank is a serving decision.

Every byte of LoRA weights resident on the card is a byte the paged KV cache cannot use, and KV memory
is what decides how many sequences run at once. These pure functions (no database, no torch) turn a
base model's shape manifest (adapters.manifest) and a fleet plan into exact figures:

    LoRA parameters per adapter = sum over targets t, layers l of  r * (in_t + out_t)
    adapter bytes               = parameters * bytes(dtype)
    fleet bytes                 = adapters * adapter bytes
    base bytes                  = base parameters * bytes(dtype)
    KV bytes per token          = layers * 2 (K and V) * kv_heads * head_dim * bytes(kv_dtype)
    KV bytes left               = card - base - fleet
    max concurrent sequences    = floor(KV bytes left / KV bytes per sequence)

Units: "GB" means 10**9 bytes (SI), everywhere in this module and in `manage.py capacity`. A card sold
as "80 GB" holds at least 80 * 10**9 bytes (an A100-80GB holds 80 GiB, an H100-80GB 81559 MiB), so
planning in SI gigabytes errs on the safe side: a plan that fits here fits on the card.

Not counted: activations, the CUDA context and allocator slack — a real deployment keeps a few GB back
(pass a smaller --gpu-gb). `dtype` is the weights' dtype for the base *and* the adapters, because the
worker casts adapters to the runner's dtype when it loads them into a slot.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

from protocol.lora_layout import FAMILIES, FUSED_MODULES

from .manifest import ATTENTION_MODULES, TARGET_MODULES, shape_manifest_from_config

GB = 10**9  # SI gigabyte; see the module docstring for why not GiB

TARGET_PRESETS: dict[str, tuple[str, ...]] = {
    "attention-only": ATTENTION_MODULES,  # q_proj, k_proj, v_proj, o_proj
    "all-linear": TARGET_MODULES,  # the four above + gate_proj, up_proj, down_proj
}
TABLE_RANKS = (4, 8, 16, 32, 64)
TABLE_TARGETS = ("attention-only", "all-linear")

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

# --- presets ----------------------------------------------------------------------------------
# The fields below are copied from each model's published config.json on the Hugging Face hub.
# Only the fields the manifest reads are kept; nothing is downloaded at runtime.
_PRESET_CONFIGS: dict[str, dict] = {
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "llama-2-7b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    },
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    # (sliding_window 4096 is ignored: lorafleet's paged cache keeps the whole context.)
    "mistral-7b": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/Qwen/Qwen2-7B/blob/main/config.json
    "qwen2-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json (head_dim 128 is written there, as here)
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/google/gemma-2-9b/blob/main/config.json (head_dim 256 beside hidden 3584 / 16 heads).
    # That file does not write tie_word_embeddings: transformers' Gemma default (True) is written here, as the
    # checkpoint has no lm_head.weight.
    "gemma-2-9b": {
        "model_type": "gemma2",
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    # https://huggingface.co/google/gemma-3-1b-pt/blob/main/config.json (the text-only Gemma 3, Gemma3ForCausalLM;
    # the 4B-27B checkpoints are vision-language models, not served), tied as above
    "gemma-3-1b": {
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
}
PRESET_NAMES = tuple(_PRESET_CONFIGS)


class CapacityError(ValueError):
    """The plan's inputs make no sense (unknown preset, target, dtype; non-positive sizes)."""


def preset_manifest(name: str) -> dict:
    """The shape manifest of a named preset; a fresh copy, so callers may not corrupt the table."""
    try:
        config = _PRESET_CONFIGS[name.lower()]
    except KeyError:
        raise CapacityError(f"Unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}.") from None
    return shape_manifest_from_config(copy.deepcopy(config))


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ("bf16", "bfloat16", "torch.float16", "fp32", "fp8", ...)."""
    key = dtype.lower().removeprefix("torch.")
    try:
        return _DTYPE_BYTES[key]
    except KeyError:
        raise CapacityError(f"Unknown dtype {dtype!r}; use one of bf16, fp16, fp32, fp8, int8.") from None


def resolve_targets(targets: str | list[str] | tuple[str, ...], manifest: dict) -> tuple[str, ...]:
    """A preset name, a comma-separated string or a list -> module names the base actually has."""
    if isinstance(targets, str):
        if targets in TARGET_PRESETS:
            # in the base's own module names: a fused family's qkv_proj is attention, gate_up_proj MLP
            preset = set(TARGET_PRESETS[targets])
            names = tuple(m for m in manifest["modules"] if set(FUSED_MODULES.get(m, (m,))) <= preset)
        else:
            names = tuple(t.strip() for t in targets.split(",") if t.strip())
    else:
        names = tuple(targets)
    if not names:
        raise CapacityError("Name at least one target module (or attention-only / all-linear).")
    unknown = [n for n in names if n not in manifest["modules"]]
    if unknown:
        raise CapacityError(
            f"Unknown target module(s) {', '.join(unknown)}; the base has {', '.join(manifest['modules'])} "
            f"(presets: {', '.join(TARGET_PRESETS)})."
        )
    return tuple(dict.fromkeys(names))  # de-duplicated, order kept


def lora_parameters_by_module(manifest: dict, rank: int, targets: tuple[str, ...]) -> dict[str, int]:
    """r * (in + out) * layers for each target: A is [r, in] and B is [out, r] in every layer."""
    out = {}
    for name in targets:
        mod = manifest["modules"][name]
        out[name] = rank * (mod["in_features"] + mod["out_features"]) * mod["layers"]
    return out


def base_parameter_count(manifest: dict) -> int:
    """Parameters of a Llama-family decoder computed from its shapes (what the checkpoint holds).

        N = V*h                                   token embedding
          + (0 if tie_word_embeddings else V*h)   lm_head
          + L * ( sum over the 7 projections of in*out
                  + (H*hd + 2*KV*hd if qwen2)     Qwen2's q/k/v projections carry a bias
                  + (2*hd if qwen3, gemma3_text)  the per-head RMSNorm weights on q and k
                  + n*h )                         the layer's RMSNorm weights: n = the family's norms_per_layer, 2
                                                  (input, post-attention), Gemma's 4 (pre- and post-attention,
                                                  pre- and post-feedforward)
          + h                                     final RMSNorm

    Llama-2-7B gives 6,738,415,616, Llama-3-8B 8,030,261,248, Mistral-7B 7,241,732,096, Qwen2-7B 7,615,616,512,
    Gemma-2-9B 9,241,705,984 and Gemma-3-1B 999,885,952 — the counts their model cards publish.
    """
    h = manifest["hidden_size"]
    vocab = manifest["vocab_size"]
    layers = manifest["num_layers"]
    embeddings = vocab * h * (1 if manifest["tie_word_embeddings"] else 2)
    projections = sum(m["in_features"] * m["out_features"] for m in manifest["modules"].values())
    family = FAMILIES[manifest["architecture"]]
    hd = manifest["head_dim"]
    qkv_bias = (manifest["num_attention_heads"] + 2 * manifest["num_key_value_heads"]) * hd if family.qkv_bias else 0
    qk_norm = 2 * hd if family.qk_norm else 0
    per_layer = projections + qkv_bias + qk_norm + family.norms_per_layer * h
    return embeddings + layers * per_layer + h


def base_parameters(manifest: dict) -> int:
    """The checkpoint's own count when the manifest has one (read from safetensors), else the formula."""
    return int(manifest.get("num_parameters") or 0) or base_parameter_count(manifest)


def kv_bytes_per_token(manifest: dict, kv_dtype: str) -> int:
    """layers * 2 (K and V) * kv_heads * head_dim * bytes: grouped-query attention stores only KV heads."""
    return (
        manifest["num_layers"] * 2 * manifest["num_key_value_heads"] * manifest["head_dim"] * dtype_bytes(kv_dtype)
    )


@dataclass(frozen=True)
class CapacityPlan:
    """Every figure of one plan, in parameters and bytes (exact integers); see the module docstring."""

    base_name: str
    family: str  # the base's model_type (protocol.lora_layout.FAMILIES): llama, qwen3, phi3, ...
    rank: int
    targets: tuple[str, ...]
    targets_label: str  # "attention-only", "all-linear" or the comma-joined list
    dtype: str
    kv_dtype: str
    num_adapters: int
    gpu_bytes: int
    context_len: int
    block_size: int
    lora_params_by_module: dict[str, int] = field(repr=False)
    lora_params_per_adapter: int
    adapter_bytes: int
    fleet_bytes: int
    base_params: int
    base_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int  # a full context, rounded up to whole KV blocks
    kv_bytes_left: int  # negative when base + fleet exceed the card
    max_concurrent_sequences: int
    max_resident_adapters: int  # most adapters beside the base that still leave one full sequence
    fits: bool  # base + fleet fit on the card

    @property
    def verdict(self) -> str:
        need = self.base_bytes + self.fleet_bytes
        if not self.fits:
            return (
                f"DOES NOT FIT: base + {self.num_adapters} adapters need {need / GB:.2f} GB of a "
                f"{self.gpu_bytes / GB:.2f} GB card ({(need - self.gpu_bytes) / GB:.2f} GB over); "
                f"at most {self.max_resident_adapters} adapters fit beside the base with room for one "
                f"{self.context_len}-token sequence."
            )
        if self.max_concurrent_sequences == 0:
            return (
                f"DOES NOT FIT: the weights fit, but the {self.kv_bytes_left / GB:.2f} GB left cannot hold "
                f"one {self.context_len}-token sequence ({self.kv_bytes_per_sequence / GB:.2f} GB of KV)."
            )
        return (
            f"FITS: {self.max_concurrent_sequences} concurrent sequences of {self.context_len} tokens in "
            f"the {self.kv_bytes_left / GB:.2f} GB left for the KV cache."
        )

    def to_dict(self) -> dict:
        """JSON-safe, for the dashboard page and `capacity --json`."""
        data = asdict(self)
        data["targets"] = list(self.targets)
        data["verdict"] = self.verdict
        return data


def plan_capacity(
    manifest: dict,
    *,
    rank: int,
    targets: str | list[str] | tuple[str, ...] = "all-linear",
    dtype: str = "bf16",
    num_adapters: int = 1,
    gpu_gb: float = 80.0,
    context_len: int = 4096,
    kv_dtype: str | None = None,
    block_size: int = 16,
    base_name: str = "",
) -> CapacityPlan:
    """One plan: `num_adapters` rank-`rank` adapters on `targets`, all resident on a `gpu_gb` card.

    kv_dtype defaults to dtype. block_size is the paged KV cache's block (the worker's default is 16):
    a sequence occupies whole blocks, so its context is rounded up to a multiple of it.
    """
    if rank <= 0:
        raise CapacityError(f"rank must be positive; got {rank}.")
    if num_adapters < 0:
        raise CapacityError(f"the number of adapters cannot be negative; got {num_adapters}.")
    if gpu_gb <= 0:
        raise CapacityError(f"GPU memory must be positive; got {gpu_gb} GB.")
    if context_len <= 0 or block_size <= 0:
        raise CapacityError("context length and block size must be positive.")
    kv_dtype = kv_dtype or dtype
    weight_bytes = dtype_bytes(dtype)
    names = resolve_targets(targets, manifest)
    label = targets if isinstance(targets, str) and targets in TARGET_PRESETS else ",".join(names)

    by_module = lora_parameters_by_module(manifest, rank, names)
    lora_params = sum(by_module.values())
    adapter_bytes = lora_params * weight_bytes
    fleet_bytes = num_adapters * adapter_bytes
    base_params = base_parameters(manifest)
    base_bytes = base_params * weight_bytes
    gpu_bytes = int(round(gpu_gb * GB))

    per_token = kv_bytes_per_token(manifest, kv_dtype)
    blocks = -(-context_len // block_size)  # ceil
    per_sequence = per_token * blocks * block_size
    kv_left = gpu_bytes - base_bytes - fleet_bytes
    max_sequences = max(kv_left, 0) // per_sequence
    room_for_adapters = gpu_bytes - base_bytes - per_sequence
    max_resident = max(room_for_adapters, 0) // adapter_bytes
    return CapacityPlan(
        base_name=base_name,
        family=str(manifest.get("architecture") or ""),
        rank=rank,
        targets=names,
        targets_label=label,
        dtype=dtype,
        kv_dtype=kv_dtype,
        num_adapters=num_adapters,
        gpu_bytes=gpu_bytes,
        context_len=context_len,
        block_size=block_size,
        lora_params_by_module=by_module,
        lora_params_per_adapter=lora_params,
        adapter_bytes=adapter_bytes,
        fleet_bytes=fleet_bytes,
        base_params=base_params,
        base_bytes=base_bytes,
        kv_bytes_per_token=per_token,
        kv_bytes_per_sequence=per_sequence,
        kv_bytes_left=kv_left,
        max_concurrent_sequences=max_sequences,
        max_resident_adapters=max_resident,
        fits=kv_left >= 0,
    )


def concurrent_at_mean(kv_bytes_left: int, kv_bytes_per_token: int, block_size: int, mean_tokens: int) -> int:
    """Sequences whose KV fits in `kv_bytes_left` when each holds `mean_tokens` (prompt + answer so far) in whole
    blocks: what a worker that takes KV on demand runs at once when its sequences average that length (beyond it,
    the pool runs out and sequences are preempted). The worst case is every sequence at its full context."""
    if mean_tokens < 1:
        raise CapacityError("the mean sequence length must be at least one token.")
    per = -(-mean_tokens // block_size) * block_size * kv_bytes_per_token
    return max(kv_bytes_left, 0) // per


def capacity_table(
    manifest: dict,
    *,
    ranks: tuple[int, ...] = TABLE_RANKS,
    target_presets: tuple[str, ...] = TABLE_TARGETS,
    **plan_kwargs,
) -> list[CapacityPlan]:
    """The rank x targets trade-off: one plan per (rank, preset), ranks outer, presets inner.

    plan_kwargs are those of plan_capacity except rank and targets (dtype, num_adapters, gpu_gb, ...).
    """
    return [
        plan_capacity(manifest, rank=rank, targets=preset, **plan_kwargs)
        for rank in ranks
        for preset in target_presets
    ]


# --- the worker's pool: the same arithmetic the worker sizes itself with (protocol.memory) ----------


def parse_fleet_mix(text: str, manifest: dict) -> list:
    """'8:attention-only:500,16:all-linear:300,4:q_proj+v_proj:200' -> [FleetEntry, ...]."""
    from protocol.memory import FleetEntry

    entries = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            rank, targets, count = part.split(":")
            names = targets if targets in TARGET_PRESETS else [t for t in targets.split("+") if t]
            entries.append(FleetEntry(rank=int(rank), targets=resolve_targets(names, manifest),
                                      count=int(count)))
        except ValueError as exc:
            raise CapacityError(f"fleet mix entry {part!r} is not RANK:TARGETS:COUNT ({exc}).") from None
    return entries


def plan_pool(manifest: dict, *, budget_bytes: int, dtype: str = "fp32", block_size: int = 16,
              max_running: int = 64, prefill_chunk: int = 256, max_lora_rank: int = 64, device: str = "cpu",
              fleet: list | tuple = (), context_len: int | None = None, adapter_dtype: str | None = None) -> dict:
    """What a worker built with these numbers does with its budget: weights, workspace, pages of the one
    pool (protocol.memory.split_budget, exactly as ModelRunner sizes itself), and with `fleet` resident,
    the pages adapters take, the pages left for KV and the concurrent full-context sequences.

    `device` matters for the workspace (on CUDA the worker measures one forward pass and takes the larger of that
    and this arithmetic, so a CUDA worker's pool may come out a little smaller than this) and, on a CPU in fp32,
    for a tied LM head: the worker packs a copy of it (protocol.memory.packed_head_copy_bytes).

    `adapter_dtype` (run_worker --adapter-dtype): how resident adapters are stored, `dtype` by default; a
    16-bit one beside fp32 pages puts two adapter elements in each page element."""
    from protocol.lora_layout import ModelShape
    from protocol.memory import BudgetTooSmall, packed_head_copy_bytes, plan_fleet, split_budget, workspace_bytes

    shape = ModelShape.from_config(manifest)
    db = dtype_bytes(dtype)
    ab = dtype_bytes(adapter_dtype) if adapter_dtype else db
    half = (adapter_dtype or "").lower().removeprefix("torch.") in ("bf16", "bfloat16", "fp16", "float16")
    if ab != db and not (db == 4 and half):
        raise CapacityError(f"adapters in {adapter_dtype} beside {dtype} weights: a worker stores adapters in the "
                            f"model's dtype, or in fp16 / bf16 beside an fp32 model.")
    workspace = workspace_bytes(shape, vocab_size=manifest["vocab_size"], max_batch_tokens=prefill_chunk + max_running,
                                max_running=max_running, max_context=manifest["max_position_embeddings"],
                                max_lora_rank=max_lora_rank, dtype_bytes=db, chunked_decode=device != "cuda")
    # a CPU worker's packed copy of a tied LM head (ModelRunner's default there) is weights too
    weights = base_parameters(manifest) * db + packed_head_copy_bytes(
        vocab_size=manifest["vocab_size"], hidden_size=manifest["hidden_size"],
        tied=bool(manifest.get("tie_word_embeddings")), device=device, dtype_bytes=db)
    try:
        split = split_budget(budget_bytes=budget_bytes, weights_bytes=weights,
                             workspace_bytes=workspace, shape=shape, block_size=block_size, dtype_bytes=db)
    except BudgetTooSmall as exc:
        raise CapacityError(str(exc)) from None
    plan = plan_fleet(split, shape, list(fleet), context_len=context_len or manifest["max_position_embeddings"],
                      packing=db // ab)
    return {"split": split.to_dict(), "fleet": plan.to_dict(), "adapter_dtype_bytes": ab}
