"""A worker's error code is typed end to end (protocol.errors.ErrorCode): the client gets the code's HTTP status
and the code itself, and the audit row records the enum's value; a code the gateway does not know is an
internal_error that names it, never a silent success."""
from __future__ import annotations

import pytest

from gateway.models import AuditRecord
from protocol.errors import ErrorCode
from protocol.jobs import GenerationResult, JobMeta

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


def test_the_gateway_publishes_the_jobs_meta_as_protocol_builds_it(api, post, settings):
    settings.LORAFLEET_MAX_ATTEMPTS = 2
    post("/v1/completions", {"model": "support-bot", "prompt": "Hi", "max_tokens": 2, "stream": True},
         key=api.acme_secret)
    sent = api.dispatcher.published[0].meta
    meta = JobMeta.from_dict(sent)
    assert sent == meta.to_dict()  # exactly the fields JobMeta defines, nothing read with .get on the other side
    assert (meta.stream, meta.base_slug, meta.base_sha256, meta.max_attempts) == (True, "tiny", api.base.sha256, 2)
    assert meta.deadline is not None
