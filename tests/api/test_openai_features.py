"""Issue 19 through the gateway: logprobs, n, echo, penalties, seed, best_of — OpenAI's shapes, streamed and not,
usage over every choice, and the audit row's n and logprobs_returned.

The queue boundary is replaced by a dispatcher that runs a real engine on the tiny checkpoint in this process,
so the tokens, logprobs and deltas are real (tests/e2e drives the whole stack with the openai client).
"""
from __future__ import annotations

import json

import pytest
from django.db import DatabaseError, transaction

from gateway.models import AuditRecord
from inference_worker.engine import Engine
from inference_worker.model import ModelRunner
from protocol.jobs import GenerationJob

pytestmark = pytest.mark.django_db
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = Engine(ModelRunner(tiny_checkpoint, pool_pages=256, enable_lora=False), lambda key: b"", max_running=16,
                 prefill_chunk=64).start()
    yield eng
    eng.stop()


@pytest.fixture
def live(api, engine):
    """The api world, answered by the real engine (on the base: these tests are about shapes, not adapters).
    Events are built the way the worker's task builds them, and travel through JSON."""

    def answer(job, meta):
        served = job.adapter
        handle = engine.submit(GenerationJob.from_dict({**job.to_dict(), "adapter": None}))
        ident = {"worker_id": "w1", "adapter_sha256": served and served.sha256,
                 "adapter_identity": served and served.identity}
        events = [{"type": "delta", **d, **ident} for d in handle.deltas(timeout=60)] if meta["stream"] else []
        result = handle.result(timeout=60)
        result.adapter_sha256, result.adapter_identity = ident["adapter_sha256"], ident["adapter_identity"]
        events.append({"type": "final", "result": result.to_dict(), "worker_id": "w1", "attempts": 1})
        return [json.loads(json.dumps(e)) for e in events]

    api.dispatcher.answer = answer
    api.engine = engine
    return api


def sse_events(response) -> list:
    raw = b"".join(response.streaming_content).decode()
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]


def complete(post, live, **body):
    return post("/v1/completions", {"model": "support-bot", "prompt": PROMPT, "max_tokens": 8, **body},
                key=live.acme_secret)


def chat(post, live, **body):
    return post("/v1/chat/completions", {"model": "support-bot", "max_tokens": 8, "ignore_eos": True,
                                         "messages": [{"role": "user", "content": "Tell me a story"}], **body},
                key=live.acme_secret)


def test_completions_with_n_logprobs_and_echo(live, post):
    r = complete(post, live, n=3, logprobs=2, echo=True, temperature=0.9, seed=4, ignore_eos=True)
    assert r.status_code == 200, r.content
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    n_prompt = data["usage"]["prompt_tokens"]
    generated = 0
    for c in data["choices"]:
        assert c["text"].startswith(PROMPT) and c["finish_reason"] == "length"
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert len(lp["tokens"]) == n_prompt + 8  # echo: the prompt's tokens first
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing before the first
        assert all(v <= 0 for v in lp["token_logprobs"][1:])
        # up to logprobs + 1 alternatives: the chosen token is always among them, with its own logprob
        for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert 1 <= len(top) <= 3 and top[token] == value
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        generated += len(lp["tokens"]) - n_prompt
    assert len({c["text"] for c in data["choices"]}) == 3  # each choice its own seed
    assert data["usage"]["completion_tokens"] == generated == 24  # all n choices
    assert data["usage"]["total_tokens"] == n_prompt + 24
    job = live.dispatcher.published[0].job
    assert (job.n, job.logprobs, job.prompt_logprobs, job.seed) == (3, 2, 2, 4)
    row = AuditRecord.objects.get()
    assert (row.n, row.logprobs_returned, row.completion_tokens) == (3, True, 24)


def test_the_same_seed_gives_the_same_choices(live, post):
    answers = [complete(post, live, n=4, temperature=1.0, seed=11, max_tokens=10).json() for _ in range(2)]
    assert [c["text"] for c in answers[0]["choices"]] == [c["text"] for c in answers[1]["choices"]]
    greedy = complete(post, live, n=4, temperature=0, max_tokens=10).json()
    assert len({c["text"] for c in greedy["choices"]}) == 1


def test_chat_logprobs_in_openais_shape(live, post, tiny_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    r = chat(post, live, logprobs=True, top_logprobs=3, temperature=1.0, seed=5)
    assert r.status_code == 200, r.content
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None and len(content) == 8
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] >= e["logprob"]
        assert all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"])
    # the same answer with tokens as ids (vLLM's return_tokens_as_token_ids): they decode to the text, and the
    # bytes of the tokens that are text (not special tokens) spell it
    as_ids = chat(post, live, logprobs=True, top_logprobs=1, temperature=1.0, seed=5,
                  return_tokens_as_token_ids=True).json()
    ids = [int(e["token"].removeprefix("token_id:")) for e in as_ids["choices"][0]["logprobs"]["content"]]
    assert as_ids["choices"][0]["message"]["content"] == choice["message"]["content"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
    special = set(tokenizer.all_special_ids)
    spelled = b"".join(bytes(e["bytes"]) for e, t in zip(content, ids, strict=True) if t not in special)
    assert spelled.decode("utf-8", errors="replace") == choice["message"]["content"]
    without = chat(post, live, temperature=0).json()
    assert without["choices"][0]["logprobs"] is None
    assert [AuditRecord.objects.get(request_id=x["lorafleet"]["request_id"]).logprobs_returned
            for x in (as_ids, without)] == [True, False]


def test_streams_carry_index_per_choice_and_logprobs(live, post):
    full = complete(post, live, n=2, logprobs=1, temperature=0.8, seed=3, ignore_eos=True).json()
    r = complete(post, live, n=2, logprobs=1, temperature=0.8, seed=3, ignore_eos=True, stream=True,
                 stream_options={"include_usage": True})
    chunks = sse_events(r)
    assert chunks[0]["lorafleet"]["adapter"] == "support-bot"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    for want in full["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == want["index"]]
        assert "".join(c["text"] for c in mine) == want["text"]
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        values = [v for c in mine if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert tokens == want["logprobs"]["tokens"] and values == want["logprobs"]["token_logprobs"]
        assert [c["finish_reason"] for c in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"
    row = AuditRecord.objects.get(request_id=chunks[0]["lorafleet"]["request_id"])
    assert (row.n, row.logprobs_returned, row.status) == (2, True, "ok")


def test_a_chat_stream_of_n_choices_starts_each_with_the_role(live, post):
    full = chat(post, live, n=2, temperature=0.7, seed=9, logprobs=True).json()
    chunks = sse_events(chat(post, live, n=2, temperature=0.7, seed=9, logprobs=True, stream=True))
    for want in full["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == want["index"]]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == want["message"]["content"]
        assert [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]] == want["logprobs"]["content"]
        assert mine[-1]["finish_reason"] == want["finish_reason"]


def test_echo_streams_the_prompt_first(live, post):
    chunks = sse_events(complete(post, live, echo=True, temperature=0, stream=True))
    full = complete(post, live, echo=True, temperature=0).json()
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


def test_penalties_and_logit_bias_reach_the_worker_and_change_the_answer(live, post):
    plain = complete(post, live, temperature=0, max_tokens=16, ignore_eos=True).json()["choices"][0]["text"]
    pen = complete(post, live, temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=2.0,
                   presence_penalty=1.0, repetition_penalty=1.3, logit_bias={"44": 3, "7": -100})
    assert pen.status_code == 200
    job = live.dispatcher.published[-1].job
    assert (job.frequency_penalty, job.presence_penalty, job.repetition_penalty) == (2.0, 1.0, 1.3)
    assert sorted(job.logit_bias) == [[7, -100.0], [44, 3.0]]
    assert pen.json()["choices"][0]["text"] != plain


@pytest.mark.parametrize("route, extra, param, code", [
    ("completions", {"logprobs": 6}, "logprobs", "invalid_parameter"),
    ("completions", {"logprobs": True}, "logprobs", "invalid_parameter"),
    ("completions", {"best_of": 2}, "best_of", "unsupported_parameter"),
    ("completions", {"n": 2, "best_of": 4}, "best_of", "unsupported_parameter"),
    ("completions", {"suffix": "tail"}, "suffix", "unsupported_parameter"),
    ("completions", {"echo": "yes"}, "echo", "invalid_parameter"),
    ("completions", {"n": 0}, "n", "invalid_parameter"),
    ("completions", {"n": 9}, "n", "invalid_parameter"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty", "invalid_parameter"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty", "invalid_parameter"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "invalid_parameter"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "invalid_parameter"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias", "invalid_parameter"),
    ("completions", {"logit_bias": {"100000": 1}}, "logit_bias", "invalid_parameter"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "invalid_parameter"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_parameter"),
    ("chat", {"logprobs": 3}, "logprobs", "invalid_parameter"),
    ("chat", {"echo": True}, "echo", "unknown_parameter"),
])
def test_refusals_name_the_parameter(live, post, route, extra, param, code):
    r = (chat if route == "chat" else complete)(post, live, **extra)
    assert r.status_code == 400, r.content
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
    if param == "best_of":
        assert "rank them yourself" in r.json()["error"]["message"]
    assert not live.dispatcher.published
    assert AuditRecord.objects.get().logprobs_returned is False


def test_best_of_equal_to_n_is_plain_n(live, post):
    r = complete(post, live, n=2, best_of=2, temperature=0)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_the_audit_trigger_fixes_n_and_sets_logprobs_returned_once(world, postgres):
    def raw(sql, params):
        with transaction.atomic(), postgres.cursor() as cursor:
            cursor.execute(sql, params)

    record = AuditRecord.objects.create(route="/v1/completions", tenant=world.acme, n=4)
    with pytest.raises(DatabaseError, match="identity"):
        raw("UPDATE gateway_auditrecord SET n = 1 WHERE id = %s", [record.pk])
    raw("UPDATE gateway_auditrecord SET logprobs_returned = true WHERE id = %s", [record.pk])
    with pytest.raises(DatabaseError, match="identity"):
        raw("UPDATE gateway_auditrecord SET logprobs_returned = false WHERE id = %s", [record.pk])
    raw("UPDATE gateway_auditrecord SET status = 'ok' WHERE id = %s", [record.pk])
    with pytest.raises(DatabaseError, match="final"):
        raw("UPDATE gateway_auditrecord SET logprobs_returned = false WHERE id = %s", [record.pk])
    record.refresh_from_db()
    assert (record.n, record.logprobs_returned) == (4, True)
