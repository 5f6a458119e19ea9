"""The prefix cache as a caller and an operator see it through the whole stack (issue 46): a system prompt sent again
by the same tenant to the same adapter is read from the worker's cache, and the answer, the audit row and /metrics
say how many prompt tokens were; another tenant, another adapter or another cache_salt never reuses them (0)."""
from __future__ import annotations

import secrets

import openai

from .conftest import series_value, worker_metric

SYSTEM = ("You are the support assistant of a bicycle shop. Answer in one short paragraph, politely, and only about "
          "bicycles, their parts, repairs, prices and opening hours. ") * 2


def _client(e2e, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=e2e.url + "/v1", api_key=e2e.seed["keys"][tenant], max_retries=0, timeout=120)


def _cached_total(e2e) -> float:
    base = e2e.seed["bases"]["main"]["slug"]
    return series_value(e2e.web_metrics(), f'lorafleet_prompt_tokens_cached_total{{base="{base}"}}') or 0.0


def test_a_repeated_system_prompt_is_read_from_the_cache_of_its_tenant_and_adapter_only(e2e, db_rows):
    messages = [{"role": "system", "content": f"[{secrets.token_hex(4)}] " + SYSTEM},  # cold in this worker
                {"role": "user", "content": "When do you open?"}]
    a, b = _client(e2e, "a"), _client(e2e, "b")
    before = _cached_total(e2e)
    worker_hits = worker_metric(e2e.worker, "lorafleet_worker_prefix_cache_hit_tokens_total")

    def ask(client, model, **extra):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, **extra)

    cold = ask(a, "a-1")
    assert cold.usage.prompt_tokens > 100 and cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = ask(a, "a-1")
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens
    assert cold.usage.prompt_tokens // 2 < cached < warm.usage.prompt_tokens  # the shared prefix, in whole blocks
    assert warm.choices[0].message.content == cold.choices[0].message.content  # the same greedy answer
    row = db_rows("SELECT status, prompt_tokens, cached_tokens FROM gateway_auditrecord WHERE request_id = %s",
                  (warm.model_extra["lorafleet"]["request_id"],))
    assert [(r["status"], r["prompt_tokens"], r["cached_tokens"]) for r in row] == [("ok", warm.usage.prompt_tokens,
                                                                                      cached)]
    assert _cached_total(e2e) - before >= cached
    assert worker_metric(e2e.worker, "lorafleet_worker_prefix_cache_hit_tokens_total") - worker_hits >= cached

    # the identical prompt, from another tenant, to another adapter, or under another salt: read afresh
    assert ask(b, "b-1").usage.prompt_tokens_details.cached_tokens == 0
    assert ask(a, "a-3").usage.prompt_tokens_details.cached_tokens == 0
    salted = ask(a, "a-1", extra_body={"cache_salt": "end-user-1"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    again = ask(a, "a-1", extra_body={"cache_salt": "end-user-1"})  # the same salt again: its own cache
    assert again.usage.prompt_tokens_details.cached_tokens == cached
