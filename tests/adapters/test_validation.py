"""Hostile and malformed inputs for the pure validation layer (no database, no storage).

Safetensors files are crafted byte by byte here, because the attacks (overlapping offsets, shapes that
wrap around in 64 bits, 100,000 entries) are exactly what no well-behaved writer produces.
"""
from __future__ import annotations

import io
import json
import struct
import time

import numpy as np
import pytest

from adapters.manifest import lora_tensor_names, shape_manifest_from_config
from adapters.safetensors_check import SafetensorsError, check_finite, read_layout
from adapters.validation import AdapterValidationError, check_config, parse_config, validate_adapter

MANIFEST = shape_manifest_from_config({
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
})
CONFIG = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "use_rslora": False,
          "target_modules": ["q_proj", "v_proj"], "bias": "none", "modules_to_save": None, "use_dora": False,
          "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "lora_dropout": 0.05}


def safetensors_bytes(header: dict, data: bytes, *, header_len: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def from_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    header, chunks, offset = {}, [], 0
    for name, array in arrays.items():
        blob = array.tobytes()
        header[name] = {"dtype": {"float32": "F32", "float16": "F16"}[array.dtype.name], "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    return safetensors_bytes(header, b"".join(chunks))


def good_arrays(r: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {}
    for module in ("q_proj", "v_proj"):
        spec = MANIFEST["modules"][module]
        for layer in range(2):
            a, b = lora_tensor_names(MANIFEST, module, layer)
            arrays[a] = rng.standard_normal((r, spec["in_features"])).astype(np.float32)
            arrays[b] = rng.standard_normal((spec["out_features"], r)).astype(np.float32)
    return arrays


def layout_of(blob: bytes, **kwargs):
    return read_layout(io.BytesIO(blob), len(blob), **kwargs)


def validate(blob: bytes, config: dict | None = None, max_rank: int = 64):
    return validate_adapter(dict(CONFIG if config is None else config), io.BytesIO(blob), len(blob), MANIFEST, max_rank)


def test_a_well_formed_adapter_is_described():
    spec = validate(from_arrays(good_arrays()))
    assert (spec.rank, spec.alpha, spec.use_rslora, spec.dtype) == (8, 16.0, False, "float32")
    assert spec.target_modules == ["q_proj", "v_proj"]
    assert spec.parameter_count == 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)


# --- the safetensors container ------------------------------------------------------------------

def test_a_header_over_the_limit_is_refused_without_reading_it():
    blob = struct.pack("<Q", 50 * 1024 * 1024) + b"{}"
    with pytest.raises(SafetensorsError, match="declares 52428800 bytes; the limit is 4194304"):
        layout_of(blob)


def test_a_header_longer_than_the_file_is_truncation():
    raw = safetensors_bytes({}, b"")
    with pytest.raises(SafetensorsError, match="truncated"):
        layout_of(raw[:-2])


def test_a_hundred_thousand_entries_are_refused_quickly():
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(100_000)}
    blob = safetensors_bytes(header, b"\0" * 400_000)
    start = time.perf_counter()
    with pytest.raises(SafetensorsError, match="limit"):
        layout_of(blob)  # over the header-size limit
    with pytest.raises(SafetensorsError, match="lists 100000 tensors; the limit is 20000"):
        layout_of(blob, max_header_bytes=len(blob))  # and over the entry limit on its own
    assert time.perf_counter() - start < 5


def test_more_tensors_than_the_base_can_take_is_refused_before_looking_at_names():
    arrays = good_arrays()
    arrays.update({f"extra.{i}": np.ones(1, np.float32) for i in range(21)})  # 8 + 21 > 2 layers × 7 × 2
    with pytest.raises(AdapterValidationError, match="lists 29 tensors; the limit is 28"):
        validate(from_arrays(arrays))


@pytest.mark.parametrize("offsets, message", [
    ([[0, 16], [8, 24]], "overlaps the previous tensor"),
    ([[0, 16], [20, 36]], "leaving unaccounted bytes 16–20"),
    ([[0, 16], [16, 32]], "extra bytes after the last tensor"),
    ([[0, 16], [16, 40]], "data_offsets span 24 bytes"),
    ([[0, 16], [16, 4000]], "ends at byte 4000 but the data section has only 40"),
    ([[0, 16], [16, 0]], "invalid data_offsets"),
])
def test_offsets_must_tile_the_data_exactly(offsets, message):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": offsets[0]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": offsets[1]}}
    with pytest.raises(SafetensorsError, match=message):
        layout_of(safetensors_bytes(header, b"\0" * 40))


@pytest.mark.parametrize("shape, message", [
    ([0, 8], "no elements"),
    ([2**32, 2**32], "more elements than the file can hold"),   # wraps to 0 in uint64
    ([2**62, 4], "more elements than the file can hold"),
    ([-1, 4], "invalid shape"),
    ([True, 4], "invalid shape"),
    ([1] * 9, "invalid shape"),
])
def test_hostile_shapes_are_refused(shape, message):
    header = {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    with pytest.raises(SafetensorsError, match=message):
        layout_of(safetensors_bytes(header, b"\0" * 16))


@pytest.mark.parametrize("dtype", ["I64", "U8", "F64", "BOOL", "object", None])
def test_only_float_dtypes_are_accepted(dtype):
    header = {"a": {"dtype": dtype, "shape": [2], "data_offsets": [0, 16]}}
    with pytest.raises(SafetensorsError, match="adapters must be F32, F16, BF16"):
        layout_of(safetensors_bytes(header, b"\0" * 16))


@pytest.mark.parametrize("raw, message", [
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "names 'a' twice"),
    (b'{"a": NaN}', "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b"{" * 5000 + b"}" * 5000, "not valid UTF-8 JSON|not a JSON object|invalid"),
    (b'{"a": "\xff"}', "not valid UTF-8 JSON"),
    (b'{"__metadata__": {"format": 1}}', "__metadata__ must map strings to strings"),
])
def test_malformed_headers_are_refused(raw, message):
    with pytest.raises(SafetensorsError, match=message):
        layout_of(struct.pack("<Q", len(raw)) + raw + b"\0\0\0\0")


def test_a_file_shorter_than_the_length_prefix_is_refused():
    with pytest.raises(SafetensorsError, match="too short"):
        layout_of(b"\x01\x02")


@pytest.mark.parametrize("dtype, word, bad_bits", [
    ("F32", np.uint32, 0x7FC0_0000),   # NaN
    ("F32", np.uint32, 0xFF80_0000),   # -Inf
    ("F16", np.uint16, 0x7C00),        # +Inf
    ("BF16", np.uint16, 0x7FC1),       # NaN, a dtype numpy cannot even hold
])
def test_nan_and_inf_are_found_in_every_dtype_across_chunk_boundaries(dtype, word, bad_bits):
    bits = np.full(1000, 0x3C00 if word is np.uint16 else 0x3F80_0000, dtype=word)  # finite ones
    bits[777] = bad_bits
    blob = safetensors_bytes({"w": {"dtype": dtype, "shape": [1000], "data_offsets": [0, bits.nbytes]}},
                             bits.tobytes())
    fh = io.BytesIO(blob)
    layout = read_layout(fh, len(blob))
    with pytest.raises(SafetensorsError, match=r"tensor w contains NaN or Inf \(element 777\)"):
        check_finite(fh, layout, chunk_bytes=64)  # many chunks: the element index survives chunking
    bits[777] = bits[0]
    fh = io.BytesIO(safetensors_bytes({"w": {"dtype": dtype, "shape": [1000], "data_offsets": [0, bits.nbytes]}},
                                      bits.tobytes()))
    check_finite(fh, layout, chunk_bytes=64)  # all finite: no complaint


# --- tensors against the base -----------------------------------------------------------------

def test_config_rank_must_equal_the_tensor_rank():
    with pytest.raises(AdapterValidationError) as excinfo:
        validate(from_arrays(good_arrays(r=4)))
    assert "has rank 4 (shape [4, 64]) but adapter_config.json says r = 8" in str(excinfo.value)
    assert excinfo.value.field == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_a_missing_layer_is_refused():
    arrays = good_arrays()
    del arrays["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    with pytest.raises(AdapterValidationError, match="layers.1.self_attn.v_proj.lora_B.weight is missing"):
        validate(from_arrays(arrays))


def test_tensors_for_a_module_the_config_does_not_list_are_refused():
    arrays = good_arrays()
    config = {**CONFIG, "target_modules": ["q_proj"]}
    with pytest.raises(AdapterValidationError, match="the weights adapt v_proj, which target_modules does not list"):
        validate(from_arrays(arrays), config)


@pytest.mark.parametrize("extra_name, message", [
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding or output layer"),
    ("base_model.model.lm_head.weight", "embedding or output layer"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
    ("base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight", "layer 5, but the base model has 2 layers"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "is a bias"),
    ("base_model.model.model.layers.0.self_attn.c_attn.lora_A.weight", "does not match any module"),
])
def test_stray_tensors_are_refused_by_name(extra_name, message):
    arrays = good_arrays()
    arrays[extra_name] = np.ones(4, np.float32)
    with pytest.raises(AdapterValidationError, match=message) as excinfo:
        validate(from_arrays(arrays))
    assert excinfo.value.field == extra_name


def test_an_empty_weights_file_matches_no_module():
    with pytest.raises(AdapterValidationError, match="matches no module"):
        validate(safetensors_bytes({}, b""))


def test_mixed_dtypes_are_refused():
    arrays = good_arrays()
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    arrays[name] = arrays[name].astype(np.float16)
    with pytest.raises(AdapterValidationError, match=r"tensors mix dtypes \['float16', 'float32'\]"):
        validate(from_arrays(arrays))


# --- adapter_config.json -----------------------------------------------------------------------

@pytest.mark.parametrize("change, field, message", [
    ({"use_dora": True}, "use_dora", "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save", "modules_to_save"),
    ({"rank_pattern": {"q_proj": 16}}, "rank_pattern", "per-module ranks"),
    ({"alpha_pattern": {"q_proj": 32}}, "alpha_pattern", "per-module alphas"),
    ({"layers_to_transform": [0]}, "layers_to_transform", "subset of layers"),
    ({"peft_type": "IA3"}, "peft_type", "only LORA"),
    ({"peft_type": None}, "peft_type", "only LORA"),
    ({"task_type": "SEQ_CLS"}, "task_type", "only CAUSAL_LM"),
    ({"r": 0}, "r", "positive integer"),
    ({"r": "8"}, "r", "positive integer"),
    ({"r": 65}, "r", "rank 65 is over this base model's maximum LoRA rank of 64"),
    ({"lora_alpha": None}, "lora_alpha", "positive number"),
    ({"use_rslora": "yes"}, "use_rslora", "true or false"),
    ({"bias": "all"}, "bias", "bias='none'"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out", "not supported"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules", "embedding or output layer"),
    ({"target_modules": ["embed_tokens"]}, "target_modules", "embedding or output layer"),
    ({"target_modules": ["query_key_value"]}, "target_modules", "not a module of this base model"),
    ({"target_modules": ".*proj"}, "target_modules", "list of module names"),
    ({"target_modules": []}, "target_modules", "list of module names"),
    ({"kasa_config": {"x": 1}}, "kasa_config", "does not support"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices", "embedding rows"),
])
def test_config_features_we_cannot_serve_are_refused(change, field, message):
    with pytest.raises(AdapterValidationError, match=message) as excinfo:
        check_config({**CONFIG, **change}, MANIFEST, 64)
    assert excinfo.value.field == field


def test_benign_and_unset_config_fields_are_accepted():
    config = {**CONFIG, "task_type": None, "lora_dropout": 0.1, "init_lora_weights": "gaussian",
              "some_future_flag": None, "another_future_flag": False, "base_model_name_or_path": "x"}
    assert check_config(config, MANIFEST, 64) == (8, 16.0, False, ["q_proj", "v_proj"])
    assert check_config({**CONFIG, "target_modules": "all-linear"}, MANIFEST, 64)[3] == sorted(MANIFEST["modules"])


@pytest.mark.parametrize("raw, message", [
    (b"\xff\xfe", "not valid UTF-8 JSON"),
    (b"[]", "must be a JSON object"),
    (b"{" + b" " * (300 * 1024) + b"}", "over 256 KB"),
])
def test_a_config_that_is_not_a_small_json_object_is_refused(raw, message):
    with pytest.raises(AdapterValidationError, match=message) as excinfo:
        parse_config(raw)
    assert excinfo.value.field == "adapter_config.json"
