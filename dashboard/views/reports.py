"""Usage, audit and capacity pages: what a tenant's adapters served, the audit log, and the planner.

Every row read is the current tenant's (``for_tenant(request.tenant)``); any member may read them.
"""
from __future__ import annotations

import uuid
from datetime import datetime, time, timedelta

from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from adapters import capacity
from adapters.models import Adapter
from gateway.models import AuditRecord
from tenants.context import tenant_view

from .. import charts, usage
from ..forms import AuditFilterForm, CapacityForm
from .adapters import usage_window


@tenant_view
def usage_page(request: HttpRequest) -> HttpResponse:
    window = usage_window(request)
    series = usage.usage_series(request.tenant, window=window)
    names = dict(Adapter.objects.for_tenant(request.tenant).values_list("pk", "name"))
    panels = []
    # adapter_id None (explicit base requests) is not in `names`, so .get's default covers it.
    for adapter_id, buckets in sorted(series.items(), key=lambda kv: names.get(kv[0], "")):
        latencies = [x for b in buckets for x in b.latencies]
        panels.append({
            "name": names.get(adapter_id, "base model (no adapter)"),
            "adapter_id": adapter_id,
            "requests": sum(b.requests for b in buckets),
            "tokens": sum(b.tokens for b in buckets),
            "p50": usage.percentile(latencies, 50),
            "p95": usage.percentile(latencies, 95),
            "charts": charts.adapter_charts(buckets, window),
        })
    return render(request, "adapters/usage.html", {"panels": panels, "window": window})


@tenant_view
def audit(request: HttpRequest) -> HttpResponse:
    records = AuditRecord.objects.for_tenant(request.tenant)
    form = AuditFilterForm(request.GET or None, tenant=request.tenant)
    if form.is_valid():
        data = form.cleaned_data
        if q := data["q"]:  # already stripped by the CharField
            records = records.filter(request_id__icontains=q) if len(q) < 36 \
                else records.filter(request_id=_uuid_or_none(q))
        if data["adapter"]:
            records = records.filter(adapter=data["adapter"])
        if data["version"]:
            records = records.filter(version_number=data["version"])
        if data["status"]:
            records = records.filter(status=data["status"])
        tz = timezone.get_current_timezone()
        if data["date_from"]:
            records = records.filter(created_at__gte=datetime.combine(data["date_from"], time.min, tz))
        if data["date_to"]:
            records = records.filter(created_at__lt=datetime.combine(data["date_to"] + timedelta(days=1), time.min, tz))
    page = Paginator(records.order_by("-created_at", "-id"), 50).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(request, "adapters/audit.html", {"form": form, "page": page, "query": query.urlencode()})


def _uuid_or_none(value: str):
    try:
        return uuid.UUID(value.strip())
    except ValueError:
        return None


@tenant_view
def capacity_page(request: HttpRequest) -> HttpResponse:
    form = CapacityForm(request.GET or None, tenant=request.tenant)
    if not form.is_bound:  # a first visit shows the default plan rather than an empty page
        form = CapacityForm({name: field.initial for name, field in form.fields.items()}, tenant=request.tenant)
    plan = table = chart = None
    error = None
    if form.is_valid():
        data = form.cleaned_data
        name, manifest = form.manifest()
        kwargs = dict(dtype=data["dtype"], kv_dtype=data["kv_dtype"], num_adapters=data["adapters"],
                      gpu_gb=data["gpu_gb"], context_len=data["context_len"], base_name=name)
        try:
            plan = capacity.plan_capacity(manifest, rank=data["rank"], targets=data["targets"], **kwargs)
            table = capacity.capacity_table(manifest, **kwargs)
        except capacity.CapacityError as err:
            error = str(err)
        else:
            chart = _capacity_chart(table)
    return render(request, "adapters/capacity.html", {
        "form": form, "plan": plan, "chart": chart, "error": error,
        "figures": _capacity_figures(plan) if plan else [],
        "rows": [{"plan": p, "fleet": si_bytes(p.fleet_bytes), "kv_left": si_bytes(p.kv_bytes_left)} for p in table or []],
    })


def si_bytes(n: int) -> str:
    """SI units (1 GB = 10**9 bytes), as the capacity planner counts; Django's filesizeformat is binary."""
    if n < 0:
        return "−" + si_bytes(-n)
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _capacity_figures(plan) -> list[tuple[str, str]]:
    return [
        ("Model family (model_type)", plan.family),
        ("LoRA parameters per adapter", f"{plan.lora_params_per_adapter:,}"),
        ("Bytes per adapter", f"{plan.adapter_bytes:,} ({si_bytes(plan.adapter_bytes)})"),
        (f"Fleet bytes ({plan.num_adapters:,} adapters)", f"{plan.fleet_bytes:,} ({si_bytes(plan.fleet_bytes)})"),
        ("Base parameters", f"{plan.base_params:,}"),
        ("Base bytes", f"{plan.base_bytes:,} ({si_bytes(plan.base_bytes)})"),
        ("KV bytes per token", f"{plan.kv_bytes_per_token:,}"),
        (f"KV bytes per {plan.context_len:,}-token sequence",
         f"{plan.kv_bytes_per_sequence:,} ({si_bytes(plan.kv_bytes_per_sequence)})"),
        ("KV memory left on the card", f"{plan.kv_bytes_left:,} ({si_bytes(plan.kv_bytes_left)})"),
        ("Max concurrent sequences", f"{plan.max_concurrent_sequences:,}"),
    ]


def _capacity_chart(table: list) -> dict:
    """Grouped bars: max concurrent sequences per rank, one bar per target preset."""
    width, height, left, bottom, top = 560, 220, 64, 28, 12
    plot_w, plot_h = width - left - 8, height - bottom - top
    ranks = list(dict.fromkeys(p.rank for p in table))
    presets = list(dict.fromkeys(p.targets_label for p in table))
    peak = max((p.max_concurrent_sequences for p in table), default=0)
    top_value = charts.nice_max(peak)  # 1 when there is no data
    group_w = plot_w / max(len(ranks), 1)
    bar_w = (group_w - 12) / max(len(presets), 1)
    bars, labels = [], []
    for gi, rank in enumerate(ranks):
        labels.append((left + gi * group_w + group_w / 2, f"r={rank}"))
        for pi, preset in enumerate(presets):
            plan = next(p for p in table if p.rank == rank and p.targets_label == preset)
            h = plot_h * plan.max_concurrent_sequences / top_value
            bars.append({
                "x": left + gi * group_w + 6 + pi * bar_w, "y": top + plot_h - h, "w": bar_w - 2, "h": h,
                "css": f"bar-s{pi}", "title": f"rank {rank}, {preset}: {plan.max_concurrent_sequences} sequences"
                + ("" if plan.fits else " (does not fit)"), "fits": plan.fits,
            })
    ticks = [(top + plot_h * (1 - f), f"{top_value * f:g}") for f in (0, 0.5, 1)]
    return {"width": width, "height": height, "left": left, "top": top, "bottom": height - bottom, "bars": bars,
            "labels": labels, "ticks": ticks, "legend": [(f"bar-s{i}", p) for i, p in enumerate(presets)]}
