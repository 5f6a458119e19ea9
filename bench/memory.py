"""One memory budget for KV cache and adapters (issue 13): the unified pool against fixed slots, side by side.

    .venv/bin/python bench/memory.py [--requests 400] [--window 0] [--workdir /tmp/lorafleet-bench]

Model: the mid model's width and depth (hidden 1024, 8 layers, ffn 2816) with Llama-2-7B's attention
(multi-head: 16 KV heads of 64), random weights, fp32 on CPU. Budget: the pool is sized so that
base : pool has the ratio of Llama-2-7B in bf16 on an 80 GB card at --memory-fraction 0.90 (the pool
that protocol.memory.split_budget leaves there, over the base's bytes).

Fleets of 1,000 adapters: (a) r=8 attention-only, (b) r=16 all-linear, (c) ranks from {4, 8, 16, 32, 64}
over mixed targets. Traffic: --requests requests, Zipf(1.1) over the fleet, 128-512-token prompts, 32 new
tokens each, all submitted at once (arriving faster than the engine serves them); max_running 512, so
memory, not a request cap, bounds concurrency.

Systems on identical traffic, each at the same budget:
- LoRA disabled    the engine on a runner built with enable_lora=False, the same requests on the base
- fixed slots      the layout this replaced: 8 slots reserved up front, each the size of an r=64 all-linear
                   adapter, KV gets the rest; a request waits while all 8 slots hold adapters in use
- unified pool     adapters cost their real rank and targets, paged in and out of the one pool with KV

Each system runs the whole workload to completion (--requests 400 by default: the issue's 2,000 requests of
up to 512-token prompts on the mid model take ~25 minutes per system on 2 cores; --requests 2000 --window 120
gives the concurrency figures of the full traffic in a fixed window instead, where generated tok/s is not
comparable because the window ends during prefill). Reported: peak and mean running sequences (sampled
every 20 ms), generated tok/s, p50/p99 time to first token of the requests that got one, adapter hit rate (acquisitions that found
the adapter resident), device loads per second.

Adapter bytes: one random template per (rank, targets); each adapter is the template with its index
written into its first weight, so every adapter has its own bytes and sha256 (memory and paging do not
depend on the values). Blobs are made on demand by the loader, as a storage read would deliver them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import threading
import time
from pathlib import Path

# OpenMP wait policy: the runtime default, as a deployed worker runs (bench/engine.py says why)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save  # noqa: E402

from demo.tiny_base import build_tiny_base  # noqa: E402
from inference_worker.engine import Engine  # noqa: E402
from inference_worker.model import ModelRunner  # noqa: E402
from protocol.jobs import AdapterRef, GenerationJob  # noqa: E402
from protocol.lora_layout import ATTENTION_MODULES, TARGET_MODULES, ModelShape  # noqa: E402
from protocol.memory import split_budget, workspace_bytes  # noqa: E402

MID = dict(hidden=1024, layers=8, heads=16, kv_heads=16, intermediate=2816, max_position=1024)  # 512 + 32 fit
LLAMA2_7B = ModelShape(num_layers=32, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32,
                       head_dim=128)
N_ADAPTERS, NEW_TOKENS, MAX_RUNNING, ZIPF_S = 1000, 32, 512, 1.1
TARGET_MIX = [ATTENTION_MODULES, TARGET_MODULES, ("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "down_proj")]


def pool_to_base_ratio() -> float:
    """Pool bytes over base bytes for Llama-2-7B, bf16, on an 80 GB card at 0.90 (the worker's arithmetic)."""
    db, weights = 2, 6_738_415_616 * 2
    ws = workspace_bytes(LLAMA2_7B, vocab_size=32000, max_batch_tokens=256 + 64, max_running=64, max_context=4096,
                         max_lora_rank=64, dtype_bytes=db)
    split = split_budget(budget_bytes=int(0.9 * 80e9), weights_bytes=weights, workspace_bytes=ws, shape=LLAMA2_7B,
                         block_size=16, dtype_bytes=db)
    return split.pool_bytes / weights


class Fleet:
    """1,000 adapters of one mix: refs made on demand, blobs made by the loader."""

    def __init__(self, shape: ModelShape, name: str):
        self.shape, self.name = shape, name
        self.templates: dict[tuple, bytes] = {}
        self.refs: dict[int, AdapterRef] = {}
        self.reads = 0

    def spec(self, i: int) -> tuple[int, tuple[str, ...]]:
        if self.name == "a":
            return 8, ATTENTION_MODULES
        if self.name == "b":
            return 16, TARGET_MODULES
        return (4, 8, 16, 32, 64)[i % 5], TARGET_MIX[(i // 5) % 4]

    def _template(self, rank: int, targets) -> bytes:
        key = (rank, targets)
        if key not in self.templates:
            g, proj, t = torch.Generator().manual_seed(rank), self.shape.projections(), {}
            for layer in range(self.shape.num_layers):
                for m in targets:
                    d_in, d_out = proj[m]
                    p = f"base_model.model.model.layers.{layer}.{'self_attn' if m in ATTENTION_MODULES else 'mlp'}.{m}"
                    t[f"{p}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in ** 0.5
                    t[f"{p}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) / rank ** 0.5
            self.templates[key] = save(t)
        return self.templates[key]

    def blob(self, i: int) -> bytes:
        data = bytearray(self._template(*self.spec(i)))
        (header_len,) = struct.unpack("<Q", data[:8])
        struct.pack_into("<f", data, 8 + header_len, float(i))  # the first weight of the first tensor
        return bytes(data)

    def ref(self, i: int) -> AdapterRef:
        if i not in self.refs:
            rank, targets = self.spec(i)
            self.refs[i] = AdapterRef(version_id=i, sha256=hashlib.sha256(self.blob(i)).hexdigest(),
                                      storage_key=f"{self.name}/{i}", rank=rank, alpha=2.0 * rank, use_rslora=False,
                                      target_modules=list(targets), name=f"{self.name}{i}")
        return self.refs[i]

    def loader(self, key: str) -> bytes:
        self.reads += 1
        return self.blob(int(key.split("/")[1]))


def traffic(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(128, 513, size=n)
    prompts = [rng.integers(10, vocab, size=int(k)).tolist() for k in lens]
    p = 1.0 / np.arange(1, N_ADAPTERS + 1) ** ZIPF_S
    return prompts, rng.choice(N_ADAPTERS, size=n, p=p / p.sum()).tolist()


def run(base: Path, pages: int, prompts, adapters, fleet: Fleet | None, *, fixed_slots: int, window: float) -> dict:
    runner = ModelRunner(base, pool_pages=pages, max_lora_rank=64, enable_lora=fleet is not None,
                         max_running=MAX_RUNNING, fixed_lora_slots=fixed_slots)
    eng = Engine(runner, fleet.loader if fleet else (lambda k: b""), max_running=MAX_RUNNING, prefill_chunk=512,
                 host_cache_bytes=1 << 30).start()
    jobs = [GenerationJob(f"r{k}", fleet.ref(a) if fleet else None, prompt_token_ids=p, max_tokens=NEW_TOKENS,
                          temperature=0.0, ignore_eos=True) for k, (p, a) in enumerate(zip(prompts, adapters, strict=True))]
    samples: list[int] = []
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            samples.append(len(eng._running))
            time.sleep(0.02)

    t0 = time.perf_counter()
    handles = [eng.submit(j) for j in jobs]
    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    if window:  # a fixed window, then cancel what is left
        time.sleep(window)
    else:  # to completion: the makespan of the whole workload
        for h in handles:
            h.result(timeout=3600)
    stop.set()
    elapsed = time.perf_counter() - t0
    stats = eng.stats()
    for h in handles:
        h.cancel()
    results = [h.result(timeout=300) for h in handles]
    eng.stop()
    limit = window or float("inf")
    ttft = [r.first_token_s for r in results if r.first_token_s is not None and r.first_token_s <= limit]
    cache = stats.get("cache") or {}
    resident_hits = cache.get("resident_hits", 0)
    acquisitions = resident_hits + cache.get("device_loads", 0)
    return {
        "peak_running": max(samples), "mean_running": float(np.mean(samples)),
        "tok_s": stats["tokens_generated"] / elapsed,
        "ttft_p50": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p99": float(np.percentile(ttft, 99)) if ttft else None,
        "first_tokens": len(ttft),
        "hit_rate": resident_hits / acquisitions if acquisitions else None,
        "loads_per_s": cache.get("device_loads", 0) / elapsed,
        "admissions_waited_memory": stats.get("admissions_waited_memory", 0),
        "pages": pages, "page_bytes": runner.pool.page_bytes,
    }


def fmt(name: str, r: dict) -> str:
    hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
    ttft = "-" if r["ttft_p50"] is None else f"{r['ttft_p50']:.1f}/{r['ttft_p99']:.1f}"
    return (f"{name:<26} {r['peak_running']:>5} {r['mean_running']:>7.1f} {r['tok_s']:>7.1f} {ttft:>13} "
            f"{r['first_tokens']:>6} {hit:>5} {r['loads_per_s']:>7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=0.0,
                    help="seconds per system, then cancel the rest (0: run every request to completion)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--fleets", default="a,b,c")
    ap.add_argument("--workdir", default="/tmp/lorafleet-bench")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    base = Path(args.workdir) / "base-memory-mid-1k"
    if not (base / "model.safetensors").exists():
        build_tiny_base(base, arch="llama", seed=0, **MID)
    probe = ModelRunner(base, pool_pages=1, enable_lora=False)
    weights = probe.weights_bytes
    ratio = pool_to_base_ratio()
    pages = int(ratio * weights // probe.pool.page_bytes)
    shape = probe.shape
    prompts, adapters = traffic(args.requests, probe.config.vocab_size)
    print(f"model: hidden 1024, 8 layers, 16 KV heads (Llama-2-7B attention), {weights / 1e6:.0f} MB fp32; "
          f"pool = {ratio:.2f} x base (Llama-2-7B bf16 on 80 GB at 0.90) = {pages} pages of "
          f"{probe.pool.page_bytes / 1e6:.2f} MB")
    print(f"traffic: {args.requests} requests, prompts 128-512 tokens, {NEW_TOKENS} new, Zipf({ZIPF_S}) over "
          f"{N_ADAPTERS} adapters ({len(set(adapters))} distinct drawn); "
          f"{f'window {args.window:.0f} s' if args.window else 'each system to completion'}; "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}", flush=True)
    header = (f"{'system':<26} {'peak':>5} {'mean':>7} {'tok/s':>7} {'TTFT p50/p99':>13} {'firsts':>6} "
              f"{'hit':>5} {'loads/s':>7}")
    print(header)
    out = {"pages": pages, "ratio": ratio, "systems": {}}
    base_run = run(base, pages, prompts, adapters, None, fixed_slots=0, window=args.window)
    out["systems"]["lora-disabled"] = base_run
    print(fmt("LoRA disabled", base_run), flush=True)
    for name in args.fleets.split(","):
        fleet = Fleet(shape, name)
        for i in set(adapters):
            fleet.ref(i)  # sha256 up front: the gateway's job message carries it
        fixed = run(base, pages, prompts, adapters, fleet, fixed_slots=8, window=args.window)
        print(fmt(f"fleet ({name}) fixed slots", fixed), flush=True)
        unified = run(base, pages, prompts, adapters, fleet, fixed_slots=0, window=args.window)
        print(fmt(f"fleet ({name}) unified pool", unified), flush=True)
        out["systems"][f"{name}-fixed"], out["systems"][f"{name}-unified"] = fixed, unified
        print(f"  fleet ({name}): unified/fixed peak running {unified['peak_running'] / fixed['peak_running']:.2f}x, "
              f"mean {unified['mean_running'] / max(fixed['mean_running'], 1e-9):.2f}x, tok/s "
              f"{unified['tok_s'] / max(fixed['tok_s'], 1e-9):.2f}x; unified/LoRA-disabled peak running "
              f"{unified['peak_running'] / base_run['peak_running']:.2f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
