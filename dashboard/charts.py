"""The geometry of small server-rendered SVG bar charts: the templates only draw rectangles and need no
JavaScript chart library. Fed with dashboard.usage's buckets (usage page, adapter page) and the capacity
planner's table (capacity page)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .usage import Bucket


@dataclass
class Bar:
    x: float
    y: float
    width: float
    height: float
    title: str


@dataclass
class Chart:
    """A bar chart in SVG user units: plot area from (left, top) to (width, height - bottom)."""

    title: str
    width: int
    height: int
    left: int
    bottom: int
    top: int
    series: list[tuple[str, str, list[Bar]]]  # (legend, css class, bars)
    y_ticks: list[tuple[float, str]]
    x_labels: list[tuple[float, str]]
    empty: bool


def nice_max(value: float) -> float:
    """The smallest 1/2/5 × 10^k at or above value, so the top tick is a round number."""
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * exp >= value:
            return step * exp
    return 10 * exp


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 1_000:
        return f"{value / 1_000:.1f}k"
    return f"{value:g}"


def bar_chart(title: str, buckets: list[Bucket], metrics: list[tuple[str, str, str]], *, unit: str = "",
              window: str = "24h", width: int = 360, height: int = 140) -> Chart:
    """metrics: (bucket attribute, legend, css class); several metrics are drawn over each other,
    largest first, so p95 stands behind p50."""
    left, bottom, top = 48, 20, 8
    plot_w, plot_h = width - left - 4, height - bottom - top
    values = {attr: [getattr(b, attr) for b in buckets] for attr, _, _ in metrics}
    peak = max([v for vs in values.values() for v in vs if v is not None] or [0])
    scale_max = nice_max(peak)  # 1.0 when there is no data
    slot = plot_w / max(len(buckets), 1)
    series = []
    for attr, legend, css in metrics:
        bars = []
        for i, (bucket, value) in enumerate(zip(buckets, values[attr], strict=True)):
            if not value:
                continue
            h = plot_h * value / scale_max
            label = bucket.start.strftime("%H:%M" if window == "24h" else "%a %d %H:%M")
            tooltip = f"{label} UTC — {legend}: {_fmt(value, unit)}"
            bars.append(Bar(left + i * slot + 1, top + plot_h - h, max(slot - 2, 1), h, tooltip))
        series.append((legend, css, bars))
    ticks = [(top + plot_h * (1 - f), _fmt(scale_max * f, unit)) for f in (0, 0.5, 1)]
    step = max(len(buckets) // 4, 1)
    labels = [
        (left + i * slot + slot / 2, b.start.strftime("%H:%M" if window == "24h" else "%a %d"))
        for i, b in enumerate(buckets) if i % step == 0
    ]
    return Chart(title, width, height, left, bottom, top, series, ticks, labels, empty=peak == 0)


def adapter_charts(buckets: list[Bucket], window: str) -> list[Chart]:
    """The three charts the usage page shows for one adapter."""
    return [
        bar_chart("Requests", buckets, [("requests", "requests", "bar-a"), ("errors", "errors", "bar-err")], window=window),
        bar_chart("Tokens (prompt + completion)", buckets, [("tokens", "tokens", "bar-b")], window=window),
        bar_chart("Latency", buckets, [("p95", "p95", "bar-p95"), ("p50", "p50", "bar-p50")], unit="s", window=window),
    ]


@dataclass
class LineChart:
    """A line chart in SVG user units (the fine-tuning page's loss by step): `lines` are (legend, css class,
    polyline points "x,y x,y ...", last point or None)."""

    title: str
    width: int
    height: int
    left: int
    bottom: int
    top: int
    lines: list[tuple[str, str, str, tuple[float, float] | None]]
    y_ticks: list[tuple[float, str]]
    x_labels: list[tuple[float, str]]
    empty: bool


def line_chart(title: str, train: list[tuple[int, float]], valid: list[tuple[int, float]], *,
               total_steps: int | None = None, width: int = 560, height: int = 200) -> LineChart:
    """Loss by step: the x axis runs to the job's total steps (so a running job's line grows across it), the y axis
    from 0 to a round number above the highest loss."""
    left, bottom, top = 48, 20, 8
    plot_w, plot_h = width - left - 8, height - bottom - top
    steps = max([total_steps or 0] + [s for s, _ in train + valid] + [1])
    peak = nice_max(max([v for _, v in train + valid if math.isfinite(v)] or [0]))

    def xy(step: int, value: float) -> tuple[float, float]:
        value = min(max(value, 0.0), peak) if math.isfinite(value) else peak
        return round(left + plot_w * step / steps, 2), round(top + plot_h * (1 - value / peak), 2)

    lines = []
    for legend, css, points in (("train loss", "line-a", train), ("validation loss", "line-b", valid)):
        coords = [xy(s, v) for s, v in points]
        lines.append((legend, css, " ".join(f"{x},{y}" for x, y in coords), coords[-1] if coords else None))
    ticks = [(top + plot_h * (1 - f), _fmt(peak * f, "")) for f in (0, 0.5, 1)]
    labels = [(left + plot_w * f, f"{round(steps * f)}") for f in (0, 0.5, 1)]
    return LineChart(title, width, height, left, bottom, top, lines, ticks, labels, empty=not (train or valid))
