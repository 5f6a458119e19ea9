from __future__ import annotations

import datetime as dt
import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from tenants.scoping import TenantScopedQuerySet, scoped_queryset


class AuditStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    OK = "ok", "Answered"
    ERROR = "error", "Failed"


class AppendOnlyError(RuntimeError):
    """Audit records are append-only: final ones never change, none is ever deleted."""


class AuditQuerySet(TenantScopedQuerySet):
    tenant_path = "tenant"

    def delete(self):
        raise AppendOnlyError("Audit records are append-only; they cannot be deleted.")

    def update(self, **kwargs):
        if self.exclude(status=AuditStatus.PENDING).exists():
            raise AppendOnlyError("A final audit record never changes.")
        return super().update(**kwargs)

    def finalise_pending(self, **fields) -> int:
        """The one write a record gets after creation: only rows still pending are touched, so no
        guard query is needed (a row finalised meanwhile is simply not matched)."""
        return super(AuditQuerySet, self.filter(status=AuditStatus.PENDING)).update(**fields)


class AuditRecord(models.Model):
    """Exactly one per inference request: which weights produced this response?

    Append-only (also enforced by Postgres triggers): created pending, finalised once, never changed
    or deleted afterwards. Names and hashes are copied in, so the record stays true whatever happens
    to the rows it points at.
    """

    request_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    route = models.CharField(max_length=100)

    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    key_prefix = models.CharField(max_length=40, blank=True)
    adapter = models.ForeignKey("adapters.Adapter", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    adapter_name = models.CharField(max_length=64, blank=True)
    version = models.ForeignKey(
        "adapters.AdapterVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    version_number = models.PositiveIntegerField(null=True, blank=True)
    expected_sha256 = models.CharField(max_length=64, blank=True, help_text="sha256 of the version requested.")
    weights_sha256 = models.CharField(
        max_length=64, blank=True, help_text="sha256 of the weights the worker actually loaded and verified."
    )
    adapter_identity = models.CharField(  # noqa: DJ001 - NULL until the worker's result sets it, once (trigger, 0004)
        max_length=64, null=True, blank=True,
        help_text="What the worker served: sha256 over the weights' sha256, rank, alpha, rsLoRA and target "
                  "modules (inference_worker.jobs.adapter_identity). Empty for base-model requests and refusals.",
    )
    adapter_dtype = models.CharField(
        max_length=16, blank=True,
        help_text="How the worker held the adapter's weights as it applied them: float32, or float16 / bfloat16 "
                  "from a 16-bit adapter pool (docs/SERVING.md). Empty for base-model requests and refusals.",
    )
    base_model = models.ForeignKey("adapters.BaseModel", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    base_slug = models.CharField(max_length=50, blank=True)
    base_sha256 = models.CharField(max_length=64, blank=True)
    worker_id = models.CharField(max_length=200, blank=True)

    status = models.CharField(max_length=10, choices=AuditStatus.choices, default=AuditStatus.PENDING)
    http_status = models.PositiveSmallIntegerField(null=True, blank=True)
    error_code = models.CharField(max_length=50, blank=True)
    error_message = models.CharField(max_length=500, blank=True)
    finish_reason = models.CharField(max_length=20, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)

    n = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="Choices asked for (OpenAI's n); empty when the body was never parsed.")
    logprobs_returned = models.BooleanField(
        null=True, blank=True, help_text="Whether the caller got logprobs; set once, when the record is final.")
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True, help_text="Tokens of every choice.")
    # db_default: a web process of the previous release, still running during a deploy, inserts rows without them
    cached_tokens = models.PositiveIntegerField(
        default=0, db_default=0,
        help_text="Prompt tokens whose KV came from the worker's prefix cache (usage.prompt_tokens_details).")
    preemptions = models.PositiveIntegerField(
        default=0, db_default=0,
        help_text="Times the worker preempted a sequence of this request to share the worker fairly and recomputed "
                  "it; the answer is the same as without.")
    queue_seconds = models.FloatField(null=True, blank=True)
    first_token_seconds = models.FloatField(null=True, blank=True)
    total_seconds = models.FloatField(null=True, blank=True)
    # Only when the tenant asks for it, and never the text itself.
    prompt_sha256 = models.CharField(max_length=64, blank=True)
    output_sha256 = models.CharField(max_length=64, blank=True)

    objects = AuditQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # the dashboard's usage charts and audit table: a tenant's rows by time
            models.Index(fields=["tenant", "created_at"], name="audit_tenant_created"),
            models.Index(fields=["adapter", "created_at"], name="audit_adapter_created"),
            models.Index(fields=["weights_sha256"], name="audit_weights_sha256"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.status}"

    def save(self, *args, **kwargs):
        # Text here may echo what a caller sent (a field name in an error message): PostgreSQL text
        # cannot hold NUL, and a refusal must never turn into a 500 because its audit row failed.
        for field in self._meta.concrete_fields:
            value = getattr(self, field.attname)
            if isinstance(value, str) and "\x00" in value:
                setattr(self, field.attname, value.replace("\x00", "\ufffd"))
        if self.pk is not None and not self._state.adding:
            stored = type(self).objects.filter(pk=self.pk).values_list("status", flat=True).first()
            if stored is not None and stored != AuditStatus.PENDING:
                raise AppendOnlyError(f"Audit record {self.request_id} is final and never changes.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError("Audit records are append-only; they cannot be deleted.")

    @property
    def is_final(self) -> bool:
        return self.status != AuditStatus.PENDING


class ApiKey(models.Model):
    """An API key of a tenant, optionally bound to one of its adapters (gateway/keys.py: format and checks).

    Only the lookup id, a SHA-256 of the secret and its last four characters are stored. Issued and
    revoked through gateway/services.py, which holds the rules (who may, which adapter).
    """

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    # The public part of the key, `lf_live_<key_id>_...`; unique, used to find the row.
    key_id = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    last4 = models.CharField(max_length=4)
    bound_adapter = models.ForeignKey(
        "adapters.Adapter", null=True, blank=True, on_delete=models.PROTECT, related_name="bound_keys"
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Who revoked it (gateway.services.revoke_api_key); empty for keys revoked by a trusted caller, or
    # before this was recorded.
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = scoped_queryset("tenant").as_manager()

    class Meta:
        # The table keeps the name it had when the model lived in tenants (gateway/migrations/0005).
        db_table = "tenants_apikey"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}…{self.last4}"

    @property
    def prefix(self) -> str:
        return f"lf_live_{self.key_id}"

    def is_usable(self, now: dt.datetime | None = None) -> bool:
        now = now or timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)
