"""Cold load of one adapter with Llama-2-7B shapes, from a local file into a device slot, verified.

    .venv/bin/python bench/adapter_load.py [--loads 20] [--workdir /tmp/lorafleet-bench]

The adapter: r=16 on all seven projections of Llama-2-7B (hidden 4096, intermediate 11008, 32 layers,
32 heads, no GQA), bf16, PEFT tensor names: 40 M parameters, 80 MB. Each load goes the production path
through a fresh AdapterCache (so nothing is warm in it): read the file (the OS page cache is warm after the
first read; this machine gives no way to drop it), mapped as the worker maps local blobs, and also read()
into memory as for S3 -> sha256 against the expected hash -> safetensors parse
-> name/shape check -> pages of the runner's memory pool (inference_worker.lora.LoraPool over a PagePool with
7B shapes, fp32 as the CPU runner keeps it; a 7B base itself is not loaded, the copy does not depend on it).
Reports p50/p99 of the whole path and of its parts. Goal (DESIGN.md): p50 <= 150 ms on CPU.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

# Shared CPUs: passive OpenMP waiting (see bench/engine.py). Set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save_file  # noqa: E402

from inference_worker.adapter_cache import LOADING, READY, AdapterCache, map_file  # noqa: E402
from inference_worker.lora import TARGETS, LoraPool  # noqa: E402
from inference_worker.memory_pool import PagePool  # noqa: E402
from protocol.jobs import AdapterRef  # noqa: E402
from protocol.lora_layout import ModelShape  # noqa: E402
from protocol.memory import adapter_pages, page_elements  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, RANK = 4096, 11008, 32, 32, 16
SHAPES = ModelShape(num_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=INTER, num_heads=HEADS,
                    num_kv_heads=HEADS, head_dim=HIDDEN // HEADS).projections()  # Llama-2-7B


class PoolOnlyRunner:
    """The part of ModelRunner an adapter load touches: config and the memory pool with its resident adapters."""

    def __init__(self, adapters: int = 2, block_size: int = 16):
        self.config = SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      head_dim=HIDDEN // HEADS, intermediate_size=INTER, num_hidden_layers=LAYERS)
        self.max_lora_rank = RANK
        shape = ModelShape.from_config(self.config)
        pages = adapters * adapter_pages(shape, RANK, TARGETS, block_size)
        self.pool = PagePool(num_layers=LAYERS, num_pages=pages, page_elems=page_elements(shape, block_size),
                             dtype=torch.float32, device="cpu")
        self.lora = LoraPool(self.pool, shape, max_rank=RANK, block_size=block_size)

    def load_adapter(self, weights, *, rank, scale, key=""):
        return self.lora.place(key, weights, rank=rank, scale=scale)

    def unload_adapter(self, slot):
        self.lora.remove(slot)


def write_adapter(path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    t = {}
    for layer in range(LAYERS):
        for p, (d_in, d_out) in SHAPES.items():
            block = "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{block}.{p}"
            t[f"{name}.lora_A.weight"] = (torch.randn(RANK, d_in, generator=g) / d_in**0.5).to(torch.bfloat16)
            t[f"{name}.lora_B.weight"] = (torch.randn(d_out, RANK, generator=g) / RANK**0.5).to(torch.bfloat16)
    save_file(t, str(path))


def pct(xs, q):
    return float(np.percentile(np.array(xs) * 1000, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--workdir", default="/tmp/lorafleet-bench")
    args = ap.parse_args()
    path = Path(args.workdir) / "adapter-7b-r16.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        write_adapter(path)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    ref = AdapterRef(version_id=1, sha256=sha, storage_key=str(path), rank=RANK, alpha=32.0, use_rslora=False,
                     target_modules=list(TARGETS))
    runner = PoolOnlyRunner()
    print(f"adapter: {path.stat().st_size / 1e6:.1f} MB bf16, r={RANK}, 7 projections x {LAYERS} layers; "
          f"{runner.lora.pages_for(RANK, TARGETS)} pool pages of {runner.pool.page_bytes / 1e6:.1f} MB fp32 each; "
          f"{torch.get_num_threads()} torch threads")

    def read(key: str) -> bytes:
        return Path(key).read_bytes()

    # The worker's loader maps a blob on local storage (inference_worker.worker.load_blob) and reads
    # the bytes from S3; both are measured, the mapped one first, the goal is about the local file.
    for label, loader in (("mapped file (the worker's path for filesystem storage)", map_file),
                          ("read() into memory (the path for S3 bytes)", read)):
        total, verify, slot = [], [], []
        for i in range(args.loads + 1):  # the first load is a warm-up (page cache, allocator), not counted
            done = threading.Event()
            cache = AdapterCache(runner, loader, host_cache_bytes=1 << 30, on_loaded=done.set)
            t0 = time.perf_counter()
            got = cache.acquire(ref, "bench")
            assert got.state == LOADING
            done.wait(60)
            got = cache.acquire(ref, "bench")
            t1 = time.perf_counter()
            assert got.state == READY, got
            s = cache.stats()
            cache.close()
            runner.unload_adapter(got.slot)  # the next fresh cache starts from an empty pool
            if i:
                total.append(t1 - t0)
                verify.append(s["load_seconds"])
                slot.append(s["device_load_seconds"])
        print(f"{args.loads} cold loads, {label}: file -> sha256 verified -> parsed -> checked -> pool pages:")
        print(f"  total               p50 {pct(total, 50):6.1f} ms   p99 {pct(total, 99):6.1f} ms   "
              f"min {pct(total, 0):6.1f} ms   (goal p50 <= 150 ms: {'met' if pct(total, 50) <= 150 else 'MISSED'})")
        print(f"  read+hash+parse+chk p50 {pct(verify, 50):6.1f} ms   p99 {pct(verify, 99):6.1f} ms   "
              f"min {pct(verify, 0):6.1f} ms  (loader thread)")
        print(f"  copy into pool      p50 {pct(slot, 50):6.1f} ms   p99 {pct(slot, 99):6.1f} ms   "
              f"min {pct(slot, 0):6.1f} ms  (engine thread)")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared with other work)")


if __name__ == "__main__":
    main()
