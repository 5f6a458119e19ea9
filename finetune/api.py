"""OpenAI's Files and fine-tuning jobs API under /v1/, for a tenant's API key. Thin: files.py and jobs.py decide.

    POST   /v1/files                              multipart: file, purpose=fine-tune (+ model: a base to check
                                                  token lengths against at upload, a lorafleet extension)
    GET    /v1/files  ·  GET/DELETE /v1/files/{id}  ·  GET /v1/files/{id}/content
    POST   /v1/fine_tuning/jobs  ·  GET /v1/fine_tuning/jobs  ·  GET /v1/fine_tuning/jobs/{id}
    POST   /v1/fine_tuning/jobs/{id}/cancel  ·  GET /v1/fine_tuning/jobs/{id}/events

Authentication and errors as the inference API's (gateway/auth.py, gateway/errors.py): a missing or bad key is a
401, every refusal OpenAI's error shape with a stable code, another tenant's file or job a 404.
"""
from __future__ import annotations

import json

from django.http import FileResponse, JsonResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema

from gateway.auth import KeyRefused, authenticate
from gateway.errors import ApiError, invalid
from gateway.serializers import ErrorResponse
from gateway.views import OpenAIView

from . import files as file_service
from . import jobs as job_service
from .models import FineTuningJob, JobEvent, TrainingFile
from .params import parse_job_body
from .serializers import FileUpload, JobCreate
from .storage import open_dataset

_ERRORS = {code: OpenApiResponse(ErrorResponse, description="OpenAI's error shape")
           for code in (400, 401, 403, 404, 413, 429, 503)}
DEFAULT_PAGE = 20
MAX_PAGE = 100


def _ts(value) -> int | None:
    return int(value.timestamp()) if value else None


def file_object(f: TrainingFile) -> dict:
    return {"id": f.public_id, "object": "file", "bytes": f.size_bytes, "created_at": _ts(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "status_details": None,
            "expires_at": None, "lorafleet": {"sha256": f.sha256, "examples": f.examples}}


def job_object(job: FineTuningJob) -> dict:
    h = job.hyperparameters
    hyper = {"n_epochs": h["n_epochs"], "batch_size": h["batch_size"],
             "learning_rate_multiplier": h["learning_rate_multiplier"]}
    error = ({"code": job.error_code, "message": job.error_message, "param": job.error_param or None}
             if job.status == "failed" else None)
    return {
        "id": job.public_id, "object": "fine_tuning.job", "created_at": _ts(job.created_at),
        "finished_at": _ts(job.finished_at), "model": job.model_name, "organization_id": job.tenant.slug,
        "status": job.status, "training_file": job.training_file.public_id,
        "validation_file": job.validation_file.public_id if job.validation_file_id else None,
        "hyperparameters": hyper, "method": {"type": "supervised", "supervised": {"hyperparameters": hyper}},
        "seed": job.seed, "user_provided_suffix": job.suffix, "fine_tuned_model": job.fine_tuned_model or None,
        "trained_tokens": job.trained_tokens, "result_files": [], "error": error, "estimated_finish": None,
        "integrations": [], "metadata": job.metadata or None,
        "lorafleet": {
            "adapter": job.suffix, "base_model": job.base.slug, "auto_activate": job.auto_activate,
            "lora": {"rank": h["lora_rank"], "alpha": h["lora_alpha"], "target_modules": h["lora_target_modules"]},
            "learning_rate": h["learning_rate"], "estimated_tokens": job.estimated_tokens,
            "weights_sha256": job.result_version.sha256 if job.result_version_id else None,
        },
    }


def event_object(event: JobEvent) -> dict:
    return {"id": event.public_id, "object": "fine_tuning.job.event", "created_at": _ts(event.created_at),
            "level": event.level, "message": event.message, "type": event.type, "data": event.data or {}}


def _limit(request) -> int:
    raw = request.GET.get("limit")
    if raw is None:
        return DEFAULT_PAGE
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_PAGE:
        raise invalid(f"limit must be an integer from 1 to {MAX_PAGE}.", param="limit")
    return value


def _page(queryset, request, cursor_lookup, object_fn) -> JsonResponse:
    """OpenAI's cursor pages: newest first, `after` = the id of the last object of the previous page."""
    limit = _limit(request)
    after = request.GET.get("after")
    if after:
        anchor = queryset.filter(public_id=after).values_list("pk", flat=True).first()
        if anchor is None:
            raise invalid(f"after {after[:80]!r} is not an id of this list.", param="after")
        queryset = queryset.filter(**{cursor_lookup: anchor})
    rows = list(queryset[: limit + 1])
    return JsonResponse({"object": "list", "data": [object_fn(r) for r in rows[:limit]],
                         "has_more": len(rows) > limit,
                         "first_id": rows[0].public_id if rows else None,
                         "last_id": rows[:limit][-1].public_id if rows else None})


class FinetuneView(OpenAIView):
    """Authenticates first; ApiError anywhere becomes its answer."""

    def handle_exception(self, exc):
        if isinstance(exc, ApiError):
            return exc.response()
        return super().handle_exception(exc)

    def key(self, request):
        try:
            return authenticate(request._request)
        except KeyRefused as err:
            raise ApiError(err.status, err.code, err.message, type=err.type, headers=err.headers) from None


class FilesView(FinetuneView):
    @extend_schema(operation_id="create_file", request={"multipart/form-data": FileUpload},
                   responses={200: OpenApiResponse(description="The file object"), **_ERRORS},
                   description="Upload a JSONL dataset (`purpose=fine-tune`), checked line by line while it streams.")
    def post(self, request):
        key = self.key(request)
        django_request = request._request
        file_service.check_while_receiving(django_request)
        upload = django_request.FILES.get("file")
        refusal = file_service.upload_refusal(django_request)
        if refusal is not None:
            raise refusal
        if upload is None:
            raise invalid("Send the dataset as the multipart field 'file'.", param="file", code="missing_parameter")
        base = None
        if django_request.POST.get("model"):
            base = job_service.resolve_base(key.tenant, django_request.POST["model"])
        created = file_service.create_training_file(key.tenant, upload, purpose=django_request.POST.get("purpose", ""),
                                                    base=base)
        return JsonResponse(file_object(created))

    @extend_schema(operation_id="list_files", responses={200: OpenApiResponse(description="A page of file objects"), **_ERRORS})
    def get(self, request):
        key = self.key(request)
        files = TrainingFile.objects.for_tenant(key.tenant).live()
        purpose = request.GET.get("purpose")
        if purpose:
            files = files.filter(purpose=purpose)
        if request.GET.get("order") == "asc":
            return _page(files.order_by("created_at", "id"), request, "pk__gt", file_object)
        return _page(files.order_by("-created_at", "-id"), request, "pk__lt", file_object)


def _own_file(key, file_id: str) -> TrainingFile:
    found = TrainingFile.objects.for_tenant(key.tenant).live().filter(public_id=file_id).first()
    if found is None:
        raise file_service.file_not_found(file_id)
    return found


class FileDetailView(FinetuneView):
    @extend_schema(operation_id="retrieve_file", responses={200: OpenApiResponse(description="The file object"),
                                                            **_ERRORS})
    def get(self, request, file_id: str):
        return JsonResponse(file_object(_own_file(self.key(request), file_id)))

    @extend_schema(operation_id="delete_file", responses={200: OpenApiResponse(description="{id, object, deleted}"),
                                                          **_ERRORS})
    def delete(self, request, file_id: str):
        found = _own_file(self.key(request), file_id)
        file_service.delete_training_file(found)
        return JsonResponse({"id": found.public_id, "object": "file", "deleted": True})


class FileContentView(FinetuneView):
    @extend_schema(operation_id="download_file", responses={200: OpenApiResponse(description="The JSONL bytes"),
                                                            **_ERRORS})
    def get(self, request, file_id: str):
        found = _own_file(self.key(request), file_id)
        try:
            handle = open_dataset(found.storage_key)
        except Exception:
            raise ApiError(503, "storage_unavailable", "The file cannot be read from storage; retry shortly.",
                           type="server_error", headers={"Retry-After": "5"}) from None
        return FileResponse(handle, content_type="application/jsonl", as_attachment=True, filename=found.filename)


def _jobs(key):
    jobs = FineTuningJob.objects.for_tenant(key.tenant)
    job_service.reap_lost_jobs(jobs)
    return jobs.select_related("tenant", "base", "training_file", "validation_file", "result_version")


def _own_job(key, job_id: str) -> FineTuningJob:
    found = _jobs(key).filter(public_id=job_id).first()
    if found is None:
        raise job_service.job_not_found(job_id)
    return found


class JobsView(FinetuneView):
    @extend_schema(operation_id="create_fine_tuning_job", request=JobCreate,
                   responses={200: OpenApiResponse(description="The job"), **_ERRORS},
                   description="Fine-tune a LoRA adapter of a base on a JSONL file; the result is a new version of "
                               "the adapter named by `suffix`.")
    def post(self, request):
        key = self.key(request)
        try:
            body = json.loads(request._request.body or b"null")
        except (ValueError, UnicodeDecodeError):
            raise invalid("The body is not valid JSON.", code="invalid_json") from None
        params = parse_job_body(body)
        job = job_service.create_job(key.tenant, params, key=key)
        return JsonResponse(job_object(_own_job(key, job.public_id)))

    @extend_schema(operation_id="list_fine_tuning_jobs",
                   responses={200: OpenApiResponse(description="A page of jobs"), **_ERRORS})
    def get(self, request):
        return _page(_jobs(self.key(request)), request, "pk__lt", job_object)


class JobDetailView(FinetuneView):
    @extend_schema(operation_id="retrieve_fine_tuning_job", responses={200: OpenApiResponse(description="The job"),
                                                                       **_ERRORS})
    def get(self, request, job_id: str):
        return JsonResponse(job_object(_own_job(self.key(request), job_id)))


class JobCancelView(FinetuneView):
    @extend_schema(operation_id="cancel_fine_tuning_job", request=None, responses={200: OpenApiResponse(description="The job"),
                                                                     **_ERRORS})
    def post(self, request, job_id: str):
        key = self.key(request)
        job_service.cancel_job(key.tenant, job_id)
        return JsonResponse(job_object(_own_job(key, job_id)))


class JobEventsView(FinetuneView):
    @extend_schema(operation_id="list_fine_tuning_events", responses={200: OpenApiResponse(description="Events"),
                                                                      **_ERRORS})
    def get(self, request, job_id: str):
        job = _own_job(self.key(request), job_id)
        return _page(JobEvent.objects.filter(job=job).order_by("-id"), request, "pk__lt", event_object)
