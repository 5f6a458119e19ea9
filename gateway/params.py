"""The body of a completion request, checked field by field: every refusal names the field.

Unknown fields are refused (a typo such as `max_token` must not silently use the default), and
OpenAI parameters we accept but cannot honour (n > 1, logprobs, penalties...) are refused by name
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
    "top_k", "ignore_eos",  # lorafleet extensions (vLLM's names)
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
CHAT_ROLES = {"system", "developer", "user", "assistant"}
MAX_STOP = 4


@dataclass
class GenerationParams:
    model: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    prompt: str | None = None  # completions
    prompt_token_ids: list[int] | None = None  # completions given token ids
    messages: list[dict[str, str]] = field(default_factory=list)  # chat


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
    for name, default in (("suffix", None), ("echo", False), ("best_of", 1)):
        _must_be_default(body, name, default)
    params = _common(body, max_tokens_field="max_tokens")
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
    _must_be_default(body, "top_logprobs", None)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise invalid("Send max_completion_tokens or max_tokens, not both.", param="max_completion_tokens")
    which = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _common(body, max_tokens_field=which)
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


def _common(body: dict[str, Any], *, max_tokens_field: str) -> GenerationParams:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid("model is required: the name of one of your adapters (`name` or `name@version`).",
                      param="model", code="missing_parameter")
    for name, default in (("n", 1), ("logprobs", None), ("presence_penalty", 0), ("frequency_penalty", 0),
                          ("logit_bias", None)):
        _must_be_default(body, name, default)
    cap = settings.LORAFLEET_MAX_TOKENS_CAP
    max_tokens = _int(body, max_tokens_field, default=16, lo=1, hi=cap,
                      why=f"at least 1 and at most {cap} (this server's cap)")
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
    return GenerationParams(
        model=model.strip(), max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        seed=seed, stop=_stop(body.get("stop")), stream=stream, include_usage=include_usage,
        ignore_eos=_bool(body, "ignore_eos"),
    )


def _refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {', '.join(unknown)}.", param=unknown[0],
                      code="unknown_parameter")


def _must_be_default(body: dict[str, Any], name: str, default: Any) -> None:
    value = body.get(name)
    if value is None or value == default or (default is None and value in (False, {}, 0)):
        return
    raise invalid(f"{name}={value!r} is not supported by this server.", param=name, code="unsupported_parameter")


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
