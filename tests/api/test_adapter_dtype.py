"""Every answer says how the worker held the adapter's weights (float32, or 16-bit from a worker started with
--adapter-dtype), and the audit row keeps it: a 16-bit pool applies rounded weights, and "which weights produced
this response?" must be answerable from the record alone."""
from __future__ import annotations

import json

import pytest

from gateway.models import AuditRecord
from protocol.jobs import GenerationResult

pytestmark = pytest.mark.django_db


def body(**extra) -> dict:
    return {"model": "support-bot", "prompt": "Once upon a time", "max_tokens": 4, **extra}


def holding(dtype):
    """A worker whose adapter pool holds weights in `dtype` (None for the base model's requests)."""
    def answer(job, meta):
        held = dtype if job.adapter is not None else None
        result = GenerationResult(request_id=job.request_id, status="ok", text="hello there", finish_reason="stop",
                                  prompt_tokens=3, completion_tokens=2,
                                  adapter_sha256=job.adapter.sha256 if job.adapter else None,
                                  adapter_identity=job.adapter.identity if job.adapter else None, adapter_dtype=held)
        events = [{"type": "delta", "text": "hello", "worker_id": "w1",
                   "adapter_sha256": job.adapter.sha256 if job.adapter else None, "adapter_dtype": held}]
        return (events if meta["stream"] else []) + [
            {"type": "final", "result": result.to_dict(), "worker_id": "w1", "attempts": 1}]
    return answer


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_answer_and_the_audit_row_say_how_the_adapter_was_held(api, post, dtype):
    api.dispatcher.answer = holding(dtype)
    r = post("/v1/completions", body(), key=api.acme_secret)
    assert r.status_code == 200
    assert r.json()["lorafleet"]["adapter_dtype"] == dtype == r["X-Lorafleet-Adapter-Dtype"]
    row = AuditRecord.objects.get()
    assert (row.status, row.adapter_dtype, row.weights_sha256) == ("ok", dtype, api.acme_v2.sha256)


def test_a_stream_says_it_in_its_first_chunk_and_on_the_record(api, post):
    api.dispatcher.answer = holding("float16")
    r = post("/v1/completions", body(stream=True), key=api.acme_secret)
    assert r.status_code == 200 and r["X-Lorafleet-Adapter-Dtype"] == "float16"
    raw = b"".join(r.streaming_content).decode()
    chunks = [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
    named = [c["lorafleet"]["adapter_dtype"] for c in chunks if "lorafleet" in c]
    assert named and set(named) == {"float16"}
    assert AuditRecord.objects.get().adapter_dtype == "float16"


def test_the_base_model_and_a_refusal_name_no_adapter_dtype(api, post):
    api.dispatcher.answer = holding("float16")
    r = post("/v1/completions", body(model="base/tiny"), key=api.acme_secret)
    assert r.status_code == 200
    assert r.json()["lorafleet"]["adapter_dtype"] is None and "X-Lorafleet-Adapter-Dtype" not in r
    assert AuditRecord.objects.get().adapter_dtype == ""
    assert post("/v1/completions", body(model="no-such-adapter"), key=api.acme_secret).status_code == 404
    assert AuditRecord.objects.order_by("-id").first().adapter_dtype == ""


def test_the_dashboard_and_the_admin_show_a_16_bit_adapter(api, post, client, admin_client):
    for dtype in ("float32", "float16"):
        api.dispatcher.answer = holding(dtype)
        assert post("/v1/completions", body(), key=api.acme_secret).status_code == 200
    assert client.login(username="alice", password="alice-password-1")
    page = client.get("/audit/").content.decode()
    assert page.count(">float16</span>") == 1 and ">float32</span>" not in page  # only the rounded one is flagged
    fp16 = AuditRecord.objects.get(adapter_dtype="float16")
    listed = admin_client.get("/admin/gateway/auditrecord/", {"adapter_dtype": "float16"}).content.decode()
    assert str(fp16.request_id) in listed
    assert str(AuditRecord.objects.get(adapter_dtype="float32").request_id) not in listed
    detail = admin_client.get(f"/admin/gateway/auditrecord/{fp16.pk}/change/").content.decode()
    assert "float16" in detail and 'name="adapter_dtype"' not in detail  # read-only: shown, never an input
