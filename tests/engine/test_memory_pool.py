"""One memory budget for KV cache and adapters (issue 13): the budget adds up, adapters cost their real rank
and targets, what can never fit is refused at once, and a fleet far larger than the pool is served."""
import hashlib
import random
import time
from collections import deque

import pytest
import torch
from safetensors.torch import save

from inference_worker.engine import Engine
from inference_worker.model import ModelRunner, onednn_packing_available
from protocol.jobs import AdapterRef, GenerationJob
from protocol.lora_layout import ATTENTION_MODULES, TARGET_MODULES, ModelShape
from protocol.memory import adapter_pages
from tests.support.peft_factory import make_random_peft_adapter

PROMPT = [17, 120, 45, 301, 9, 77, 250, 13]


def raw_adapter(shape: ModelShape, *, rank: int, targets, seed: int) -> bytes:
    """PEFT-named safetensors bytes of a random adapter (fast: no PEFT model is built)."""
    g = torch.Generator().manual_seed(seed)
    proj, t = shape.projections(), {}
    for layer in range(shape.num_layers):
        for m in targets:
            d_in, d_out = proj[m]
            p = f"base_model.model.model.layers.{layer}.{'self_attn' if m in ATTENTION_MODULES else 'mlp'}.{m}"
            t[f"{p}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in ** 0.5
            t[f"{p}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.5
    return save(t)


def ref_of(blob: bytes, key: str, *, rank: int, targets, alpha: float = 16.0, name: str = "") -> AdapterRef:
    return AdapterRef(version_id=1, sha256=hashlib.sha256(blob).hexdigest(), storage_key=key, rank=rank, alpha=alpha,
                      use_rslora=False, target_modules=list(targets), name=name or key)


def test_the_budget_adds_up_to_within_one_page(tiny_llama):
    """weights + workspace + pool pages == the budget (less than one page unused); KV blocks, adapter pages
    and free pages always add up to the pool."""
    budget = 64 * 2**20
    runner = ModelRunner(tiny_llama, memory_bytes=budget, max_running=16, max_batch_tokens=64)
    m = runner.memory
    assert m.weights_bytes == runner.weights_bytes > 0 and m.workspace_bytes > 0
    used = m.weights_bytes + m.workspace_bytes + runner.pool.num_pages * runner.pool.page_bytes
    assert budget - runner.pool.page_bytes < used <= budget
    assert runner.pool.bytes == m.pool_bytes and m.num_pages == runner.pool.num_pages

    shape = runner.shape
    runner.load_adapter(__import__("safetensors.torch", fromlist=["load"]).load(
        raw_adapter(shape, rank=8, targets=TARGET_MODULES, seed=1)), rank=8, scale=2.0)
    runner.kv.allocator.allocate(5)
    r = runner.memory_report()
    assert r["kv_blocks_used"] == 5 and r["adapter_pages"] == adapter_pages(shape, 8, TARGET_MODULES, 16)
    assert r["kv_blocks_used"] + r["adapter_pages"] + r["free_pages"] == r["pages"] == m.num_pages
    assert r["budget_bytes"] == budget and r["adapter_bytes_resident"] == r["adapter_pages"] * r["page_bytes"]


def test_a_budget_too_small_for_the_base_is_refused_with_the_figures(tiny_llama):
    with pytest.raises(ValueError, match="not one .* page"):
        ModelRunner(tiny_llama, memory_bytes=10_000)


def test_an_adapter_costs_its_real_rank_and_targets(tiny_llama):
    """r=8 attention-only takes <= 1/15 of the pool bytes of r=64 all-linear; on Llama-2-7B shapes the
    arithmetic gives 1/19.5, and 1/8 of an r=64 on the same targets: nothing is padded."""
    from safetensors.torch import load

    runner = ModelRunner(tiny_llama, pool_pages=512, max_lora_rank=64)
    shape = runner.shape
    free = runner.pool.num_free
    runner.load_adapter(load(raw_adapter(shape, rank=8, targets=ATTENTION_MODULES, seed=1)), rank=8, scale=1.0)
    small = free - runner.pool.num_free
    runner.load_adapter(load(raw_adapter(shape, rank=64, targets=TARGET_MODULES, seed=2)), rank=64, scale=1.0)
    big = free - small - runner.pool.num_free
    assert small * 15 <= big, (small, big)

    llama7b = ModelShape(num_layers=32, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32,
                         head_dim=128)
    r8_attn = adapter_pages(llama7b, 8, ATTENTION_MODULES, 16)
    assert adapter_pages(llama7b, 64, TARGET_MODULES, 16) / r8_attn == 19.5
    assert adapter_pages(llama7b, 64, ATTENTION_MODULES, 16) == 8 * r8_attn


def test_what_can_never_fit_is_refused_at_once(tiny_llama):
    """Under pressure the engine queues; but a request whose KV alone exceeds the pool, or whose adapter
    plus KV does, fails at once with a clear code instead of waiting forever."""
    from safetensors.torch import load  # noqa: F401

    shape = ModelShape.from_config(ModelRunner(tiny_llama, pool_pages=1, enable_lora=False).config)
    big = raw_adapter(shape, rank=64, targets=TARGET_MODULES, seed=3)
    big_ref = ref_of(big, "big", rank=64, targets=TARGET_MODULES)
    pages = adapter_pages(shape, 64, TARGET_MODULES, 16)
    runner = ModelRunner(tiny_llama, pool_pages=20, max_lora_rank=64)  # 320 positions, a third of the adapter
    assert pages > 20
    eng = Engine(runner, {"big": big}.__getitem__, max_running=4).start()
    try:
        t0 = time.perf_counter()
        too_long = eng.generate(GenerationJob("long", None, prompt_token_ids=PROMPT * 40, max_tokens=500 - 320,
                                              temperature=0.0), timeout=10)
        huge = eng.generate(GenerationJob("huge", big_ref, prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0),
                            timeout=10)
        assert time.perf_counter() - t0 < 5
        assert (too_long.status, too_long.error_code) == ("error", "prompt_too_long")
        assert (huge.status, huge.error_code) == ("error", "adapter_too_large")
        assert f"{pages} pages" in huge.error_message
        ok = eng.generate(GenerationJob("ok", None, prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0), timeout=10)
        assert ok.ok
    finally:
        eng.stop()


@pytest.mark.django_db
@pytest.mark.parametrize("base_fixture,adapter_dtype", [("tiny_llama", None), ("tiny_llama", "bfloat16"),
                                                        ("tiny_tied_wide", None)])
def test_capacity_agrees_with_worker_status_of_a_worker_built_from_the_same_numbers(request, tmp_path, base_fixture,
                                                                                   adapter_dtype):
    """`manage.py capacity --memory-gb G --mix ...` prints the split a worker built with G reports in
    worker_status, and the adapter pages that fleet takes once resident; with `--adapter-dtype bfloat16`, those of
    a worker with the 16-bit adapter pool (half as many). A tied model wide enough for packed weights: the
    worker's packed copy of its LM head is in both figures."""
    base_dir = request.getfixturevalue(base_fixture)
    import json
    from io import StringIO

    from django.core.management import call_command

    from adapters.services import register_base_model
    from inference_worker.worker import WorkerRuntime

    base = register_base_model("tinycap", base_dir, max_lora_rank=64)
    gb, running, chunk = 0.05, 8, 32
    out = StringIO()
    call_command("capacity", "--base", base.slug, "--rank", "16", "--adapters", "1", "--gpu-gb", "1",
                 "--memory-gb", str(gb), "--dtype", "fp32", "--max-running", str(running), "--prefill-chunk",
                 str(chunk), "--mix", "8:attention-only:2,16:all-linear:1,4:q_proj+v_proj:3", "--json",
                 *(["--adapter-dtype", adapter_dtype] if adapter_dtype else []), stdout=out)
    plan = json.loads(out.getvalue())["pool"]

    shape = ModelShape.from_config(base.shape_manifest)
    mix = [(8, ATTENTION_MODULES, 2), (16, TARGET_MODULES, 1), (4, ("q_proj", "v_proj"), 3)]
    blobs, refs = {}, []
    for i, (rank, targets, count) in enumerate(mix):
        for k in range(count):
            key = f"m{i}-{k}"
            blobs[key] = raw_adapter(shape, rank=rank, targets=targets, seed=10 * i + k)
            refs.append(ref_of(blobs[key], key, rank=rank, targets=targets))
    runner = ModelRunner(base_dir, memory_bytes=int(gb * 1e9), max_running=running,
                         max_batch_tokens=chunk + running, max_lora_rank=64,
                         adapter_dtype=getattr(torch, adapter_dtype) if adapter_dtype else None)
    engine = Engine(runner, blobs.__getitem__, max_running=running, prefill_chunk=chunk).start()
    try:
        for ref in refs:
            assert engine.generate(GenerationJob(ref.name, ref, prompt_token_ids=PROMPT, max_tokens=2,
                                                 temperature=0.0), timeout=30).ok
        runtime = WorkerRuntime(base_slug=base.slug, base_sha256=base.sha256, queue=base.queue_name,
                                checkpoint_path=str(base_dir), engine=engine, worker_id="w", device="cpu",
                                concurrency=running)
        mem = runtime.status()["memory"]
    finally:
        engine.stop()
    if base_fixture == "tiny_tied_wide" and onednn_packing_available(torch.device("cpu"), torch.float32):
        assert runner.head_copy_bytes == 512 * 512 * 4 and mem["head_copy_bytes"] == runner.head_copy_bytes
    split, fleet = plan["split"], plan["fleet"]
    assert (mem["budget_bytes"], mem["weights_bytes"], mem["workspace_bytes"]) == \
        (split["budget_bytes"], split["weights_bytes"], split["workspace_bytes"])
    assert (mem["pages"], mem["page_bytes"], mem["pool_bytes"]) == \
        (split["num_pages"], split["page_bytes"], split["pool_bytes"])
    assert mem["adapter_pages"] == fleet["adapter_pages"] and mem["kv_blocks_used"] == 0
    assert mem["free_pages"] == fleet["kv_pages"]
    assert mem["resident_adapters_by_rank"] == {"4": 3, "8": 2, "16": 1}
    fp32_pages = sum(adapter_pages(shape, r, t, 16) * n for r, t, n in mix)
    assert mem["adapter_pages"] == (fp32_pages if adapter_dtype is None else
                                    sum(adapter_pages(shape, r, t, 16, 2) * n for r, t, n in mix))
    if adapter_dtype:
        assert mem["adapter_pages"] <= fp32_pages / 2 + len(refs) and mem["adapter_dtype"] == adapter_dtype


def test_capacity_refuses_an_adapter_dtype_no_worker_can_store():
    from adapters.capacity import PRESET_NAMES, CapacityError, plan_pool, preset_manifest

    manifest = preset_manifest(PRESET_NAMES[0])
    for dtype, adapter_dtype in (("bf16", "fp32"), ("fp32", "fp8")):
        with pytest.raises(CapacityError, match="or in fp16 / bf16 beside an fp32 model"):
            plan_pool(manifest, budget_bytes=10**11, dtype=dtype, adapter_dtype=adapter_dtype)


def test_a_thousand_adapters_through_a_pool_that_holds_twenty(tiny_llama, tmp_path):
    """1,000 adapters (ranks 4-16, mixed targets), a pool that holds ~20 of them beside the KV blocks, 10,000
    requests with Zipf(1.1) traffic: every request answered, the hot adapters' greedy tokens equal PEFT's,
    no adapter evicted while a sequence uses it, and the pool left with no KV blocks in use."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    runner = ModelRunner(tiny_llama, pool_pages=1, max_lora_rank=16, enable_lora=False)
    shape = runner.shape
    target_sets = [ATTENTION_MODULES, TARGET_MODULES, ("q_proj", "v_proj"), ("o_proj", "down_proj", "up_proj")]
    blobs, refs, peft_dirs = {}, [], {}
    for i in range(1000):
        rank, targets = (4, 8, 16)[i % 3], target_sets[i % 4]
        key = f"a{i}"
        if i < 5:  # the hottest adapters are real PEFT adapters, checked against PEFT below
            d = make_random_peft_adapter(tiny_llama, tmp_path / key, r=rank, alpha=2 * rank, target_modules=targets,
                                         seed=i)
            blobs[key] = (d / "adapter_model.safetensors").read_bytes()
            peft_dirs[i] = d
            refs.append(ref_of(blobs[key], key, rank=rank, targets=targets, alpha=2.0 * rank))
        else:
            blobs[key] = raw_adapter(shape, rank=rank, targets=targets, seed=i)
            refs.append(ref_of(blobs[key], key, rank=rank, targets=targets))
    mean_pages = sum(adapter_pages(shape, r.rank, r.target_modules, 16) for r in refs) / len(refs)
    max_running = 32
    pool_pages = int(20 * mean_pages) + max_running * 2
    runner = ModelRunner(tiny_llama, pool_pages=pool_pages, max_lora_rank=16, max_running=max_running)
    eng = Engine(runner, blobs.__getitem__, max_running=max_running, prefill_chunk=128,
                 host_cache_bytes=4 << 20).start()

    violations = []
    real_unload = runner.unload_adapter

    def unload(slot):  # pinned adapters are never evicted
        key = runner.lora._slots[slot].key
        if eng.cache.pinned().get(key, 0):
            violations.append(key)
        real_unload(slot)

    runner.unload_adapter = unload
    weights = [1 / (k + 1) ** 1.1 for k in range(1000)]
    picks = rng.choices(range(1000), weights=weights, k=10_000)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 12))] for _ in range(50)]
    results, outstanding = {}, deque()
    t0 = time.perf_counter()
    try:
        for n, i in enumerate(picks):
            job = GenerationJob(f"r{n}", refs[i], prompt_token_ids=prompts[n % 50], max_tokens=4, temperature=0.0,
                                ignore_eos=True)
            outstanding.append((n, i, eng.submit(job)))
            while len(outstanding) >= 4 * max_running:
                k, a, h = outstanding.popleft()
                results[k] = (a, h.result(timeout=120))
        while outstanding:
            k, a, h = outstanding.popleft()
            results[k] = (a, h.result(timeout=120))
        stats = eng.stats()
    finally:
        eng.stop()
    elapsed = time.perf_counter() - t0
    assert len(results) == 10_000
    failed = [(k, r.error_code, r.error_message) for k, (_, r) in results.items() if not r.ok]
    assert not failed, failed[:5]
    assert all(len(r.token_ids) == 4 for _, r in results.values())
    assert not violations
    assert stats["memory"]["kv_blocks_used"] == 0
    assert stats["cache"]["evictions"] > 100 and stats["admissions_waited_memory"] >= 0
    assert len(eng.resident_adapters()) <= pool_pages  # bounded by the pool, not by a slot count
    print(f"10,000 requests over 1,000 adapters in {elapsed:.1f} s; {stats['cache']['cold_loads']} cold loads, "
          f"{stats['cache']['evictions']} evictions, {stats['admissions_waited_memory']} admissions waited")

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    for i, d in peft_dirs.items():
        model = PeftModel.from_pretrained(base, str(d)).eval()
        seen = [(k, r) for k, (a, r) in results.items() if a == i][:3]
        assert seen, f"adapter {i} was never requested"
        for k, r in seen:
            ids = torch.tensor([prompts[k % 50]])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                     min_new_tokens=4)[0, ids.shape[1]:].tolist()
            assert r.token_ids == out, (i, k)
        base = model.unload()



