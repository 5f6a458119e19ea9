"""What a tenant's adapters served: request and token counts and latency percentiles from the audit log.

Reads gateway.AuditRecord rows, always through ``for_tenant``. Percentiles are computed in Python over
the window's rows, so the same code gives the same answer on SQLite and PostgreSQL; a window is at most
7 days of one tenant and only a few numbers per row are fetched, streamed with ``.iterator()``.
dashboard/charts.py turns the buckets into bar charts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Count, Max, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from gateway.models import AuditRecord, AuditStatus

#: window name -> (span, bucket width)
WINDOWS: dict[str, tuple[timedelta, timedelta]] = {
    "24h": (timedelta(hours=24), timedelta(hours=1)),
    "7d": (timedelta(days=7), timedelta(hours=6)),
}


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
        AuditRecord.objects.for_tenant(tenant)
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
        if status == AuditStatus.ERROR:
            bucket.errors += 1
        elif total is not None:
            bucket.latencies.append(total)
    return series


def adapter_totals(tenant, *, since: datetime) -> dict[int, dict]:
    """Per adapter id: requests and tokens since `since`, and when it last served (any time)."""
    audit = AuditRecord.objects.for_tenant(tenant).filter(adapter__isnull=False).order_by()
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
