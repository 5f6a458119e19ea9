"""Issue 12: one tenant's numbers can neither break nor change another tenant's answers on a shared worker."""
import hashlib
import threading

import torch
from safetensors.torch import save

from inference_worker.engine import Engine
from inference_worker.jobs import AdapterRef, GenerationJob
from inference_worker.model import ModelRunner
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
