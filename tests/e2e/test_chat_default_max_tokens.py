"""OpenAI's chat default on the real stack (issue 46): the official openai client, sending no max_tokens, gets a
whole answer that ends at its stop, not 16 tokens cut off with finish_reason "length".

The tiny random base of these tests never says its end-of-turn token by itself, so the answer's natural end is a
stop string (OpenAI's finish_reason is "stop" for both): one taken from the greedy answer *after* its 20th token,
where the old default of 16 would have cut it off first.
"""
from __future__ import annotations

import openai

MESSAGES = [{"role": "user", "content": "Tell me a story about a dragon"}]


def _stop_after(short: str, long: str) -> str:
    """The shortest string that begins where `short` ends inside `long` and occurs nowhere before it."""
    assert long.startswith(short) and len(long) > len(short), (short, long)
    for k in range(1, len(long) - len(short) + 1):
        candidate = long[len(short):len(short) + k]
        if candidate.strip() and long.find(candidate) == len(short):
            return candidate
    raise AssertionError(f"no stop string after {short!r} in {long!r}")


def test_the_openai_client_without_max_tokens_gets_a_whole_answer(e2e, db_rows):
    client = openai.OpenAI(base_url=e2e.url + "/v1", api_key=e2e.seed["keys"]["a"], max_retries=0, timeout=120)
    first20 = client.chat.completions.create(model="a-1", messages=MESSAGES, max_tokens=20, temperature=0)
    first40 = client.chat.completions.create(model="a-1", messages=MESSAGES, max_tokens=40, temperature=0)
    assert first20.choices[0].finish_reason == first40.choices[0].finish_reason == "length"
    short, long = first20.choices[0].message.content, first40.choices[0].message.content
    stop = _stop_after(short, long)

    chat = client.chat.completions.create(model="a-1", messages=MESSAGES, temperature=0, stop=[stop])
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.content == short  # everything up to the stop: more than 16 tokens
    assert chat.usage.completion_tokens >= 20
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0  # OpenAI's field, read by the official client
    row = db_rows("SELECT status, finish_reason, completion_tokens, cached_tokens FROM gateway_auditrecord "
                  "WHERE request_id = %s", (chat.model_extra["lorafleet"]["request_id"],))
    assert len(row) == 1 and (row[0]["status"], row[0]["finish_reason"]) == ("ok", "stop")
    assert row[0]["completion_tokens"] == chat.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="a-1", messages=MESSAGES, temperature=0, stop=[stop],
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == short
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_without_max_tokens_keep_openais_legacy_default_of_16(e2e):
    client = openai.OpenAI(base_url=e2e.url + "/v1", api_key=e2e.seed["keys"]["a"], max_retries=0, timeout=120)
    completion = client.completions.create(model="a-0", prompt="Once upon a time", temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 16
