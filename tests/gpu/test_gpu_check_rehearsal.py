"""`bash bench/gpu_check.sh --cpu-rehearsal` runs every step of the GPU check on tiny CPU shapes (Triton
through its interpreter, and compiled ahead of time for sm_90), so the script a GPU session runs cannot
rot between the sessions that have a GPU. Each step must pass and leave its log and figures."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.gpu_check import run_check

REPO = Path(__file__).resolve().parents[2]
STEPS = ("kernels", "gpu_kernels", "parity", "parity_qwen3", "parity_phi3", "parity_gemma2", "parity_gemma3", "fleet")


@pytest.mark.timeout(900)
def test_cpu_rehearsal_runs_every_step_and_records_its_figures(tmp_path):
    out = tmp_path / "out"
    # what the device machine has: no Django settings, no interpreter flag from the test suite's conftest
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "TRITON_INTERPRET")}
    env.update(OUT=str(out), PYTHON=sys.executable, LORAFLEET_GPU_WORK=str(tmp_path / "work"))
    cmd = ["bash", str(REPO / "bench" / "gpu_check.sh"), "--cpu-rehearsal"]
    proc = run_check(cmd, env, timeout=840)  # ~4 minutes idle with the qwen3, phi3 and gemma parity steps, more under load
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "SUMMARY gpu_check (rehearsal" in proc.stdout and ": PASS" in proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["mode"] == "rehearsal" and not summary["failed_steps"]
    assert list(summary["steps"]) == list(STEPS)
    assert not summary["goals_judged"]  # tiny CPU shapes say nothing about a GPU's throughput
    steps = {name: json.loads((out / f"{name}.json").read_text()) for name in STEPS}
    for name, rec in steps.items():
        assert (out / f"{name}.log").stat().st_size > 0
        assert rec["ok"] and rec["rehearsal"] and rec["checks"], name
        assert all(c["ok"] for c in rec["checks"]), name
        assert any(c["name"] == "django_free" for c in rec["checks"]), name

    kernels = {c["name"] for c in steps["kernels"]["checks"]}
    assert {f"agree_with_float64_reference_{d}" for d in ("float16", "bfloat16", "float32")} <= kernels
    assert {"compile_for_sm90", "fp16_intermediate_beyond_65504_stays_finite"} <= kernels
    assert steps["kernels"]["env"]["triton_interpret"] == "1"
    assert len(steps["gpu_kernels"]["figures"]["cells"]) == 4

    parity = steps["parity"]
    assert {c["name"] for c in parity["checks"]} >= {
        "base_logits_within_bf16_tolerance", "lora_logits_within_bf16_tolerance",
        "base_greedy_tokens_equal_transformers_or_part_at_near_ties",
        "lora_greedy_tokens_equal_PEFT_or_part_at_near_ties",
        "mixed_batch_tokens_equal_alone_or_part_at_near_ties", "adapters_change_outputs"}
    assert set(parity["goals"]) == {"base_requests_equal_transformers", "lora_requests_equal_PEFT",
                                    "mixed_batch_requests_equal_alone"}

    fleet = steps["fleet"]["figures"]
    assert set(fleet["tok_s"]) == {"base", "mixed", "hf", "peft"} and all(v > 0 for v in fleet["tok_s"].values())
    assert fleet["decode_step"]["mixed"]["of_copy_bw"] > 0
    assert set(steps["fleet"]["goals"]) == {"mixed_vs_peft", "mixed_vs_base"}
