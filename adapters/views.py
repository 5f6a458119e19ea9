"""Dashboard pages of the adapters app: list, create, detail, upload, make live, delete, usage, audit,
capacity.

Thin on purpose: every object is fetched through ``for_tenant(request.tenant)`` (another tenant's
adapter, version or audit row is a 404), the role is enforced by ``tenant_view``, and every change is
one call to a service (adapters/services.py, adapters/uploads.py).
"""
from __future__ import annotations

import logging
import uuid
from datetime import datetime, time, timedelta

from django.apps import apps
from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt, csrf_protect

from tenants.context import tenant_view

from . import capacity, services, uploads, usage
from .forms import ActivateForm, AdapterCreateForm, AuditFilterForm, CapacityForm, UploadForm, UsageWindowForm
from .models import Adapter, AdapterVersion, VersionPointerChange
from .storage import BlobStorageError
from .uploads import cap_upload_size, upload_cut_error
from .validation import AdapterValidationError

log = logging.getLogger(__name__)


def _live_adapter(request: HttpRequest, pk: int) -> Adapter:
    return get_object_or_404(
        Adapter.objects.for_tenant(request.tenant).live().select_related("base", "active_version"), pk=pk
    )


def gpu_bytes(version: AdapterVersion, base) -> int:
    """Bytes the version occupies in a device slot: the worker casts adapters to the base's dtype."""
    try:
        per_param = capacity.dtype_bytes(str(base.shape_manifest.get("dtype") or "bfloat16"))
    except capacity.CapacityError:
        per_param = 2
    return version.parameter_count * per_param


def _window(request: HttpRequest) -> str:
    form = UsageWindowForm(request.GET)
    return (form.is_valid() and form.cleaned_data["window"]) or "24h"


# --- adapters ---------------------------------------------------------------------------------


@tenant_view
def adapter_list(request: HttpRequest) -> HttpResponse:
    adapters = list(Adapter.objects.for_tenant(request.tenant).live().select_related("base", "active_version"))
    totals = usage.adapter_totals(request.tenant, since=timezone.now() - timedelta(hours=24))
    rows = []
    for adapter in adapters:
        version = adapter.active_version
        rows.append({
            "adapter": adapter,
            "version": version,
            "gpu_bytes": gpu_bytes(version, adapter.base) if version else None,
            **totals.get(adapter.pk, {"requests": 0, "tokens": 0, "last_used": None}),
        })
    return render(request, "adapters/list.html", {"rows": rows})


@tenant_view(write=True)
def adapter_create(request: HttpRequest) -> HttpResponse:
    form = AdapterCreateForm(request.POST or None, tenant=request.tenant)
    if request.method == "POST" and form.is_valid():
        adapter = services.create_adapter(
            request.tenant, form.cleaned_data["name"], form.cleaned_data["base"],
            created_by=request.user, description=form.cleaned_data["description"],
        )
        messages.success(request, f"Adapter {adapter.name} created. Upload its first version.")
        return redirect("adapters:upload", pk=adapter.pk)
    return render(request, "adapters/create.html", {"form": form}, status=400 if form.is_bound else 200)


@tenant_view
def adapter_detail(request: HttpRequest, pk: int) -> HttpResponse:
    adapter = _live_adapter(request, pk)
    versions = list(adapter.versions.select_related("created_by").order_by("-number"))
    for version in versions:
        version.gpu_bytes = gpu_bytes(version, adapter.base)
    history = (
        VersionPointerChange.objects.for_tenant(request.tenant)
        .filter(adapter=adapter).select_related("from_version", "to_version", "actor")
    )
    window = _window(request)
    buckets = usage.usage_series(request.tenant, window=window).get(adapter.pk)
    charts = usage.adapter_charts(buckets, window) if buckets else []
    return render(request, "adapters/detail.html", {
        "adapter": adapter, "versions": versions, "history": history, "charts": charts, "window": window,
    })


@tenant_view(manage=True)
def adapter_delete(request: HttpRequest, pk: int) -> HttpResponse:
    adapter = _live_adapter(request, pk)
    if request.method == "POST":
        services.soft_delete_adapter(adapter, actor=request.user)
        messages.success(request, f"Adapter {adapter.name} is deleted; requests naming it now get 410 Gone.")
        return redirect("adapters:list")
    bound_keys = adapter.bound_keys.filter(revoked_at__isnull=True).count()
    return render(request, "adapters/delete.html", {"adapter": adapter, "bound_keys": bound_keys})


# --- versions ---------------------------------------------------------------------------------


def _wants_json(request: HttpRequest) -> bool:
    return "application/json" in request.headers.get("Accept", "")


@csrf_exempt
def upload(request: HttpRequest, pk: int) -> HttpResponse:
    """Cap the body before anything reads it — CSRF checking reads request.POST, which parses the whole
    multipart body — then check CSRF and the role as usual (Django's documented pattern for upload handlers)."""
    cap_upload_size(request)
    return _upload(request, pk)


@csrf_protect
@tenant_view(write=True)
def _upload(request: HttpRequest, pk: int) -> HttpResponse:
    """Upload a new version. The page's script posts with XMLHttpRequest (for the progress bar) and
    asks for JSON; without JavaScript the same form posts normally and gets a page back."""
    adapter = _live_adapter(request, pk)
    # Bound on every POST, even an empty one, so a POST with no files is a named 400, not an unbound form.
    form = UploadForm(request.POST, request.FILES) if request.method == "POST" else UploadForm()
    error = None
    cut = upload_cut_error(request) if request.method == "POST" else None
    if cut is not None:
        error = {"field": cut.field, "message": str(cut)}
        if _wants_json(request):
            return JsonResponse({"ok": False, "field": error["field"], "error": error["message"]}, status=413)
        return render(request, "adapters/upload.html", {"adapter": adapter, "form": form, "error": error}, status=413)
    if request.method == "POST":
        if form.is_valid():
            try:
                # The UploadedFiles go straight to the service: above FILE_UPLOAD_MAX_MEMORY_SIZE Django has
                # streamed them to temporary files, and the service streams them on to storage.
                version = uploads.create_adapter_version(
                    adapter,
                    config_file=form.cleaned_data["config_file"],
                    weights_file=form.cleaned_data["weights_file"],
                    created_by=request.user,
                    activate=True if form.cleaned_data["activate"] else None,
                )
            except AdapterValidationError as err:
                error = {"field": err.field, "message": str(err)}
            except BlobStorageError:
                log.exception("storing a new version of adapter %s failed", adapter.pk)
                error = {"field": "storage", "message": "Storing the weights failed on our side; nothing was "
                         "recorded. Please try again in a minute."}
            else:
                adapter.refresh_from_db(fields=["active_version"])
                live = adapter.active_version_id == version.pk
                text = f"Version {version.number} uploaded (sha256 {version.sha256[:12]}…)" + (" and live." if live else ".")
                if _wants_json(request):
                    return JsonResponse({
                        "ok": True, "number": version.number, "sha256": version.sha256, "live": live,
                        "message": text, "url": reverse("adapters:detail", args=[adapter.pk]),
                    }, status=201)
                messages.success(request, text)
                return redirect("adapters:detail", pk=adapter.pk)
        else:
            missing = next(iter(form.errors))
            error = {"field": missing, "message": f"{form.fields[missing].label}: {form.errors[missing][0]}"}
        status = 503 if error["field"] == "storage" else 400  # our failure, not the upload's
        if _wants_json(request):
            return JsonResponse({"ok": False, "field": error["field"], "error": error["message"]}, status=status)
        return render(request, "adapters/upload.html", {"adapter": adapter, "form": form, "error": error},
                      status=status)
    return render(request, "adapters/upload.html", {"adapter": adapter, "form": form, "error": None})


@tenant_view(write=True)
def activate(request: HttpRequest, pk: int, number: int) -> HttpResponse:
    """Make any version live (rollback or roll forward), after a confirmation naming from → to and a reason."""
    adapter = _live_adapter(request, pk)
    version = get_object_or_404(AdapterVersion.objects.for_tenant(request.tenant), adapter=adapter, number=number)
    if adapter.active_version_id == version.pk:
        messages.info(request, f"Version {version.number} is already live.")
        return redirect("adapters:detail", pk=adapter.pk)
    form = ActivateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            services.activate_version(adapter, version, actor=request.user, reason=form.cleaned_data["reason"])
        except services.AdapterStateError as err:
            form.add_error(None, str(err))
        else:
            messages.success(request, f"Version {version.number} of {adapter.name} is live; new requests use it now.")
            return redirect("adapters:detail", pk=adapter.pk)
    return render(request, "adapters/activate.html", {
        "adapter": adapter, "version": version, "current": adapter.active_version, "form": form,
    }, status=400 if form.is_bound else 200)


# --- usage, audit, capacity -------------------------------------------------------------------


@tenant_view
def usage_page(request: HttpRequest) -> HttpResponse:
    window = _window(request)
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
            "charts": usage.adapter_charts(buckets, window),
        })
    return render(request, "adapters/usage.html", {"panels": panels, "window": window})


@tenant_view
def audit(request: HttpRequest) -> HttpResponse:
    records = apps.get_model("gateway", "AuditRecord").objects.for_tenant(request.tenant)
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
    form = CapacityForm(request.GET or None)
    if not form.is_bound:  # a first visit shows the default plan rather than an empty page
        form = CapacityForm({name: field.initial for name, field in form.fields.items()})
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
        ("LoRA parameters per adapter", f"{plan.lora_params_per_adapter:,}"),
        ("Bytes per adapter", f"{plan.adapter_bytes:,} ({si_bytes(plan.adapter_bytes)})"),
        (f"Fleet bytes ({plan.num_adapters:,} adapters)", f"{plan.fleet_bytes:,} ({si_bytes(plan.fleet_bytes)})"),
        ("Base parameters", f"{plan.base_params:,}"),
        ("Base bytes", f"{plan.base_bytes:,} ({si_bytes(plan.base_bytes)})"),
        ("KV bytes per token", f"{plan.kv_bytes_per_token:,}"),
        (f"KV bytes per {plan.context_len:,}-token sequence", f"{plan.kv_bytes_per_sequence:,} ({si_bytes(plan.kv_bytes_per_sequence)})"),
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
    top_value = usage._nice_max(peak)  # 1 when there is no data
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
