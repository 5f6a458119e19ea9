"""Running bench/gpu_check.sh from a test: in a process group of its own, so a timeout ends the step
scripts it started too (killing only bash would leave them running)."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_check(cmd: list[str], env: dict, *, timeout: float) -> subprocess.CompletedProcess:
    # our own script, run by bash from PATH
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # noqa: S603
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} ran past {timeout} s\n{out[-4000:]}\n{err[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
