"""Sampling and stopping: what a caller sees in tokens and text."""
import json

import pytest
import torch

from inference_worker.sampling import IncrementalText, RequestSampler, SamplingParams, SequenceSampling, sample_step
from protocol.jobs import AdapterRef, GenerationJob, GenerationResult


class ByteTokenizer:
    """One token per byte (ids 0..255) plus 256 = a special EOS; multi-byte characters span tokens."""

    eos_token_id = 256

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode(self, text):
        return list(text.encode("utf-8"))


def feed(text_state: IncrementalText, s: str) -> bool:
    stopped = False
    for t in s.encode("utf-8"):
        stopped = text_state.append(t)
        if stopped:
            break
    return stopped


def test_job_and_result_round_trip_through_json():
    ref = AdapterRef(version_id=3, sha256="ab" * 32, storage_key="adapters/ab", rank=16, alpha=32.0,
                     use_rslora=True, target_modules=["q_proj", "v_proj"], name="support-bot")
    job = GenerationJob(request_id="r1", adapter=ref, prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9,
                        top_k=40, seed=11, stop=["\n\n"], stop_token_ids=[2], ignore_eos=True)
    back = GenerationJob.from_dict(json.loads(json.dumps(job.to_dict())))
    assert back == job
    assert back.adapter.scale == pytest.approx(32.0 / 4.0)  # rsLoRA: alpha / sqrt(r)
    base = GenerationJob.from_dict(json.loads(json.dumps(GenerationJob("r2", None, prompt_token_ids=[1, 2]).to_dict())))
    assert base.adapter is None and base.prompt_token_ids == [1, 2]
    res = GenerationResult(request_id="r1", status="ok", token_ids=[5, 6], text="ok", finish_reason="length",
                           prompt_tokens=2, completion_tokens=2, adapter_sha256=ref.sha256, queued_s=0.1,
                           first_token_s=0.2, total_s=0.3)
    assert GenerationResult.from_dict(json.loads(json.dumps(res.to_dict()))) == res


def _batch(rows: int, sampled: dict[int, SequenceSampling]) -> list[SequenceSampling]:
    """One sampling state per row: `sampled`'s where given, greedy elsewhere."""
    return [sampled.get(row) or SequenceSampling(SamplingParams(temperature=0.0)) for row in range(rows)]


def test_greedy_rows_take_the_argmax_and_sampled_rows_follow_their_seed():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    batch = _batch(4, {2: SequenceSampling(SamplingParams(temperature=1.0, seed=123))})
    tokens = sample_step(logits, batch).tokens
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] == int(logits[3].argmax())
    # The same seed gives the same draws whatever else is in the batch.
    alone = [SequenceSampling(SamplingParams(temperature=1.0, seed=123))]
    draws_in_batch = [tokens[2]] + [sample_step(logits, batch).tokens[2] for _ in range(20)]
    draws_alone = [sample_step(logits[2:3], alone).tokens[0] for _ in range(21)]
    assert draws_in_batch == draws_alone
    other = RequestSampler(SamplingParams(temperature=1.0, seed=124))
    assert [other.sample(logits[2]) for _ in range(21)] != draws_alone


def test_top_k_and_top_p_only_sample_from_the_allowed_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0, -2.0])
    topk = RequestSampler(SamplingParams(temperature=2.0, top_k=2, seed=0))
    assert {topk.sample(logits) for _ in range(200)} == {0, 1}
    # softmax: p0 ~ .66, p1 ~ .24, p2 ~ .09; top_p .8 keeps tokens 0 and 1 (0 alone is < .8).
    topp = RequestSampler(SamplingParams(temperature=1.0, top_p=0.8, seed=0))
    assert {topp.sample(logits) for _ in range(300)} == {0, 1}
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(top_p=0.0).validate() is not None


def test_stop_string_split_across_tokens_is_cut_from_the_text():
    t = IncrementalText(ByteTokenizer(), [65], stop=["END"])
    assert not feed(t, "hello E")
    assert t.stable_text_len(False) == len("hello ")  # "E" may start "END": held back from the stream
    assert not feed(t, "N")
    assert feed(t, "D and more")
    assert t.text == "hello " and t.stopped


def test_the_earliest_of_several_stop_strings_wins():
    t = IncrementalText(ByteTokenizer(), [65], stop=["xyz", "\n\n"])
    assert feed(t, "a\n\nxyz")
    assert t.text == "a"


def test_multibyte_characters_are_emitted_whole():
    t = IncrementalText(ByteTokenizer(), [65])
    b = "né€".encode()
    seen = []
    for tok in b:
        t.append(tok)
        seen.append(t.text)
    assert all("\ufffd" not in s for s in seen)
    assert t.text == "né€"
    # An unfinished character at the end is still returned by flush (as U+FFFD).
    t.append(0xE2)
    t.flush()
    assert t.text.startswith("né€") and len(t.text) == 4


def test_tiny_temperatures_are_greedy_and_non_finite_rows_fail_alone():
    """Issue 12: temperatures that pass the 0-2 check but overflow logits / t (1e-300, 1e-45, 1e-38) decode
    greedily; a row with NaN or inf logits fails alone and names why; the other rows keep their tokens."""
    logits = torch.randn(4, 50)
    for t in (1e-300, 1e-45, 1e-38, 1e-6):
        assert SamplingParams(temperature=t).greedy
    assert SamplingParams(temperature=float("nan")).validate() is not None
    assert SamplingParams(temperature=float("inf")).validate() is not None
    bad = logits.clone()
    bad[1, 3] = float("nan")
    bad[2, 7] = float("inf")
    step = sample_step(bad, _batch(4, {2: SequenceSampling(SamplingParams(temperature=0.7, seed=1)),
                                       3: SequenceSampling(SamplingParams(temperature=0.7, seed=1))}))
    tokens, failed = step.tokens, step.failed
    assert set(failed) == {1, 2} and "non-finite" in str(failed[1])
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[3] == RequestSampler(SamplingParams(temperature=0.7, seed=1)).sample(logits[3])


def test_only_rows_holding_a_nan_or_an_infinity_fail_even_when_a_finite_row_sums_past_the_float_range():
    from inference_worker.sampling import non_finite_rows

    logits = torch.zeros(6, 1000)
    logits[1, 7] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, 5], logits[3, 6] = float("inf"), float("-inf")  # sums to NaN
    logits[4] = 3e38  # finite, but its sum overflows to inf: checked element by element, and kept
    logits[5, 999] = float("-inf")
    assert non_finite_rows(logits) == [1, 2, 3, 5]
    assert non_finite_rows(torch.randn(64, 49152)) == []
