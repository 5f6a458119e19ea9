from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from protocol.lora_layout import peft_scale
from tenants.models import Tenant, slug_validator
from tenants.scoping import TenantScopedQuerySet, scoped_queryset

adapter_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
    "Use 1–64 letters, digits, dots, underscores and hyphens, starting with a letter or digit ('@' is reserved for versions).",
)
sha256_validator = RegexValidator(r"^[0-9a-f]{64}$", "A sha256 is 64 lowercase hex characters.")


class BaseModelQuerySet(models.QuerySet):
    def usable_by(self, tenant) -> BaseModelQuerySet:
        """The bases `tenant` may use: the one rule behind the API (a base it may not use is a 404, as if it did
        not exist) and every page that lists bases to its users (capacity planner, new-adapter form)."""
        return self if tenant.may_use_base else self.none()


class BaseModel(models.Model):
    """A base checkpoint that adapters attach to; one Celery queue (and worker fleet) per base."""

    slug = models.CharField(max_length=50, unique=True, validators=[slug_validator])
    display_name = models.CharField(max_length=200)
    checkpoint_path = models.CharField(max_length=1000, blank=True, help_text="Local Hugging Face checkpoint folder.")
    storage_uri = models.CharField(max_length=1000, blank=True, help_text="Or a storage URI holding the checkpoint.")
    sha256 = models.CharField(max_length=64, validators=[sha256_validator], help_text="sha256 of config + weights.")
    architecture = models.CharField(max_length=30)
    shape_manifest = models.JSONField()
    max_lora_rank = models.PositiveIntegerField(default=64)
    queue_name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = BaseModelQuerySet.as_manager()

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class AdapterQuerySet(TenantScopedQuerySet):
    tenant_path = "tenant"

    def live(self) -> AdapterQuerySet:
        return self.filter(deleted_at__isnull=True)


class Adapter(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=64, validators=[adapter_name_validator])
    base = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="adapters")
    description = models.CharField(max_length=500, blank=True)
    # The only thing that moves on rollback or roll-forward; every move is a VersionPointerChange.
    active_version = models.ForeignKey(
        "AdapterVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    deleted_at = models.DateTimeField(null=True, blank=True)

    objects = AdapterQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="adapter_unique_tenant_name")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"

    @property
    def is_deleted(self) -> bool:
        return self.deleted_at is not None


class ImmutableFieldError(ValidationError):
    pass


class AdapterVersionQuerySet(TenantScopedQuerySet):
    tenant_path = "adapter__tenant"

    def update(self, **kwargs):
        touched = set(kwargs) & set(AdapterVersion.IMMUTABLE_FIELDS)
        if touched:
            raise ImmutableFieldError(f"Adapter versions are immutable; cannot update {sorted(touched)}.")
        return super().update(**kwargs)


class AdapterVersion(models.Model):
    """One uploaded set of LoRA weights. Never changes after creation (also enforced by a Postgres trigger)."""

    IMMUTABLE_FIELDS = (
        "adapter", "number", "sha256", "storage_key", "size_bytes", "rank", "alpha", "use_rslora",
        "target_modules", "dtype", "parameter_count", "peft_config", "created_by", "created_at",
    )

    adapter = models.ForeignKey(Adapter, on_delete=models.PROTECT, related_name="versions")
    number = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64, validators=[sha256_validator])
    storage_key = models.CharField(max_length=300)
    size_bytes = models.BigIntegerField()
    rank = models.PositiveIntegerField()
    alpha = models.FloatField()
    use_rslora = models.BooleanField(default=False)
    target_modules = models.JSONField()
    dtype = models.CharField(max_length=20)
    parameter_count = models.BigIntegerField()
    peft_config = models.JSONField(default=dict)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)

    objects = AdapterVersionQuerySet.as_manager()

    class Meta:
        ordering = ["adapter", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["adapter", "number"], name="adapterversion_unique_adapter_number"),
            models.CheckConstraint(condition=models.Q(number__gte=1), name="adapterversion_number_positive"),
            models.CheckConstraint(condition=models.Q(rank__gte=1), name="adapterversion_rank_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.adapter}@{self.number}"

    def save(self, *args, **kwargs):
        if self.pk is not None and not self._state.adding:
            attnames = [self._meta.get_field(name).attname for name in self.IMMUTABLE_FIELDS]
            stored = type(self).objects.filter(pk=self.pk).values(*attnames).first()
            if stored is not None:
                for name, attname in zip(self.IMMUTABLE_FIELDS, attnames, strict=True):
                    if stored[attname] != getattr(self, attname):
                        raise ImmutableFieldError(f"Adapter versions are immutable; cannot change {name}.")
        super().save(*args, **kwargs)

    @property
    def scale(self) -> float:
        """PEFT's scaling (protocol.lora_layout.peft_scale): alpha / r, or alpha / sqrt(r) for rsLoRA."""
        return peft_scale(self.alpha, self.rank, self.use_rslora)


class VersionPointerChange(models.Model):
    """A move of Adapter.active_version: who, from, to, when, why."""

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="pointer_changes")
    from_version = models.ForeignKey(AdapterVersion, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    to_version = models.ForeignKey(AdapterVersion, on_delete=models.PROTECT, related_name="+")
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    reason = models.CharField(max_length=500)
    at = models.DateTimeField(default=timezone.now)

    objects = scoped_queryset("adapter__tenant").as_manager()

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        frm = self.from_version.number if self.from_version_id else "—"
        return f"{self.adapter}: {frm} → {self.to_version.number}"
