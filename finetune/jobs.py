"""Verbs on fine-tuning jobs: create (validate, check limits, queue), cancel, fail, reap lost ones, log events.

Creating a job validates its files synchronously, inside the request: the structure again (storage is not trusted
to hand back what was checked), and each example's tokens with the job's base's chat template against its
context. A refused job is a 4xx naming the file, the line and why, and nothing is recorded or queued. A job that
passes is recorded `queued` (its events say it went through validating_files) and published on its base's
training queue once the row is committed, so a trainer never receives a job it cannot read.
"""
from __future__ import annotations

import datetime as dt
import logging
import secrets

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from adapters.models import Adapter, BaseModel, adapter_name_validator
from gateway.binding import BASE_PREFIX
from gateway.errors import ApiError, invalid
from tenants.models import Tenant

from .files import check_token_lengths, file_not_found, read_examples
from .models import ACTIVE_STATUSES, FineTuneLimits, FineTuningJob, JobEvent, JobStatus, TrainingFile
from .params import DEFAULT_EPOCHS, DEFAULT_MAX_BATCH, JobParams, resolve_lora
from .queue import QueueUnavailable, publish_training_job

log = logging.getLogger(__name__)


def job_not_found(job_id: str) -> ApiError:
    return ApiError(404, "job_not_found", f"No fine-tuning job {str(job_id)[:80]!r} exists or you do not have "
                                          f"access to it.", param="fine_tuning_job_id")


def add_event(job: FineTuningJob, message: str, *, level: str = JobEvent.Level.INFO,
              type: str = JobEvent.Type.MESSAGE, data: dict | None = None) -> JobEvent:
    return JobEvent.objects.create(job=job, message=message[:2000], level=level, type=type, data=data)


# --- limits ----------------------------------------------------------------------------------------


def limits_for(tenant: Tenant) -> FineTuneLimits:
    """The tenant's row (admin), or the settings' defaults (unsaved)."""
    row = FineTuneLimits.objects.filter(tenant=tenant).first()
    return row or FineTuneLimits(tenant=tenant,
                                 max_concurrent_jobs=settings.LORAFLEET_FINETUNE_MAX_CONCURRENT_JOBS,
                                 max_tokens_per_job=settings.LORAFLEET_FINETUNE_MAX_TOKENS_PER_JOB,
                                 max_tokens_per_day=settings.LORAFLEET_FINETUNE_MAX_TOKENS_PER_DAY)


def tokens_of_last_day(tenant: Tenant) -> int:
    """Training tokens of the tenant's jobs created in the last 24 hours: a job that may still train (or trained)
    counts its estimate; one that failed or was cancelled counts what it trained before it stopped."""
    since = timezone.now() - dt.timedelta(days=1)
    total = 0
    for status, estimated, trained in (FineTuningJob.objects.for_tenant(tenant).filter(created_at__gte=since)
                                       .values_list("status", "estimated_tokens", "trained_tokens")):
        if status in (*ACTIVE_STATUSES, JobStatus.SUCCEEDED):
            total += estimated
        else:
            total += trained or 0
    return total


def check_limits(tenant: Tenant, tokens: int) -> None:
    limits = limits_for(tenant)
    if tokens > limits.max_tokens_per_job:
        raise ApiError(400, "job_tokens_limit", f"This job would train {tokens} tokens (the training file's tokens × "
                                                f"n_epochs); your organisation's limit per job is "
                                                f"{limits.max_tokens_per_job}. Use fewer epochs or a smaller file.",
                       param="training_file")
    active = FineTuningJob.objects.for_tenant(tenant).filter(status__in=ACTIVE_STATUSES).count()
    if active >= limits.max_concurrent_jobs:
        raise ApiError(429, "concurrent_jobs_limit", f"Your organisation has {active} fine-tuning jobs queued or "
                                                     f"running; its limit is {limits.max_concurrent_jobs}. Wait for "
                                                     f"one to finish or cancel one.",
                       type="rate_limit_error", headers={"Retry-After": "60"})
    used = tokens_of_last_day(tenant)
    if used + tokens > limits.max_tokens_per_day:
        raise ApiError(429, "daily_tokens_limit", f"This job would train {tokens} tokens; your organisation's jobs of "
                                                  f"the last 24 hours account for {used} of its daily limit of "
                                                  f"{limits.max_tokens_per_day}.",
                       type="rate_limit_error", headers={"Retry-After": "3600"})


# --- create ----------------------------------------------------------------------------------------


def resolve_base(tenant: Tenant, model: str) -> BaseModel:
    slug = model[len(BASE_PREFIX):] if model.startswith(BASE_PREFIX) else model
    base = BaseModel.objects.usable_by(tenant).filter(slug=slug).first()
    if base is None or not base.checkpoint_path:
        # the same answer for "no such base" and "a base you may not use": existence is not leaked
        raise ApiError(404, "model_not_found", f"The base model {model[:80]!r} does not exist or your organisation "
                                               f"may not fine-tune it.", param="model")
    return base


def _file(tenant: Tenant, file_id: str, param: str) -> TrainingFile:
    file = TrainingFile.objects.for_tenant(tenant).live().filter(public_id=file_id).first()
    if file is None:
        raise file_not_found(file_id, param)
    return file


def _check_suffix(key, tenant: Tenant, base: BaseModel, suffix: str) -> None:
    try:
        adapter_name_validator(suffix)
    except Exception:
        raise invalid(f"suffix {suffix[:64]!r} cannot name an adapter: use 1–64 letters, digits, dots, underscores and "
                      f"hyphens, starting with a letter or digit.", param="suffix") from None
    existing = Adapter.objects.for_tenant(tenant).filter(name=suffix).first()
    if key is not None and key.bound_adapter_id is not None and (existing is None or existing.pk != key.bound_adapter_id):
        raise ApiError(403, "key_bound_to_adapter", f"This API key is bound to adapter {key.bound_adapter.name!r}: it "
                                                    f"may fine-tune only that adapter (suffix).", param="suffix")
    if existing is None:
        return
    if existing.is_deleted:
        raise ApiError(400, "adapter_deleted", f"The adapter {suffix!r} is deleted; choose another suffix.",
                       param="suffix")
    if existing.base_id != base.pk:
        raise invalid(f"The adapter {suffix!r} belongs to base {existing.base.slug!r}, not {base.slug!r}; a new version "
                      f"must be trained on its own base. Choose another suffix.", param="suffix",
                      code="adapter_base_mismatch")


def create_job(tenant: Tenant, params: JobParams, *, key=None, created_by=None) -> FineTuningJob:
    """Validate, record and queue a job; ApiError (nothing recorded or queued) when it is refused."""
    base = resolve_base(tenant, params.model)
    training = _file(tenant, params.training_file, "training_file")
    validation = _file(tenant, params.validation_file, "validation_file") if params.validation_file else None
    resolve_lora(params, base)
    job_hex = secrets.token_hex(12)
    suffix = params.suffix or (key.bound_adapter.name if key is not None and key.bound_adapter_id else f"ft-{job_hex[:8]}")
    _check_suffix(key, tenant, base, suffix)
    train = read_examples(training, file_label=f"training_file {training.public_id}")
    tokens = check_token_lengths(base, train, file_label=f"training_file {training.public_id}", param="training_file")
    if validation is not None:
        valid = read_examples(validation, file_label=f"validation_file {validation.public_id}")
        check_token_lengths(base, valid, file_label=f"validation_file {validation.public_id}", param="validation_file")
    n_epochs = params.n_epochs or DEFAULT_EPOCHS
    multiplier = params.learning_rate_multiplier or 1.0
    hyperparameters = {
        "n_epochs": n_epochs,
        "batch_size": params.batch_size or min(DEFAULT_MAX_BATCH, train.count),
        "learning_rate_multiplier": multiplier,
        "learning_rate": settings.LORAFLEET_FINETUNE_BASE_LEARNING_RATE * multiplier,
        "lora_rank": params.rank,
        "lora_alpha": params.alpha if params.alpha is not None else float(2 * params.rank),
        "lora_target_modules": list(params.target_modules or ()),
    }
    estimated = tokens * n_epochs
    seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
    with transaction.atomic():
        Tenant.objects.select_for_update().get(pk=tenant.pk)  # one tenant's creations count their limits in turn
        check_limits(tenant, estimated)
        job = FineTuningJob.objects.create(
            public_id=f"ftjob-{job_hex}", tenant=tenant, base=base, model_name=params.model, training_file=training,
            validation_file=validation, suffix=suffix, seed=seed, hyperparameters=hyperparameters,
            auto_activate=params.auto_activate, status=JobStatus.QUEUED, estimated_tokens=estimated,
            metadata=params.metadata, created_by_key=getattr(key, "prefix", "") or "", created_by=created_by,
        )
        add_event(job, f"Validating training file: {training.public_id}"
                       + (f" and validation file: {validation.public_id}" if validation else ""))
        add_event(job, f"Files validated: {train.count} examples, {tokens} tokens with the chat template of "
                       f"{base.slug} ({estimated} training tokens over {n_epochs} epochs); moving job to queued state")
    try:
        publish_training_job(job.public_id, base)
    except QueueUnavailable as exc:
        fail_job(job, "queue_unavailable", "The training queue could not be reached; the job was not queued. Create "
                                           "it again.")
        raise ApiError(503, "queue_unavailable", "The training queue is unavailable; the job was not queued. Retry "
                                                 "shortly.", type="server_error", headers={"Retry-After": "5"}) from exc
    return job


# --- cancel, fail, reap ----------------------------------------------------------------------------


def cancel_job(tenant: Tenant, job_id: str) -> FineTuningJob:
    """Cancel a job that has not finished. A running job's trainer sees the status at its next step and stops;
    the result of a cancelled job is never published (the trainer publishes only a job it still holds running)."""
    with transaction.atomic():
        job = FineTuningJob.objects.for_tenant(tenant).select_for_update().filter(public_id=job_id).first()
        if job is None:
            raise job_not_found(job_id)
        if job.status == JobStatus.CANCELLED:
            return job
        if job.is_final:
            raise ApiError(400, "job_not_cancellable", f"The job has already {job.status}; only a job that is queued "
                                                       f"or running can be cancelled.", param="fine_tuning_job_id")
        was = job.status
        job.status, job.finished_at = JobStatus.CANCELLED, timezone.now()
        job.save(update_fields=["status", "finished_at"])
        add_event(job, f"Fine-tuning job cancelled (it was {was})")
    return job


def fail_job(job: FineTuningJob, code: str, message: str, *, only_if: tuple[str, ...] = ACTIVE_STATUSES,
             trainer_id: str | None = None) -> bool:
    """Move an unfinished job to failed with an error; False if it had moved on meanwhile (or another trainer holds it)."""
    with transaction.atomic():
        locked = FineTuningJob.objects.select_for_update().get(pk=job.pk)
        if locked.status not in only_if or (trainer_id is not None and locked.trainer_id != trainer_id):
            return False
        _fail_locked(locked, code, message)
    job.status, job.error_code, job.error_message = locked.status, locked.error_code, locked.error_message
    return True


def _fail_locked(locked: FineTuningJob, code: str, message: str) -> None:
    locked.status, locked.finished_at = JobStatus.FAILED, timezone.now()
    locked.error_code, locked.error_message = code, message[:2000]
    locked.save(update_fields=["status", "finished_at", "error_code", "error_message"])
    add_event(locked, f"Fine-tuning job failed: {message}", level=JobEvent.Level.ERROR)


def heartbeat_ttl() -> dt.timedelta:
    return dt.timedelta(seconds=settings.LORAFLEET_TRAINER_HEARTBEAT_TTL_S)


def reap_lost_jobs(queryset=None) -> int:
    """Fail running jobs whose trainer stopped beating (killed, host gone): the API calls it before it answers
    about jobs, each trainer when it starts. Nothing was published for them (publishing is one transaction that
    also ends the job), so failing them leaves no half-written version."""
    queryset = FineTuningJob.objects.all() if queryset is None else queryset
    cutoff = timezone.now() - heartbeat_ttl()
    lost = queryset.filter(status=JobStatus.RUNNING).filter(Q(heartbeat_at__lt=cutoff) | Q(heartbeat_at__isnull=True))
    reaped = 0
    for job_pk in lost.values_list("pk", flat=True):
        with transaction.atomic():
            locked = FineTuningJob.objects.select_for_update().get(pk=job_pk)
            fresh = locked.heartbeat_at is not None and locked.heartbeat_at >= cutoff
            if locked.status != JobStatus.RUNNING or fresh:
                continue
            _fail_locked(locked, "trainer_lost", (
                f"The trainer running this job ({locked.trainer_id or 'unknown'}) stopped without finishing it (no "
                f"heartbeat for {settings.LORAFLEET_TRAINER_HEARTBEAT_TTL_S:g} s); no model was created. Create the "
                f"job again."))
        log.warning("job %s lost its trainer %s; failed", locked.public_id, locked.trainer_id)
        reaped += 1
    return reaped
