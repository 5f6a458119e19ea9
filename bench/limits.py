"""The fp32 limit of a generation workload on this machine, measured on the model's own GEMM shapes.

    .venv/bin/python bench/limits.py [--model DIR] [--rows 64,512]

A workload's limit is the time its linear layers need at the fastest fp32 GEMM torch offers here: the
prompt's FLOPs at the GEMM rate of a prefill chunk (`prefill_rows`, 512 in bench/engine.py) plus the
decode FLOPs at the rate of the decode batch (`decode_rows`, the 64 concurrent requests). "of limit" is
a system's generated tok/s over the generated tokens per second that time allows. Attention, norms,
sampling and the scheduler are not in it: they are what a system spends beyond the limit.

The rate at each row count is measured, per weight shape, with three fp32 GEMMs and the fastest kept:
- `F.linear` (MKL's sgemm through aten);
- `onednn`: oneDNN's brgemm on the weight as stored (`torch.ops.mkldnn._linear_pointwise(x, w, bias, "none",
  [], "")` accepts a plain strided weight and reads it in place);
- `onednn_packed`: oneDNN with the weight packed once into its blocked layout for that row count
  (`torch.ops.mkldnn._reorder_linear_weight(w, rows)`, then `_linear_pointwise` on it) — what inductor's CPU
  freezing pass emits and vLLM-CPU's `onednn_mm` does.
lorafleet's own GEMM (`kernels.gemm`, `OWN_IMPL`) is timed beside them and printed, but it is not in the limit: the
limit stays the fastest GEMM torch offers, as issue 15 defines it, and bench/peers.py prints lorafleet's base-only
pass against the same FLOPs at its own GEMM's rates as well.
Each implementation runs a forward pass's GEMMs in its order (every layer's q/k/v, o, gate/up and down, one
distinct weight each, then the head), so each weight streams from memory with the rest of the model's read in
between, as in a forward pass; a shape's time is the sum of its calls in one pass, best of `repeats` passes, the
implementations' passes alternating so load on shared CPUs tilts none. Other work on the CPUs only ever slows a
GEMM down, so the best pass is the machine's rate. Until 2026-12-06 each shape was timed alone over its layers'
weights; a small shape's whole set then stayed in a large L3 between passes (on the Intel Xeon guest of model 167,
whose caches hold ~64 MB for this process: mid's o weights are 34 MB over its 8 layers, SmolLM2's 40 MB over 30),
which a forward pass never sees: there the old way read higher at 512 rows (SmolLM2 302-308 against 279-287
GFLOP/s in forward order, mid 301-312 against 293-300; the two alternating, 21:30 UTC) and within the noise at 64
(bench/RESULTS.md).
The weights are on 2 MB pages, as the runner keeps its own (inference_worker.huge_pages; since 2026-12-03): there
the rates read ~5% higher than on malloc's 4 KB pages (SmolLM2 at 64 rows, three processes of each alternating on
the Zen 4 host: 196.9 / 201.0 GFLOP/s, one outlier of 161.5, against 185.1 / 193.6 / 186.4), so the limit is the
stricter one. `--huge-pages off` measures on 4 KB pages.

FLOPs counted per request (P prompt tokens, G generated): prefill = P tokens through every layer's
projections; decode = G - 1 tokens through them (the first generated token comes out of the prefill) plus
G rows of the LM head, all at the decode rate (the head's rows in a prefill step are one per sequence, as
in a decode step).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

IMPLS = ("F.linear", "onednn", "onednn_packed")
# lorafleet's own GEMM (kernels.gemm, csrc/gemm_f32.h), where it runs: timed beside torch's and printed, but not in
# the limit, which stays what the issue defines, the fastest fp32 GEMM torch offers. The runner takes it by default;
# bench/peers.py prints lorafleet's base-only pass against both.
OWN_IMPL = "lorafleet_native"


def onednn_available() -> bool:
    from inference_worker.model import onednn_packing_available

    return onednn_packing_available(torch.device("cpu"), torch.float32)


def layer_shapes(cfg) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of one decoder layer's GEMMs as the runner runs them (q/k/v and
    gate/up fused)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [("qkv", h, q + 2 * kv), ("o", q, h), ("gate_up", h, 2 * i), ("down", i, h)]


def layer_flops_per_token(cfg) -> int:
    return 2 * cfg.num_layers * sum(n * o for _, n, o in layer_shapes(cfg))


def head_flops_per_token(cfg) -> int:
    return 2 * cfg.hidden_size * cfg.vocab_size


@dataclass
class GemmRates:
    """fp32 GEMM FLOP/s at one row count: per implementation over the whole model, and the per-shape best."""

    rows: int
    by_impl: dict[str, float]  # impl -> FLOP/s over all the model's GEMMs (layers and head); OWN_IMPL's too
    best: float  # FLOP/s with the fastest of torch's impls at each shape (OWN_IMPL is not one)
    best_impl: dict[str, str] = field(default_factory=dict)  # shape -> impl that won
    load_average: float = 0.0

    def line(self) -> str:
        impls = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in self.by_impl.items())
        won = ", ".join(f"{s}: {i}" for s, i in self.best_impl.items())
        return (f"{self.rows:4d} rows: {self.best / 1e9:6.1f} GFLOP/s fastest of torch's per shape ({impls}; "
                f"fastest: {won}); load average {self.load_average:.1f}")


@torch.inference_mode()
def measure_rates(cfg, rows: int, *, repeats: int = 5, layers: int | None = None, seed: int = 0,
                  huge_pages: bool = True) -> GemmRates:
    """The model's GEMMs at `rows` rows, in a forward pass's order over `layers` distinct layers (default: the
    model's layer count; the head once after them), each implementation's whole pass in turn, best of `repeats`
    passes per shape and impl (a shape's time: the sum of its calls in one pass)."""
    from inference_worker.huge_pages import collapse_resident_memory
    from inference_worker.model import Projection  # the runner's GEMM, in each of its three forms
    from kernels import gemm_available

    impls = [i for i in IMPLS if i == "F.linear" or onednn_available()]
    timed_impls = impls + ([OWN_IMPL] if gemm_available() else [])
    g = torch.Generator().manual_seed(seed)
    n_layers = layers or cfg.num_layers
    per_layer = layer_shapes(cfg)
    head = ("lm_head", cfg.hidden_size, cfg.vocab_size)
    shapes = [(name, n, o, n_layers) for name, n, o in per_layer] + [(*head, 1)]
    # the pass's calls in order: (shape, in_features, weight) for every layer's four GEMMs, then the head
    order = [(name, n, torch.randn(o, n, generator=g) / n ** 0.5) for _ in range(n_layers) for name, n, o in per_layer]
    order.append((head[0], head[1], torch.randn(head[2], head[1], generator=g) / head[1] ** 0.5))
    made = {"F.linear": lambda w: Projection(w), "onednn": lambda w: Projection(w, onednn=True),
            "onednn_packed": lambda w: Projection(w, pack_rows=rows), OWN_IMPL: lambda w: Projection(w, native=True)}
    passes = {impl: [(name, n, made[impl](w)) for name, n, w in order] for impl in timed_impls}
    if huge_pages:  # on 2 MB pages, as the runner keeps its weights (inference_worker.huge_pages)
        collapse_resident_memory()
    # one input per width, as in a forward pass (q/k/v, gate/up and the head read the hidden state)
    xs = {n: torch.randn(rows, n, generator=g) for _, n, _, _ in shapes}
    for impl in timed_impls:  # warm-up, every shape once: first-call costs (oneDNN primitive creation) are not the rate
        for _, n, proj in passes[impl][:len(per_layer)] + passes[impl][-1:]:
            proj(xs[n])
    best_t: dict[tuple[str, str], float] = {}
    for _ in range(repeats):
        for impl in timed_impls:
            spent = dict.fromkeys((name for name, *_ in shapes), 0.0)
            for name, n, proj in passes[impl]:
                t = time.perf_counter()
                proj(xs[n])
                spent[name] += time.perf_counter() - t
            for name, dt in spent.items():
                best_t[name, impl] = min(best_t.get((name, impl), float("inf")), dt)
    del order, passes
    flops = {name: 2 * rows * n * o * count for name, n, o, count in shapes}
    total = sum(flops.values())
    by_impl = {impl: total / sum(best_t[name, impl] for name, *_ in shapes) for impl in timed_impls}
    best_impl = {name: min(impls, key=lambda i: best_t[name, i]) for name, *_ in shapes}
    best = total / sum(best_t[name, best_impl[name]] for name, *_ in shapes)
    return GemmRates(rows=rows, by_impl=by_impl, best=best, best_impl=best_impl, load_average=os.getloadavg()[0])


@dataclass
class WorkloadLimit:
    """The fp32 limit of one workload: the time its GEMMs take at the measured rates, as generated tok/s."""

    prefill_flops: float
    decode_flops: float
    generated_tokens: int
    prefill: GemmRates
    decode: GemmRates

    @property
    def seconds(self) -> float:
        return self.prefill_flops / self.prefill.best + self.decode_flops / self.decode.best

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.seconds

    def of_limit(self, tok_s: float) -> float:
        return tok_s / self.tok_s

    def describe(self) -> str:
        return (f"fp32 limit {self.tok_s:.1f} tok/s: {self.prefill_flops / 1e9:.1f} GFLOP of prompt at "
                f"{self.prefill.best / 1e9:.1f} GFLOP/s ({self.prefill.rows} rows) + {self.decode_flops / 1e9:.1f} "
                f"GFLOP of decode at {self.decode.best / 1e9:.1f} GFLOP/s ({self.decode.rows} rows) = "
                f"{self.seconds:.2f} s for {self.generated_tokens} generated tokens")

    def as_dict(self) -> dict:
        return {"limit_tok_s": self.tok_s, "limit_seconds": self.seconds, "prefill_gflop": self.prefill_flops / 1e9,
                "decode_gflop": self.decode_flops / 1e9,
                "prefill_gflops": {"rows": self.prefill.rows, "best": self.prefill.best / 1e9,
                                   **{k: v / 1e9 for k, v in self.prefill.by_impl.items()},
                                   "fastest": self.prefill.best_impl, "load": self.prefill.load_average},
                "decode_gflops": {"rows": self.decode.rows, "best": self.decode.best / 1e9,
                                  **{k: v / 1e9 for k, v in self.decode.by_impl.items()},
                                  "fastest": self.decode.best_impl, "load": self.decode.load_average}}


def workload_flops(cfg, prompt_lens: list[int], new_tokens: list[int]) -> tuple[float, float]:
    """(prefill FLOPs, decode FLOPs) of requests with these prompt lengths and generated-token counts."""
    per_tok, head = layer_flops_per_token(cfg), head_flops_per_token(cfg)
    prefill = float(sum(prompt_lens)) * per_tok
    decode = float(sum(max(g - 1, 0) for g in new_tokens)) * per_tok + float(sum(new_tokens)) * head
    return prefill, decode


def workload_limit(cfg, prompt_lens: list[int], new_tokens: list[int], *, prefill_rows: int = 512,
                   decode_rows: int = 64, repeats: int = 5, rates: tuple[GemmRates, GemmRates] | None = None
                   ) -> WorkloadLimit:
    """Measure (or reuse `rates` = (prefill, decode)) and return the workload's limit."""
    if rates is None:
        rates = (measure_rates(cfg, prefill_rows, repeats=repeats), measure_rates(cfg, decode_rows, repeats=repeats))
    prefill, decode = workload_flops(cfg, prompt_lens, new_tokens)
    return WorkloadLimit(prefill_flops=prefill, decode_flops=decode, generated_tokens=sum(new_tokens),
                         prefill=rates[0], decode=rates[1])


def read_bandwidth(mb: int = 700, repeats: int = 5) -> float:
    """Bytes per second of a plain read of `mb` MB from memory: `torch.sum` over one fp32 tensor on every torch
    thread, best of `repeats` (load only ever slows a read down). A kernel that must read a set of weights once
    cannot do so faster than this."""
    x = torch.ones(mb * 2 ** 20 // 4)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def last_level_cache_bytes() -> int:
    """The L3's size (0 where the OS does not say): what of one step's adapter weights may still be cached at
    the next step."""
    from pathlib import Path

    sizes = [0]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip().upper()
                unit = {"K": 2 ** 10, "M": 2 ** 20}.get(size[-1:], 1)
                sizes.append(int(size.rstrip("KM")) * unit)
        except (OSError, ValueError):
            continue
    return max(sizes)


def cache_that_holds(dram_bytes_per_s: float, *, fast: float = 1.5) -> int:
    """The bytes the caches actually keep for this process between two reads of them: the largest buffer, of 8 MB
    doubling up to the L3's size, that rereads at least `fast` x the DRAM read (`read_bandwidth`), or 0.

    The L3 the OS reports is the socket's, shared with whatever else the host runs: on a 2-CPU guest of an Intel
    Xeon reporting 480 MB (2026-12-03) a buffer of 8-64 MB reread at 57 GB/s, 128 MB at 32 and 256 MB at 27, the
    700 MB read's speed. The fleet ceiling counted all 480 MB as cached there; what holds is ~64 MB."""
    l3 = last_level_cache_bytes()
    held, size = 0, 8 * 2 ** 20
    while size <= l3:
        if read_bandwidth(size // 2 ** 20) < fast * dram_bytes_per_s:
            break
        held, size = size, size * 2
    return held


def adapter_bytes(cfg, rank: int, targets, elem_bytes: int = 4) -> int:
    """The bytes of one adapter's A and B over every layer, as the worker's pool places them."""
    from protocol.lora_layout import ModelShape
    from protocol.memory import adapter_elements_per_layer

    return cfg.num_layers * adapter_elements_per_layer(ModelShape.from_config(cfg), rank, targets) * elem_bytes


@dataclass
class FleetCeiling:
    """How close a fleet pass can come to the base-only pass on this host, from what it must read.

    In every step where a request runs, its adapter's A and B of every layer are read once (its prefill's last
    step and each of its decode steps: `new_tokens` steps at least); a step's adapters far exceed the L3, so at
    most what the caches hold (`cache_that_holds`, never more than the L3's size) is still cached from the step
    before. At the plain read's speed those bytes take `read_seconds`, time a fleet pass spends beyond the
    base-only pass's work: with one thread per core nothing
    else runs while a core reads them. The LoRA term's arithmetic is left out (it can only add), so this is an
    upper bound, not an estimate (bench/lora_step.py measures what the kernel adds). So fleet/base can be at
    most b / (b + read_seconds) for a base-only pass of b seconds, and at most `at_limit_goal` when base-only runs
    at 0.90 of the fp32 limit: where that is below 0.85 the two goals cannot both be met on this host."""

    step_bytes: int  # adapter bytes of one step in which every request runs (each distinct adapter once)
    steps: int  # steps each adapter is needed in, at least
    cached_bytes: int  # what the caches hold between steps (cache_that_holds; at most the L3's size)
    read_bytes_per_s: float
    base_seconds: float  # the best base-only pass
    limit_seconds: float  # the workload's fp32 limit

    @property
    def read_seconds(self) -> float:
        return self.steps * max(self.step_bytes - self.cached_bytes, 0) / self.read_bytes_per_s

    def at(self, base_seconds: float) -> float:
        return base_seconds / (base_seconds + self.read_seconds)

    @property
    def at_measured_base(self) -> float:
        return self.at(self.base_seconds)

    @property
    def at_limit_goal(self) -> float:
        return self.at(self.limit_seconds / 0.90)

    def describe(self) -> str:
        return (f"fleet ceiling: {self.steps} steps x {self.step_bytes / 1e6:.0f} MB of adapters (less the "
                f"{self.cached_bytes / 1e6:.0f} MB the caches held) at the plain read's {self.read_bytes_per_s / 1e9:.1f} GB/s = "
                f"{self.read_seconds:.2f} s beyond base-only; fleet/base at most {self.at_measured_base:.2f} beside "
                f"this run's base-only pass ({self.base_seconds:.2f} s), at most {self.at_limit_goal:.2f} beside a "
                f"base-only pass at 0.90 of the limit ({self.limit_seconds / 0.9:.2f} s)"
                + ("" if self.at_limit_goal >= 0.85 else
                   ": below 0.85, so base-only >= 0.90 of the limit and fleet >= 0.85x base-only cannot both hold "
                   "on this host at fp32"))

    def as_dict(self) -> dict:
        return {"step_bytes": self.step_bytes, "steps": self.steps, "cached_bytes": self.cached_bytes,
                "read_gb_s": self.read_bytes_per_s / 1e9, "read_seconds": self.read_seconds,
                "base_seconds": self.base_seconds, "limit_seconds": self.limit_seconds,
                "fleet_vs_base_at_most": self.at_measured_base, "fleet_vs_base_at_most_at_limit_goal": self.at_limit_goal}


def decode_kv_bytes(cfg, prompt_lens: list[int], new_tokens: list[int], elem_bytes: int = 4) -> int:
    """The KV cache decode attention must read over a workload: in the step that makes a request's g-th generated
    token (g = 2..G; the first comes out of its prefill) the request attends to all P + g - 1 positions before it
    and its own, every layer. Prefill attention (a chunk's own keys, just computed) is left out."""
    from protocol.lora_layout import ModelShape
    from protocol.memory import page_elements

    positions = sum((g - 1) * p + (g - 1) * g // 2 for p, g in zip(prompt_lens, new_tokens, strict=True))
    # a page is one KV block of every layer (the pool's own arithmetic): one position of it is a token's K and V
    return positions * cfg.num_layers * page_elements(ModelShape.from_config(cfg), 1) * elem_bytes


@dataclass
class BaseCeiling:
    """How close a base-only pass can come to the fp32 limit on this host, from the KV cache it must read.

    The limit counts only the GEMMs. Decode attention reads every running request's whole KV cache each step;
    in a forward pass that runs its ops one after another on all cores (lorafleet, vLLM-CPU and HF all do) those
    reads are time beyond the GEMMs', at best at the plain read's speed. Norms, RoPE, sampling and scheduling
    are left out (they can only add), so this is an upper bound: of limit <= limit / (limit + kv_read_seconds)."""

    kv_bytes: int
    read_bytes_per_s: float
    limit_seconds: float

    @property
    def kv_read_seconds(self) -> float:
        return self.kv_bytes / self.read_bytes_per_s

    @property
    def of_limit_at_most(self) -> float:
        return self.limit_seconds / (self.limit_seconds + self.kv_read_seconds)

    def describe(self) -> str:
        return (f"base-only ceiling: decode attention reads {self.kv_bytes / 1e9:.1f} GB of KV cache over the workload, "
                f"{self.kv_read_seconds:.2f} s at the plain read's {self.read_bytes_per_s / 1e9:.1f} GB/s beyond the "
                f"limit's {self.limit_seconds:.2f} s of GEMMs: base-only at most {self.of_limit_at_most:.2f} of the limit"
                + (" (below the 0.90 goal)" if self.of_limit_at_most < 0.90 else ""))

    def as_dict(self) -> dict:
        return {"kv_bytes": self.kv_bytes, "read_gb_s": self.read_bytes_per_s / 1e9,
                "kv_read_seconds": self.kv_read_seconds, "limit_seconds": self.limit_seconds,
                "of_limit_at_most": self.of_limit_at_most}


def best_of(a: GemmRates | None, b: GemmRates) -> GemmRates:
    """The faster of two measurements at the same row count (load only ever slows a GEMM down)."""
    return b if a is None or b.best > a.best else a


def main() -> None:
    import argparse
    import sys
    from pathlib import Path

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from inference_worker.model import ModelConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory (config.json)")
    ap.add_argument("--rows", default="64,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--huge-pages", choices=("on", "off"), default="on",
                    help="off: the weights on the 4 KB pages malloc gives them, not on 2 MB pages as the runner keeps its own")
    args = ap.parse_args()
    cfg = ModelConfig.from_dir(args.model)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, oneDNN packed GEMM available: "
          f"{onednn_available()}")
    for rows in map(int, args.rows.split(",")):
        print(measure_rates(cfg, rows, repeats=args.repeats, huge_pages=args.huge_pages == "on").line(), flush=True)


if __name__ == "__main__":
    main()
