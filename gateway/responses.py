"""OpenAI's response and stream-chunk shapes, plus lorafleet's metadata (body object and X- headers).

Every answer says exactly which weights produced it: adapter, version, the sha256 the worker verified
when it loaded them, the adapter identity it served (those weights with the rank, alpha, rsLoRA and
targets that scale and place them), the base model and its hash, the request id and the worker.

The worker is named opaquely: a stable 16-hex-digit keyed hash of its id, so a caller can tell one
worker's answers from another's but never learns host names or process ids. The audit row keeps the
real worker id for staff.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import threading
import time
import weakref

from django.conf import settings

from .binding import Target

LOGPROB_FLOOR = -9999.0  # a probability that underflows to 0 has logprob -inf, which JSON cannot carry (vLLM's floor)


def public_worker_id(worker_id: str | None) -> str | None:
    """HMAC-SHA256(SECRET_KEY, worker id), first 16 hex digits; None/"" stay as they are."""
    if not worker_id:
        return worker_id
    return hmac.new(settings.SECRET_KEY.encode(), worker_id.encode(), hashlib.sha256).hexdigest()[:16]


def metadata(request_id, target: Target | None, *, weights_sha256: str | None = None, worker_id: str | None = None,
             adapter_identity: str | None = None, adapter_dtype: str | None = None) -> dict:
    """`worker_id` is the worker's real id; the metadata carries its public_worker_id(). `adapter_dtype`: how the
    worker held the adapter's weights ("float32", or "float16" / "bfloat16" from a 16-bit adapter pool)."""
    meta = {"request_id": str(request_id), "adapter": None, "version": None, "weights_sha256": weights_sha256,
            "adapter_identity": adapter_identity, "adapter_dtype": adapter_dtype, "base_model": None,
            "base_sha256": None, "worker_id": public_worker_id(worker_id)}
    if target is not None:
        meta.update(base_model=target.base.slug, base_sha256=target.base.sha256)
        if target.adapter is not None:
            meta.update(adapter=target.adapter.name, version=target.version.number)
    return meta


def served_by(source) -> dict:
    """What the worker says it served, as `metadata` keywords: from a GenerationResult, or from a reply event's
    dict (a delta, or a final event's "result")."""
    get = source.get if isinstance(source, dict) else lambda name: getattr(source, name)
    return {"weights_sha256": get("adapter_sha256"), "adapter_identity": get("adapter_identity"),
            "adapter_dtype": get("adapter_dtype")}


def metadata_headers(meta: dict) -> dict[str, str]:
    names = {"request_id": "Request-Id", "adapter": "Adapter", "version": "Version",
             "weights_sha256": "Weights-Sha256", "adapter_identity": "Adapter-Identity", "adapter_dtype": "Adapter-Dtype",
             "base_model": "Base-Model", "base_sha256": "Base-Sha256", "worker_id": "Worker"}
    return {f"X-Lorafleet-{header}": str(meta[key]) for key, header in names.items() if meta.get(key) is not None}


def usage(result) -> dict:
    """Prompt tokens once, completion tokens of every choice (the worker's completion_tokens sums them), and in
    OpenAI's `prompt_tokens_details.cached_tokens` the prompt tokens whose KV the worker's prefix cache held (a
    prefix it had read for this tenant, adapter and cache_salt before)."""
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written as -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


class TokenText:
    """Token ids as OpenAI's logprobs show them: the token's text and its bytes. A byte-level BPE token that
    holds part of a UTF-8 character has no text of its own: it shows as "bytes:\\xe2\\x80" (OpenAI's
    convention), and `bytes` carries its real bytes. With `as_ids` (return_tokens_as_token_ids, vLLM's
    extension) every token is "token_id:<id>", which maps back to the id exactly."""

    _caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer, *, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids
        with self._lock:
            self._cache = self._caches.setdefault(tokenizer, {})
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if self.as_ids:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._render(token_id)
        return got

    def _render(self, token_id: int) -> tuple[str, list[int]]:
        tok = self.tokenizer
        piece = tok.convert_ids_to_tokens(int(token_id)) if 0 <= token_id < len(tok) else None
        if piece is None:
            return "", []
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            raw = bytes(_BYTE_DECODER[c] for c in piece)
        elif (m := _BYTE_TOKEN.fullmatch(piece)) is not None:
            raw = bytes([int(m.group(1), 16)])
        else:
            raw = tok.decode([int(token_id)], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False).encode("utf-8")
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def _lp(value) -> float | None:
    return None if value is None else max(float(value), LOGPROB_FLOOR)


def chat_logprobs(entries: list[dict], token_text: TokenText) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}."""
    content = []
    for e in entries:
        text, raw = token_text(e["token"])
        top = []
        for tid, value in e.get("top") or []:
            t, b = token_text(tid)
            top.append({"token": t, "logprob": _lp(value), "bytes": b})
        content.append({"token": text, "logprob": _lp(e["logprob"]), "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[dict], token_text: TokenText, offset: int = 0) -> dict:
    """OpenAI's legacy `logprobs`: parallel lists of tokens, their logprobs, the top alternatives (with the
    chosen token always among them, so up to logprobs + 1 entries) and each token's offset in the text.
    A first prompt token (echo) has no logprob: null, as OpenAI answers."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        text, _ = token_text(e["token"])
        tokens.append(text)
        values.append(_lp(e["logprob"]))
        offsets.append(offset)
        offset += len(text)
        if e.get("top") is None:
            tops.append(None)
            continue
        top = {token_text(tid)[0]: _lp(v) for tid, v in e["top"]}
        top.setdefault(text, _lp(e["logprob"]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class Shapes:
    """Body builders for one route: `chat=True` for /v1/chat/completions.

    `token_text` renders logprobs (None when the request asked for none); `echo` is the prompt text that
    precedes each completion choice (completions with echo), `echo_logprobs` its tokens' logprob entries."""

    def __init__(self, *, chat: bool, request_id, model: str, token_text: TokenText | None = None,
                 echo: str | None = None):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + str(request_id).replace("-", "")
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.echo = echo

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, entries: list[dict] | None, *, offset: int = 0, prompt: list[dict] | None = None) -> dict | None:
        """The choice's `logprobs` object for these token entries (prompt entries first, for echo)."""
        if self.token_text is None or entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_text)
        return completion_logprobs((prompt or []) + entries, self.token_text, offset)

    def full(self, result, meta: dict) -> dict:
        choices = []
        for c in result.all_choices():
            lps = self.logprobs(c.logprobs if c.logprobs is not None else ([] if self.token_text else None),
                                prompt=result.prompt_logprobs if self.echo is not None else None)
            if self.chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "finish_reason": c.finish_reason, "logprobs": lps})
            else:
                text = (self.echo or "") + c.text
                choices.append({"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": lps})
        body = self._head("chat.completion" if self.chat else "text_completion")
        return {**body, "choices": choices, "usage": usage(result), "lorafleet": meta}

    def chunk(self, text: str, *, index: int = 0, finish_reason: str | None = None, first: bool = False,
              meta: dict | None = None, logprobs: dict | None = None) -> dict:
        """One streamed chunk of one choice. `first`: the choice's first chunk (chat: it carries the role;
        completions with echo: the caller has put the prompt in front of `text`)."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if meta is not None:
            body["lorafleet"] = meta
        return body

    def usage_chunk(self, result) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(result)}


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
