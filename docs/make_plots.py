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
    """Mid-model tok/s per system, one group of bars per recorded run."""
    try:
        md = section(text, "Engine")
    except SystemExit:
        return None
    found = [t for t in tables(md) if t and "lorafleet base" in t[0]]
    if not found:
        return None
    rows = found[0]
    run_key = next(iter(rows[0]))
    systems = [k for k in rows[0] if k != run_key]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [r + i * width for r in range(len(rows))]
        ax.bar(xs, [number(row[system]) for row in rows], width, label=system)
    ax.set_xticks([r + 0.4 - width / 2 for r in range(len(rows))], [row[run_key] for row in rows])
    ax.set(ylabel="generated tok/s", xlabel="run (start time, 2026-11-29)",
           title="Mid model, 64 concurrent requests, Zipf over 100 adapters (bench/engine.py; 2 CPUs)")
    ax.legend(fontsize=8)
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
