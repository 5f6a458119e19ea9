"""Prompts as the worker will see them: the chat template applied, and the context length checked
before anything is enqueued (a prompt that cannot fit is the caller's 400, not a worker's job).

The web process loads only the base's tokenizer (small, CPU, cached per base and checkpoint hash),
never its weights. Completion text is tokenized by the worker as here (`encode(text, add_special_tokens=True)`);
chat prompts travel as the template's token ids (`chat_prompt`).
"""
from __future__ import annotations

import threading

from transformers import AutoTokenizer

from .errors import ApiError, invalid
from .params import GenerationParams, max_tokens_cap

_lock = threading.Lock()
_tokenizers: dict[tuple[str, str], object] = {}


def tokenizer_for(base):
    key = (base.checkpoint_path, base.sha256)
    tokenizer = _tokenizers.get(key)
    if tokenizer is None:
        with _lock:
            tokenizer = _tokenizers.get(key)
            if tokenizer is None:
                try:
                    tokenizer = AutoTokenizer.from_pretrained(base.checkpoint_path)
                except (OSError, ValueError) as exc:
                    raise ApiError(500, "base_model_unavailable",
                                   f"The tokenizer of base model {base.slug!r} cannot be loaded here.",
                                   type="server_error") from exc
                _tokenizers[key] = tokenizer
    return tokenizer


def chat_prompt(base, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """The rendered chat text and its token ids exactly as transformers' apply_chat_template(tokenize=True)
    makes them: the template writes its own special tokens, so nothing is added (a template that emits BOS
    itself, as Llama-3's does, must not get a second one from the tokenizer)."""
    tokenizer = tokenizer_for(base)
    if not getattr(tokenizer, "chat_template", None):
        raise invalid(f"The base model {base.slug!r} has no chat template; use /v1/completions.",
                      param="messages", code="chat_not_supported")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, list(tokenizer.encode(text, add_special_tokens=False))


# What the worker assumes when a checkpoint's config names no context (inference_worker/model.py's ModelConfig).
DEFAULT_CONTEXT = 2048


def base_context(base) -> int:
    """The base's context in tokens (its config's max_position_embeddings, in the shape manifest)."""
    return int(base.shape_manifest.get("max_position_embeddings") or DEFAULT_CONTEXT)


def count_and_check(base, params: GenerationParams, *, param: str) -> int:
    """Number of prompt tokens; sets `params.max_tokens` where the caller left it open (chat without max_tokens:
    OpenAI's "until a stop or the context", i.e. the context the prompt leaves, within LORAFLEET_MAX_TOKENS_CAP
    if set); 400 `context_length_exceeded` when prompt + max_tokens cannot fit, and 400 naming max_tokens when
    it alone is beyond the context (with no cap configured, the context is the cap)."""
    if params.prompt_token_ids is not None:
        n = len(params.prompt_token_ids)
        vocab = int(base.shape_manifest.get("vocab_size") or 0)
        if vocab and any(t >= vocab for t in params.prompt_token_ids):
            raise invalid(f"Prompt token ids must be below the vocabulary size {vocab}.", param=param)
    else:
        n = len(tokenizer_for(base).encode(params.prompt, add_special_tokens=True))
    context = base_context(base)
    if params.max_tokens is None:  # chat without max_tokens: as much as the context leaves
        if n >= context:
            raise invalid(f"This model's context is {context} tokens and the prompt has {n}: no room is left for an "
                          f"answer. Shorten the prompt.", param=param, code="context_length_exceeded")
        params.max_tokens = min(context - n, max_tokens_cap() or context)
        return n
    if not max_tokens_cap() and params.max_tokens > context:  # the context is the cap (a set cap is checked in params)
        raise invalid(f"{params.max_tokens_param} must be an integer, at least 1 and at most {context} (this model's "
                      f"context); got {params.max_tokens}.", param=params.max_tokens_param)
    if n + params.max_tokens > context:
        raise invalid(
            f"This model's context is {context} tokens; the prompt has {n} and {params.max_tokens_param} asks for "
            f"{params.max_tokens} more. Shorten the prompt or lower {params.max_tokens_param}.",
            param=param, code="context_length_exceeded",
        )
    return n
