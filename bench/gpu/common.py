"""What every step of bench/gpu_check.sh shares: its arguments, how a check, a figure and a goal are
recorded, the one-line verdict, and the JSON each step leaves in the output folder.

A *check* is correctness (a mismatch fails the step and the whole run); a *goal* is a performance or
agreement target from DESIGN.md or the issue, reported as met or missed without failing the run
(`gpu_check.sh --strict-goals` makes a missed goal fail too). Figures are whatever was measured.

Django-free, like everything the check imports: kernels/, protocol/, inference_worker's runner and engine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CHECK_DATE = "2026-11-30"  # the day this check was written; the JSON records the day it ran


def parse_args(description: str, extra=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "var" / "gpu_check"),
                    help="folder for this step's JSON (default $OUT, else var/gpu_check)")
    ap.add_argument("--rehearsal", action="store_true",
                    help="CPU, tiny shapes: the same code paths in seconds (Triton under TRITON_INTERPRET=1)")
    ap.add_argument("--work", default=os.environ.get("LORAFLEET_GPU_WORK",
                                                     os.path.join(tempfile.gettempdir(), "lorafleet-gpu-check")),
                    help="scratch folder for models and adapters (not copied back)")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    args.device = "cpu" if args.rehearsal else "cuda"
    return args


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


class Step:
    """One step's record: checks, goals, figures; written to <out>/<name>.json by `finish`."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.args = name, args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.checks: list[dict] = []
        self.goals: dict[str, dict] = {}
        self.figures: dict = {}
        self.error: str | None = None

    def log(self, msg: str) -> None:
        print(f"[{self.name} {time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        ok = bool(ok)
        self.checks.append({"name": name, "ok": ok, "detail": detail})
        self.log(f"check {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        return ok

    def goal(self, name: str, value: float, goal: float, *, at_least: bool = True, note: str = "") -> bool:
        met = value >= goal if at_least else value <= goal
        self.goals[name] = {"value": value, "goal": goal, "at_least": at_least, "met": bool(met), "note": note}
        self.log(f"goal {'met   ' if met else 'MISSED'} {name}: {fmt(value)} (goal {'>=' if at_least else '<='} "
                 f"{fmt(goal)})" + (f" — {note}" if note else ""))
        return met

    def figure(self, **kw) -> None:
        self.figures.update(kw)

    @property
    def ok(self) -> bool:
        return self.error is None and all(c["ok"] for c in self.checks) and bool(self.checks)

    def finish(self) -> int:
        wall = time.perf_counter() - self.t0
        failed = [c["name"] for c in self.checks if not c["ok"]]
        missed = [k for k, g in self.goals.items() if not g["met"]]
        record = {
            "step": self.name, "ok": self.ok, "rehearsal": self.args.rehearsal, "device": self.args.device,
            "wall_s": round(wall, 2), "checks": self.checks, "goals": self.goals, "figures": self.figures,
            "error": self.error, "env": environment(self.args.device),
        }
        (self.out / f"{self.name}.json").write_text(json.dumps(record, indent=2, default=str))
        verdict = "PASS" if self.ok else "FAIL"
        parts = [f"{len(self.checks) - len(failed)}/{len(self.checks)} checks"]
        if failed:
            parts.append("failed: " + ", ".join(failed))
        if self.goals:
            parts.append(f"goals {len(self.goals) - len(missed)}/{len(self.goals)} met"
                         + (" (missed: " + ", ".join(missed) + ")" if missed else ""))
        if self.error:
            parts.append("error: " + self.error.strip().splitlines()[-1][:200])
        print(f"STEP {self.name}: {verdict} — {'; '.join(parts)} — {wall:.1f} s", flush=True)
        return 0 if self.ok else 1


def run(name: str, args: argparse.Namespace, body) -> None:
    """Run body(step); an exception is recorded (the checks made so far are kept) and fails the step."""
    step = Step(name, args)
    try:
        body(step)
    except Exception:  # noqa: BLE001 — one step's crash is a recorded failure, not a lost run
        step.error = traceback.format_exc()
        print(step.error, file=sys.stderr, flush=True)
    step.check("django_free", not any(m == "django" or m.startswith("django.") for m in sys.modules),
               "nothing this step imported pulled in Django")
    sys.exit(step.finish())


def environment(device: str) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
           "machine": platform.machine(), "cpus": os.cpu_count(),
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "")}
    for mod in ("torch", "triton", "transformers", "peft"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 — a missing package is reported, not fatal here
            env[mod] = None
    try:
        import torch

        if device == "cuda" and torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                       capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
    except Exception as exc:  # noqa: BLE001 — the record says why instead of failing the step
        env["device_error"] = repr(exc)
    return env


def require_device(step: Step) -> None:
    """On the GPU path: a CUDA device, and Triton compiling (not interpreting) kernels."""
    import torch

    if step.args.rehearsal:
        return
    if not step.check("cuda_available", torch.cuda.is_available(), "torch.cuda.is_available()"):
        raise RuntimeError("no CUDA device: run `bash bench/gpu_check.sh --cpu-rehearsal` on a CPU machine")
    step.check("triton_compiled_not_interpreted", os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
               f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}")


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, mib: int | None = None) -> float:
    """Bytes/s of a large tensor copy (read + write counted), the best of several: the memory's
    practical ceiling on this machine, measured in the same process as what is compared with it."""
    import torch

    n = (mib or (1024 if device == "cuda" else 256)) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10 if device == "cuda" else 3):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n / best


PEAK_HBM_BYTES_S = {  # datasheet figures, by substring of torch.cuda.get_device_name()
    "H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
    "A100 80GB": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12, "A10": 0.6e12,
}


def datasheet_peak(device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_HBM_BYTES_S.items() if k in name), None)
