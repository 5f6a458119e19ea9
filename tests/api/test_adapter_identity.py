"""Every answer names the adapter identity the worker served (weights + rank, alpha, rsLoRA, targets); one
that names another identity — the same bytes at another scale — is refused like other weights would be."""
from __future__ import annotations

import json

import pytest

from gateway.models import AuditRecord
from protocol.jobs import GenerationResult, adapter_identity

pytestmark = pytest.mark.django_db


def body(**extra) -> dict:
    return {"model": "support-bot", "prompt": "Once upon a time", "max_tokens": 4, **extra}


def version_identity(v) -> str:
    return adapter_identity(v.sha256, v.rank, v.alpha, v.use_rslora, v.target_modules)


def answering(identity_of):
    """A worker that serves the right weights but reports `identity_of(job)` as what it served."""
    def answer(job, meta):
        result = GenerationResult(request_id=job.request_id, status="ok", text="hello there", finish_reason="stop",
                                  prompt_tokens=3, completion_tokens=2, adapter_sha256=job.adapter.sha256,
                                  adapter_identity=identity_of(job))
        events = [{"type": "delta", "text": "hello", "worker_id": "w1", "adapter_sha256": job.adapter.sha256}]
        return (events if meta["stream"] else []) + [
            {"type": "final", "result": result.to_dict(), "worker_id": "w1", "attempts": 1}]
    return answer


def test_the_answer_and_the_audit_row_name_the_identity_served(api, post):
    expected = version_identity(api.acme_v2)
    r = post("/v1/completions", body(), key=api.acme_secret)
    assert r.status_code == 200
    assert api.dispatcher.published[0].job.adapter.identity == expected
    assert r.json()["lorafleet"]["adapter_identity"] == expected
    assert r["X-Lorafleet-Adapter-Identity"] == expected
    row = AuditRecord.objects.get()
    assert (row.status, row.adapter_identity, row.weights_sha256) == ("ok", expected, api.acme_v2.sha256)


def test_a_stream_names_the_identity_in_its_last_chunk_and_on_the_record(api, post):
    expected = version_identity(api.acme_v2)
    r = post("/v1/completions", body(stream=True), key=api.acme_secret)
    assert r.status_code == 200
    raw = b"".join(r.streaming_content).decode()
    chunks = [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
    assert [c["lorafleet"]["adapter_identity"] for c in chunks if "lorafleet" in c][-1] == expected
    assert AuditRecord.objects.get().adapter_identity == expected


@pytest.mark.parametrize("served", ["another_alpha", "rslora", "fewer_targets", "missing"])
def test_the_same_weights_under_another_identity_are_refused(api, post, served):
    v = api.acme_v2
    identities = {
        "another_alpha": adapter_identity(v.sha256, v.rank, v.alpha * 2, v.use_rslora, v.target_modules),
        "rslora": adapter_identity(v.sha256, v.rank, v.alpha, not v.use_rslora, v.target_modules),
        "fewer_targets": adapter_identity(v.sha256, v.rank, v.alpha, v.use_rslora, v.target_modules[:1]),
        "missing": None,
    }
    api.dispatcher.answer = answering(lambda job: identities[served])
    r = post("/v1/completions", body(), key=api.acme_secret)
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "adapter_integrity_error" and version_identity(v) in error["message"]
    assert "choices" not in r.json()
    row = AuditRecord.objects.get()
    # the record says what the worker claimed to serve, and that the answer was refused
    assert (row.status, row.http_status, row.error_code) == ("error", 502, "adapter_integrity_error")
    assert row.adapter_identity == identities[served] and row.weights_sha256 == v.sha256

    r = post("/v1/completions", body(stream=True), key=api.acme_secret)
    raw = b"".join(r.streaming_content).decode()
    assert '"code":"adapter_integrity_error"' in raw and "[DONE]" not in raw


def test_the_base_model_has_no_adapter_identity(api, post):
    r = post("/v1/completions", body(model="base/tiny"), key=api.acme_secret)
    assert r.status_code == 200
    assert r.json()["lorafleet"]["adapter_identity"] is None and "X-Lorafleet-Adapter-Identity" not in r
    assert AuditRecord.objects.get().adapter_identity is None


def test_staff_find_a_record_by_its_identity_in_the_admin(api, post, admin_client):
    post("/v1/completions", body(), key=api.acme_secret)
    row = AuditRecord.objects.get()
    changelist = admin_client.get("/admin/gateway/auditrecord/", {"q": row.adapter_identity})
    assert changelist.status_code == 200 and str(row.request_id) in changelist.content.decode()
    assert str(row.request_id) not in admin_client.get("/admin/gateway/auditrecord/",
                                                       {"q": "f" * 64}).content.decode()
    detail = admin_client.get(f"/admin/gateway/auditrecord/{row.pk}/change/").content.decode()
    assert row.adapter_identity in detail and "w1" in detail
    assert 'name="adapter_identity"' not in detail  # read-only: shown, never an input
