"""Prompts as the worker will see them: the chat template applied, and the context length checked
before anything is enqueued (a prompt that cannot fit is the caller's 400, not a worker's job).

The web process loads only the base's tokenizer (small, CPU, cached per base and checkpoint hash),
never its weights. Completion text is tokenized by the worker as here (`encode(text, add_special_tokens=True)`);
chat prompts travel as the template's token ids (`chat_prompt`), with message content encoded as text
(gateway/prompt_text.py), and so do completion prompts sent with `"prompt_as_text": true`.

Sizes are bounded before the tokenizer runs (gateway/input_bounds.py): a prompt whose bytes cannot fit the
context is refused without tokenizing, and tokenizing what may fit stops once it is known not to.
"""
from __future__ import annotations

import threading

from transformers import AutoTokenizer

from . import prompt_text
from .errors import ApiError, invalid
from .input_bounds import (
    MAX_MESSAGES,
    TokenizerFacts,
    TooLong,
    check_lists,
    encode_within,
    min_tokens,
    tokenizer_facts,
)
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
    """The rendered chat text and its token ids as transformers' apply_chat_template(tokenize=True) makes them,
    except that control-token strings inside a message's content are encoded as text (gateway/prompt_text.py):
    the template writes its own special tokens, so nothing is added (a template that emits BOS itself, as
    Llama-3's does, must not get a second one from the tokenizer). Refused (400 `context_length_exceeded`)
    without rendering when the contents' bytes alone cannot fit the context, and without tokenizing further
    once the tokens are known to leave no room for an answer."""
    tokenizer = tokenizer_for(base)
    if not getattr(tokenizer, "chat_template", None):
        raise invalid(f"The base model {base.slug!r} has no chat template; use /v1/completions.",
                      param="messages", code="chat_not_supported")
    if len(messages) > MAX_MESSAGES:
        raise invalid(f"messages may hold at most {MAX_MESSAGES} messages; got {len(messages)}.", param="messages")
    facts = tokenizer_facts(tokenizer)
    context = base_context(base)
    budget = context - 1  # at least one token of answer
    # A template renders every content (Llama 3's trims it): their bytes alone bound the tokens from below.
    lower = min_tokens(facts, "".join(m["content"].strip() for m in messages))
    if lower > budget:
        raise _no_room(context, lower)
    rendered = prompt_text.render(tokenizer, messages)
    ids: list[int] = []
    for segment in prompt_text.segments(facts, rendered):
        if isinstance(segment, int):
            ids.append(segment)
            continue
        try:
            ids += encode_within(facts, segment, budget - len(ids), lambda s: prompt_text.text_ids(facts, s))
        except TooLong as err:
            raise _no_room(context, len(ids) + err.tokens) from None
    if len(ids) > budget:
        raise _no_room(context, len(ids))
    return rendered.text, ids


def _no_room(context: int, tokens: int) -> ApiError:
    return invalid(f"This model's context is {context} tokens and the messages make at least {tokens}: no room "
                   f"is left for an answer. Shorten the messages.", param="messages", code="context_length_exceeded")


# What the worker assumes when a checkpoint's config names no context (inference_worker/model.py's ModelConfig).
DEFAULT_CONTEXT = 2048


def base_context(base) -> int:
    """The base's context in tokens (its config's max_position_embeddings, in the shape manifest)."""
    return int(base.shape_manifest.get("max_position_embeddings") or DEFAULT_CONTEXT)


def count_and_check(base, params: GenerationParams, *, param: str) -> int:
    """Number of prompt tokens; sets `params.max_tokens` where the caller left it open (chat without max_tokens:
    OpenAI's "until a stop or the context", i.e. the context the prompt leaves, within LORAFLEET_MAX_TOKENS_CAP
    if set); 400 `context_length_exceeded` when prompt + max_tokens cannot fit, and 400 naming max_tokens when
    it alone is beyond the context (with no cap configured, the context is the cap).

    The prompt's size is bounded before it is tokenized, and tokenizing stops once the prompt is known not to
    fit (gateway/input_bounds.py); a completion prompt sent with `prompt_as_text` is encoded here, as text, and
    travels as token ids."""
    check_lists(params)
    context = base_context(base)
    if params.max_tokens is not None and not max_tokens_cap() and params.max_tokens > context:
        # the context is the cap (a set cap is checked in params)
        raise invalid(f"{params.max_tokens_param} must be an integer, at least 1 and at most {context} (this model's "
                      f"context); got {params.max_tokens}.", param=params.max_tokens_param)
    budget = context - (params.max_tokens or 1)  # the most prompt tokens that leave room for the answer
    try:
        n = _count_prompt(base, params, budget, param=param)
    except TooLong as err:
        raise _too_long(context, err.tokens, params, param=param, at_least=not err.exact) from None
    if n > budget:
        raise _too_long(context, n, params, param=param, at_least=False)
    if params.max_tokens is None:  # chat without max_tokens: as much as the context leaves
        params.max_tokens = min(context - n, max_tokens_cap() or context)
    return n


def _count_prompt(base, params: GenerationParams, budget: int, *, param: str) -> int:
    if params.prompt_token_ids is not None:
        n = len(params.prompt_token_ids)
        if n > budget:  # before looking at a million ids one by one
            raise TooLong(n, exact=True)
        vocab = int(base.shape_manifest.get("vocab_size") or 0)
        if vocab and any(t >= vocab for t in params.prompt_token_ids):
            raise invalid(f"Prompt token ids must be below the vocabulary size {vocab}.", param=param)
        return n
    tokenizer = tokenizer_for(base)
    facts = tokenizer_facts(tokenizer)
    added = tokenizer.num_special_tokens_to_add(pair=False)  # BOS and the like, as the worker's encode adds them
    as_text = params.prompt_as_text
    encode = (lambda s: prompt_text.text_ids(facts, s)) if as_text else _encoder(facts)
    try:
        n = len(encode_within(facts, params.prompt, budget - added, encode)) + added
    except TooLong as err:
        raise TooLong(err.tokens + added, exact=err.exact) from None
    if as_text:
        params.prompt_token_ids = list(facts.text_backend.encode(params.prompt, add_special_tokens=True).ids)
        n = len(params.prompt_token_ids)
    return n


def _encoder(facts: TokenizerFacts):
    backend = facts.backend
    return lambda s: backend.encode(s, add_special_tokens=False).ids


def _too_long(context: int, n: int, params: GenerationParams, *, param: str, at_least: bool) -> ApiError:
    has = f"at least {n}" if at_least else f"{n}"
    if params.max_tokens is None:
        return invalid(f"This model's context is {context} tokens and the prompt has {has}: no room is left for an "
                       f"answer. Shorten the prompt.", param=param, code="context_length_exceeded")
    return invalid(
        f"This model's context is {context} tokens; the prompt has {has} and {params.max_tokens_param} asks for "
        f"{params.max_tokens} more. Shorten the prompt or lower {params.max_tokens_param}.",
        param=param, code="context_length_exceeded",
    )
