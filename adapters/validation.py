"""Decides whether a PEFT LoRA adapter can be served faithfully on a base model, and describes it.

The rule is "refuse what we cannot serve exactly as PEFT would": the worker applies
`y = W·x + scale · B·(A·x)` on the seven Llama projections with one rank and one scale per adapter.
Anything else in an upload — trained embeddings (`modules_to_save`), DoRA, per-module rank or alpha,
a layer subset, a tensor the base has no module for — would be served wrongly or silently dropped,
so it is refused with a message naming the field or tensor. In particular an adapter whose tensors
match no module would otherwise serve the plain base model under the customer's name. Finite weights
can still overflow once served: an adapter whose delta `scale · B·A` could reach the serving dtype's
largest value is refused too (check_delta_bounds).

Pure functions over parsed inputs (no Django, no storage): uploads.py streams and stores, this decides.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from adapters.manifest import lora_tensor_names
from protocol.safetensors_check import (
    DTYPE_NAMES,
    MAX_ENTRIES,
    SafetensorsError,
    SafetensorsLayout,
    TensorInfo,
    check_finite,
    iter_tensor_chunks,
    read_layout,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 256 * 1024


class AdapterValidationError(ValueError):
    """An upload we refuse. `field` names the file, config key or tensor; str(err) is the sentence to show."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class AdapterSpec:
    """What the platform records about a valid adapter (the AdapterVersion's content columns)."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: list[str]           # sorted short names, e.g. ["q_proj", "v_proj"]
    dtype: str                          # "float32" | "float16" | "bfloat16"
    parameter_count: int
    peft_config: dict = field(default_factory=dict)


# Config keys that only matter while training or initialising, or are informational: any value is fine.
_BENIGN_KEYS = {
    "base_model_name_or_path", "revision", "peft_version", "inference_mode", "init_lora_weights",
    "lora_dropout", "auto_mapping", "megatron_core", "qalora_group_size", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "exclude_modules", "layers_pattern",
}
# Keys checked one by one below.
_CHECKED_KEYS = {"peft_type", "task_type", "r", "lora_alpha", "use_rslora", "target_modules", "bias",
                 "fan_in_fan_out"}
# Features that change the forward pass in ways the worker does not implement: must be unset/false.
_UNSUPPORTED = {
    "modules_to_save": "modules_to_save trains full copies of modules (e.g. embeddings or lm_head) that "
                       "lorafleet cannot serve; train a plain LoRA adapter without modules_to_save.",
    "use_dora": "DoRA (use_dora) adapters are not supported; lorafleet serves plain LoRA.",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported; every module must use rank r.",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported; every module must use lora_alpha.",
    "layers_to_transform": "layers_to_transform (LoRA on a subset of layers) is not supported; "
                           "adapt every layer of the target modules.",
    "layer_replication": "layer_replication is not supported.",
    "trainable_token_indices": "trainable_token_indices trains embedding rows, which lorafleet cannot serve.",
    "lora_bias": "lora_bias adds a bias to lora_B, which lorafleet does not serve.",
    "use_qalora": "QALoRA (use_qalora) is not supported.",
    "megatron_config": "Megatron-sharded LoRA layers are not supported.",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported; target modules.",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported.",
    "ensure_weight_tying": "ensure_weight_tying concerns tied embeddings, which lorafleet does not adapt.",
}
_EMBEDDING_HINTS = ("embed_tokens", "lm_head", "wte", "embed_out", "lora_embedding")


def _fail(field_name: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(field_name, message)


def parse_config(raw: bytes) -> dict:
    """adapter_config.json bytes -> dict, refusing anything that is not a small JSON object."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise _fail(CONFIG_FILE, f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES // 1024} KB.")
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _fail(CONFIG_FILE, f"{CONFIG_FILE} is not valid UTF-8 JSON.") from None
    if not isinstance(config, dict):
        raise _fail(CONFIG_FILE, f"{CONFIG_FILE} must be a JSON object.")
    return config


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_config(config: dict, manifest: dict, max_rank: int) -> tuple[int, float, bool, list[str]]:
    """Check an adapter_config.json against what we serve; returns (r, alpha, use_rslora, target_modules)."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _fail("peft_type", f"peft_type is {peft_type!r}; only LORA adapters are supported.")
    task_type = config.get("task_type")
    if task_type not in (None, "CAUSAL_LM"):
        raise _fail("task_type", f"task_type is {task_type!r}; only CAUSAL_LM adapters are supported.")

    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail("r", f"r must be a positive integer; got {r!r}.")
    if r > max_rank:
        raise _fail("r", f"rank {r} is over this base model's maximum LoRA rank of {max_rank}.")
    alpha = config.get("lora_alpha")
    if not _is_number(alpha) or not 0 < alpha < 1e6:
        raise _fail("lora_alpha", f"lora_alpha must be a positive number; got {alpha!r}.")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail("use_rslora", f"use_rslora must be true or false; got {use_rslora!r}.")
    if config.get("bias", "none") != "none":
        raise _fail("bias", f"bias is {config.get('bias')!r}; only bias='none' is supported.")
    if config.get("fan_in_fan_out"):
        raise _fail("fan_in_fan_out", "fan_in_fan_out (transposed weights, GPT-2 style) is not supported.")

    for key, reason in _UNSUPPORTED.items():
        if config.get(key):
            raise _fail(key, reason)
    for key, value in config.items():
        if key not in _BENIGN_KEYS and key not in _CHECKED_KEYS and key not in _UNSUPPORTED and value:
            # A PEFT feature we have not reviewed might change the forward pass: refuse, don't guess.
            raise _fail(key, f"{CONFIG_FILE} sets {key}, which lorafleet does not support; "
                             f"only plain LoRA adapters are served.")

    targets = config.get("target_modules")
    known = manifest["modules"]
    if targets == "all-linear":
        target_list = sorted(known)
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        target_list = sorted(set(targets))
        for name in target_list:
            if name not in known:
                if any(hint in name for hint in _EMBEDDING_HINTS):
                    raise _fail("target_modules", f"target module {name!r} is an embedding or output layer; "
                                                  f"lorafleet adapts only {', '.join(sorted(known))}.")
                raise _fail("target_modules", f"target module {name!r} is not a module of this base model; "
                                              f"allowed: {', '.join(sorted(known))}.")
    else:
        raise _fail("target_modules", f"target_modules must be a non-empty list of module names "
                                      f"(e.g. [\"q_proj\", \"v_proj\"]); got {targets!r}.")
    return r, float(alpha), use_rslora, target_list


def _explain_unknown_tensor(name: str, manifest: dict) -> str:
    if "lora_magnitude_vector" in name:
        return f"tensor {name} is a DoRA magnitude vector; DoRA adapters are not supported."
    if "modules_to_save" in name:
        return f"tensor {name} is a full module copy (modules_to_save), which lorafleet cannot serve."
    if any(hint in name for hint in _EMBEDDING_HINTS):
        return f"tensor {name} adapts an embedding or output layer, which lorafleet cannot serve."
    if name.endswith(".bias") or "lora_bias" in name:
        return f"tensor {name} is a bias; only lora_A/lora_B weights are served."
    parts = name.split(".")
    if "layers" in parts:
        index = parts.index("layers") + 1
        if index < len(parts) and parts[index].isdigit() and int(parts[index]) >= manifest["num_layers"]:
            return (f"tensor {name} is for layer {parts[index]}, but the base model has "
                    f"{manifest['num_layers']} layers.")
    return (f"tensor {name} does not match any module of the base model (expected names like "
            f"{lora_tensor_names(manifest, next(iter(manifest['modules'])), 0)[0]}).")


def check_tensors(layout: SafetensorsLayout, manifest: dict, rank: int,
                  targets: list[str]) -> tuple[str, int]:
    """Every tensor must be a lora_A/lora_B of a target module in some layer, with the right shape,
    and every target module must have both in every layer. Returns (dtype, parameter_count)."""
    tensors = layout.tensors
    if not tensors:
        raise _fail(WEIGHTS_FILE, f"{WEIGHTS_FILE} holds no tensors, so it matches no module of the base "
                                  f"model and would serve the base model unchanged.")
    expected: dict[str, tuple[str, int, str]] = {}
    for module, spec in manifest["modules"].items():
        for layer in range(int(spec["layers"])):
            name_a, name_b = lora_tensor_names(manifest, module, layer)
            expected[name_a] = (module, layer, "A")
            expected[name_b] = (module, layer, "B")

    for name in sorted(tensors):
        if name not in expected:
            raise _fail(name, _explain_unknown_tensor(name, manifest))
    found_modules = sorted({expected[name][0] for name in tensors})
    extra = sorted(set(found_modules) - set(targets))
    if extra:
        raise _fail("target_modules", f"the weights adapt {', '.join(extra)}, which target_modules does not "
                                      f"list ({', '.join(targets)}).")

    dtypes = set()
    for name in sorted(tensors):
        module, layer, which = expected[name]
        spec = manifest["modules"][module]
        info = tensors[name]
        d_in, d_out = int(spec["in_features"]), int(spec["out_features"])
        if which == "A":
            want, why = (rank, d_in), f"rank {rank} × in_features {d_in}"
        else:
            want, why = (d_out, rank), f"out_features {d_out} × rank {rank}"
        if info.shape != want:
            if len(info.shape) == 2 and info.shape[0 if which == "A" else 1] != rank:
                tensor_rank = info.shape[0 if which == "A" else 1]
                raise _fail(name, f"tensor {name} has rank {tensor_rank} (shape {list(info.shape)}) but "
                                  f"{CONFIG_FILE} says r = {rank}; expected shape {list(want)} ({why}).")
            raise _fail(name, f"tensor {name} has shape {list(info.shape)}, expected {list(want)} ({why}).")
        dtypes.add(info.dtype)

    for module in targets:
        for layer in range(int(manifest["modules"][module]["layers"])):
            for tensor_name in lora_tensor_names(manifest, module, layer):
                if tensor_name not in tensors:
                    raise _fail(tensor_name, f"tensor {tensor_name} is missing: target_modules lists {module}, "
                                             f"so every layer needs its lora_A and lora_B.")
    if len(dtypes) != 1:
        raise _fail(WEIGHTS_FILE, f"tensors mix dtypes {sorted(DTYPE_NAMES[d] for d in dtypes)}; "
                                  f"use one dtype for the whole adapter.")
    parameter_count = sum(info.numel for info in tensors.values())
    return DTYPE_NAMES[dtypes.pop()], parameter_count


# The largest finite value of each serving dtype. A delta at or above it is ±Inf once cast, and one Inf
# in a projection turns every later activation of the sequence into NaN.
BFLOAT16_MAX = 3.3895313892515355e38
_DTYPE_MAX = {"bfloat16": BFLOAT16_MAX, "float16": 65504.0, "float32": 3.4028234663852886e38}
BOUND_SCAN_CHUNK_BYTES = 1024 * 1024  # a chunk becomes float64 plus an index: ~4x its size, transiently


def serving_limit(manifest: dict) -> tuple[str, float]:
    """(dtype name, largest finite value) the delta must stay under: the base's dtype, never above bfloat16's
    (a float32 base may be served in bfloat16 on a GPU), and float16's own for a float16 base."""
    dtype = str(manifest.get("dtype") or "bfloat16").removeprefix("torch.")
    limit = _DTYPE_MAX.get(dtype, BFLOAT16_MAX)
    return ("bfloat16", BFLOAT16_MAX) if limit >= BFLOAT16_MAX else (dtype, limit)


def lora_scale(rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) for rsLoRA."""
    return alpha / (math.sqrt(rank) if use_rslora else rank)


def _as_float64(chunk: bytes, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return np.frombuffer(chunk, dtype="<f4").astype(np.float64)
    if dtype == "F16":
        return np.frombuffer(chunk, dtype="<f2").astype(np.float64)
    # bfloat16 is the top half of a float32: shift the bits up and reinterpret
    return (np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _tensor_stats(fh: BinaryIO, layout: SafetensorsLayout, info: TensorInfo, *, rows: bool) -> tuple[float, float]:
    """(max |w|, largest row norm if `rows` else largest column norm) of a 2-D tensor, chunk by chunk, in
    float64 (whose range holds the square of any float32)."""
    n_rows, n_cols = info.shape
    squares = np.zeros(n_rows if rows else n_cols)
    peak, start = 0.0, 0
    for chunk in iter_tensor_chunks(fh, layout, info, BOUND_SCAN_CHUNK_BYTES):
        values = _as_float64(chunk, info.dtype)
        index = np.arange(start, start + values.size)
        squares += np.bincount(index // n_cols if rows else index % n_cols, weights=values * values,
                               minlength=squares.size)
        peak = max(peak, float(np.abs(values).max()))
        start += values.size
    return peak, float(np.sqrt(squares.max()))


def check_delta_bounds(fh: BinaryIO, layout: SafetensorsLayout, manifest: dict, scale: float) -> None:
    """Refuse an adapter whose delta `scale · B·A` could overflow the serving dtype, naming the tensor.

    Every element of B·A is a dot product of a row of B (d_out × r) and a column of A (r × d_in), so by
    Cauchy–Schwarz max|scale·B·A| ≤ scale · max_i ‖B_i,:‖₂ · max_j ‖A_:,j‖₂ — one streaming pass over the
    weights, no product formed. A module is refused when that bound reaches the limit, and any tensor
    with a single weight whose magnitude times the scale does (the worker scales weights before use).
    Expects check_tensors to have passed: every tensor is a 2-D lora_A/lora_B of a known module.
    """
    dtype, limit = serving_limit(manifest)
    why = f"the largest {dtype} value ({limit:.3g}), which the worker serves in"
    for module, spec in manifest["modules"].items():
        for layer in range(int(spec["layers"])):
            name_a, name_b = lora_tensor_names(manifest, module, layer)
            if name_a not in layout.tensors:
                continue
            peak_a, col_a = _tensor_stats(fh, layout, layout.tensors[name_a], rows=False)
            peak_b, row_b = _tensor_stats(fh, layout, layout.tensors[name_b], rows=True)
            for name, peak in ((name_a, peak_a), (name_b, peak_b)):
                if scale * peak >= limit:
                    raise _fail(name, f"tensor {name} holds a weight of magnitude {peak:.3g}; times the LoRA "
                                      f"scale {scale:g} it reaches {why}.")
            bound = scale * row_b * col_a
            if bound >= limit:
                raise _fail(name_b, f"tensor {name_b} with {name_a}: the LoRA delta scale·B·A could reach "
                                    f"{bound:.3g} (scale {scale:g} × largest lora_B row norm {row_b:.3g} × "
                                    f"largest lora_A column norm {col_a:.3g}), at or over {why}.")


def max_entries_for(manifest: dict) -> int:
    """The most tensors a valid adapter for this base can have (lora_A + lora_B per module per layer)."""
    return min(MAX_ENTRIES, sum(2 * int(m["layers"]) for m in manifest["modules"].values()))


def validate_adapter(config: dict, weights: BinaryIO, weights_size: int, manifest: dict,
                     max_rank: int) -> AdapterSpec:
    """The whole decision: config, then the safetensors header, then tensors vs. the base, then NaN/Inf,
    then whether the served delta could overflow.

    Cheap checks first, so a hostile file is refused before its data is ever read.
    """
    rank, alpha, use_rslora, targets = check_config(config, manifest, max_rank)
    try:
        layout = read_layout(weights, weights_size, max_entries=max_entries_for(manifest))
    except SafetensorsError as exc:
        field_name = WEIGHTS_FILE if exc.field in ("header", "__metadata__") else exc.field
        raise _fail(field_name, f"{WEIGHTS_FILE}: {exc.message}") from None
    dtype, parameter_count = check_tensors(layout, manifest, rank, targets)
    try:
        check_finite(weights, layout)
    except SafetensorsError as exc:
        raise _fail(exc.field, exc.message) from None
    try:
        check_delta_bounds(weights, layout, manifest, lora_scale(rank, alpha, use_rslora))
    except SafetensorsError as exc:  # the file ended inside a tensor (it shrank since check_finite read it)
        raise _fail(exc.field, exc.message) from None
    return AdapterSpec(rank=rank, alpha=alpha, use_rslora=use_rslora, target_modules=targets,
                       dtype=dtype, parameter_count=parameter_count, peft_config=config)
