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
from adapters.validation import (
    BFLOAT16_MAX,
    AdapterValidationError,
    check_config,
    check_delta_bounds,
    parse_config,
    serving_limit,
    validate_adapter,
)
from protocol.safetensors_check import SafetensorsError, check_finite, read_layout

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
        header[name] = {"dtype": {"float32": "F32", "float16": "F16"}[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
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


# --- the served delta: finite weights that overflow once scaled -----------------------------------
# max|scale·B·A| ≤ scale · max‖B_i,:‖₂ · max‖A_:,j‖₂ must stay under the serving dtype's largest value, and
# so must every single weight times the scale.

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
V_B = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


def validate_with(blob: bytes, manifest: dict = MANIFEST, **config):
    return validate_adapter({**CONFIG, **config}, io.BytesIO(blob), len(blob), manifest, 64)


def bf16_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """A safetensors file in bfloat16 (numpy has no such dtype: the top 16 bits of each float32)."""
    header, chunks, offset = {}, [], 0
    for name, array in arrays.items():
        raw = (array.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    return safetensors_bytes(header, b"".join(chunks))


def test_weights_near_float32_max_pass_the_nan_scan_but_are_refused():
    arrays = good_arrays()
    arrays[V_B][5, 3] = 3.0e38  # finite in float32; scale 16/8 = 2 makes it 6e38
    blob = from_arrays(arrays)
    fh = io.BytesIO(blob)
    check_finite(fh, read_layout(fh, len(blob)))  # what the upload checked before: no complaint
    with pytest.raises(AdapterValidationError) as excinfo:
        validate_with(blob)
    assert excinfo.value.field == V_B
    assert f"tensor {V_B} holds a weight of magnitude 3e+38" in str(excinfo.value)
    assert "bfloat16" in str(excinfo.value)


def test_moderate_weights_whose_product_overflows_are_refused_by_the_bound():
    arrays = good_arrays()
    arrays[Q_A][:] = 1e19  # each weight × scale 2 is far from the limit...
    arrays[Q_B][:] = 1e19  # ...but every element of B·A is 8 × 1e38, times 2
    with pytest.raises(AdapterValidationError) as excinfo:
        validate_with(from_arrays(arrays))
    assert excinfo.value.field == Q_B
    message = str(excinfo.value)
    assert f"tensor {Q_B} with {Q_A}" in message and "could reach 1.6e+39" in message


def test_the_bound_accounts_for_the_scale_and_rslora():
    arrays = good_arrays()
    arrays[Q_A][:] = 1e18
    arrays[Q_B][:] = 1e18  # every element of B·A is 8e36: bound 8e36 × scale
    blob = from_arrays(arrays)
    validate_with(blob, lora_alpha=16)  # scale 2: 1.6e37
    with pytest.raises(AdapterValidationError, match="could reach 4e\\+38"):
        validate_with(blob, lora_alpha=400)  # scale 50: 4e38
    validate_with(blob, lora_alpha=40, use_rslora=True)  # alpha / sqrt(8) ≈ 14.1: 1.1e38, under the limit
    with pytest.raises(AdapterValidationError, match="could reach"):
        validate_with(blob, lora_alpha=150, use_rslora=True)  # ≈ 53: 4.2e38


def test_bfloat16_weights_are_read_as_bfloat16():
    arrays = good_arrays()
    blob = bf16_bytes(arrays)
    spec = validate_with(blob)
    assert spec.dtype == "bfloat16"
    arrays[Q_A][0, 0] = 3.0e38
    with pytest.raises(AdapterValidationError) as excinfo:
        validate_with(bf16_bytes(arrays))
    assert excinfo.value.field == Q_A


def test_a_float16_base_is_bounded_by_float16s_own_maximum():
    arrays = {name: np.full(a.shape, 200.0, np.float16) for name, a in good_arrays().items()}
    blob = from_arrays(arrays)  # every element of B·A is 8 × 200², times 2: 640,000
    validate_with(blob)  # a float32 base: far under bfloat16's maximum
    with pytest.raises(AdapterValidationError, match=r"at or over the largest float16 value \(6.55e\+04\)"):
        validate_with(blob, manifest={**MANIFEST, "dtype": "float16"})
    assert serving_limit({"dtype": "float32"}) == ("bfloat16", BFLOAT16_MAX)
    assert serving_limit({"dtype": "torch.bfloat16"}) == ("bfloat16", BFLOAT16_MAX)
    assert serving_limit({}) == ("bfloat16", BFLOAT16_MAX)


def test_the_bound_is_exact_per_row_and_column_across_chunks(monkeypatch):
    """Row and column norms survive chunk boundaries that split rows (tiny chunks here)."""
    import adapters.validation as validation

    monkeypatch.setattr(validation, "BOUND_SCAN_CHUNK_BYTES", 12)  # 3 float32s: never a whole row
    rng = np.random.default_rng(3)
    arrays = {name: rng.standard_normal(a.shape).astype(np.float32) for name, a in good_arrays().items()}
    blob = from_arrays(arrays)
    fh = io.BytesIO(blob)
    layout = read_layout(fh, len(blob))
    a, b = arrays[Q_A].astype(np.float64), arrays[Q_B].astype(np.float64)
    _, col_a = validation._tensor_stats(fh, layout, layout.tensors[Q_A], rows=False)
    peak_b, row_b = validation._tensor_stats(fh, layout, layout.tensors[Q_B], rows=True)
    assert col_a == pytest.approx(np.linalg.norm(a, axis=0).max())
    assert row_b == pytest.approx(np.linalg.norm(b, axis=1).max())
    assert peak_b == pytest.approx(np.abs(b).max())
    assert np.abs(b @ a).max() <= row_b * col_a  # it is a bound
    check_delta_bounds(fh, layout, MANIFEST, scale=2.0)


def test_adapters_written_by_peft_pass(peft_adapters, tiny_base_dir):
    """What PEFT's save_pretrained writes (float32; bfloat16 with rsLoRA on all seven projections) validates."""
    from adapters.manifest import shape_manifest_from_checkpoint

    manifest = shape_manifest_from_checkpoint(tiny_base_dir)
    for folder in (peft_adapters.good, peft_adapters.good_other):
        config = json.loads((folder / "adapter_config.json").read_text())
        weights = (folder / "adapter_model.safetensors").read_bytes()
        validate_adapter(config, io.BytesIO(weights), len(weights), manifest, 64)
