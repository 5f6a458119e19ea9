"""A worker that refuses `adapter_too_large` (the adapter's pages plus the request's KV blocks exceed its whole
memory pool, so it can never run there): the client gets a 422 that says so, not a 5xx to retry, and the
refusal is on the record like any other."""
from __future__ import annotations

import json

import pytest

from gateway.models import AuditRecord
from gateway.responses import public_worker_id
from protocol.errors import ErrorCode
from protocol.jobs import GenerationResult

pytestmark = pytest.mark.django_db

# The engine's sentence (inference_worker/engine.py), as a worker would send it.
WORKER_MESSAGE = ("adapter support-bot (rank 64) takes 40 pages of this worker's memory pool; with this request's "
                  "30 KV blocks that exceeds the pool's 64 pages")


def _refuse_too_large(job, meta):
    result = GenerationResult(request_id=job.request_id, status="error", error_code=ErrorCode.ADAPTER_TOO_LARGE,
                              error_message=WORKER_MESSAGE)
    return [{"type": "final", "result": result.to_dict(), "worker_id": "w7", "attempts": 1}]


def _body(**extra) -> dict:
    return {"model": "support-bot", "prompt": "Once upon a time", "max_tokens": 4, **extra}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", _body()),
    ("/v1/chat/completions",
     {"model": "support-bot", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
])
def test_it_is_a_422_naming_the_adapter_and_what_to_change(api, post, path, body):
    api.dispatcher.answer = _refuse_too_large
    r = post(path, body, key=api.acme_secret)
    assert r.status_code == 422
    error = r.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("adapter_too_large", "invalid_request_error", "model")
    assert error["message"].startswith(WORKER_MESSAGE)  # the worker's figures reach the client
    assert "lower max_tokens" in error["message"] and "lower rank" in error["message"]
    assert r["X-Lorafleet-Worker"] == public_worker_id("w7")
    assert api.dispatcher.cancelled == []  # answered, not abandoned
    row = AuditRecord.objects.get()
    assert (row.status, row.http_status, row.error_code, row.worker_id) == ("error", 422, "adapter_too_large", "w7")


def test_a_streamed_request_gets_the_422_in_its_status_line(api, post):
    """Refused before any token: the status line still says 422, not a 200 stream with an error in it."""
    api.dispatcher.answer = _refuse_too_large
    r = post("/v1/completions", _body(stream=True), key=api.acme_secret)
    assert r.status_code == 422 and r["Content-Type"].startswith("application/json")
    assert r.json()["error"]["code"] == "adapter_too_large"
    assert AuditRecord.objects.get().http_status == 422


def test_the_schema_and_the_docs_page_list_it(api, client):
    schema = json.loads(client.get("/api/schema/", HTTP_ACCEPT="application/json").content)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "422" in schema["paths"][path]["post"]["responses"], path
    docs = client.get("/api/docs/").content.decode()
    assert "<tr><td>422</td><td><code>adapter_too_large</code>" in docs


def test_non_finite_logits_is_a_422_about_the_adapter(api, post):
    """Issue 12: an adapter whose weights overflow at its scale fails only its own request, and the caller is
    told it is the adapter to fix (a 4xx), never a 5xx that invites a retry."""
    def refuse(job, meta):
        result = GenerationResult(request_id=job.request_id, status="error", error_code=ErrorCode.NON_FINITE_LOGITS,
                                  error_message="the model produced non-finite logits (NaN or inf) for this request")
        return [{"type": "final", "result": result.to_dict(), "worker_id": "w7", "attempts": 1}]

    api.dispatcher.answer = refuse
    r = post("/v1/completions", _body(), key=api.acme_secret)
    assert r.status_code == 422
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("non_finite_logits", "model") and "lora_alpha" in error["message"]
    assert AuditRecord.objects.get().http_status == 422
