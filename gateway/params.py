"""The body of a completion request, checked field by field: every refusal names the field.

Unknown fields are refused (a typo such as `max_token` must not silently use the default), and
OpenAI parameters we accept but cannot honour (`suffix`, `best_of` other than n) are refused by name
rather than ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig

from .errors import invalid, request_too_large

COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    # lorafleet extensions (vLLM's names); cache_salt scopes the prefix cache (see parse_cache_salt)
    "top_k", "ignore_eos", "repetition_penalty", "return_tokens_as_token_ids", "cache_salt",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "echo", "best_of", "prompt_as_text"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
CHAT_ROLES = {"system", "developer", "user", "assistant"}
MAX_STOP = 4
MAX_N = 8
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs` (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions `top_logprobs`
MAX_LOGIT_BIAS = 300
MIN_REPETITION_PENALTY = 0.01  # the worker's floor too (inference_worker/sampling.py)
MAX_CACHE_SALT = 256  # characters
COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's legacy default)


@dataclass
class GenerationParams:
    model: str
    # None: chat without max_tokens / max_completion_tokens, "until a stop or the context": the gateway sets it
    # once the base and the prompt's length are known (gateway/prompts.py, count_and_check).
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    n: int = 1
    logprobs: int | None = None  # None: no logprobs; k: each token's logprob and its k most likely rivals
    echo: bool = False  # completions: the prompt precedes each choice's text (and its logprobs, if asked)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    prompt: str | None = None  # completions
    prompt_token_ids: list[int] | None = None  # completions given token ids
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    max_tokens_param: str = "max_tokens"  # the field the caller set it with (chat: or max_completion_tokens)
    cache_salt: str = ""  # "": the prefix cache is scoped to (tenant, adapter) only
    prompt_as_text: bool = False  # completions: control-token strings in the prompt are text (gateway/prompt_text.py)


def read_body(request) -> bytes:
    """The raw body, or a 413 when it is over DATA_UPLOAD_MAX_MEMORY_SIZE (Django refuses to read it)."""
    try:
        return request.body
    except RequestDataTooBig:
        raise request_too_large(settings.DATA_UPLOAD_MAX_MEMORY_SIZE) from None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError):
        raise invalid("The request body is not valid JSON.", code="invalid_json") from None
    except RecursionError:  # e.g. 100,000 nested arrays: Python's parser runs out of stack, not memory
        raise invalid("The request body nests JSON too deeply.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    return body


def _encodable(value: str, param: str) -> str:
    """JSON may carry lone surrogates ("\\ud800") that no tokenizer can encode: a 400, not a crash."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{param} is not valid Unicode text.", param=param) from None
    return value


def parse_completion(body: dict[str, Any]) -> GenerationParams:
    _refuse_unknown(body, COMPLETION_FIELDS)
    if body.get("suffix") not in (None, ""):
        raise invalid("suffix is not supported by this server (no fill-in-the-middle).", param="suffix",
                      code="unsupported_parameter")
    params = _common(body, max_tokens_field="max_tokens", default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)
    best_of = body.get("best_of")
    if best_of is not None:
        if not _is_int(best_of) or best_of < 1:
            raise invalid(f"best_of must be a positive integer; got {best_of!r}.", param="best_of")
        if best_of != params.n:
            raise invalid(f"best_of={best_of} is not supported: this server does not generate extra candidates "
                          f"to rank server-side. Ask for n={best_of} choices with logprobs and rank them yourself, "
                          f"or leave best_of unset (or equal to n).", param="best_of", code="unsupported_parameter")
    params.echo = _bool(body, "echo")
    params.prompt_as_text = _bool(body, "prompt_as_text")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise invalid(f"logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} on /v1/completions "
                          f"(the number of most likely tokens returned beside each chosen one); got {logprobs!r}.",
                          param="logprobs")
        params.logprobs = logprobs
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty.", param="prompt")
        params.prompt = _encodable(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        params.prompt_token_ids = [int(t) for t in prompt]
    elif prompt is None:
        raise invalid("prompt is required.", param="prompt", code="missing_parameter")
    else:
        raise invalid("prompt must be a string, a list of one string, or a list of token ids "
                      "(one prompt per request).", param="prompt")
    return params


def parse_chat(body: dict[str, Any]) -> GenerationParams:
    _refuse_unknown(body, CHAT_FIELDS)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise invalid("Send max_completion_tokens or max_tokens, not both.", param="max_completion_tokens")
    which = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _common(body, max_tokens_field=which, default_max_tokens=None)  # OpenAI's: up to the context
    wants = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}; got {top!r}.",
                          param="top_logprobs")
        if not wants:
            raise invalid("top_logprobs needs logprobs: true.", param="top_logprobs")
    if wants:
        params.logprobs = top or 0
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages is required.", param="messages", code="missing_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}.", param=f"messages[{i}].role")
        params.messages.append({"role": "system" if message["role"] == "developer" else message["role"],
                                "content": _encodable(_message_text(message.get("content"), i),
                                                      f"messages[{i}].content")})
    return params


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid(f"messages[{i}].content must be a string or a list of text parts.", param=f"messages[{i}].content")


def _common(body: dict[str, Any], *, max_tokens_field: str, default_max_tokens: int | None) -> GenerationParams:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid("model is required: the name of one of your adapters (`name` or `name@version`).",
                      param="model", code="missing_parameter")
    cap = max_tokens_cap()
    max_tokens = min(default_max_tokens, cap or default_max_tokens) if default_max_tokens is not None else None
    if body.get(max_tokens_field) is not None:  # without a cap, the base's context bounds it (count_and_check)
        max_tokens = _int(body, max_tokens_field, default=0, lo=1, hi=cap or 2**31 - 1,
                          why=f"at least 1 and at most {cap} (this server's cap)" if cap else "at least 1")
    temperature = _number(body, "temperature", default=1.0, lo=0.0, hi=2.0)
    top_p = _number(body, "top_p", default=1.0, lo=0.0, hi=1.0)
    if top_p <= 0.0:
        raise invalid("top_p must be greater than 0 and at most 1.", param="top_p")
    top_k = _int(body, "top_k", default=0, lo=0, hi=1_000_000, why="0 (off) or more")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and -(2**63) <= seed < 2**63):
        raise invalid("seed must be an integer.", param="seed")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options is only allowed with stream: true.", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("stream_options may only hold include_usage.", param="stream_options")
        include_usage = bool(options.get("include_usage", False))
    repetition_penalty = _number(body, "repetition_penalty", default=1.0, lo=0.0, hi=2.0)
    if repetition_penalty < MIN_REPETITION_PENALTY:  # 1e-38 divides a logit past float32's range (issue 47)
        raise invalid(f"repetition_penalty must be a number from {MIN_REPETITION_PENALTY:g} to 2 (1 = off); got "
                      f"{repetition_penalty!r}.", param="repetition_penalty")
    return GenerationParams(
        model=model.strip(), max_tokens=max_tokens, max_tokens_param=max_tokens_field, temperature=temperature,
        top_p=top_p, top_k=top_k, cache_salt=parse_cache_salt(body.get("cache_salt")),
        seed=seed, stop=_stop(body.get("stop")), stream=stream, include_usage=include_usage,
        ignore_eos=_bool(body, "ignore_eos"),
        n=_int(body, "n", default=1, lo=1, hi=MAX_N, why=f"from 1 to {MAX_N}"),
        presence_penalty=_number(body, "presence_penalty", default=0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_number(body, "frequency_penalty", default=0.0, lo=-2.0, hi=2.0),
        repetition_penalty=repetition_penalty,
        logit_bias=_logit_bias(body.get("logit_bias")),
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
    )


def max_tokens_cap() -> int:
    """LORAFLEET_MAX_TOKENS_CAP, or 0: no cap but the base's context (the default)."""
    return max(int(settings.LORAFLEET_MAX_TOKENS_CAP or 0), 0)


def parse_cache_salt(value: Any) -> str:
    """vLLM's `cache_salt`: requests share cached prompt KV only when their salts are equal (within one tenant and
    adapter, which the worker's prefix cache always separates). A tenant serving many end users can give each its
    own salt, so that one user's latency cannot reveal which prompts another sent."""
    if value is None:
        return ""
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT:
        raise invalid(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters.",
                      param="cache_salt")
    return _encodable(value, "cache_salt")


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's shape: {"<token id>": bias from -100 to 100}; JSON keys are strings."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids to biases.",
                      param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = str(key).strip()
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses (issue 47), and 9 digits are
        # past any vocabulary, so int() never meets a 5,000-digit key (Python refuses those too).
        if not (token.isascii() and token.isdigit() and len(token) <= 9) or isinstance(bias, bool) \
                or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid(f"logit_bias maps token ids (as strings of digits) to numbers from -100 to 100; got "
                          f"{repr(key)[:24]}: {repr(bias)[:24]}.", param="logit_bias")
        out[int(token)] = float(bias)
    return out


def _refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {', '.join(unknown)}.", param=unknown[0],
                      code="unknown_parameter")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body, name, *, default: int, lo: int, hi: int, why: str) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not lo <= value <= hi:
        raise invalid(f"{name} must be an integer, {why}; got {value!r}.", param=name)
    return value


def _number(body, name, *, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise invalid(f"{name} must be a number between {lo:g} and {hi:g}; got {value!r}.", param=name)
    return float(value)


def _bool(body, name) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false.", param=name)
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP or not all(isinstance(s, str) and s for s in value):
        raise invalid(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them.", param="stop")
    return [_encodable(s, "stop") for s in value]
