"""Bodies that used to be a 500 are named 4xx answers, on the record; the worker is named opaquely."""
from __future__ import annotations

import json
import re

import pytest

from gateway.models import AuditRecord
from gateway.responses import public_worker_id
from protocol.jobs import GenerationResult

pytestmark = pytest.mark.django_db


def body(**extra) -> dict:
    return {"model": "support-bot", "prompt": "Once upon a time", "max_tokens": 4, **extra}


def test_a_hundred_thousand_deep_json_field_is_a_400_invalid_json(api, client):
    depth = 100_000
    raw = '{"model": "support-bot", "max_tokens": 4, "prompt": ' + "[" * depth + "]" * depth + "}"
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, data=raw, content_type="application/json",
                        HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}")
        assert r.status_code == 400, r.content[:200]
        assert r.json()["error"]["code"] == "invalid_json"
    assert not api.dispatcher.published
    assert list(AuditRecord.objects.values_list("http_status", "error_code")) == [(400, "invalid_json")] * 2


def test_a_body_over_the_web_limit_is_a_413_request_too_large(api, client, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 64 * 1024
    raw = json.dumps(body(prompt="x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1)))
    r = client.post("/v1/completions", data=raw, content_type="application/json",
                    HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}")
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and str(settings.DATA_UPLOAD_MAX_MEMORY_SIZE) in error["message"]
    assert r["X-Lorafleet-Request-Id"]
    row = AuditRecord.objects.get()
    assert (row.http_status, row.error_code, row.tenant_id) == (413, "request_too_large", api.acme.pk)
    assert not api.dispatcher.published
    assert client.post("/v1/completions", data=json.dumps(body()), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}").status_code == 200


def test_the_worker_is_named_by_an_opaque_stable_id_and_the_audit_keeps_the_real_one(api, post):
    real = {"first": "tiny@gpu-host-07.internal:4242", "second": "tiny@gpu-host-08.internal:77"}

    def answer_from(worker_id):
        def answer(job, meta):
            result = GenerationResult(request_id=job.request_id, status="ok", text="hi", finish_reason="stop",
                                      adapter_sha256=job.adapter.sha256, adapter_identity=job.adapter.identity)
            events = [{"type": "delta", "text": "hi", "worker_id": worker_id, "adapter_sha256": job.adapter.sha256}]
            return (events if meta["stream"] else []) + [
                {"type": "final", "result": result.to_dict(), "worker_id": worker_id, "attempts": 1}]
        return answer

    shown = {}
    for name, worker_id in real.items():
        api.dispatcher.answer = answer_from(worker_id)
        r = post("/v1/completions", body(), key=api.acme_secret)
        assert r.status_code == 200
        shown[name] = r["X-Lorafleet-Worker"]
        assert r.json()["lorafleet"]["worker_id"] == shown[name]
        assert re.fullmatch(r"[0-9a-f]{16}", shown[name])
        assert "gpu-host" not in r.content.decode() and "4242" not in shown[name]
        streamed = post("/v1/completions", body(stream=True), key=api.acme_secret)
        raw = b"".join(streamed.streaming_content).decode()
        assert streamed["X-Lorafleet-Worker"] == shown[name] and "gpu-host" not in raw
    assert shown["first"] != shown["second"]  # stable per worker, distinct between workers
    assert shown["first"] == public_worker_id(real["first"])
    rows = AuditRecord.objects.order_by("created_at", "id").values_list("worker_id", flat=True)
    assert list(rows) == [real["first"]] * 2 + [real["second"]] * 2  # staff see the real worker


def test_the_opaque_worker_id_depends_on_the_secret_key(settings):
    first = public_worker_id("tiny@host:1")
    settings.SECRET_KEY = "another-secret-key-" + "x" * 40
    assert public_worker_id("tiny@host:1") != first
    assert public_worker_id(None) is None and public_worker_id("") == ""
