"""The shape manifest of a base model: what an adapter may attach to, read from config.json.

A manifest is a plain JSON-serialisable dict stored on BaseModel. Upload validation checks every
LoRA tensor against it; the capacity planner computes memory from it; the worker never needs it.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

# The LoRA layout is written once, in protocol.lora_layout; re-exported here for the adapters app's modules.
from protocol.lora_layout import (  # noqa: F401
    ATTENTION_MODULES,
    BLOCK_OF,
    MLP_MODULES,
    SERVED_MODEL_TYPES,
    TARGET_MODULES,
    ModelShape,
    UnservedBase,
    family_of,
    peft_tensor_name,
)
from protocol.rope import RopeError, rope_from_config

SUPPORTED_ARCHITECTURES = SERVED_MODEL_TYPES  # protocol.lora_layout.FAMILIES


class ManifestError(ValueError):
    """The checkpoint is not a base lorafleet can serve."""


def shape_manifest_from_config(config: dict) -> dict:
    try:
        family = family_of(config)
        arch = family.model_type
        rope = rope_from_config(config)  # a RoPE the runner cannot compute is refused here, not at the worker
    except UnservedBase:
        raise ManifestError(
            f"model_type {config.get('model_type')!r} is not supported; lorafleet serves "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        ) from None
    except RopeError as exc:
        raise ManifestError(f"{exc}.") from None
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        intermediate = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except KeyError as exc:
        raise ManifestError(f"config.json lacks {exc.args[0]!r}.") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    shape = ModelShape(num_layers=layers, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, fused=family.fused)
    modules = {
        name: {
            "in_features": d_in,
            "out_features": d_out,
            "layers": layers,
            "path": f"model.layers.{{layer}}.{BLOCK_OF[name]}.{name}",
        }
        for name, (d_in, d_out) in shape.peft_modules().items()  # Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj
    }
    return {
        "architecture": arch,
        "num_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        # the context served, which the gateway checks prompts against: the config's own, or more where the RoPE
        # scaling extends it (dynamic NTK: x factor; protocol.rope)
        "max_position_embeddings": rope.context,
        "rope_type": rope.rope_type,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "dtype": str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        "num_parameters": 0,
        "modules": modules,
    }


def safetensors_parameter_count(path: Path) -> int:
    """Count parameters from a safetensors header without reading the tensors."""
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in info["shape"]:
            count *= int(dim)
        total += count
    return total


def shape_manifest_from_checkpoint(path: str | Path) -> dict:
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ManifestError(f"{folder} has no config.json; expected a Hugging Face checkpoint folder.")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ManifestError(f"{folder} has no *.safetensors weights (pickled .bin checkpoints are refused).")
    manifest = shape_manifest_from_config(json.loads(config_path.read_text()))
    manifest["num_parameters"] = sum(safetensors_parameter_count(w) for w in weights)
    return manifest


def lora_tensor_names(manifest: dict, module: str, layer: int) -> tuple[str, str]:
    """PEFT's names for the A and B matrices of one module in one layer."""
    if module not in manifest["modules"]:
        raise KeyError(module)
    return peft_tensor_name(layer, module, "A"), peft_tensor_name(layer, module, "B")
