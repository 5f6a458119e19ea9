"""Fine-tuning pages: a tenant's datasets and jobs, upload a dataset, start a job, watch its loss, cancel it.

The same services as the OpenAI-shaped API (finetune/files.py, finetune/jobs.py): a dataset is checked line by
line while it streams and refused whole, a job is validated and queued or refused with the API's message. Roles
as for adapter uploads: members who may write upload and start or cancel jobs; viewers read. Every object is
fetched through ``for_tenant(request.tenant)``: another tenant's job is a 404.

The job page is live without an inline script: static/js/finetune.js fetches the page's live part
(``?part=live``: status, loss chart, events, result) every two seconds while the job is active and swaps it in.
"""
from __future__ import annotations

import logging

from django import forms
from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt, csrf_protect

from adapters.models import BaseModel
from adapters.uploads import cap_upload_size
from finetune import files as file_service
from finetune import jobs as job_service
from finetune.models import ACTIVE_STATUSES, FineTuningJob, JobEvent, TrainingFile
from finetune.params import DEFAULT_EPOCHS, DEFAULT_RANK, MAX_BATCH, MAX_EPOCHS, MAX_LR_MULTIPLIER, MAX_SEED, JobParams
from gateway.errors import ApiError
from tenants.context import tenant_view

from .. import charts

log = logging.getLogger(__name__)


class JobForm(forms.Form):
    """Start a job: the API's fields, with its defaults ("auto") left blank."""

    training_file = forms.ChoiceField(label="Training file")
    validation_file = forms.ChoiceField(label="Validation file", required=False)
    model = forms.ChoiceField(label="Base model")
    suffix = forms.CharField(label="Adapter name", max_length=64,
                             help_text="The result becomes a new version of this adapter (created if new).")
    n_epochs = forms.IntegerField(label="Epochs", min_value=1, max_value=MAX_EPOCHS, required=False,
                                  help_text=f"Blank: {DEFAULT_EPOCHS}.")
    batch_size = forms.IntegerField(label="Batch size", min_value=1, max_value=MAX_BATCH, required=False,
                                    help_text="Blank: 8, or fewer when the file has fewer examples.")
    learning_rate_multiplier = forms.FloatField(label="Learning-rate multiplier", min_value=1e-6,
                                                max_value=MAX_LR_MULTIPLIER, required=False,
                                                help_text="Blank: 1 (times the server's base learning rate).")
    rank = forms.IntegerField(label="LoRA rank", min_value=1, max_value=256, initial=DEFAULT_RANK)
    seed = forms.IntegerField(label="Seed", min_value=0, max_value=MAX_SEED, required=False,
                              help_text="Blank: a random one (recorded). The same seed and data give the same weights.")
    auto_activate = forms.BooleanField(label="Make the new version live when it is done", required=False)

    def __init__(self, *args, tenant, **kwargs):
        super().__init__(*args, **kwargs)
        files = [(f.public_id, f"{f.filename} ({f.examples} examples, {f.public_id})")
                 for f in TrainingFile.objects.for_tenant(tenant).live()]
        self.fields["training_file"].choices = files
        self.fields["validation_file"].choices = [("", "none")] + files
        self.fields["model"].choices = [(b.slug, b.display_name or b.slug)
                                        for b in BaseModel.objects.usable_by(tenant).exclude(checkpoint_path="")]

    def params(self) -> JobParams:
        d = self.cleaned_data
        return JobParams(model=d["model"], training_file=d["training_file"], validation_file=d["validation_file"] or None,
                         suffix=d["suffix"].strip(), seed=d["seed"], n_epochs=d["n_epochs"],
                         batch_size=d["batch_size"], learning_rate_multiplier=d["learning_rate_multiplier"],
                         rank=d["rank"], auto_activate=d["auto_activate"])


def _wants_json(request: HttpRequest) -> bool:
    return "application/json" in request.headers.get("Accept", "")


@tenant_view
def jobs(request: HttpRequest) -> HttpResponse:
    """The tenant's datasets and jobs, the upload form and the new-job form."""
    return _jobs_page(request, JobForm(tenant=request.tenant, initial={"rank": DEFAULT_RANK}))


def _jobs_page(request: HttpRequest, form: JobForm, *, error: str | None = None, status: int = 200) -> HttpResponse:
    tenant = request.tenant
    return render(request, "finetune/jobs.html", {
        "files": TrainingFile.objects.for_tenant(tenant).live()[:50],
        "jobs": FineTuningJob.objects.for_tenant(tenant).select_related("base", "result_version__adapter")[:50],
        "form": form, "job_error": error, "max_file_bytes": settings.LORAFLEET_FINETUNE_MAX_FILE_BYTES,
        "max_file": file_service.human_bytes(settings.LORAFLEET_FINETUNE_MAX_FILE_BYTES),
    }, status=status)


@csrf_exempt
def upload_file(request: HttpRequest) -> HttpResponse:
    """Cap the body before anything reads it (CSRF checking parses the multipart body), then check CSRF and role."""
    cap_upload_size(request, settings.LORAFLEET_FINETUNE_MAX_FILE_BYTES)
    return _upload_file(request)


@csrf_protect
@tenant_view(write=True)
def _upload_file(request: HttpRequest) -> HttpResponse:
    """A dataset, checked while it streams. The page posts it with XMLHttpRequest (for the progress bar) and asks for
    JSON; without JavaScript the same form posts normally and comes back to the page with a message."""
    if request.method != "POST":
        return redirect("finetuning:jobs")
    try:
        if getattr(request, "lorafleet_upload_cut", None):
            raise file_service.too_large(settings.LORAFLEET_FINETUNE_MAX_FILE_BYTES)
        upload = request.FILES.get("file")
        if upload is None:
            raise ApiError(400, "missing_parameter", "Choose a JSONL file to upload.", param="file")
        created = file_service.create_training_file(request.tenant, upload, purpose="fine-tune")
    except ApiError as err:
        if _wants_json(request):
            return JsonResponse({"ok": False, "error": err.message, "code": err.code}, status=err.status)
        messages.error(request, f"Dataset refused: {err.message}")
        return redirect("finetuning:jobs")
    text = f"{created.filename} stored as {created.public_id}: {created.examples} examples, sha256 {created.sha256[:12]}…"
    if _wants_json(request):
        return JsonResponse({"ok": True, "id": created.public_id, "examples": created.examples,
                             "sha256": created.sha256, "message": text, "url": reverse("finetuning:jobs")}, status=201)
    messages.success(request, text)
    return redirect("finetuning:jobs")


@tenant_view(write=True)
def create_job(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return redirect("finetuning:jobs")
    form = JobForm(request.POST, tenant=request.tenant)
    if not form.is_valid():
        return _jobs_page(request, form, status=400)
    try:
        job = job_service.create_job(request.tenant, form.params(), created_by=request.user)
    except ApiError as err:
        return _jobs_page(request, form, error=err.message, status=err.status)
    messages.success(request, f"Fine-tuning job {job.public_id} is queued.")
    return redirect("finetuning:job", job_id=job.public_id)


def _own_job(request: HttpRequest, job_id: str) -> FineTuningJob:
    job = (FineTuningJob.objects.for_tenant(request.tenant)
           .select_related("base", "training_file", "validation_file", "result_version__adapter",
                           "result_version__provenance")
           .filter(public_id=job_id).first())
    if job is None:
        raise Http404("No such fine-tuning job.")
    return job


def loss_points(job: FineTuningJob) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train, validation) losses by step, from the job's metrics events."""
    train, valid = [], []
    for data in JobEvent.objects.filter(job=job, type=JobEvent.Type.METRICS).order_by("id").values_list("data", flat=True):
        data = data or {}
        if "train_loss" in data and "step" in data:
            train.append((int(data["step"]), float(data["train_loss"])))
        if "valid_loss" in data and "step" in data:
            valid.append((int(data["step"]), float(data["valid_loss"])))
    return train, valid


@tenant_view
def job_detail(request: HttpRequest, job_id: str) -> HttpResponse:
    job = _own_job(request, job_id)
    train, valid = loss_points(job)
    total = next((e.data.get("total_steps") for e in JobEvent.objects.filter(job=job, type=JobEvent.Type.METRICS)
                  .order_by("-id")[:1] if e.data), None)
    context = {
        "job": job, "active": job.status in ACTIVE_STATUSES,
        "chart": charts.line_chart("Training loss", train, valid, total_steps=total),
        "events": JobEvent.objects.filter(job=job).order_by("-id")[:30],
        "last": train[-1] if train else None, "total_steps": total,
        "provenance": getattr(job.result_version, "provenance", None) if job.result_version_id else None,
    }
    if request.GET.get("part") == "live":
        return render(request, "finetune/_job_live.html", context)
    return render(request, "finetune/job.html", context)


@tenant_view(write=True)
def cancel(request: HttpRequest, job_id: str) -> HttpResponse:
    if request.method != "POST":
        return redirect("finetuning:job", job_id=job_id)
    _own_job(request, job_id)  # 404 for another tenant's job
    try:
        job = job_service.cancel_job(request.tenant, job_id)
    except ApiError as err:
        messages.error(request, err.message)
    else:
        messages.success(request, f"Job {job.public_id} is cancelled; no new version will be made.")
    return redirect("finetuning:job", job_id=job_id)
