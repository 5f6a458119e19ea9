"""On a machine with a CUDA device, the kernels step of the GPU check passes with kernels compiled for it
(bench/gpu_check.sh unsets TRITON_INTERPRET, which this suite's conftest sets). Skipped without a GPU."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.gpu_check import run_check

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_compiled_kernels_agree_with_the_reference_on_the_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "TRITON_INTERPRET")}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable)
    cmd = ["bash", str(REPO / "bench" / "gpu_check.sh"), "--only", "kernels"]
    proc = run_check(cmd, env, timeout=280)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "kernels.json").read_text())
    assert rec["ok"] and rec["device"] == "cuda" and rec["env"]["triton_interpret"] == ""
