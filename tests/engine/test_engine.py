"""The engine as the worker uses it: submit from many threads, results that do not depend on the batch."""
import hashlib
import random
import time
from pathlib import Path

import pytest
import torch

from inference_worker.engine import Engine
from inference_worker.model import ModelRunner
from protocol.jobs import AdapterRef, GenerationJob
from protocol.lora_layout import TARGET_MODULES as ALL_TARGETS
from tests.support.peft_factory import make_random_peft_adapter

TARGET_SETS = [("q_proj", "v_proj"), ALL_TARGETS, ("o_proj", "down_proj"), ("k_proj", "gate_proj", "up_proj")]
RANKS = [4, 8, 16, 32, 64]
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and keeps running through the field until night falls",
    "In a small village",
    "She opened the door, looked around the empty room, and said",
    "Hello",
]


class Fleet:
    """PEFT-made adapters of one tiny base, their refs, and a dict-backed loader that counts reads."""

    def __init__(self, base: Path, root: Path, n: int):
        self.base, self.dirs, self.refs, self.blobs, self.reads = base, [], [], {}, []
        for i in range(n):
            r, targets, rslora = RANKS[i % len(RANKS)], TARGET_SETS[i % len(TARGET_SETS)], i % 3 == 2
            d = make_random_peft_adapter(base, root / f"a{i}", r=r, alpha=2 * r if i % 2 else 16,
                                         target_modules=targets, use_rslora=rslora, seed=100 + i)
            blob = (d / "adapter_model.safetensors").read_bytes()
            key = f"adapters/{i}"
            self.blobs[key] = blob
            self.dirs.append(d)
            self.refs.append(AdapterRef(version_id=i + 1, sha256=hashlib.sha256(blob).hexdigest(), storage_key=key,
                                        rank=r, alpha=float(2 * r if i % 2 else 16), use_rslora=rslora,
                                        target_modules=list(targets), name=f"a{i}"))

    def loader(self, key: str) -> bytes:
        self.reads.append(key)
        return self.blobs[key]


@pytest.fixture(scope="module")
def fleet(tiny_llama, tmp_path_factory) -> Fleet:
    return Fleet(tiny_llama, tmp_path_factory.mktemp("fleet"), 32)


def make_engine(base, loader, *, pool_pages=512, **kw) -> Engine:
    runner = ModelRunner(base, pool_pages=pool_pages, max_lora_rank=64)
    return Engine(runner, loader, **kw).start()


@pytest.fixture
def engine(fleet):
    eng = make_engine(fleet.base, fleet.loader, prefill_chunk=16)
    yield eng
    eng.stop()


def greedy(rid, adapter, prompt, max_tokens=24, **kw) -> GenerationJob:
    return GenerationJob(request_id=rid, adapter=adapter, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                         ignore_eos=True, **kw)


def test_greedy_tokens_do_not_depend_on_the_batch(engine, fleet):
    """32 requests on 32 adapters (ranks 4..64, different targets, some rsLoRA) plus base requests,
    arriving at staggered times with prompts longer than the prefill chunk: each gets the tokens it
    gets when it runs alone."""
    jobs = [greedy(f"r{i}", fleet.refs[i], PROMPTS[i % len(PROMPTS)]) for i in range(32)]
    jobs += [greedy(f"base{i}", None, PROMPTS[i]) for i in range(2)]
    alone = {j.request_id: engine.generate(j, timeout=60) for j in jobs}
    assert all(r.ok and len(r.token_ids) == 24 for r in alone.values())
    # Adapters change outputs (otherwise this test would prove nothing).
    assert len({tuple(r.token_ids) for r in alone.values()}) > 20

    rng = random.Random(0)
    handles = {}
    for j in rng.sample(jobs, len(jobs)):
        handles[j.request_id] = engine.submit(j)
        time.sleep(rng.choice([0, 0, 0.002, 0.01]))
    together = {rid: h.result(timeout=120) for rid, h in handles.items()}
    for rid, res in together.items():
        assert res.ok, res.error_message
        assert res.token_ids == alone[rid].token_ids, rid
        assert res.text == alone[rid].text
    stats = engine.stats()
    assert stats["distinct_adapters_max"] >= 8 and stats["batch_size_max"] >= 16
    assert stats["memory"]["kv_blocks_used"] == 0  # every request gave its KV blocks back
    assert stats["cache"]["cold_loads"] == 32  # the second round was served from the cache
    assert engine.metrics.requests_finished == 2 * len(jobs)


def test_engine_greedy_equals_peft_generate(fleet):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    i = 17  # rank 16, all seven projections, rsLoRA
    ref = fleet.refs[i]
    assert set(ref.target_modules) == set(ALL_TARGETS)
    tok = AutoTokenizer.from_pretrained(str(fleet.base))
    model = AutoModelForCausalLM.from_pretrained(str(fleet.base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(fleet.dirs[i])).eval()
    eng = make_engine(fleet.base, fleet.loader)
    try:
        for prompt in PROMPTS[:3]:
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
            res = eng.generate(GenerationJob("p", ref, prompt=prompt, max_tokens=20, temperature=0.0), timeout=60)
            assert res.ok and res.token_ids == out
            assert res.adapter_sha256 == ref.sha256
    finally:
        eng.stop()


def test_a_failing_request_fails_alone(fleet):
    """Corrupted blob, unreadable blob, over-long prompt and a forward pass that raises for one sequence:
    each fails with its own code; the requests batched with them finish with their usual tokens."""
    blobs = dict(fleet.blobs)
    blobs["corrupt"] = blobs["adapters/9"][:-1] + bytes([blobs["adapters/9"][-1] ^ 0xFF])
    corrupt_ref = AdapterRef(**{**fleet.refs[9].to_dict(), "storage_key": "corrupt"})

    def loader(key):
        if key == "missing":
            raise FileNotFoundError(key)
        return blobs[key]

    missing_ref = AdapterRef(**{**fleet.refs[2].to_dict(), "storage_key": "missing", "sha256": "0" * 64})
    poison = 7  # a token id whose forward pass raises, to exercise the per-sequence fallback
    eng = make_engine(fleet.base, loader)
    real_forward = eng.runner.forward

    def forward(steps):
        if any(poison in s.token_ids for s in steps):
            raise RuntimeError("device fault")
        return real_forward(steps)

    eng.runner.forward = forward
    try:
        good = [greedy(f"g{i}", fleet.refs[i], PROMPTS[i]) for i in range(4)]
        alone = [eng.generate(j, timeout=60).token_ids for j in good]
        bad = [
            greedy("corrupt", corrupt_ref, "Hi there"),
            greedy("missing", missing_ref, "Hi there"),
            greedy("long", fleet.refs[0], "x", prompt_token_ids=[5] * 600),
            GenerationJob("poison", None, prompt_token_ids=[3, 4, poison], max_tokens=5, temperature=0.0),
            GenerationJob("bad-params", None, prompt="Hi", top_p=0.0),
        ]
        handles = [eng.submit(j) for j in bad[:2] + good[:2] + bad[2:] + good[2:]]
        results = {h.request_id: h.result(timeout=60) for h in handles}
        for j, want in zip(good, alone, strict=True):
            assert results[j.request_id].ok and results[j.request_id].token_ids == want
        codes = {rid: (r.status, r.error_code) for rid, r in results.items() if not r.ok}
        assert codes == {
            "corrupt": ("error", "adapter_integrity_error"),
            "missing": ("error", "adapter_load_failed"),
            "long": ("error", "prompt_too_long"),
            "poison": ("error", "internal_error"),
            "bad-params": ("error", "invalid_request"),
        }
        assert results["corrupt"].adapter_sha256 is None  # never served
        assert corrupt_ref.identity not in eng.resident_adapters()
        assert eng.stats()["memory"]["kv_blocks_used"] == 0
    finally:
        eng.stop()


def test_cancel_frees_the_request_at_once(engine, fleet):
    ref = fleet.refs[3]
    h = engine.submit(greedy("long", ref, PROMPTS[0], max_tokens=400))
    other = engine.submit(greedy("other", fleet.refs[4], PROMPTS[1], max_tokens=30))
    first = next(iter(h.stream(timeout=30)))
    assert first
    h.cancel()
    res = h.result(timeout=30)
    assert res.finish_reason == "cancelled" and res.error_code == "cancelled"
    assert 0 < res.completion_tokens < 400
    assert other.result(timeout=60).ok
    time.sleep(0.05)
    stats = engine.stats()
    assert stats["memory"]["kv_blocks_used"] == 0  # every request gave its KV blocks back
    assert ref.identity not in engine.cache.pinned()
    # A request cancelled while still queued ends cancelled; its neighbours are unaffected.
    queued = [engine.submit(greedy(f"q{i}", None, PROMPTS[0], max_tokens=5)) for i in range(3)]
    queued[1].cancel()
    assert [q.result(timeout=30).finish_reason for q in queued] == ["length", "cancelled", "length"]


def test_stop_strings_and_stop_tokens_end_the_answer(engine, fleet):
    ref = fleet.refs[5]
    full = engine.generate(greedy("full", ref, PROMPTS[2], max_tokens=30), timeout=60)
    text = full.text
    # A stop string that starts inside one token and ends in a later one.
    mid = len(text) // 2
    stop = text[mid : mid + 4]
    assert len(stop) == 4
    cut = text.find(stop)
    h = engine.submit(greedy("stopped", ref, PROMPTS[2], max_tokens=30, stop=["never-there", stop]))
    streamed = "".join(h.stream(timeout=60))
    res = h.result()
    assert res.finish_reason == "stop" and res.text == text[:cut] and streamed == res.text
    assert res.completion_tokens < 30

    tok = full.token_ids[10]
    first = full.token_ids.index(tok)
    res = engine.generate(greedy("stop-id", ref, PROMPTS[2], max_tokens=30, stop_token_ids=[tok]), timeout=60)
    assert res.finish_reason == "stop" and res.token_ids == full.token_ids[: first + 1]

    res = engine.generate(greedy("length", ref, PROMPTS[2], max_tokens=7), timeout=60)
    assert res.finish_reason == "length" and res.token_ids == full.token_ids[:7]
    assert 0 <= res.queued_s <= res.first_token_s <= res.total_s


def test_eos_ends_generation_unless_ignored(engine):
    eos = engine.runner.config.eos_token_id
    prompt = [3, 4, 5]
    free = engine.generate(GenerationJob("free", None, prompt_token_ids=prompt, max_tokens=12, temperature=0.0,
                                         ignore_eos=True), timeout=60)
    # Force EOS as the answer by treating the model's first token as EOS for this run.
    engine.eos_ids = frozenset({free.token_ids[0], eos})
    res = engine.generate(GenerationJob("eos", None, prompt_token_ids=prompt, max_tokens=12, temperature=0.0), timeout=60)
    assert res.finish_reason == "stop" and res.token_ids == free.token_ids[:1]
    res = engine.generate(GenerationJob("ign", None, prompt_token_ids=prompt, max_tokens=12, temperature=0.0,
                                        ignore_eos=True), timeout=60)
    assert res.token_ids == free.token_ids


def test_seeded_sampling_is_reproducible_inside_any_batch(engine, fleet):
    def job(rid, seed, adapter=fleet.refs[7]):
        return GenerationJob(rid, adapter, prompt=PROMPTS[3], max_tokens=20, temperature=0.9, top_p=0.95,
                             top_k=50, seed=seed, ignore_eos=True)

    alone = engine.generate(job("alone", 42), timeout=60).token_ids
    handles = [engine.submit(job(f"n{i}", 1000 + i, fleet.refs[i])) for i in range(8)]
    mine = engine.submit(job("mine", 42))
    handles += [engine.submit(job(f"m{i}", 2000 + i, fleet.refs[i])) for i in range(8)]
    assert mine.result(timeout=60).token_ids == alone
    others = [h.result(timeout=60).token_ids for h in handles]
    assert alone not in others[:1] and len({tuple(o) for o in others}) > 8
    assert engine.generate(job("again", 43), timeout=60).token_ids != alone


def test_memory_pressure_and_cold_loads(fleet):
    """A pool that holds the two largest of six adapters and a few KV blocks: admission waits for pages,
    idle adapters are evicted to make room, every answer is right; ten simultaneous requests for one cold
    adapter read its blob once."""
    probe = make_engine(fleet.base, fleet.loader)
    pages = sorted(probe.cache.pages_for(fleet.refs[10 + i]) for i in range(6))
    probe.stop()
    eng = make_engine(fleet.base, fleet.loader, pool_pages=pages[-1] + pages[-2] + 8)
    try:
        jobs = [greedy(f"s{i}", fleet.refs[10 + i], PROMPTS[i % 5], max_tokens=12) for i in range(6)]
        alone = [eng.generate(j, timeout=60).token_ids for j in jobs]
        handles = [eng.submit(j) for j in jobs]
        assert [h.result(timeout=60).token_ids for h in handles] == alone
        stats = eng.stats()
        assert len(eng.resident_adapters()) < 6 and stats["cache"]["evictions"] >= 4
        assert stats["admissions_waited_memory"] >= 1
        assert stats["memory"]["kv_blocks_used"] == 0

        before = len(fleet.reads)
        ref = fleet.refs[20]
        hs = [eng.submit(greedy(f"c{i}", ref, PROMPTS[0], max_tokens=4)) for i in range(10)]
        assert len({tuple(h.result(timeout=60).token_ids) for h in hs}) == 1
        assert fleet.reads[before:] == [ref.storage_key]
    finally:
        eng.stop()


def test_requests_after_stop_are_answered_not_lost(fleet):
    eng = make_engine(fleet.base, fleet.loader)
    eng.stop()
    res = eng.submit(greedy("late", None, PROMPTS[0])).result(timeout=5)
    assert res.status == "error" and res.error_code == "engine_stopped"
