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
import time

from django.conf import settings

from .binding import Target


def public_worker_id(worker_id: str | None) -> str | None:
    """HMAC-SHA256(SECRET_KEY, worker id), first 16 hex digits; None/"" stay as they are."""
    if not worker_id:
        return worker_id
    return hmac.new(settings.SECRET_KEY.encode(), worker_id.encode(), hashlib.sha256).hexdigest()[:16]


def metadata(request_id, target: Target | None, *, weights_sha256: str | None = None, worker_id: str | None = None,
             adapter_identity: str | None = None) -> dict:
    """`worker_id` is the worker's real id; the metadata carries its public_worker_id()."""
    meta = {"request_id": str(request_id), "adapter": None, "version": None, "weights_sha256": weights_sha256,
            "adapter_identity": adapter_identity, "base_model": None, "base_sha256": None,
            "worker_id": public_worker_id(worker_id)}
    if target is not None:
        meta.update(base_model=target.base.slug, base_sha256=target.base.sha256)
        if target.adapter is not None:
            meta.update(adapter=target.adapter.name, version=target.version.number)
    return meta


def metadata_headers(meta: dict) -> dict[str, str]:
    names = {"request_id": "Request-Id", "adapter": "Adapter", "version": "Version",
             "weights_sha256": "Weights-Sha256", "adapter_identity": "Adapter-Identity", "base_model": "Base-Model",
             "base_sha256": "Base-Sha256", "worker_id": "Worker"}
    return {f"X-Lorafleet-{header}": str(meta[key]) for key, header in names.items() if meta.get(key) is not None}


def usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


class Shapes:
    """Body builders for one route: `chat=True` for /v1/chat/completions."""

    def __init__(self, *, chat: bool, request_id, model: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + str(request_id).replace("-", "")
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, result, meta: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "finish_reason": result.finish_reason, "logprobs": None}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
            body = self._head("text_completion")
        return {**body, "choices": [choice], "usage": usage(result), "lorafleet": meta}

    def chunk(self, text: str, *, finish_reason: str | None = None, first: bool = False, meta: dict | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
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
