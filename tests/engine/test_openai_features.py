"""Issue 19 in the engine: logprobs, n > 1 over a prompt prefilled once, penalties, logit_bias, seeds.

transformers (and PEFT) are the oracle: logprobs are the log-softmax of their logits, penalties change
tokens as a direct computation of OpenAI's formula over their logits says.
"""
import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_worker.engine import Engine
from inference_worker.memory_pool import PagePool
from inference_worker.model import ModelRunner
from protocol.jobs import AdapterRef, GenerationJob, GenerationResult
from tests.support.peft_factory import make_random_peft_adapter

PROMPT = [17, 120, 45, 301, 9, 77, 250, 13, 88, 402, 5, 66, 140, 233, 31, 7, 99, 250, 3]  # 19: not whole blocks
PROMPT_32 = [(7 * i + 3) % 400 + 10 for i in range(32)]  # exactly two blocks of 16
OTHER = [5, 6, 7, 8, 200, 201, 202, 44, 45]


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    folder = make_random_peft_adapter(tiny_llama, tmp_path_factory.mktemp("peft19") / "a", r=8, alpha=16,
                                      target_modules=("q_proj", "v_proj", "down_proj"), seed=19)
    blob = (folder / "adapter_model.safetensors").read_bytes()
    ref = AdapterRef(version_id=1, sha256=hashlib.sha256(blob).hexdigest(), storage_key="a19", rank=8, alpha=16.0,
                     use_rslora=False, target_modules=["q_proj", "v_proj", "down_proj"], name="a19")
    return folder, ref, {"a19": blob}


@pytest.fixture(scope="module")
def engine(tiny_llama, adapter):
    runner = ModelRunner(tiny_llama, pool_pages=256, max_lora_rank=16)
    eng = Engine(runner, adapter[2].__getitem__, max_running=32, prefill_chunk=8).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def hf(tiny_llama, adapter):
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32),
                                     str(adapter[0])).eval()
    return {None: base, "a19": peft}


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of transformers (or PEFT) for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def job(rid, prompt=PROMPT, adapter=None, **kw) -> GenerationJob:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0.0)
    return GenerationJob(rid, adapter, prompt_token_ids=list(prompt), ignore_eos=True, **kw)


def check_logprobs(result: GenerationResult, model, prompt: list[int], k: int) -> None:
    """Every generated token's logprob and its top k equal log_softmax(transformers' logits) within 1e-4."""
    for choice in result.choices:
        ref = torch.log_softmax(hf_logits(model, prompt + choice.token_ids), dim=-1)
        assert len(choice.logprobs) == len(choice.token_ids)
        for j, (tok, entry) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert entry["token"] == tok
            assert entry["logprob"] == pytest.approx(float(row[tok]), abs=1e-4)
            top = torch.topk(row, k)
            assert len(entry["top"]) == k
            assert [v for _, v in entry["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
            for (i, v), want in zip(entry["top"], top.indices.tolist(), strict=True):
                assert i == want or abs(float(row[want]) - v) < 1e-4  # equal, or a tie


def test_logprobs_equal_transformers_for_base_and_adapter_in_a_mixed_batch(engine, adapter, hf):
    """Base and PEFT-adapter requests asking for logprobs (greedy, and sampled at temperature 0.7: logprobs
    are the model's, before temperature and top-p), batched with requests of both that ask for none."""
    ref = adapter[1]
    asking = [job("lp-base", logprobs=5), job("lp-adapter", adapter=ref, logprobs=5),
              job("lp-sampled", adapter=ref, logprobs=3, temperature=0.7, top_p=0.9, seed=5),
              job("lp-zero", prompt=OTHER, logprobs=0)]
    quiet = [job(f"q{i}", prompt=OTHER if i % 2 else PROMPT, adapter=ref if i % 3 else None, max_tokens=16)
             for i in range(6)]
    alone = {j.request_id: engine.generate(j, timeout=120) for j in quiet}
    handles = [engine.submit(j) for pair in zip(quiet, asking + asking[:2], strict=True) for j in pair]
    results = {h.request_id: h.result(timeout=120) for h in handles}
    assert all(r.ok for r in results.values())
    for j in quiet:  # asking for nothing: no logprobs, and the same tokens as alone
        assert results[j.request_id].choices[0].logprobs is None
        assert results[j.request_id].token_ids == alone[j.request_id].token_ids
    check_logprobs(results["lp-base"], hf[None], PROMPT, 5)
    check_logprobs(results["lp-adapter"], hf["a19"], PROMPT, 5)
    check_logprobs(results["lp-sampled"], hf["a19"], PROMPT, 3)
    check_logprobs(results["lp-zero"], hf[None], OTHER, 0)
    # greedy picks the top token, so its logprob is the top-1 value
    assert all(e["token"] == e["top"][0][0] for e in results["lp-base"].choices[0].logprobs)
    assert results["lp-base"].token_ids != results["lp-adapter"].token_ids  # the adapter matters here


def test_prompt_logprobs_equal_transformers_across_prefill_chunks(engine, adapter, hf):
    """echo's prompt logprobs: the prompt (19 tokens) is prefilled in chunks of 8; every token but the first
    gets log_softmax(logits at the position before it)."""
    for name, ref in ((None, None), ("a19", adapter[1])):
        res = engine.generate(job("echo", adapter=ref, prompt_logprobs=2, logprobs=1, max_tokens=3), timeout=60)
        assert res.ok and len(res.prompt_logprobs) == len(PROMPT)
        assert res.prompt_logprobs[0] == {"token": PROMPT[0], "logprob": None, "top": None}
        ref_lp = torch.log_softmax(hf_logits(hf[name], PROMPT), dim=-1)
        for p in range(1, len(PROMPT)):
            entry = res.prompt_logprobs[p]
            assert entry["token"] == PROMPT[p]
            assert entry["logprob"] == pytest.approx(float(ref_lp[p - 1, PROMPT[p]]), abs=1e-4)
            assert [v for _, v in entry["top"]] == pytest.approx(torch.topk(ref_lp[p - 1], 2).values.tolist(),
                                                                abs=1e-4)


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT_32], ids=["partial-last-block", "whole-blocks"])
def test_n4_greedy_prefills_the_prompt_once_and_gives_four_identical_choices(engine, adapter, prompt):
    ref = adapter[1]
    one = engine.generate(job("one", prompt=prompt, adapter=ref, max_tokens=20), timeout=60)
    before = engine.stats()
    res = engine.generate(job("four", prompt=prompt, adapter=ref, max_tokens=20, n=4), timeout=60)
    after = engine.stats()
    assert res.ok and [c.index for c in res.choices] == [0, 1, 2, 3]
    assert all(c.token_ids == one.token_ids and c.text == one.text for c in res.choices)
    assert res.completion_tokens == 4 * 20 and res.prompt_tokens == len(prompt)
    # the prompt's KV was computed once for the four sequences
    assert after["prompt_prefills"] - before["prompt_prefills"] == 1
    assert after["sequences"] - before["sequences"] == 4
    # (the prefix cache holds "one"'s full prompt blocks: what it gave was not read again)
    cached = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert res.cached_tokens == cached == (len(prompt) - 1) // 16 * 16
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) - cached
    full = len(prompt) // 16
    assert after["kv_blocks_shared"] - before["kv_blocks_shared"] == 3 * full
    assert after["kv_blocks_copied"] - before["kv_blocks_copied"] == (3 if len(prompt) % 16 else 0)
    assert after["memory"]["kv_blocks_used"] == 0  # shared blocks freed by their last holder


def test_shared_prompt_blocks_are_refcounted_while_the_choices_run(engine):
    h = engine.submit(job("held", prompt=PROMPT_32, n=3, max_tokens=200))
    next(iter(h.stream(timeout=60)))
    used = engine.stats()["memory"]["kv_blocks_used"]
    h.cancel()
    assert h.result(timeout=60).finish_reason == "cancelled"
    # KV on demand: two shared prompt blocks once + per sequence the blocks its tokens so far fill (one or two,
    # depending on how far it got), not ceil((32 + 200) / 16) - 2 = 13 of its own reserved for max_tokens
    assert 2 + 3 * 1 <= used <= 2 + 3 * 3
    assert engine.stats()["memory"]["kv_blocks_used"] == 0


def test_n4_sampled_with_a_seed_is_reproducible_and_each_choice_has_its_own_seed(engine, adapter):
    ref = adapter[1]

    def sampled(rid, seed, n=4):
        return job(rid, adapter=ref, n=n, temperature=1.0, seed=seed, max_tokens=16)

    first = engine.generate(sampled("s1", 7), timeout=60)
    again = engine.generate(sampled("s2", 7), timeout=60)
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    assert len({tuple(c.token_ids) for c in first.choices}) == 4  # distinct derived seeds
    assert first.choices[0].token_ids == engine.generate(sampled("s3", 7, n=1), timeout=60).token_ids
    other = engine.generate(sampled("s4", 8), timeout=60)
    assert [c.token_ids for c in other.choices] != [c.token_ids for c in first.choices]
    # the same batch composition twice: the same answers
    runs = []
    for _ in range(2):
        hs = [engine.submit(sampled("mine", 7)), engine.submit(job("greedy-neighbour", prompt=OTHER, max_tokens=16))]
        runs.append([[c.token_ids for c in h.result(timeout=60).choices] for h in hs])
    assert runs[0] == runs[1]


def penalised_greedy(model, prompt, steps, *, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """The direct computation: transformers' logits, then logit_bias, repetition_penalty (prompt + output,
    divide positive / multiply negative), then OpenAI's mu[j] -= c[j] * frequency + (c[j] > 0) * presence,
    then argmax."""
    out: list[int] = []
    for _ in range(steps):
        mu = hf_logits(model, prompt + out)[-1].clone()
        for t, b in (bias or {}).items():
            mu[t] += b
        if repetition != 1.0:
            for t in set(prompt + out):
                mu[t] = mu[t] / repetition if mu[t] > 0 else mu[t] * repetition
        for t in set(out):
            c = out.count(t)
            mu[t] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
        out.append(int(mu.argmax()))
    return out


@pytest.mark.parametrize("kw", [dict(frequency=1.5), dict(presence=1.2), dict(frequency=0.6, presence=0.5),
                                dict(frequency=-0.5), dict(repetition=1.8), dict(bias={44: 5.0, 301: -100.0})],
                         ids=["frequency", "presence", "both", "negative-frequency", "repetition", "logit-bias"])
def test_penalties_change_tokens_as_the_formula_says(engine, adapter, hf, kw):
    plain = engine.generate(job("plain", adapter=adapter[1], max_tokens=24), timeout=60).token_ids
    want = penalised_greedy(hf["a19"], PROMPT, 24, **kw)
    j = job("pen", adapter=adapter[1], max_tokens=24, presence_penalty=kw.get("presence", 0.0),
            frequency_penalty=kw.get("frequency", 0.0), repetition_penalty=kw.get("repetition", 1.0),
            logit_bias=[[t, b] for t, b in kw.get("bias", {}).items()])
    # in a batch with unpenalised neighbours: the penalties are per request
    hs = [engine.submit(job("n1", adapter=adapter[1], max_tokens=24)), engine.submit(j),
          engine.submit(job("n2", prompt=OTHER, max_tokens=24, frequency_penalty=0.3))]
    got = [h.result(timeout=60) for h in hs]
    assert got[1].token_ids == want
    assert got[1].token_ids != plain  # the penalty changed the answer
    assert got[0].token_ids == plain
    assert got[2].token_ids == penalised_greedy(hf[None], OTHER, 24, frequency=0.3)


def test_streamed_deltas_of_n_choices_with_logprobs_add_up_to_the_result(engine, adapter):
    h = engine.submit(job("stream", adapter=adapter[1], n=3, temperature=0.9, seed=3, logprobs=2, max_tokens=24,
                          prompt_logprobs=0))
    deltas = list(h.deltas(timeout=60))
    res = h.result()
    assert res.ok and "prompt_logprobs" in deltas[0] and len(deltas[0]["prompt_logprobs"]) == len(PROMPT)
    for c in res.choices:
        mine = [d for d in deltas if d["index"] == c.index]
        assert "".join(d["text"] for d in mine) == c.text
        assert [e for d in mine for e in d["logprobs"]] == c.logprobs
    # what travels to the gateway survives JSON
    assert GenerationResult.from_dict(json.loads(json.dumps(res.to_dict()))) == res


def test_parameters_the_engine_cannot_honour_fail_that_request_only(engine):
    bad = [job("n0", n=0), job("n-huge", n=10_000), job("lp", logprobs=21), job("bias", logit_bias=[[10**6, 1.0]]),
           job("rep", repetition_penalty=0.0), job("pen", presence_penalty=float("nan"))]
    good = engine.submit(job("fine", n=2))
    results = [engine.generate(j, timeout=30) for j in bad]
    assert [r.error_code for r in results] == ["invalid_request"] * len(bad)
    assert good.result(timeout=60).ok


def test_pool_refcounts_free_a_shared_page_with_its_last_holder():
    pool = PagePool(num_layers=1, num_pages=8, page_elems=4, dtype=torch.float32, device="cpu")
    blocks = pool.allocate_blocks(3)
    pool.share_blocks(blocks[:2], 2)  # three holders of the first two
    assert pool.free_blocks(blocks) == [blocks[2]] and pool.kv_pages == 2
    assert pool.free_blocks(blocks[:2]) == [] and pool.kv_pages == 2
    assert pool.free_blocks(blocks[:2]) == blocks[:2] and pool.num_free == 8
    with pytest.raises(ValueError):
        pool.free_blocks(blocks[:1])
    with pytest.raises(ValueError):
        pool.share_blocks(blocks[:1])
