"""Files, fine-tuning jobs, their events, per-tenant limits, and the provenance of a trained adapter version.

Public ids are OpenAI's shapes (`file-…`, `ftjob-…`, `ftevent-…`): random, so they say nothing about how many
objects exist. Every tenant-facing query goes through `for_tenant` (tenants/scoping.py): another tenant's file
or job is not found. Provenance hangs off an AdapterVersion by a one-to-one link from here, so adapters/ needs
no migration and knows nothing of fine-tuning.
"""
from __future__ import annotations

import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

from adapters.models import AdapterVersion, BaseModel, sha256_validator
from tenants.models import Tenant
from tenants.scoping import TenantScopedQuerySet, scoped_queryset


def _public_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def new_file_id() -> str:
    return _public_id("file")


def new_job_id() -> str:
    return _public_id("ftjob")


def new_event_id() -> str:
    return _public_id("ftevent")


class TrainingFileQuerySet(TenantScopedQuerySet):
    tenant_path = "tenant"

    def live(self) -> TrainingFileQuerySet:
        return self.filter(deleted_at__isnull=True)


class TrainingFile(models.Model):
    """A validated JSONL dataset (`purpose: fine-tune`). The bytes live in the adapters storage under their sha256
    (finetune/storage.py); a row exists only for a file that passed validation, and deleting it is a soft delete
    (jobs keep pointing at what they trained on)."""

    public_id = models.CharField(max_length=40, unique=True, default=new_file_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="training_files")
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=20, default="fine-tune")
    sha256 = models.CharField(max_length=64, validators=[sha256_validator])
    storage_key = models.CharField(max_length=300)
    size_bytes = models.BigIntegerField()
    examples = models.PositiveIntegerField(help_text="Lines holding one training example each.")
    created_at = models.DateTimeField(default=timezone.now)
    deleted_at = models.DateTimeField(null=True, blank=True)

    objects = TrainingFileQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.filename})"


class JobStatus(models.TextChoices):
    VALIDATING_FILES = "validating_files", "Validating files"
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


ACTIVE_STATUSES = (JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.RUNNING)
FINAL_STATUSES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class FineTuningJob(models.Model):
    """One supervised LoRA fine-tune of a base for a tenant; on success, a new version of adapter `suffix`.

    The status moves forward only: validating_files → queued → running → succeeded | failed | cancelled (a queued
    job may be cancelled or fail directly). A trainer holds a running job by `trainer_id` and keeps
    `heartbeat_at` fresh; a running job whose heartbeat is older than LORAFLEET_TRAINER_HEARTBEAT_TTL_S lost its
    trainer and is failed (finetune/jobs.py reap_lost_jobs)."""

    public_id = models.CharField(max_length=40, unique=True, default=new_job_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="fine_tuning_jobs")
    base = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="+")
    model_name = models.CharField(max_length=120, help_text="`model` as the caller named the base.")
    training_file = models.ForeignKey(TrainingFile, on_delete=models.PROTECT, related_name="+")
    validation_file = models.ForeignKey(TrainingFile, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    suffix = models.CharField(max_length=64, help_text="The adapter the result becomes a version of.")
    seed = models.BigIntegerField()
    # resolved values: n_epochs, batch_size, learning_rate_multiplier, learning_rate, rank, alpha, target_modules
    hyperparameters = models.JSONField()
    auto_activate = models.BooleanField(default=False)
    metadata = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=20, choices=JobStatus.choices, default=JobStatus.VALIDATING_FILES)
    estimated_tokens = models.BigIntegerField(default=0, help_text="Training tokens × epochs, counted at creation.")
    trained_tokens = models.BigIntegerField(null=True, blank=True)
    error_code = models.CharField(max_length=60, blank=True)
    error_message = models.TextField(blank=True)
    error_param = models.CharField(max_length=60, blank=True)
    fine_tuned_model = models.CharField(max_length=120, blank=True)
    result_version = models.OneToOneField(AdapterVersion, null=True, blank=True, on_delete=models.PROTECT,
                                          related_name="fine_tuning_job")
    created_by_key = models.CharField(max_length=40, blank=True, help_text="Prefix of the API key that created it.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    trainer_id = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = scoped_queryset("tenant").as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # the limits count a tenant's active jobs and its jobs of the last day
            models.Index(fields=["tenant", "status"], name="ftjob_tenant_status"),
            # trainers and the reaper look for a base's queued or running jobs
            models.Index(fields=["base", "status"], name="ftjob_base_status"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=~models.Q(status="succeeded") | models.Q(result_version__isnull=False),
                name="ftjob_succeeded_has_version"),
        ]

    def __str__(self) -> str:
        return self.public_id

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES


class JobEvent(models.Model):
    """One line of a job's log, as `GET /v1/fine_tuning/jobs/{id}/events` returns it."""

    class Level(models.TextChoices):
        INFO = "info"
        WARN = "warn"
        ERROR = "error"

    class Type(models.TextChoices):
        MESSAGE = "message"
        METRICS = "metrics"

    public_id = models.CharField(max_length=40, unique=True, default=new_event_id, editable=False)
    job = models.ForeignKey(FineTuningJob, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(default=timezone.now)
    level = models.CharField(max_length=10, choices=Level.choices, default=Level.INFO)
    type = models.CharField(max_length=10, choices=Type.choices, default=Type.MESSAGE)
    message = models.CharField(max_length=2000)
    data = models.JSONField(null=True, blank=True)

    objects = scoped_queryset("job__tenant").as_manager()

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.job_id}: {self.message[:60]}"


class FineTuneLimits(models.Model):
    """A tenant's fine-tuning limits (admin). A tenant without a row gets the settings' defaults
    (LORAFLEET_FINETUNE_MAX_CONCURRENT_JOBS, _MAX_TOKENS_PER_JOB, _MAX_TOKENS_PER_DAY)."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="fine_tune_limits")
    max_concurrent_jobs = models.PositiveIntegerField(
        help_text="Jobs validating, queued or running at once; one more is a 429 concurrent_jobs_limit.")
    max_tokens_per_job = models.BigIntegerField(
        help_text="Training tokens (tokens of the training file × epochs) one job may train; more is a 400 "
                  "job_tokens_limit.")
    max_tokens_per_day = models.BigIntegerField(
        help_text="Training tokens of the jobs created over the last 24 hours; more is a 429 daily_tokens_limit.")

    objects = scoped_queryset("tenant").as_manager()

    class Meta:
        verbose_name = "fine-tuning limits"
        verbose_name_plural = "fine-tuning limits"
        constraints = [
            models.CheckConstraint(condition=models.Q(max_tokens_per_job__gte=0, max_tokens_per_day__gte=0),
                                   name="finetunelimits_non_negative"),
        ]

    def __str__(self) -> str:
        return f"limits of {self.tenant}"


class AdapterProvenance(models.Model):
    """Which data and which settings made an adapter version's weights. Written once, in the same transaction
    as the version it describes; never changed (every field is read-only in admin)."""

    version = models.OneToOneField(AdapterVersion, on_delete=models.PROTECT, related_name="provenance")
    job_public_id = models.CharField("job id", max_length=40)
    training_file_sha256 = models.CharField(max_length=64, validators=[sha256_validator])
    validation_file_sha256 = models.CharField(max_length=64, blank=True)
    base_slug = models.CharField(max_length=50)
    base_sha256 = models.CharField(max_length=64, validators=[sha256_validator])
    hyperparameters = models.JSONField()
    seed = models.BigIntegerField()
    steps = models.PositiveIntegerField()
    trained_tokens = models.BigIntegerField()
    train_loss = models.FloatField()
    valid_loss = models.FloatField(null=True, blank=True)
    trainer_version = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)

    objects = scoped_queryset("version__adapter__tenant").as_manager()

    class Meta:
        verbose_name_plural = "adapter provenance"

    def __str__(self) -> str:
        return f"provenance of {self.version}"
