"""What a client sees: OpenAI shapes, lorafleet metadata, named 400s, 429s, 5xx — and one audit row each."""
from __future__ import annotations

import json

import pytest

from gateway.models import AuditRecord
from gateway.queue import QueueUnavailable
from gateway.responses import public_worker_id
from protocol.jobs import GenerationResult

pytestmark = pytest.mark.django_db


def body(**extra) -> dict:
    return {"model": "support-bot", "prompt": "Once upon a time", "max_tokens": 4, **extra}


def sse_events(response) -> list:
    raw = b"".join(response.streaming_content).decode()
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]


def test_a_completion_says_which_weights_answered(api, post):
    r = post("/v1/completions", body(temperature=0, seed=7, stop=["\n"]), key=api.acme_secret)
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["choices"] == [{"index": 0, "text": "hello there", "finish_reason": "length", "logprobs": None}]
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    meta = data["lorafleet"]
    assert meta["adapter"] == "support-bot" and meta["version"] == 2
    assert meta["weights_sha256"] == api.acme_v2.sha256 and meta["worker_id"] == public_worker_id("w1")
    assert meta["base_model"] == "tiny" and meta["base_sha256"] == api.base.sha256
    assert r["X-Lorafleet-Weights-Sha256"] == api.acme_v2.sha256 and r["X-Lorafleet-Request-Id"] == meta["request_id"]
    job = api.dispatcher.published[0].job
    assert (job.temperature, job.seed, job.stop, job.max_tokens, job.prompt) == (0.0, 7, ["\n"], 4, "Once upon a time")
    row = AuditRecord.objects.get()
    assert str(row.request_id) == meta["request_id"]
    assert (row.status, row.http_status, row.weights_sha256, row.worker_id) == ("ok", 200, api.acme_v2.sha256, "w1")
    assert (row.prompt_tokens, row.completion_tokens, row.finish_reason, row.attempts) == (3, 2, "length", 1)
    assert row.version_id == api.acme_v2.pk and row.expected_sha256 == api.acme_v2.sha256
    assert row.prompt_sha256 == "" and row.output_sha256 == ""  # no text, not even hashes, by default


def test_a_tenant_may_keep_sha256_of_prompts_and_outputs(api, post):
    api.acme.audit_store_text_hashes = True
    api.acme.save()
    assert post("/v1/completions", body(), key=api.acme_secret).status_code == 200
    row = AuditRecord.objects.get()
    assert len(row.prompt_sha256) == 64 and len(row.output_sha256) == 64


def test_chat_uses_the_chat_template(api, post):
    r = post("/v1/chat/completions", {"model": "support-bot", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 3},
        key=api.acme_secret)
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "hello there"}
    prompt = api.dispatcher.published[0].job.prompt
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_streaming_sends_openai_chunks_with_metadata_first_and_last(api, post):
    r = post("/v1/chat/completions", {"model": "support-bot", "messages": [{"role": "user", "content": "Hi"}],
                                      "stream": True, "stream_options": {"include_usage": True}}, key=api.acme_secret)
    assert r.status_code == 200 and r["Content-Type"] == "text/event-stream"
    chunks = sse_events(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "hello"}
    assert chunks[0]["lorafleet"]["weights_sha256"] == api.acme_v2.sha256
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "hello there"
    last_choice = [c for c in chunks if c["choices"]][-1]
    assert last_choice["choices"][0]["finish_reason"] == "length"
    assert last_choice["lorafleet"]["worker_id"] == public_worker_id("w1")
    assert chunks[-1]["usage"]["total_tokens"] == 5 and chunks[-1]["choices"] == []
    assert AuditRecord.objects.get().status == "ok"


def test_a_completion_stream_has_text_chunks(api, post):
    r = post("/v1/completions", body(stream=True), key=api.acme_secret)
    chunks = sse_events(r)
    assert [c["choices"][0]["text"] for c in chunks] == ["hello", " there", ""]
    assert chunks[0]["object"] == "text_completion"


@pytest.mark.parametrize("extra, param, code", [
    ({"max_token": 5}, "max_token", "unknown_parameter"),
    ({"max_tokens": 10**6}, "max_tokens", "invalid_parameter"),
    ({"max_tokens": 0}, "max_tokens", "invalid_parameter"),
    ({"temperature": 3}, "temperature", "invalid_parameter"),
    ({"top_p": 0}, "top_p", "invalid_parameter"),
    ({"n": 9}, "n", "invalid_parameter"),
    ({"best_of": 3}, "best_of", "unsupported_parameter"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_parameter"),
    ({"prompt": ""}, "prompt", "invalid_parameter"),
    ({"prompt": ["a", "b"]}, "prompt", "invalid_parameter"),
    ({"prompt": "word " * 200}, "prompt", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": 128}, "prompt", "context_length_exceeded"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_parameter"),
])
def test_invalid_parameters_are_named(api, post, extra, param, code):
    r = post("/v1/completions", body(**extra), key=api.acme_secret)
    assert r.status_code == 400, r.content
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == code
    assert not api.dispatcher.published
    row = AuditRecord.objects.get()
    assert (row.http_status, row.error_code, row.tenant_id) == (400, code, api.acme.pk)


def test_a_body_that_is_not_json_is_a_400(api, client):
    r = client.post("/v1/completions", data="{nope", content_type="application/json",
                    HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_requests_per_minute_are_limited_with_retry_after(api, post):
    api.acme.requests_per_minute = 2
    api.acme.save()
    codes = [post("/v1/completions", body(), key=api.acme_secret).status_code for _ in range(3)]
    assert codes[:2] == [200, 200] or codes[0] == 429  # a minute boundary may fall between them
    r = post("/v1/completions", body(), key=api.acme_secret)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r["Retry-After"]) <= 60
    assert post("/v1/completions", body(), key=api.globex_secret).status_code == 200  # per tenant
    assert AuditRecord.objects.filter(http_status=429, tenant=api.acme).exists()


def test_concurrent_requests_are_limited(api, post):
    from gateway.limits import TenantSlot

    api.acme.max_concurrent_requests = 1
    api.acme.save()
    with TenantSlot(api.acme):  # one request of acme in flight
        r = post("/v1/completions", body(), key=api.acme_secret)
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert r["Retry-After"] == "1"
    assert post("/v1/completions", body(), key=api.acme_secret).status_code == 200


def test_a_broker_that_is_down_is_a_503_on_the_record(api, post):
    api.dispatcher.publish_error = QueueUnavailable("connection refused")
    r = post("/v1/completions", body(), key=api.acme_secret)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_unavailable"
    row = AuditRecord.objects.get()
    assert (row.status, row.http_status, row.error_code) == ("error", 503, "queue_unavailable")


def test_no_reply_in_time_is_a_504_on_the_record_and_the_job_is_cancelled(api, post):
    api.dispatcher.answer = lambda job, meta: None
    r = post("/v1/completions", body(), key=api.acme_secret, HTTP_X_LORAFLEET_TIMEOUT="0.2")
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    row = AuditRecord.objects.get()
    assert (row.http_status, row.error_code) == (504, "timeout")
    assert api.dispatcher.cancelled == [str(row.request_id)]
    assert api.dispatcher.published[0].expires_s == pytest.approx(0.2)


@pytest.mark.parametrize("code, status", [("adapter_integrity_error", 502), ("adapter_load_failed", 502),
                                          ("worker_lost", 502), ("prompt_too_long", 400)])
def test_worker_failures_keep_their_code(api, post, code, status):
    def fail(job, meta):
        result = GenerationResult(request_id=job.request_id, status="error", error_code=code, error_message="boom")
        return [{"type": "final", "result": result.to_dict(), "worker_id": "w9", "attempts": 2}]

    api.dispatcher.answer = fail
    r = post("/v1/completions", body(), key=api.acme_secret)
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert r["X-Lorafleet-Worker"] == public_worker_id("w9")
    row = AuditRecord.objects.get()
    assert (row.http_status, row.error_code, row.worker_id, row.attempts) == (status, code, "w9", 2)


def test_an_answer_from_other_weights_is_never_passed_off(api, post):
    def wrong(job, meta):
        result = GenerationResult(request_id=job.request_id, status="ok", text="x", finish_reason="stop",
                                  adapter_sha256="f" * 64)
        return [{"type": "final", "result": result.to_dict(), "worker_id": "w1", "attempts": 1}]

    api.dispatcher.answer = wrong
    r = post("/v1/completions", body(), key=api.acme_secret)
    assert r.status_code == 502 and r.json()["error"]["code"] == "adapter_integrity_error"


def test_metrics_schema_and_docs(api, post, client, settings):
    settings.LORAFLEET_METRICS_TENANT_LABELS = True
    post("/v1/completions", body(), key=api.acme_secret)
    text = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.LORAFLEET_METRICS_TOKEN}").content.decode()
    assert 'lorafleet_http_requests_total{route="completions",status="200",tenant="acme"}' in text
    assert "lorafleet_http_request_duration_seconds_bucket" in text
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert schema.status_code == 200
    paths = json.loads(schema.content)["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(paths)
    request_body = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert request_body["$ref"].endswith("/CompletionRequest")
    assert paths["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    page = docs.content.decode()
    assert "/v1/chat/completions" in page and "adapter_not_found" in page and "max_tokens" in page
    assert "<script" not in page  # nothing to fetch from a CDN: readable offline


def test_rows_left_pending_by_a_dead_web_process_are_closed_once(api):
    from django.core.management import call_command
    from django.utils import timezone

    old = AuditRecord.objects.create(route="completions", tenant=api.acme,
                                     created_at=timezone.now() - timezone.timedelta(hours=1))
    fresh = AuditRecord.objects.create(route="completions", tenant=api.acme)
    call_command("close_abandoned_audit")
    old.refresh_from_db()
    fresh.refresh_from_db()
    assert (old.status, old.error_code) == ("error", "abandoned") and fresh.status == "pending"


def test_a_bug_is_a_500_in_openai_shape_and_the_row_is_still_final(api, post):
    api.dispatcher.answer = lambda job, meta: RuntimeError("bug")
    r = post("/v1/completions", body(), key=api.acme_secret)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    row = AuditRecord.objects.get()
    assert (row.status, row.http_status, row.error_code) == ("error", 500, "internal_error")


def test_wrong_method_and_event_stream_accept_headers_keep_the_openai_shape(api, client, post):
    r = client.get("/v1/completions", HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = post("/v1/completions", body(stream=True), key=api.acme_secret, HTTP_ACCEPT="text/event-stream")
    assert r.status_code == 200 and r["Content-Type"] == "text/event-stream"


def test_text_no_tokenizer_can_encode_is_a_400(api, client):
    raw = '{"model": "support-bot", "prompt": "bad \\ud800 text"}'
    r = client.post("/v1/completions", data=raw, content_type="application/json",
                    HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_unknown_v1_routes_answer_json(api, client):
    for path in ("/v1/nothing", "/v1/models/a%0Ab", "/v1/completions/extra"):
        r = client.get(path, HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path


def test_a_stream_that_fails_after_it_started_says_so_in_band_and_on_the_record(api, post):
    def fail_midway(job, meta):
        result = GenerationResult(request_id=job.request_id, status="error", error_code="internal_error",
                                  error_message="engine failed")
        return [{"type": "delta", "text": "hel", "worker_id": "w1", "adapter_sha256": job.adapter.sha256},
                {"type": "final", "result": result.to_dict(), "worker_id": "w1", "attempts": 1}]

    api.dispatcher.answer = fail_midway
    r = post("/v1/completions", body(stream=True), key=api.acme_secret)
    assert r.status_code == 200  # the status line went out with the first token
    raw = b"".join(r.streaming_content).decode()
    events = [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == "hel"
    assert events[-1]["error"]["code"] == "internal_error" and "[DONE]" not in raw
    row = AuditRecord.objects.get()
    assert (row.status, row.error_code) == ("error", "internal_error")


# Closing a response sends request_finished, which (as in production) closes the database connection;
# inside a rolled-back test transaction that would lose the transaction, so this test commits for real.
@pytest.mark.django_db(transaction=True)
def test_a_client_that_leaves_mid_stream_is_recorded_and_its_job_cancelled(api, post):
    r = post("/v1/completions", body(stream=True), key=api.acme_secret)
    next(iter(r.streaming_content))  # the first chunk, then the client goes away
    r.close()
    row = AuditRecord.objects.get()
    assert (row.status, row.error_code) == ("error", "client_disconnected")
    assert api.dispatcher.cancelled == [str(row.request_id)]
