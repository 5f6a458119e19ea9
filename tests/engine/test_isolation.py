"""Issue 12: one tenant's numbers can neither break nor change another tenant's answers on a shared worker."""
import hashlib
import threading
import time

import torch
from safetensors.torch import save

from inference_worker.engine import Engine
from inference_worker.model import ModelRunner
from protocol.jobs import AdapterRef, GenerationJob
from protocol.lora_layout import ATTENTION_MODULES

PROMPT = [17, 120, 45, 301, 9, 77, 250, 13]


def huge_adapter(runner) -> tuple[bytes, AdapterRef]:
    """Finite weights near float32's maximum (they pass a NaN/Inf scan) whose LoRA delta overflows."""
    proj, t = runner.shape.projections(), {}
    for layer in range(runner.shape.num_layers):
        for m in ATTENTION_MODULES:
            d_in, d_out = proj[m]
            p = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            t[f"{p}.lora_A.weight"] = torch.full((8, d_in), 3e38)
            t[f"{p}.lora_B.weight"] = torch.full((d_out, 8), 3e38)
    blob = save(t)
    return blob, AdapterRef(version_id=9, sha256=hashlib.sha256(blob).hexdigest(), storage_key="huge", rank=8,
                            alpha=16.0, use_rslora=False, target_modules=list(ATTENTION_MODULES), name="huge")


def test_a_tenants_bad_numbers_never_end_another_tenants_stream(tiny_llama):
    """While tenant A streams 480 greedy tokens, tenant B sends temperatures 1e-300, 1e-45, 1e-38 and calls
    an adapter with weights near the dtype's maximum: A's stream completes with the tokens of a solo run;
    B's requests are answered (greedy) or fail alone with non_finite_logits, never an internal error."""
    runner = ModelRunner(tiny_llama, pool_pages=256, max_lora_rank=16)
    blob, huge = huge_adapter(runner)
    eng = Engine(runner, {"huge": blob}.__getitem__, max_running=16, prefill_chunk=32).start()
    try:
        a_job = GenerationJob("a-solo", None, prompt_token_ids=PROMPT, max_tokens=480, temperature=0.0,
                              ignore_eos=True)
        solo = eng.generate(a_job, timeout=120)
        assert solo.ok and len(solo.token_ids) == 480

        a = eng.submit(GenerationJob("a", None, prompt_token_ids=PROMPT, max_tokens=480, temperature=0.0,
                                     ignore_eos=True))
        streamed = []
        reader = threading.Thread(target=lambda: streamed.extend(a.stream(timeout=120)))
        reader.start()
        b_results = []
        for round_ in range(3):
            hs = [eng.submit(GenerationJob(f"b{round_}-{t}", None, prompt_token_ids=PROMPT[::-1], max_tokens=8,
                                           temperature=t, seed=3)) for t in (1e-300, 1e-45, 1e-38)]
            hs += [eng.submit(GenerationJob(f"b{round_}-huge-{t}", huge, prompt_token_ids=PROMPT, max_tokens=8,
                                            temperature=t)) for t in (0.0, 0.8)]
            b_results += [h.result(timeout=120) for h in hs]
        reader.join(timeout=120)
        got = a.result(timeout=120)
    finally:
        eng.stop()
    assert got.ok and got.token_ids == solo.token_ids and "".join(streamed) == got.text
    greedy_b = [r for r in b_results if "huge" not in r.request_id]
    assert all(r.ok for r in greedy_b)
    assert len({tuple(r.token_ids) for r in greedy_b}) == 1  # all three temperatures decode greedily
    huge_results = [r for r in b_results if "huge" in r.request_id]
    assert all(r.status == "error" and r.error_code == "non_finite_logits" for r in huge_results), \
        [(r.error_code, r.error_message) for r in huge_results]
    assert not any(r.error_code == "internal_error" for r in b_results)


def _submit_flood(eng, *, max_tokens: int, tenant: str = "flooder") -> list:
    """A flooding tenant's eight 400-token prompts."""
    return [eng.submit(GenerationJob(f"f{i}", None, prompt_token_ids=[(i * 31 + k) % 500 + 1 for k in range(400)],
                                     max_tokens=max_tokens, temperature=0.0, ignore_eos=True, tenant=tenant))
            for i in range(8)]


def _first_tokens_before_small(tiny_llama, fair: bool) -> int:
    """8 long prompts from a flooding tenant, then one small request from another: how many of the
    flood's requests produced their first token before the small one did."""
    runner = ModelRunner(tiny_llama, pool_pages=512, enable_lora=False)
    eng = Engine(runner, lambda k: b"", max_running=64, prefill_chunk=128)
    flood = _submit_flood(eng, max_tokens=4, tenant="flooder" if fair else "")
    small = eng.submit(GenerationJob("s", None, prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0,
                                     ignore_eos=True, tenant="small" if fair else ""))
    eng.start()  # everything is queued before the first step: the order is the scheduler's alone
    try:
        s = small.result(timeout=60)
        firsts = [h.result(timeout=60).first_token_s for h in flood]
    finally:
        eng.stop()
    return sum(f < s.first_token_s for f in firsts)


def test_fair_scheduling_serves_the_small_tenant_before_the_flood(tiny_llama):
    """VTC (Sheng et al., OSDI 2024): the tenant with the least service gets admission and the prefill budget
    first. Under FIFO the small tenant's prompt waits behind all eight long prompts; with VTC it is
    prefilled at once."""
    assert _first_tokens_before_small(tiny_llama, fair=False) == 8
    assert _first_tokens_before_small(tiny_llama, fair=True) <= 1


def test_a_tenant_arriving_mid_flood_is_prefilled_before_the_floods_queued_prompts(tiny_llama):
    """The flood's eight long prompts are admitted (and charged) at once but prefilled 128 tokens a step; a
    small request arriving after the first of those steps starts at the service the flood has *received*,
    not at what it has been charged for, so its prompt goes first in the next step's prefill budget. (When
    it started level with the charges, it waited behind the whole queued flood, as under FIFO.)"""
    runner = ModelRunner(tiny_llama, pool_pages=512, enable_lora=False)
    eng = Engine(runner, lambda k: b"", max_running=64, prefill_chunk=128)
    flood = _submit_flood(eng, max_tokens=1)
    eng.start()
    try:
        while eng.stats()["steps"] < 1:  # the flood is admitted and its prefill under way
            time.sleep(0.0005)
        at_submit = eng.stats()["steps"]
        small = eng.submit(GenerationJob("s", None, prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0,
                                         ignore_eos=True, tenant="small"))
        s = small.result(timeout=60)
        at_done = eng.stats()["steps"]
        assert all(h.result(timeout=60).ok for h in flood)
    finally:
        eng.stop()
    assert s.ok
    # 3200 prompt tokens at 128 a step: 25 steps of prefill (the flood asks one token each, so its counter
    # hardly moves until it is all in). The small request needs the next step for its prompt and three more
    # for its other tokens: 5 steps here; 19 when it started level with the flood's charges.
    assert at_done - at_submit <= 8, f"the small request took steps {at_submit}..{at_done}"


def _recording(runner) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Every forward the engine runs, as (start_pos, token ids) per sequence step."""
    forwards: list[list[tuple[int, tuple[int, ...]]]] = []
    forward = runner.forward

    def record(steps):
        forwards.append([(s.start_pos, tuple(s.token_ids)) for s in steps])
        return forward(steps)

    runner.forward = record
    return forwards


def test_a_newcomers_prompt_does_not_share_its_step_with_the_floods_prefill(tiny_llama):
    """On a CPU a step's time grows with its tokens: the small tenant's prompt is prefilled in a step that
    carries the flood's decodes but none of its queued prompt chunks (each longer than the small prompt's 8
    tokens); the flood's prefill goes on in the next step (in chunks bounded by the step's time while the small
    tenant decodes: tests/engine/test_scheduling.py)."""
    runner = ModelRunner(tiny_llama, pool_pages=512, enable_lora=False)
    forwards = _recording(runner)
    eng = Engine(runner, lambda k: b"", max_running=64, prefill_chunk=128)
    flood = _submit_flood(eng, max_tokens=4)
    eng.start()
    try:
        while eng.stats()["steps"] < 2:
            time.sleep(0.0005)
        small = eng.submit(GenerationJob("s", None, prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0,
                                         ignore_eos=True, tenant="small"))
        assert small.result(timeout=60).ok
        assert all(h.result(timeout=60).ok for h in flood)
    finally:
        eng.stop()
    at = next(i for i, f in enumerate(forwards) if (0, tuple(PROMPT)) in f)
    others = [ids for pos, ids in forwards[at] if (pos, ids) != (0, tuple(PROMPT))]
    assert all(len(ids) == 1 for ids in others), [len(ids) for ids in others]  # decodes only, if any
    # a flood prompt chunk: past the first 128-token chunk, before the end of its 400-token prompt
    assert any(len(PROMPT) + 8 < pos < 400 for pos, ids in forwards[at + 1]), "the flood's prefill goes on"


def test_tenants_level_with_each_other_share_a_prefill_step(tiny_llama):
    """Three tenants arriving together (counters level) have their prompts prefilled in one step, not one
    tenant a step."""
    runner = ModelRunner(tiny_llama, pool_pages=256, enable_lora=False)
    forwards = _recording(runner)
    eng = Engine(runner, lambda k: b"", max_running=16, prefill_chunk=128)
    hs = [eng.submit(GenerationJob(f"t{i}", None, prompt_token_ids=[p + i for p in PROMPT] * 3, max_tokens=2,
                                   temperature=0.0, ignore_eos=True, tenant=f"tenant-{i}")) for i in range(3)]
    eng.start()
    try:
        assert all(h.result(timeout=60).ok for h in hs)
    finally:
        eng.stop()
    assert sorted(len(ids) for _, ids in forwards[0]) == [24, 24, 24], forwards[0]


def test_one_busy_tenant_gets_the_whole_engine(tiny_llama):
    """Work-conserving: a tenant alone is admitted up to max_running at once, whatever its counter."""
    runner = ModelRunner(tiny_llama, pool_pages=512, enable_lora=False)
    eng = Engine(runner, lambda k: b"", max_running=16, prefill_chunk=512)
    hs = [eng.submit(GenerationJob(f"r{i}", None, prompt_token_ids=PROMPT, max_tokens=8, temperature=0.0,
                                   ignore_eos=True, tenant="only")) for i in range(16)]
    eng.start()
    try:
        assert all(h.result(timeout=60).ok for h in hs)
        assert eng.stats()["batch_size_max"] == 16
    finally:
        eng.stop()
