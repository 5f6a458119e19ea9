"""Fair scheduling across tenants (issue 12): one tenant floods at its concurrency cap with long requests,
another sends small ones. Time to first token of the small tenant, solo and under the flood, with the
engine's VTC scheduling and with plain FIFO (every request of one tenant: the engine's order before VTC),
and the total generated tok/s of both.

    .venv/bin/python bench/fairness.py [--small 40] [--flood 16] [--base DIR]

Runs on the tiny local base (built on the fly) by default; --base takes any Llama-family checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from inference_worker.engine import Engine  # noqa: E402
from inference_worker.model import ModelRunner  # noqa: E402
from protocol.jobs import GenerationJob  # noqa: E402


def run(base: Path, *, flood: int, small: int, fair: bool, with_flood: bool, long_prompt: int = 400,
        long_tokens: int = 64, gap_s: float = 0.05) -> dict:
    runner = ModelRunner(base, pool_pages=flood * 32 + 256, enable_lora=False, max_running=64)
    eng = Engine(runner, lambda k: b"", max_running=64, prefill_chunk=256).start()
    vocab = runner.config.vocab_size
    stop = threading.Event()

    def flooder(i: int) -> None:
        n = 0
        while not stop.is_set():
            prompt = [(7 * i + 13 * n + k) % (vocab - 1) + 1 for k in range(long_prompt)]
            eng.generate(GenerationJob(f"f{i}-{n}", None, prompt_token_ids=prompt, max_tokens=long_tokens,
                                           temperature=0.0, ignore_eos=True, tenant="flooder" if fair else ""),
                         timeout=600)
            n += 1

    threads = [threading.Thread(target=flooder, args=(i,), daemon=True) for i in range(flood if with_flood else 0)]
    for t in threads:
        t.start()
    time.sleep(1.0 if with_flood else 0)  # the flood is running before the small tenant arrives
    t0, tokens0 = time.perf_counter(), eng.metrics.tokens_generated
    handles = []
    for k in range(small):
        handles.append(eng.submit(GenerationJob(f"s{k}", None, prompt_token_ids=[5 + k % 50] * 8, max_tokens=8,
                                                temperature=0.0, ignore_eos=True, tenant="small" if fair else "")))
        time.sleep(gap_s)
    results = [h.result(timeout=600) for h in handles]
    elapsed = time.perf_counter() - t0
    generated = eng.metrics.tokens_generated - tokens0
    stop.set()
    for t in threads:
        t.join(timeout=600)
    eng.stop()
    ttft = np.array([r.first_token_s for r in results])
    return {"p50": float(np.percentile(ttft, 50)), "p95": float(np.percentile(ttft, 95)),
            "tok_s": generated / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=40)
    ap.add_argument("--flood", type=int, default=16)
    ap.add_argument("--base", default=None)
    args = ap.parse_args()
    if args.base:
        base = Path(args.base)
    else:
        from demo.tiny_base import build_tiny_base

        base = build_tiny_base(Path(tempfile.mkdtemp()) / "tiny", seed=1)
    solo = run(base, flood=args.flood, small=args.small, fair=True, with_flood=False)
    fifo = run(base, flood=args.flood, small=args.small, fair=False, with_flood=True)
    vtc = run(base, flood=args.flood, small=args.small, fair=True, with_flood=True)
    print(f"small tenant TTFT p50/p95: solo {solo['p50'] * 1e3:.1f}/{solo['p95'] * 1e3:.1f} ms; "
          f"flooded, FIFO {fifo['p50'] * 1e3:.1f}/{fifo['p95'] * 1e3:.1f} ms; "
          f"flooded, VTC {vtc['p50'] * 1e3:.1f}/{vtc['p95'] * 1e3:.1f} ms")
    print(f"p95 ratio to solo: FIFO {fifo['p95'] / solo['p95']:.2f}x, VTC {vtc['p95'] / solo['p95']:.2f}x "
          f"(goal <= 1.5x)")
    print(f"total generated tok/s under the flood: FIFO {fifo['tok_s']:.0f}, VTC {vtc['tok_s']:.0f} "
          f"(VTC/FIFO {vtc['tok_s'] / fifo['tok_s']:.2f}, goal >= 0.95)")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
