"""The last line of "exactly one audit row per request" (issue 47): a request that fails in a way nobody
planned for — a bug, a library raising deep in the request path — is still answered 500 `internal_error`
in our own words, and still leaves its one row.

serving.py's guard around the whole request path calls `close_failed` with the answer it is about to give:
the pending row is finalised if the request had one; otherwise a final row is written now (also when the
failure came before the key was known: the row then names no tenant). A row that is already final is
left as it is (gateway/audit.py: `record_refusal` notes its id on the draft, `finalise` changes only a
pending row), so the guard can never add a second row. It never raises: the answer goes out whatever the
database says, and a row it could not write is in the log.
"""
from __future__ import annotations

import logging

from django.utils import timezone

from . import audit
from .errors import ApiError
from .models import AuditRecord, AuditStatus

log = logging.getLogger(__name__)


def close_failed(draft: audit.AuditDraft, err: ApiError, *, http_status: int | None = None) -> None:
    """The request's one row, final with `err` (its HTTP status, or `http_status` when the status line has
    already gone out, as in a stream)."""
    status = err.status if http_status is None else http_status
    try:
        if draft.record_id is not None:
            audit.finalise(draft, ok=False, http_status=status, error_code=err.code, error_message=err.audit_text)
            return
        try:
            audit.record_refusal(draft, http_status=status, error_code=err.code, error_message=err.audit_text)
        except Exception:  # what the draft knows may be what failed: the row with what is certain
            log.exception("full audit row for %s failed; writing the minimal one", draft.request_id)
            record = AuditRecord.objects.create(
                request_id=draft.request_id, route=draft.route, tenant=draft.tenant, key_prefix=draft.key_prefix,
                status=AuditStatus.ERROR, http_status=status, error_code=err.code[:50],
                error_message=err.audit_text[:500], finished_at=timezone.now(), total_seconds=draft.elapsed(),
                logprobs_returned=False,
            )
            draft.record_id = record.pk
    except Exception:
        log.exception("the audit row of %s could not be written", draft.request_id)
