"""Issue 46 through the gateway: a tenant's share weight and the request's cache_salt travel in the job; the prefix
cache's reuse (cached_tokens) and the worker's preemptions come back in usage, the audit row and /metrics; chat
without max_tokens generates until a stop or the context (OpenAI's default), completions keep 16."""
from __future__ import annotations

import json

import pytest
from django.db import DatabaseError, transaction

from gateway.models import AuditRecord
from gateway.prompts import base_context, chat_prompt
from protocol.jobs import GenerationResult

pytestmark = pytest.mark.django_db

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def chat_body(**extra) -> dict:
    return {"model": "support-bot", "messages": MESSAGES, **extra}


def completion_body(**extra) -> dict:
    return {"model": "support-bot", "prompt": "Once upon a time", **extra}


def sse_events(response) -> list:
    raw = b"".join(response.streaming_content).decode()
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]


def reusing(cached: int, preemptions: int = 0, prompt_tokens: int = 12):
    """A worker whose prefix cache held `cached` of the prompt's tokens, and that preempted the request
    `preemptions` times."""
    def answer(job, meta):
        result = GenerationResult(
            request_id=job.request_id, status="ok", text="hello there", token_ids=[5, 6], finish_reason="stop",
            prompt_tokens=prompt_tokens, completion_tokens=2, adapter_sha256=job.adapter.sha256,
            adapter_identity=job.adapter.identity, cached_tokens=cached, preemptions=preemptions)
        events = [{"type": "delta", "text": "hello", "worker_id": "w1", "adapter_sha256": job.adapter.sha256},
                  {"type": "delta", "text": " there", "worker_id": "w1", "adapter_sha256": job.adapter.sha256}]
        return (events if meta["stream"] else []) + [
            {"type": "final", "result": json.loads(json.dumps(result.to_dict())), "worker_id": "w1", "attempts": 1}]
    return answer


# --- the tenant's share weight ------------------------------------------------------------------------------


def test_a_job_carries_its_tenants_share_weight(api, post):
    api.acme.share_weight = 3
    api.acme.save()
    assert post(CHAT, chat_body(max_tokens=4), key=api.acme_secret).status_code == 200
    assert post(COMPLETIONS, completion_body(), key=api.globex_secret).status_code == 200
    acme_job, globex_job = (p.job for p in api.dispatcher.published)
    assert acme_job.tenant == str(api.acme.pk) and acme_job.tenant_weight == 3.0
    assert globex_job.tenant == str(api.globex.pk) and globex_job.tenant_weight == 1.0  # the default: equal shares
    # and it survives the trip to the worker, which reads the job back from JSON
    assert type(acme_job).from_dict(json.loads(json.dumps(acme_job.to_dict()))).tenant_weight == 3.0


# --- cache_salt ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [(CHAT, chat_body()), (COMPLETIONS, completion_body())])
def test_cache_salt_travels_in_the_job(api, post, path, body):
    assert post(path, {**body, "cache_salt": "end-user-42"}, key=api.acme_secret).status_code == 200
    assert post(path, body, key=api.acme_secret).status_code == 200
    salted, plain = (p.job for p in api.dispatcher.published)
    assert (salted.cache_salt, plain.cache_salt) == ("end-user-42", "")


@pytest.mark.parametrize("path, body", [(CHAT, chat_body()), (COMPLETIONS, completion_body())])
@pytest.mark.parametrize("salt", ["s" * 257, "", 42, ["a"], "\ud800"])
def test_a_cache_salt_that_is_not_a_short_string_is_a_400_naming_it(api, post, path, body, salt):
    r = post(path, {**body, "cache_salt": salt}, key=api.acme_secret)
    assert r.status_code == 400, r.content
    assert r.json()["error"]["param"] == "cache_salt" and r.json()["error"]["code"] == "invalid_parameter"
    assert not api.dispatcher.published
    row = AuditRecord.objects.get()
    assert (row.http_status, row.error_code) == (400, "invalid_parameter")


def test_a_cache_salt_of_256_characters_is_accepted(api, post):
    assert post(CHAT, chat_body(cache_salt="s" * 256), key=api.acme_secret).status_code == 200
    assert api.dispatcher.published[0].job.cache_salt == "s" * 256


# --- cached tokens and preemptions: usage, the audit row, /metrics ----------------------------------------------


@pytest.mark.parametrize("path, body", [(CHAT, chat_body()), (COMPLETIONS, completion_body())])
def test_cached_tokens_are_in_usage_and_on_the_record(api, post, path, body):
    api.dispatcher.answer = reusing(cached=7, preemptions=2)
    r = post(path, body, key=api.acme_secret)
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 7}
    assert (usage["prompt_tokens"], usage["total_tokens"]) == (12, 14)  # cached tokens are still prompt tokens
    row = AuditRecord.objects.get(request_id=r.json()["lorafleet"]["request_id"])
    assert (row.status, row.prompt_tokens, row.cached_tokens, row.preemptions) == ("ok", 12, 7, 2)


@pytest.mark.parametrize("path, body", [(CHAT, chat_body()), (COMPLETIONS, completion_body())])
def test_a_streams_usage_chunk_says_how_many_prompt_tokens_were_cached(api, post, path, body):
    api.dispatcher.answer = reusing(cached=7, preemptions=1)
    r = post(path, {**body, "stream": True, "stream_options": {"include_usage": True}}, key=api.acme_secret)
    assert r.status_code == 200
    chunks = sse_events(r)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
    row = AuditRecord.objects.get()
    assert (row.status, row.cached_tokens, row.preemptions) == ("ok", 7, 1)


def test_without_a_cache_hit_usage_says_zero_and_refusals_record_zero(api, post):
    r = post(CHAT, chat_body(), key=api.acme_secret)
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert post(CHAT, chat_body(model="no-such-adapter"), key=api.acme_secret).status_code == 404
    assert list(AuditRecord.objects.order_by("id").values_list("cached_tokens", "preemptions")) == [(0, 0), (0, 0)]


def test_metrics_count_prompt_tokens_and_cached_prompt_tokens(api, post, client, settings):
    def scraped() -> dict[str, float]:
        text = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.LORAFLEET_METRICS_TOKEN}").content.decode()
        return {name: next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                            if line.startswith(f'{name}{{base="tiny"}} ')), 0.0)
                for name in ("lorafleet_prompt_tokens_total", "lorafleet_prompt_tokens_cached_total")}

    before = scraped()
    api.dispatcher.answer = reusing(cached=7, prompt_tokens=12)
    assert post(CHAT, chat_body(), key=api.acme_secret).status_code == 200
    api.dispatcher.answer = reusing(cached=0, prompt_tokens=5)
    streamed = post(COMPLETIONS, completion_body(stream=True), key=api.acme_secret)
    assert streamed.status_code == 200 and sse_events(streamed)  # a stream counts once it has ended
    after = scraped()
    assert after["lorafleet_prompt_tokens_total"] - before["lorafleet_prompt_tokens_total"] == 17
    assert after["lorafleet_prompt_tokens_cached_total"] - before["lorafleet_prompt_tokens_cached_total"] == 7


def test_the_audit_admin_shows_cached_tokens_and_preemptions(api, post, admin_client):
    api.dispatcher.answer = reusing(cached=7, preemptions=3)
    assert post(CHAT, chat_body(), key=api.acme_secret).status_code == 200
    row = AuditRecord.objects.get()
    listed = admin_client.get("/admin/gateway/auditrecord/").content.decode()
    assert "column-cached_tokens" in listed and "column-preemptions" in listed
    detail = admin_client.get(f"/admin/gateway/auditrecord/{row.pk}/change/").content.decode()
    assert "Cached tokens" in detail and "Preemptions" in detail
    assert 'name="cached_tokens"' not in detail  # read-only: shown, never an input
    exported = admin_client.get("/admin/gateway/auditrecord/csv/")
    lines = b"".join(exported.streaming_content).decode().splitlines()
    header, values = lines[0].split(","), lines[1].split(",")
    assert values[header.index("cached_tokens")] == "7" and values[header.index("preemptions")] == "3"


def _raw(connection, sql, params=()):
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)


def test_postgres_keeps_a_final_rows_cached_tokens_and_preemptions(world, postgres):
    """The append-only trigger covers the new columns: set once when the row is finalised, never after."""
    record = AuditRecord.objects.create(route="/v1/chat/completions", tenant=world.acme)
    _raw(postgres, "UPDATE gateway_auditrecord SET status = 'ok', cached_tokens = 7, preemptions = 2 WHERE id = %s",
         [record.pk])
    for column in ("cached_tokens", "preemptions"):
        with pytest.raises(DatabaseError, match="final"):
            _raw(postgres, f"UPDATE gateway_auditrecord SET {column} = 0 WHERE id = %s", [record.pk])
    assert AuditRecord.objects.values_list("cached_tokens", "preemptions").get(pk=record.pk) == (7, 2)


def test_a_row_inserted_without_the_new_columns_reads_zero(world, postgres):
    """A web process of the previous release, still running during a deploy, inserts rows that know nothing of
    them: the database's default fills them in."""
    _raw(postgres, "INSERT INTO gateway_auditrecord (request_id, created_at, route, key_prefix, adapter_name, "
         "expected_sha256, weights_sha256, adapter_dtype, base_slug, base_sha256, worker_id, status, error_code, "
         "error_message, finish_reason, attempts, prompt_sha256, output_sha256) VALUES (gen_random_uuid(), now(), "
         "'/v1/completions', '', '', '', '', '', '', '', '', 'pending', '', '', '', 0, '', '')")
    assert AuditRecord.objects.values_list("cached_tokens", "preemptions").get() == (0, 0)


# --- max_tokens: OpenAI's chat default -----------------------------------------------------------------------


def prompt_ids(api, messages) -> list[int]:
    return chat_prompt(api.base, messages)[1]


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(api, post, settings):
    assert settings.LORAFLEET_MAX_TOKENS_CAP == 0  # the default: the base's context is the cap
    context = base_context(api.base)
    assert context == 128  # the tiny checkpoint of these tests
    assert post(CHAT, chat_body(), key=api.acme_secret).status_code == 200
    assert api.dispatcher.published[-1].job.max_tokens == context - len(prompt_ids(api, MESSAGES))
    assert post(CHAT, chat_body(stream=True), key=api.acme_secret).status_code == 200
    assert api.dispatcher.published[-1].job.max_tokens == context - len(prompt_ids(api, MESSAGES))


def test_chat_without_max_tokens_is_not_refused_for_a_prompt_near_the_context(api, post):
    """The old default of 16 made prompt + 16 > context a 400; now the answer gets what the prompt leaves."""
    context = base_context(api.base)
    words = next(k for k in range(1, 400) if len(prompt_ids(api, [{"role": "user", "content": "word " * k}])) > context - 16)
    messages = [{"role": "user", "content": "word " * words}]
    n = len(prompt_ids(api, messages))
    assert context - 16 < n < context
    r = post(CHAT, chat_body(messages=messages), key=api.acme_secret)
    assert r.status_code == 200, r.content
    assert api.dispatcher.published[-1].job.max_tokens == context - n
    # a prompt that leaves no room at all is still the caller's 400
    full = [{"role": "user", "content": "word " * (words + 40)}]
    r = post(CHAT, chat_body(messages=full), key=api.acme_secret)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"


def test_explicit_max_tokens_and_max_completion_tokens_are_kept(api, post):
    assert post(CHAT, chat_body(max_tokens=5), key=api.acme_secret).status_code == 200
    assert post(CHAT, chat_body(max_completion_tokens=6), key=api.acme_secret).status_code == 200
    assert [p.job.max_tokens for p in api.dispatcher.published] == [5, 6]


def test_completions_keep_their_default_of_16(api, post):
    assert post(COMPLETIONS, completion_body(), key=api.acme_secret).status_code == 200
    assert post(COMPLETIONS, completion_body(stream=True), key=api.acme_secret).status_code == 200
    assert [p.job.max_tokens for p in api.dispatcher.published] == [16, 16]


@pytest.mark.parametrize("path, body, field", [(CHAT, chat_body(), "max_tokens"),
                                               (CHAT, chat_body(), "max_completion_tokens"),
                                               (COMPLETIONS, completion_body(), "max_tokens")])
def test_without_a_cap_max_tokens_beyond_the_context_is_a_400_naming_it(api, post, path, body, field):
    r = post(path, {**body, field: 129}, key=api.acme_secret)
    assert r.status_code == 400
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (field, "invalid_parameter")
    assert "at most 128" in r.json()["error"]["message"]
    assert not api.dispatcher.published


def test_a_configured_cap_bounds_the_chat_default_and_refuses_more(api, post, settings):
    settings.LORAFLEET_MAX_TOKENS_CAP = 20
    assert post(CHAT, chat_body(), key=api.acme_secret).status_code == 200
    assert api.dispatcher.published[-1].job.max_tokens == 20
    assert post(CHAT, chat_body(max_tokens=20), key=api.acme_secret).status_code == 200
    r = post(CHAT, chat_body(max_tokens=21), key=api.acme_secret)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "at most 20 (this server's cap)" in r.json()["error"]["message"]
    settings.LORAFLEET_MAX_TOKENS_CAP = 8  # below the completions default: the cap wins
    assert post(COMPLETIONS, completion_body(), key=api.acme_secret).status_code == 200
    assert api.dispatcher.published[-1].job.max_tokens == 8
