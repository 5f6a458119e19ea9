"""Issue 19 with the official openai client against the real stack (web, Redis, a worker subprocess):
logprobs equal transformers' and PEFT's log-softmax, n choices, seeds, penalties, echo, streams, the audit row.

Token ids come back exactly through vLLM's `return_tokens_as_token_ids` extension (tokens as "token_id:<id>"),
so every logprob is compared with transformers at the very token the worker chose.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

PROMPT = "Once upon a time"
IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def client(e2e):
    return openai.OpenAI(base_url=e2e.url + "/v1", api_key=e2e.seed["keys"]["a"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle(e2e):
    """transformers for the base, PEFT for adapter a-0 (the very folder its version was uploaded from), and the
    tokenizer the worker uses."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = e2e.root / "peft-1"  # seed_stack.py: a-0 is the first upload
    sha = hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert sha == e2e.seed["adapters"]["a-0"]["versions"][0]["sha256"]
    base = AutoModelForCausalLM.from_pretrained(str(e2e.checkpoint), dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(e2e.checkpoint), dtype=torch.float32),
                                     str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(e2e.checkpoint))
    return {"base": base, "a-0": peft, "tokenizer": tokenizer}


def base_model(e2e) -> str:
    return "base/" + e2e.seed["bases"]["main"]["slug"]


def token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token[len("token_id:"):])


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches(model, prompt_ids: list[int], tokens: list[int], values: list[float], tops: list[dict[int, float]],
                   k: int) -> None:
    """Each chosen token's logprob, and the k most likely tokens with theirs, equal log_softmax of the oracle's
    logits at that position within 1e-4."""
    ref = log_softmax(model, prompt_ids + tokens)
    for j, (tok, value, top) in enumerate(zip(tokens, values, tops, strict=True)):
        row = ref[len(prompt_ids) - 1 + j]
        assert value == pytest.approx(float(row[tok]), abs=1e-4)
        for tid, v in top.items():
            assert v == pytest.approx(float(row[tid]), abs=1e-4)
        best = torch.topk(row, k).values.tolist()
        assert sorted(top.values(), reverse=True)[:k] == pytest.approx(best, abs=1e-4)


def test_logprobs_equal_transformers_and_peft_in_a_batch_mixed_with_requests_that_ask_for_none(e2e, client, oracle):
    tok = oracle["tokenizer"]
    messages = [{"role": "user", "content": "Tell me a story"}]

    def completion_lp(model):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=2,
                                         logprobs=5, extra_body=IDS)

    def chat_lp():
        return client.chat.completions.create(model="a-0", messages=messages, max_tokens=10, temperature=0,
                                              logprobs=True, top_logprobs=5, extra_body=IDS)

    def quiet(i):
        model = ["a-1", "a-2", base_model(e2e), "a-0"][i % 4]
        if i % 2:
            return client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        return "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0.7, stream=True) if c.choices)

    with ThreadPoolExecutor(11) as pool:
        quiet_answers = [pool.submit(quiet, i) for i in range(8)]
        base_lp, adapter_lp, chat_answer = pool.submit(completion_lp, base_model(e2e)), \
            pool.submit(completion_lp, "a-0"), pool.submit(chat_lp)
        answers = [f.result() for f in quiet_answers]
        base_lp, adapter_lp, chat_answer = base_lp.result(), adapter_lp.result(), chat_answer.result()
    assert all(a for a in answers)

    prompt_ids = tok.encode(PROMPT, add_special_tokens=True)
    for name, answer in (("base", base_lp), ("a-0", adapter_lp)):
        lp = answer.choices[0].logprobs
        ids = [token_id(t) for t in lp.tokens]
        tops = [{token_id(t): v for t, v in top.items()} for top in lp.top_logprobs]
        assert len(ids) == answer.usage.completion_tokens
        assert_matches(oracle[name], prompt_ids, ids, lp.token_logprobs, tops, 5)
    assert base_lp.choices[0].logprobs.tokens != adapter_lp.choices[0].logprobs.tokens

    chat_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=True)
    content = chat_answer.choices[0].logprobs.content
    ids = [token_id(e.token) for e in content]
    tops = [{token_id(t.token): t.logprob for t in e.top_logprobs} for e in content]
    assert all(len(e.top_logprobs) == 5 for e in content)
    assert_matches(oracle["a-0"], chat_ids, ids, [e.logprob for e in content], tops, 5)
    assert ids[0] == max(tops[0], key=tops[0].get)  # greedy: the chosen token is the most likely


def test_n4_greedy_gives_four_identical_choices_and_usage_counts_them_all(e2e, client, db_rows):
    r = client.completions.with_raw_response.create(model="a-0", prompt=PROMPT, n=4, max_tokens=8, temperature=0,
                                                    extra_body={"ignore_eos": True})
    answer = r.parse()
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert len({c.text for c in answer.choices}) == 1 and answer.choices[0].text
    assert answer.usage.completion_tokens == 4 * 8
    one = client.completions.create(model="a-0", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == answer.choices[0].text and one.usage.prompt_tokens == answer.usage.prompt_tokens
    row = db_rows("SELECT n, logprobs_returned, completion_tokens, status FROM gateway_auditrecord "
                  "WHERE request_id::text = %s", (r.headers["X-Lorafleet-Request-Id"],))
    assert row == [{"n": 4, "logprobs_returned": False, "completion_tokens": 32, "status": "ok"}]


def test_n4_sampled_with_a_seed_is_reproducible(client):
    def ask(seed):
        return [c.text for c in client.completions.create(model="a-1", prompt=PROMPT, n=4, max_tokens=12,
                                                           temperature=1.0, seed=seed).choices]

    first = ask(1234)
    assert ask(1234) == first
    assert len(set(first)) > 1  # each choice samples with its own seed
    assert ask(4321) != first


def test_penalties_change_tokens_as_openais_formula_says(e2e, client, oracle):
    """Greedy with frequency and presence penalties equals the direct computation on transformers' logits:
    mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c[j] = times j was generated."""
    prompt_ids = oracle["tokenizer"].encode(PROMPT, add_special_tokens=True)
    f, p = 1.2, 0.6
    out: list[int] = []
    for _ in range(24):
        mu = log_softmax(oracle["base"], prompt_ids + out)[-1]  # a per-row constant shift: argmax is the same
        for t in set(out):
            mu[t] -= out.count(t) * f + p
        out.append(int(mu.argmax()))
    answer = client.completions.create(model=base_model(e2e), prompt=PROMPT, max_tokens=24, temperature=0,
                                       frequency_penalty=f, presence_penalty=p, logprobs=0,
                                       extra_body={"ignore_eos": True, **IDS})
    assert [token_id(t) for t in answer.choices[0].logprobs.tokens] == out
    plain = client.completions.create(model=base_model(e2e), prompt=PROMPT, max_tokens=24, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True, **IDS})
    assert [token_id(t) for t in plain.choices[0].logprobs.tokens] != out


def test_streams_of_n_choices_with_logprobs(client, db_rows):
    kw = dict(model="a-2", messages=[{"role": "user", "content": "Hello"}], n=2, max_tokens=10, temperature=0.9,
              seed=77, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    for want in full.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == want.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == want.message.content
        streamed = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in want.logprobs.content]
        assert mine[-1].finish_reason == want.finish_reason
    request_id = chunks[0].model_extra["lorafleet"]["request_id"]
    rows = db_rows("SELECT n, logprobs_returned FROM gateway_auditrecord WHERE request_id::text = %s", (request_id,))
    assert rows == [{"n": 2, "logprobs_returned": True}]


def test_echo_and_best_of(client):
    answer = client.completions.create(model="a-3", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                       logprobs=1)
    lp = answer.choices[0].logprobs
    assert answer.choices[0].text.startswith(PROMPT) and lp.token_logprobs[0] is None
    assert len(lp.tokens) == answer.usage.prompt_tokens + answer.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="a-3", prompt=PROMPT, max_tokens=4, best_of=3)
    assert err.value.code == "unsupported_parameter" and "best_of" in str(err.value)
