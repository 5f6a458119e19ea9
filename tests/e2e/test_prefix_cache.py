"""The prefix cache on the real stack (issue 46): an application that sends the same system prompt with every request
reuses its KV within its tenant and adapter — the response's usage, the audit row and the worker's Prometheus
series say how much — and never across tenants or adapters."""
from __future__ import annotations

import openai

from tests.e2e.conftest import worker_metric

SYSTEM = ("You are the support assistant of a company that sells garden tools. Answer politely, in two sentences, "
          "and never promise a delivery date. " * 3)


def ask(client, model: str, question: str):
    return client.chat.completions.create(model=model, temperature=0, max_tokens=6, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def test_a_shared_system_prompt_is_read_once_per_tenant_and_adapter(e2e, db_rows):
    a = openai.OpenAI(base_url=e2e.url + "/v1", api_key=e2e.seed["keys"]["a"], max_retries=0, timeout=120)
    b = openai.OpenAI(base_url=e2e.url + "/v1", api_key=e2e.seed["keys"]["b"], max_retries=0, timeout=120)
    hits_before = worker_metric(e2e.worker, "lorafleet_worker_prefix_cache_hit_tokens_total")

    first = ask(a, "a-2", "Where is my rake?")
    second = ask(a, "a-2", "Can I return a shovel?")
    assert second.usage.prompt_tokens_details.cached_tokens >= 32  # the system prompt's full blocks
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    again = ask(a, "a-2", "Where is my rake?")
    assert again.choices[0].message.content == first.choices[0].message.content  # the same answer from the cache

    # the same words under another adapter of the tenant, or from another tenant, are read in full
    assert ask(a, "a-3", "Can I return a shovel?").usage.prompt_tokens_details.cached_tokens == 0
    assert ask(b, "b-2", "Can I return a shovel?").usage.prompt_tokens_details.cached_tokens == 0

    rows = db_rows("SELECT cached_tokens FROM gateway_auditrecord WHERE request_id = %s",
                   (second.model_extra["lorafleet"]["request_id"],))
    assert rows == [{"cached_tokens": second.usage.prompt_tokens_details.cached_tokens}]
    hits = worker_metric(e2e.worker, "lorafleet_worker_prefix_cache_hit_tokens_total") - hits_before
    assert hits >= second.usage.prompt_tokens_details.cached_tokens + again.usage.prompt_tokens_details.cached_tokens
