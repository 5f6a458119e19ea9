"""Exactly one AuditRecord per request.

A request refused before it reaches a queue (401 after the key was found, 400, 403, 404, 409, 410,
429) gets one row written final at once. A request that is enqueued gets a *pending* row, committed
before the job is published (so a worker can never answer a request that has no record), and that
row is finalised exactly once by the web process that answered — it alone knows the HTTP status the
caller saw. The update is conditional on the row still being pending, so two writers can never both
finalise it, and Postgres refuses any later change.
"""
from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field

from django.utils import timezone

from .models import AuditRecord, AuditStatus


@dataclass
class AuditDraft:
    """What the request path has learned so far; every step adds to it."""

    route: str
    request_id: uuid.UUID = field(default_factory=uuid.uuid4)
    started: float = field(default_factory=time.monotonic)
    tenant: object = None
    key_prefix: str = ""
    target: object = None  # gateway.binding.Target
    refused_adapter: object = None  # the caller's adapter when binding refused it (deleted, not ready)
    prompt_text: str | None = None
    n: int | None = None  # choices asked for, once the body is parsed
    record_id: int | None = None

    def identity(self) -> dict:
        row = {"request_id": self.request_id, "route": self.route, "tenant": self.tenant, "key_prefix": self.key_prefix,
               "n": self.n}
        target = self.target
        if target is not None:
            row.update(base_model=target.base, base_slug=target.base.slug, base_sha256=target.base.sha256)
            if target.adapter is not None:
                row.update(adapter=target.adapter, adapter_name=target.adapter.name, version=target.version,
                           version_number=target.version.number, expected_sha256=target.version.sha256)
        elif self.refused_adapter is not None:
            adapter = self.refused_adapter
            row.update(adapter=adapter, adapter_name=adapter.name, base_model=adapter.base,
                       base_slug=adapter.base.slug, base_sha256=adapter.base.sha256)
        if self.prompt_text is not None and self.tenant is not None and self.tenant.audit_store_text_hashes:
            row["prompt_sha256"] = sha256_text(self.prompt_text)
        return row

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def record_refusal(draft: AuditDraft, *, http_status: int, error_code: str, error_message: str) -> AuditRecord:
    """One final row for a request that never reached a queue; its id is noted on the draft, so that nothing
    later writes a second row for the request (gateway/request_guard.py)."""
    record = AuditRecord.objects.create(
        **draft.identity(),
        status=AuditStatus.ERROR,
        http_status=http_status,
        error_code=error_code[:50],
        error_message=error_message[:500],
        finished_at=timezone.now(),
        total_seconds=draft.elapsed(),
        logprobs_returned=False,
    )
    draft.record_id = record.pk
    return record


def open_pending(draft: AuditDraft) -> AuditRecord:
    record = AuditRecord.objects.create(**draft.identity(), status=AuditStatus.PENDING)
    draft.record_id = record.pk
    return record


def finalise(draft: AuditDraft, *, ok: bool, http_status: int, error_code: str = "", error_message: str = "",
             result=None, worker_id: str = "", attempts: int | None = None, logprobs_returned: bool = False) -> bool:
    """Finalise the pending row once; returns False if it was already final (nothing is changed).
    `logprobs_returned`: the caller got logprobs (all of them, or in a stream that broke, some)."""
    fields = {
        "logprobs_returned": bool(logprobs_returned),
        "status": AuditStatus.OK if ok else AuditStatus.ERROR,
        "http_status": http_status,
        "error_code": (error_code or "")[:50],
        "error_message": (error_message or "")[:500],
        "finished_at": timezone.now(),
        "total_seconds": draft.elapsed(),
        "worker_id": (worker_id or "")[:200],
    }
    for name, value in fields.items():
        if isinstance(value, str):  # PostgreSQL text cannot hold NUL (see AuditRecord.save)
            fields[name] = value.replace("\x00", "\ufffd")
    if attempts is not None:
        fields["attempts"] = min(attempts, 32767)
    if result is not None:
        fields.update(
            weights_sha256=result.adapter_sha256 or "",
            adapter_identity=(result.adapter_identity or "")[:64] or None,  # what the worker says it served
            adapter_dtype=(result.adapter_dtype or "")[:16],
            finish_reason=result.finish_reason or "",
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cached_tokens=max(int(result.cached_tokens or 0), 0),
            preemptions=max(int(result.preemptions or 0), 0),
            queue_seconds=result.queued_s,
            first_token_seconds=result.first_token_s,
            total_seconds=result.total_s,  # the worker's own figure; the web's end-to-end is in /metrics
        )
        if ok and draft.tenant is not None and draft.tenant.audit_store_text_hashes:
            fields["output_sha256"] = sha256_text(result.text)
    return AuditRecord.objects.filter(request_id=draft.request_id).finalise_pending(**fields) == 1
