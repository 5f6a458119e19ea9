"""The body of `POST /v1/fine_tuning/jobs`, read and checked: every refusal names the field and says why.

OpenAI's fields: model, training_file, validation_file, suffix, seed, hyperparameters (n_epochs, batch_size,
learning_rate_multiplier; each an integer/number or "auto") or the same under
method = {"type": "supervised", "supervised": {"hyperparameters": {...}}}, metadata. lorafleet's extensions
(the openai client sends them with `extra_body`):

    "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    "auto_activate": true      a later version of an existing adapter goes live at once (the first always does)

"auto" resolves to: n_epochs 3, batch_size min(8, examples), learning_rate_multiplier 1 (times
LORAFLEET_FINETUNE_BASE_LEARNING_RATE). The job reports the resolved values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gateway.errors import ApiError, invalid
from protocol.lora_layout import ATTENTION_MODULES, FUSED_MODULES, TARGET_MODULES

KNOWN_KEYS = {"model", "training_file", "validation_file", "suffix", "seed", "hyperparameters", "method",
              "metadata", "integrations", "lora", "auto_activate"}
HYPERPARAMETERS = ("n_epochs", "batch_size", "learning_rate_multiplier")
DEFAULT_EPOCHS = 3
MAX_EPOCHS = 50
DEFAULT_MAX_BATCH = 8
MAX_BATCH = 256
MAX_LR_MULTIPLIER = 100.0
DEFAULT_RANK = 8
FUSED_QKV = "qkv_proj"  # Phi-3's fused attention input projection
MAX_SEED = 2**31 - 1


@dataclass
class JobParams:
    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = None
    seed: int | None = None
    n_epochs: int | None = None  # None: "auto"
    batch_size: int | None = None
    learning_rate_multiplier: float | None = None
    rank: int = DEFAULT_RANK
    alpha: float | None = None  # None: 2 × rank (an integer, as PEFT's lora_alpha is usually given)
    target_modules: tuple[str, ...] | None = None  # None: the base's attention projections
    auto_activate: bool = False
    metadata: dict = field(default_factory=dict)


def _string(body: dict, name: str, *, required: bool = False, max_len: int = 200) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise invalid(f"{name} is required.", param=name, code="missing_parameter")
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > max_len:
        raise invalid(f"{name} must be a non-empty string of at most {max_len} characters.", param=name)
    return value.strip()


def _int(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(f"{name} must be an integer from {low} to {high}; got {str(value)[:40]!r}.", param=name)
    return value


def _hyperparameters(raw, where: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise invalid(f"{where} must be an object.", param=where)
    unknown = sorted(set(raw) - set(HYPERPARAMETERS))
    if unknown:
        raise invalid(f"{where}.{unknown[0]} is not a hyperparameter of supervised fine-tuning (they are "
                      f"{', '.join(HYPERPARAMETERS)}; LoRA's rank, alpha and targets go in \"lora\").",
                      param=f"{where}.{unknown[0]}")
    out = {}
    for name, value in raw.items():
        param = f"{where}.{name}"
        if value == "auto" or value is None:
            continue
        if name == "n_epochs":
            out[name] = _int(value, param, 1, MAX_EPOCHS)
        elif name == "batch_size":
            out[name] = _int(value, param, 1, MAX_BATCH)
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_LR_MULTIPLIER:
                raise invalid(f"{param} must be a number above 0 and at most {MAX_LR_MULTIPLIER:g}, or \"auto\"; got "
                              f"{str(value)[:40]!r}.", param=param)
            out[name] = float(value)
    return out


def _method_hyperparameters(method) -> dict:
    if not isinstance(method, dict):
        raise invalid("method must be an object {\"type\": \"supervised\", \"supervised\": {...}}.", param="method")
    kind = method.get("type")
    if kind != "supervised":
        raise invalid(f"method.type {str(kind)[:30]!r} is not supported; this server trains LoRA adapters with "
                      f"supervised fine-tuning (\"supervised\").", param="method.type", code="unsupported_method")
    supervised = method.get("supervised") or {}
    if not isinstance(supervised, dict):
        raise invalid("method.supervised must be an object.", param="method.supervised")
    return _hyperparameters(supervised.get("hyperparameters"), "method.supervised.hyperparameters")


def _lora(raw, params: JobParams) -> None:
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise invalid("lora must be an object {\"rank\": 8, \"alpha\": 16, \"target_modules\": [...]}.", param="lora")
    unknown = sorted(set(raw) - {"rank", "alpha", "target_modules"})
    if unknown:
        raise invalid(f"lora.{unknown[0]} is not supported (rank, alpha, target_modules).", param=f"lora.{unknown[0]}")
    if raw.get("rank") is not None:
        params.rank = _int(raw["rank"], "lora.rank", 1, 4096)
    if raw.get("alpha") is not None:
        params.alpha = float(_int(raw["alpha"], "lora.alpha", 1, 65536))
    if raw.get("target_modules") is not None:
        targets = raw["target_modules"]
        if (not isinstance(targets, list) or not targets
                or not all(isinstance(t, str) for t in targets)):
            raise invalid("lora.target_modules must be a non-empty list of module names.", param="lora.target_modules")
        params.target_modules = tuple(dict.fromkeys(targets))


def parse_job_body(body) -> JobParams:
    if not isinstance(body, dict):
        raise invalid("The body must be a JSON object.", code="invalid_json")
    unknown = sorted(set(body) - KNOWN_KEYS)
    if unknown:
        raise invalid(f"{unknown[0][:40]!r} is not a parameter of fine-tuning jobs.", param=unknown[0][:40],
                      code="unknown_parameter")
    params = JobParams(model=_string(body, "model", required=True), training_file=_string(body, "training_file",
                                                                                         required=True, max_len=60))
    params.validation_file = _string(body, "validation_file", max_len=60)
    params.suffix = _string(body, "suffix", max_len=64)
    if body.get("seed") is not None:
        params.seed = _int(body["seed"], "seed", 0, MAX_SEED)
    hyper = _hyperparameters(body.get("hyperparameters"), "hyperparameters")
    if body.get("method") is not None:
        from_method = _method_hyperparameters(body["method"])
        clash = sorted(k for k in set(hyper) & set(from_method) if hyper[k] != from_method[k])
        if clash:
            raise invalid(f"hyperparameters.{clash[0]} and method.supervised.hyperparameters.{clash[0]} disagree; give "
                          f"it once.", param=f"hyperparameters.{clash[0]}")
        hyper = {**hyper, **from_method}
    params.n_epochs = hyper.get("n_epochs")
    params.batch_size = hyper.get("batch_size")
    params.learning_rate_multiplier = hyper.get("learning_rate_multiplier")
    if body.get("integrations"):
        raise invalid("integrations (Weights and Biases) are not supported here.", param="integrations",
                      code="unsupported_parameter")
    metadata = body.get("metadata")
    if metadata is not None:
        if (not isinstance(metadata, dict) or len(metadata) > 16
                or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                           for k, v in metadata.items())):
            raise invalid("metadata must be an object of at most 16 string keys (64 characters) and string values "
                          "(512 characters).", param="metadata")
        params.metadata = metadata
    _lora(body.get("lora"), params)
    auto = body.get("auto_activate", False)
    if not isinstance(auto, bool):
        raise invalid("auto_activate must be true or false.", param="auto_activate")
    params.auto_activate = auto
    return params


def resolve_lora(params: JobParams, base) -> None:
    """Check rank and targets against the base; fill in the default targets (its attention projections)."""
    if params.rank > base.max_lora_rank:
        raise ApiError(400, "rank_too_large", f"lora.rank {params.rank} is above the largest rank base {base.slug!r} "
                                              f"serves ({base.max_lora_rank}).", param="lora.rank")
    canonical = (*TARGET_MODULES, *FUSED_MODULES)  # the order adapters list their targets in
    present = (base.shape_manifest or {}).get("modules") or TARGET_MODULES
    modules = sorted(present, key=lambda m: canonical.index(m) if m in canonical else len(canonical))
    if params.target_modules is None:
        params.target_modules = tuple(m for m in modules if m in ATTENTION_MODULES or m == FUSED_QKV)
        return
    missing = [m for m in params.target_modules if m not in modules]
    if missing:
        raise invalid(f"lora.target_modules: {missing[0][:40]!r} is not a module of base {base.slug!r} that LoRA can "
                      f"target (one of {', '.join(modules)}).", param="lora.target_modules")
    params.target_modules = tuple(m for m in modules if m in params.target_modules)
