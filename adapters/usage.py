"""What a tenant's adapters served: request and token counts and latency percentiles from the audit log.

Reads gateway.AuditRecord rows, always through ``for_tenant`` (the model is looked up by name: the
gateway depends on adapters, not the other way round). Percentiles are computed in Python over the
window's rows, so the same code gives the same answer on SQLite and PostgreSQL; a window is at most
7 days of one tenant and only three numbers per row are fetched, streamed with ``.iterator()``.

The second half turns buckets into the geometry of small server-rendered SVG bar charts, so the
templates only draw rectangles and need no JavaScript chart library.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.apps import apps
from django.db.models import Count, Max, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

#: window name -> (span, bucket width)
WINDOWS: dict[str, tuple[timedelta, timedelta]] = {
    "24h": (timedelta(hours=24), timedelta(hours=1)),
    "7d": (timedelta(days=7), timedelta(hours=6)),
}


def _audit():
    return apps.get_model("gateway", "AuditRecord")


@dataclass
class Bucket:
    start: datetime
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)

    @property
    def p50(self) -> float | None:
        return percentile(self.latencies, 50)

    @property
    def p95(self) -> float | None:
        return percentile(self.latencies, 95)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (the value below which q% of observations fall); None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def window_start(window: str, now: datetime) -> tuple[datetime, timedelta, int]:
    """(first bucket start, bucket width, bucket count), with buckets aligned to whole widths."""
    span, width = WINDOWS[window]
    epoch = datetime(2000, 1, 1, tzinfo=now.tzinfo)
    end = epoch + ((now - epoch) // width + 1) * width  # the end of the bucket holding `now`
    count = int(span / width)
    return end - count * width, width, count


def usage_series(tenant, *, window: str = "24h", now: datetime | None = None) -> dict[int | None, list[Bucket]]:
    """Per adapter id (None = explicit base requests), one Bucket per interval of the window."""
    now = now or timezone.now()
    start, width, count = window_start(window, now)
    series: dict[int | None, list[Bucket]] = {}
    rows = (
        _audit().objects.for_tenant(tenant)
        .filter(created_at__gte=start)
        .values_list("adapter_id", "created_at", "status", "prompt_tokens", "completion_tokens", "total_seconds")
        .order_by()
    )
    for adapter_id, created_at, status, prompt, completion, total in rows.iterator(chunk_size=2000):
        buckets = series.get(adapter_id)
        if buckets is None:
            buckets = series[adapter_id] = [Bucket(start + i * width) for i in range(count)]
        index = min(int((created_at - start) / width), count - 1)
        bucket = buckets[index]
        bucket.requests += 1
        bucket.tokens += (prompt or 0) + (completion or 0)
        if status == "error":
            bucket.errors += 1
        elif total is not None:
            bucket.latencies.append(total)
    return series


def adapter_totals(tenant, *, since: datetime) -> dict[int, dict]:
    """Per adapter id: requests and tokens since `since`, and when it last served (any time)."""
    audit = _audit().objects.for_tenant(tenant).filter(adapter__isnull=False).order_by()
    totals = {
        row["adapter_id"]: {"requests": row["requests"], "tokens": row["prompt"] + row["completion"], "last_used": None}
        for row in audit.filter(created_at__gte=since).values("adapter_id").annotate(
            requests=Count("id"),
            prompt=Coalesce(Sum("prompt_tokens"), 0),
            completion=Coalesce(Sum("completion_tokens"), 0),
        )
    }
    for row in audit.values("adapter_id").annotate(last=Max("created_at")):
        totals.setdefault(row["adapter_id"], {"requests": 0, "tokens": 0, "last_used": None})["last_used"] = row["last"]
    return totals


# --- chart geometry ---------------------------------------------------------------------------


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


def _nice_max(value: float) -> float:
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
    scale_max = _nice_max(peak)  # 1.0 when there is no data
    slot = plot_w / max(len(buckets), 1)
    series = []
    for attr, legend, css in metrics:
        bars = []
        for i, (bucket, value) in enumerate(zip(buckets, values[attr])):
            if not value:
                continue
            h = plot_h * value / scale_max
            label = bucket.start.strftime("%H:%M" if window == "24h" else "%a %d %H:%M")
            bars.append(Bar(left + i * slot + 1, top + plot_h - h, max(slot - 2, 1), h, f"{label} UTC — {legend}: {_fmt(value, unit)}"))
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
