"""Adapter pages: list, create, detail, upload, make live, delete.

Thin on purpose: every object is fetched through ``for_tenant(request.tenant)`` (another tenant's
adapter or version is a 404), the role is enforced by ``tenant_view``, and every change is one call to
a service (adapters/services.py, adapters/uploads.py).
"""
from __future__ import annotations

import logging
from datetime import timedelta

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt, csrf_protect

from adapters import capacity, services, uploads
from adapters.models import Adapter, AdapterVersion, BaseModel, VersionPointerChange
from adapters.storage import BlobStorageError
from adapters.uploads import cap_upload_size, upload_cut_error
from adapters.validation import AdapterValidationError
from gateway.models import ApiKey
from tenants.context import tenant_view

from .. import charts, usage
from ..forms import ActivateForm, AdapterCreateForm, UploadForm, UsageWindowForm

log = logging.getLogger(__name__)


def _live_adapter(request: HttpRequest, pk: int) -> Adapter:
    return get_object_or_404(
        Adapter.objects.for_tenant(request.tenant).live().select_related("base", "active_version"), pk=pk
    )


def gpu_bytes(version: AdapterVersion, base: BaseModel) -> int:
    """Bytes the version occupies in a device slot: the worker casts adapters to the base's dtype."""
    try:
        per_param = capacity.dtype_bytes(str(base.shape_manifest.get("dtype") or "bfloat16"))
    except capacity.CapacityError:
        per_param = 2
    return version.parameter_count * per_param


def usage_window(request: HttpRequest) -> str:
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
    versions = list(adapter.versions.select_related("created_by", "provenance").order_by("-number"))
    for version in versions:
        version.gpu_bytes = gpu_bytes(version, adapter.base)
    history = (
        VersionPointerChange.objects.for_tenant(request.tenant)
        .filter(adapter=adapter).select_related("from_version", "to_version", "actor")
    )
    window = usage_window(request)
    buckets = usage.usage_series(request.tenant, window=window).get(adapter.pk)
    adapter_charts = charts.adapter_charts(buckets, window) if buckets else []
    return render(request, "adapters/detail.html", {
        "adapter": adapter, "versions": versions, "history": history, "charts": adapter_charts, "window": window,
    })


@tenant_view(manage=True)
def adapter_delete(request: HttpRequest, pk: int) -> HttpResponse:
    adapter = _live_adapter(request, pk)
    if request.method == "POST":
        services.soft_delete_adapter(adapter, actor=request.user)
        messages.success(request, f"Adapter {adapter.name} is deleted; requests naming it now get 410 Gone.")
        return redirect("adapters:list")
    bound_keys = ApiKey.objects.for_tenant(request.tenant).filter(bound_adapter=adapter, revoked_at__isnull=True).count()
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
            except BlobStorageError as err:
                log.exception("storing a new version of adapter %s failed", adapter.pk)
                error = {"field": "storage", "code": err.code, "message": "Storing the weights failed on our side "
                         f"({err.code}); nothing was recorded. Please try again in a minute."}
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
            code = {"code": error["code"]} if "code" in error else {}  # storage failures say which
            return JsonResponse({"ok": False, "field": error["field"], "error": error["message"], **code}, status=status)
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
