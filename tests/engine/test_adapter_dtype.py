"""The 16-bit adapter pool (ModelRunner(adapter_dtype=...), run_worker --adapter-dtype): beside an fp32 model,
adapters stored in fp16 or bf16 take half the pages and compute what PEFT computes on those stored weights.

PEFT is the oracle: an adapter saved in fp16 / bf16 (the same random weights as the fp32 one, rounded to
nearest), loaded onto the fp32 transformers model. An fp32 upload is rounded to nearest as it is placed; a
16-bit upload is stored exactly, so it answers as from an fp32 pool (to fp32 summation order).
"""
import pytest
import torch
from peft import PeftModel

from inference_worker.lora import LoraPool, NoRoom
from inference_worker.memory_pool import PagePool
from inference_worker.model import ModelRunner
from protocol.lora_layout import TARGET_MODULES, ModelShape
from protocol.memory import adapter_pages, page_elements
from tests.engine.test_model_parity import PROMPT, Seq, greedy, hf_greedy, hf_model, load_peft_into
from tests.support.peft_factory import make_random_peft_adapter

HALF = [torch.float16, torch.bfloat16]


def adapters(base, tmp_path, dtype):
    """The same random adapter saved in fp32 and in `dtype` (PEFT rounds to nearest when it casts)."""
    kw = dict(r=16, alpha=32, target_modules=TARGET_MODULES, seed=11)
    return (make_random_peft_adapter(base, tmp_path / "fp32", **kw),
            make_random_peft_adapter(base, tmp_path / "half", dtype=dtype, **kw))


def logits_of(runner, slot, prompt=PROMPT):
    seq = Seq(runner, len(prompt) + 1, slot)
    out = runner.forward([seq.step(prompt)])
    seq.free()
    return out


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_16_bit_pool_answers_what_peft_answers_on_the_stored_weights(tiny_llama, tmp_path, dtype):
    fp32_dir, half_dir = adapters(tiny_llama, tmp_path, dtype)
    theirs = hf_greedy(PeftModel.from_pretrained(hf_model(tiny_llama), str(half_dir)).eval(), PROMPT, 32)

    runner = ModelRunner(tiny_llama, pool_pages=256, max_lora_rank=32, adapter_dtype=dtype)
    from_fp32, from_half = load_peft_into(runner, fp32_dir), load_peft_into(runner, half_dir)
    assert greedy(runner, PROMPT, 32, slot=from_fp32) == theirs
    assert greedy(runner, PROMPT, 32, slot=from_half) == theirs
    assert theirs != greedy(runner, PROMPT, 32, slot=-1)  # the adapter changes the answer
    # an fp32 upload is rounded to nearest as it is placed: the very weights of the 16-bit file
    assert torch.equal(logits_of(runner, from_fp32), logits_of(runner, from_half))
    assert runner.memory_report()["adapter_dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_16_bit_upload_answers_as_from_an_fp32_pool_in_half_the_pages(tiny_llama, tmp_path, dtype):
    _, half_dir = adapters(tiny_llama, tmp_path, dtype)
    fp32_pool = ModelRunner(tiny_llama, pool_pages=256, max_lora_rank=32)
    half_pool = ModelRunner(tiny_llama, pool_pages=256, max_lora_rank=32, adapter_dtype=dtype)
    wide, narrow = load_peft_into(fp32_pool, half_dir), load_peft_into(half_pool, half_dir)
    # the same stored values either way: only the kernels' fp32 summation order may differ (-ffast-math)
    torch.testing.assert_close(logits_of(half_pool, narrow), logits_of(fp32_pool, wide), rtol=1e-5, atol=1e-5)
    pages = fp32_pool.pool.adapter_pages, half_pool.pool.adapter_pages
    assert pages == (adapter_pages(fp32_pool.shape, 16, TARGET_MODULES, 16),
                     adapter_pages(fp32_pool.shape, 16, TARGET_MODULES, 16, packing=2))
    assert pages[1] == -(-pages[0] // 2) or pages[1] == pages[0] // 2 + 1  # half, up to a page of rounding


def test_a_16_bit_pool_fits_twice_the_adapters():
    shape = ModelShape(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
    weights = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight": t
               for i in range(2) for ab, t in (("A", torch.randn(16, 64)), ("B", torch.randn(64, 16)))}
    fp32_pages = adapter_pages(shape, 16, ["q_proj"], 4)
    for dtype, fits in ((torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 2)):
        pool = PagePool(num_layers=2, num_pages=fp32_pages, page_elems=page_elements(shape, 4), dtype=torch.float32,
                        device="cpu")
        lora = LoraPool(pool, shape, max_rank=16, block_size=4, dtype=dtype)
        slots = [lora.place(f"a{n}", weights, rank=16, scale=1.0) for n in range(fits)]
        with pytest.raises(NoRoom):
            lora.place("one more", weights, rank=16, scale=1.0)
        # each reads back its weights, rounded to the pool's dtype
        a = lora.tables["q_proj"].a_of(lora._buffers[1], slots[-1])
        stored = weights["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
        assert a.dtype == dtype and torch.equal(a, stored.to(dtype))


def test_adapters_of_another_width_than_the_model_allows_are_refused():
    pool = PagePool(num_layers=1, num_pages=4, page_elems=64, dtype=torch.bfloat16, device="cpu")
    shape = ModelShape(num_layers=1, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="or in bfloat16 / float16 beside a float32 model"):
        LoraPool(pool, shape, max_rank=8, block_size=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="beside a torch.bfloat16 pool"):
        LoraPool(pool, shape, max_rank=8, block_size=1, dtype=torch.float16)
    fp32 = PagePool(num_layers=1, num_pages=4, page_elems=64, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="torch.float64 beside a torch.float32 pool"):
        LoraPool(fp32, shape, max_rank=8, block_size=1, dtype=torch.float64)


def test_the_worker_setting_names_a_dtype_or_is_refused():
    from inference_worker.worker import adapter_dtype_of

    assert adapter_dtype_of("") is None and adapter_dtype_of(None) is None  # the model's own
    assert adapter_dtype_of("bfloat16") is torch.bfloat16 and adapter_dtype_of("float16") is torch.float16
    for name in ("bf16", "float64"):
        with pytest.raises(ValueError, match="expected one of float32, bfloat16, float16"):
            adapter_dtype_of(name)


@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["fp32", "fp16"])
def test_every_answer_says_how_its_adapter_was_held(tiny_llama, tmp_path, dtype):
    """The result (and so the audit row) names the pool's adapter dtype for adapter requests, none for the base."""
    import hashlib

    from inference_worker.engine import Engine
    from protocol.jobs import AdapterRef, GenerationJob

    fp32_dir, _ = adapters(tiny_llama, tmp_path, torch.float16)
    blob = (fp32_dir / "adapter_model.safetensors").read_bytes()
    ref = AdapterRef(version_id=1, sha256=hashlib.sha256(blob).hexdigest(), storage_key="a", rank=16, alpha=32.0,
                     use_rslora=False, target_modules=list(TARGET_MODULES), name="a")
    runner = ModelRunner(tiny_llama, pool_pages=256, max_lora_rank=32, adapter_dtype=dtype)
    eng = Engine(runner, {"a": blob}.__getitem__, max_running=4, prefill_chunk=32).start()
    try:
        with_adapter, base = (eng.generate(GenerationJob(f"r{i}", adapter, prompt_token_ids=PROMPT, max_tokens=4,
                                                         temperature=0.0), timeout=120)
                              for i, adapter in enumerate((ref, None)))
    finally:
        eng.stop()
    assert with_adapter.ok and base.ok
    assert with_adapter.adapter_dtype == ("float16" if dtype is torch.float16 else "float32")
    assert with_adapter.adapter_sha256 == ref.sha256 and base.adapter_dtype is None
    assert type(with_adapter).from_dict(with_adapter.to_dict()).adapter_dtype == with_adapter.adapter_dtype
