"""Issue 47 on the request path: bounded input before the tokenizer, exactly one audit row even on a 500,
and no exception's or library's text in any answer.

The request goes through the real API down to the queue boundary (tests/api/conftest.py's scripted
dispatcher) on the tiny checkpoint, whose tokenizer is real: prompts are tokenized for real.
"""
from __future__ import annotations

import json
import uuid

import pytest

from gateway import input_bounds, prompt_text, prompts
from gateway.models import AuditRecord
from protocol.jobs import GenerationResult

pytestmark = pytest.mark.django_db

# What must never reach a client: an exception's own words, torch's, a traceback.
PLANTED = "probability tensor contains either `inf`, `nan` or element < 0 (planted)"
LIBRARY_WORDS = ("Traceback", "tensor", "torch", "Error(", "planted", "Exception")


def rows_for(response) -> list[AuditRecord]:
    return list(AuditRecord.objects.filter(request_id=uuid.UUID(response["X-Lorafleet-Request-Id"])))


def assert_our_words(response) -> None:
    text = response.content.decode()
    assert not any(word in text for word in LIBRARY_WORDS), text


def completion(**extra) -> dict:
    return {"model": "support-bot", "prompt": "Once upon a time", "max_tokens": 4, **extra}


def chat(content: str = "hello", **extra) -> dict:
    return {"model": "support-bot", "max_tokens": 4, "messages": [{"role": "user", "content": content}], **extra}


# --- one audit row, whatever raises ------------------------------------------------------------------


def _raise(*args, **kwargs):
    raise RuntimeError(PLANTED)


@pytest.mark.parametrize("where", [
    "gateway.serving.authenticate",  # before the key is known: the row names no tenant
    "gateway.serving.check_logit_bias",  # after binding, before any row
    "gateway.prompt_text.render",  # inside the chat template's rendering
    "gateway.serving.shapes_for",  # after the pending row is committed and the job published
    "gateway.responses.Shapes.full",  # while the answer is built from the worker's result
])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_an_exception_planted_deep_in_the_path_is_a_500_with_one_row_and_no_library_text(api, post, monkeypatch,
                                                                                        where, route):
    if where == "gateway.responses.Shapes.full":
        from gateway.responses import Shapes

        monkeypatch.setattr(Shapes, "full", _raise)
    else:
        monkeypatch.setattr(where, _raise)
    if route == "completions":
        r = post("/v1/completions", completion(), key=api.acme_secret)
    else:
        r = post("/v1/chat/completions", chat(), key=api.acme_secret)
    if where == "gateway.prompt_text.render" and route == "completions":
        assert r.status_code == 200  # completions never render a template
        return
    assert r.status_code == 500, r.content
    error = r.json()["error"]
    assert (error["code"], error["type"]) == ("internal_error", "server_error")
    assert error["message"] == "The server failed while answering this request."
    assert_our_words(r)
    rows = rows_for(r)
    assert len(rows) == 1, rows
    row = rows[0]
    assert (row.status, row.http_status, row.error_code) == ("error", 500, "internal_error")
    assert row.tenant_id == (None if where == "gateway.serving.authenticate" else api.acme.pk)
    assert AuditRecord.objects.count() == 1  # and no other row for anything else


def test_an_exception_in_a_stream_after_it_started_is_said_in_band_and_recorded_once(api, post, monkeypatch):
    from gateway.responses import Shapes

    real_chunk = Shapes.chunk

    def chunk(self, text, **kw):
        if kw.get("finish_reason"):
            raise RuntimeError(PLANTED)
        return real_chunk(self, text, **kw)

    monkeypatch.setattr(Shapes, "chunk", chunk)
    r = post("/v1/completions", completion(stream=True), key=api.acme_secret)
    assert r.status_code == 200
    raw = b"".join(r.streaming_content).decode()
    assert "[DONE]" not in raw and '"internal_error"' in raw and PLANTED not in raw
    rows = rows_for(r)
    assert len(rows) == 1 and rows[0].status == "ok"  # the answer was whole when the finish chunk failed


def test_a_stream_that_fails_before_the_answer_is_whole_is_an_internal_error_on_the_record(api, post, monkeypatch):
    from gateway import serving

    real = serving.GenerationResult.from_dict

    def from_dict(data):
        raise RuntimeError(PLANTED)

    monkeypatch.setattr(serving.GenerationResult, "from_dict", staticmethod(from_dict))
    r = post("/v1/completions", completion(stream=True), key=api.acme_secret)
    raw = b"".join(r.streaming_content).decode()
    monkeypatch.setattr(serving.GenerationResult, "from_dict", staticmethod(real))
    events = [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "internal_error" and PLANTED not in raw
    rows = rows_for(r)
    assert len(rows) == 1 and (rows[0].status, rows[0].error_code) == ("error", "internal_error")


def test_a_workers_internal_failure_text_stays_on_the_record_not_in_the_answer(api, post):
    def torch_failed(job, meta):
        result = GenerationResult(request_id=job.request_id, status="error", error_code="internal_error",
                                  error_message=f"the forward pass failed for this request: RuntimeError('{PLANTED}')")
        return [{"type": "final", "result": result.to_dict(), "worker_id": "w1", "attempts": 1}]

    api.dispatcher.answer = torch_failed
    r = post("/v1/completions", completion(), key=api.acme_secret)
    assert (r.status_code, r.json()["error"]["code"]) == (500, "internal_error")
    assert r.json()["error"]["message"] == "The worker failed while answering this request."
    assert_our_words(r)
    (row,) = rows_for(r)
    assert PLANTED in row.error_message  # the operator still learns what happened


def test_drf_refusals_are_in_our_words(api, client):
    r = client.get("/v1/completions", HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}")
    assert r.status_code == 405
    assert r.json()["error"]["message"] == "This route does not accept 'GET'; see /api/docs/."


# --- sampling parameters that used to be 500s ------------------------------------------------------


@pytest.mark.parametrize("bias", [{"²": 1}, {"1" * 5000: 1}, {"٣": 1}, {"-1": 1}, {"1e3": 1}, {" ": 1}])
def test_logit_bias_keys_are_ascii_token_ids_or_a_400(api, post, bias):
    r = post("/v1/completions", completion(logit_bias=bias), key=api.acme_secret)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "logit_bias"), r.content
    assert len(r.json()["error"]["message"]) < 200  # a 5,000-digit key is not echoed back whole
    (row,) = rows_for(r)
    assert (row.http_status, row.error_code) == (400, "invalid_parameter")


@pytest.mark.parametrize("penalty", [1e-38, 1e-45, 1e-300, 0.0099, 0])
def test_repetition_penalty_has_a_floor_and_says_so(api, post, penalty):
    r = post("/v1/completions", completion(repetition_penalty=penalty, temperature=1), key=api.acme_secret)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "repetition_penalty")
    assert "from 0.01 to 2" in r.json()["error"]["message"]
    assert len(rows_for(r)) == 1


def test_the_floor_itself_is_accepted(api, post):
    r = post("/v1/completions", completion(repetition_penalty=0.01), key=api.acme_secret)
    assert r.status_code == 200, r.content
    assert api.dispatcher.published[0].job.repetition_penalty == 0.01


# --- input bounded before the tokenizer ------------------------------------------------------------


@pytest.fixture
def encoded(monkeypatch):
    """Every string the web tokenizes for a completion or a chat, in order."""
    seen: list[str] = []
    real_encoder, real_text_ids = prompts._encoder, prompt_text.text_ids

    def encoder(facts):
        encode = real_encoder(facts)
        return lambda s: seen.append(s) or encode(s)

    def text_ids(facts, s):
        seen.append(s)
        return real_text_ids(facts, s)

    monkeypatch.setattr(prompts, "_encoder", encoder)
    monkeypatch.setattr(prompt_text, "text_ids", text_ids)
    return seen


def test_a_prompt_that_cannot_fit_by_its_bytes_is_refused_without_tokenizing(api, post, encoded):
    r = post("/v1/completions", completion(prompt="x" * 1_000_000), key=api.acme_secret)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
    assert "at least" in r.json()["error"]["message"]
    assert encoded == [] and api.dispatcher.published == []
    assert len(rows_for(r)) == 1


def test_chat_messages_that_cannot_fit_by_their_bytes_are_refused_before_the_template(api, post, monkeypatch):
    rendered = []
    real = prompt_text.render
    monkeypatch.setattr(prompt_text, "render", lambda *a: rendered.append(1) or real(*a))
    many = [{"role": "user", "content": "y" * 50_000} for _ in range(20)]
    r = post("/v1/chat/completions", {**chat(), "messages": many}, key=api.acme_secret)
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == \
        (400, "context_length_exceeded", "messages")
    assert rendered == [] and len(rows_for(r)) == 1


def test_what_may_fit_is_tokenized_only_until_it_is_known_not_to(tiny_checkpoint):
    """Text that passes the byte bound (its tokens are far shorter than the longest) but has far more tokens
    than the budget: counting stops after the first slice, long before the end of the text."""
    from transformers import AutoTokenizer

    facts = input_bounds.tokenizer_facts(AutoTokenizer.from_pretrained(str(tiny_checkpoint)))
    text = "q z x v " * 10_000  # 80,000 characters, a token each
    budget = input_bounds.min_tokens(facts, text) + 10  # passes the byte bound
    seen: list[str] = []
    encode = prompts._encoder(facts)
    with pytest.raises(input_bounds.TooLong) as refused:
        input_bounds.encode_within(facts, text, budget, lambda s: seen.append(s) or encode(s))
    assert refused.value.tokens > budget
    assert sum(map(len, seen)) <= input_bounds.SLICE_CHARS < len(text) / 4


def test_slices_count_what_the_whole_text_counts(tiny_checkpoint):
    """Cut where slices are cut, a text's slices make exactly the tokens the whole does (byte-level BPE), so
    a text exactly at the budget fits and one token less refuses it."""
    from transformers import AutoTokenizer

    from demo.tiny_base import corpus_text

    facts = input_bounds.tokenizer_facts(AutoTokenizer.from_pretrained(str(tiny_checkpoint)))
    encode = prompts._encoder(facts)
    text = " ".join(corpus_text()) * 8
    pos, total = 0, 0
    while pos < len(text):
        if len(text) - pos > 2 * input_bounds.SLICE_CHARS:
            end, soft = input_bounds._cut(text, pos, pos + input_bounds.SLICE_CHARS)
            assert soft
        else:
            end = len(text)
        total += len(encode(text[pos:end]))
        pos = end
    whole = encode(text)
    assert total == len(whole)
    assert input_bounds.encode_within(facts, text, len(whole), encode) == whole
    with pytest.raises(input_bounds.TooLong):
        input_bounds.encode_within(facts, text, len(whole) - 1, encode)


def test_a_long_list_of_token_ids_is_refused_before_each_id_is_read(api, post):
    r = post("/v1/completions", completion(prompt=[1] * 200_000), key=api.acme_secret)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")


def test_lists_and_stop_strings_have_caps(api, post):
    r = post("/v1/chat/completions", {**chat(), "messages": [{"role": "user", "content": "a"}] * 2049},
             key=api.acme_secret)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")
    assert "at most 2048" in r.json()["error"]["message"]
    r = post("/v1/completions", completion(stop=["z" * 1001]), key=api.acme_secret)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "stop")
    r = post("/v1/completions", completion(stop=["z" * 1000]), key=api.acme_secret)
    assert r.status_code == 200


def test_a_prompt_that_fits_is_counted_exactly(api, post):
    tokenizer = prompts.tokenizer_for(api.base)
    prompt = "Once upon a time " * 5
    r = post("/v1/completions", completion(prompt=prompt, max_tokens=128 - len(tokenizer.encode(prompt))),
             key=api.acme_secret)
    assert r.status_code == 200, r.content
    r = post("/v1/completions", completion(prompt=prompt, max_tokens=129 - len(tokenizer.encode(prompt))),
             key=api.acme_secret)
    assert r.status_code == 400 and f"the prompt has {len(tokenizer.encode(prompt))} and" in r.json()["error"]["message"]
