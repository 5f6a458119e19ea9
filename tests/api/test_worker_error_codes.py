"""A worker's error code is typed end to end (protocol.errors.ErrorCode): the client gets the code's HTTP status
and the code itself, and the audit row records the enum's value; a code the gateway does not know is an
internal_error that names it, never a silent success."""
from __future__ import annotations

import pytest

from gateway.models import AuditRecord
from inference_worker.jobs import GenerationResult
from protocol.errors import ErrorCode

pytestmark = pytest.mark.django_db


def answer_with(code: str):
    def answer(job, meta):
        result = GenerationResult(request_id=job.request_id, status="error", error_code=code, error_message="boom")
        return [{"type": "final", "result": result.to_dict(), "worker_id": "w1", "attempts": 1}]

    return answer


@pytest.mark.parametrize("code", list(ErrorCode), ids=str)
def test_every_worker_error_code_has_its_status_and_is_audited_as_is(api, post, code):
    api.dispatcher.answer = answer_with(code)
    r = post("/v1/completions", {"model": "support-bot", "prompt": "Hi", "max_tokens": 2}, key=api.acme_secret)
    assert (r.status_code, r.json()["error"]["code"]) == (code.http_status, code.value)
    assert r.json()["error"]["type"] == ("server_error" if code.http_status >= 500 else "invalid_request_error")
    row = AuditRecord.objects.get()
    assert (row.status, row.http_status, row.error_code) == ("error", code.http_status, code.value)


def test_an_unknown_worker_code_is_an_internal_error_that_names_it(api, post):
    api.dispatcher.answer = answer_with("gpu_on_fire")
    r = post("/v1/completions", {"model": "support-bot", "prompt": "Hi", "max_tokens": 2}, key=api.acme_secret)
    error = r.json()["error"]
    assert (r.status_code, error["code"]) == (500, "internal_error") and "gpu_on_fire" in error["message"]
    assert AuditRecord.objects.get().error_code == "internal_error"
