from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from .scoping import scoped_queryset

slug_validator = RegexValidator(
    r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$",
    "Use 1–50 lowercase letters, digits and hyphens, not starting or ending with a hyphen.",
)


class Tenant(models.Model):
    slug = models.CharField(max_length=50, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)
    # Explicit base-model requests are allowed only for tenants that may use the base.
    may_use_base = models.BooleanField(default=True)
    # Store sha256 of prompts and outputs in the audit log (never the text itself).
    audit_store_text_hashes = models.BooleanField(default=False)
    requests_per_minute = models.PositiveIntegerField(default=600)
    max_concurrent_requests = models.PositiveIntegerField(default=64)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"
    VIEWER = "viewer", "Viewer"


class Membership(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    objects = scoped_queryset("tenant").as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="membership_unique_tenant_user")]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"

    @property
    def can_write(self) -> bool:
        """Upload and activate adapter versions."""
        return self.role in (Role.OWNER, Role.ADMIN, Role.MEMBER)

    @property
    def can_manage(self) -> bool:
        """Manage API keys and members."""
        return self.role in (Role.OWNER, Role.ADMIN)


class ApiKey(models.Model):
    """An API key. Only the lookup id, a SHA-256 of the secret and its last four characters are stored."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
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
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = scoped_queryset("tenant").as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}…{self.last4}"

    @property
    def prefix(self) -> str:
        return f"lf_live_{self.key_id}"

    def is_usable(self, now=None) -> bool:
        now = now or timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)
