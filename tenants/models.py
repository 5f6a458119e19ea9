from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models.functions import Lower
from django.utils import timezone

from .scoping import TenantScopedQuerySet, scoped_queryset

slug_validator = RegexValidator(
    r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$",
    "Use 1–50 lowercase letters, digits and hyphens, not starting or ending with a hyphen.",
)

MAX_SHARE_WEIGHT = 100  # a tenant at 100 beside one at 1 gets 99% of a contended worker: enough range for tiers


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
    # Physical separation: the tenant's requests go only to workers started with `run_worker --tenant <slug>`,
    # and those workers serve no one else (gateway/routing.py).
    dedicated = models.BooleanField(
        "dedicated worker pool", default=False,
        help_text="Serve this tenant only on its own workers (manage.py run_worker --base BASE --tenant SLUG), "
                  "which serve no other tenant. With none running, its requests wait for one (504 at the "
                  "request timeout); they never fall back to the shared workers.")
    # Copied into every job (GenerationJob.tenant_weight): the worker's engine shares its running sequences and
    # KV blocks between the tenants that compete for them in proportion to these weights (issue 46).
    share_weight = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(MAX_SHARE_WEIGHT)],
        help_text=f"From 1 to {MAX_SHARE_WEIGHT}. When tenants compete for a worker's running sequences and KV "
                  f"blocks, each gets weight / sum of competing weights of them; a tenant alone may use all of them. "
                  f"Equal weights (the default, 1) share equally.")

    class Meta:
        ordering = ["slug"]
        constraints = [
            # the engine divides by the sum of weights: a zero or runaway weight must never reach a job
            models.CheckConstraint(condition=models.Q(share_weight__gte=1, share_weight__lte=MAX_SHARE_WEIGHT),
                                   name="tenant_share_weight_in_range"),
        ]

    def __str__(self) -> str:
        return self.slug

    def clean(self) -> None:
        """A tenant's concurrency cap stays below a worker's task threads: at the cap, one tenant would hold every
        thread, and other tenants' jobs would wait in the queue where no fair scheduler sees them."""
        from django.core.exceptions import ValidationError

        threads = settings.LORAFLEET_WORKER_CONCURRENCY
        if self.max_concurrent_requests is not None and self.max_concurrent_requests >= threads:
            raise ValidationError({"max_concurrent_requests": (
                f"Must be below a worker's task threads (LORAFLEET_WORKER_CONCURRENCY = {threads}); at or above it "
                f"one tenant could hold every thread of a worker and hold up every other tenant's requests. "
                f"Raise the workers' concurrency first.")})


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
    # When the user last chose this tenant (switched to it or joined it): a fresh login lands in the
    # tenant with the latest value, so nobody else's choice (e.g. whoever invited them) decides it.
    last_used_at = models.DateTimeField(null=True, blank=True)

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


INVITATION_LIFETIME = dt.timedelta(days=7)


class InvitationQuerySet(TenantScopedQuerySet):
    tenant_path = "tenant"

    def open(self) -> InvitationQuerySet:
        """Neither accepted, declined nor revoked (expired ones included: an owner may still revoke them)."""
        return self.filter(accepted_at__isnull=True, declined_at__isnull=True, revoked_at__isnull=True)

    def pending(self, now: dt.datetime | None = None) -> InvitationQuerySet:
        """Open and not expired: the ones that can still be accepted."""
        return self.open().filter(expires_at__gt=now or timezone.now())

    def addressed_to(self, user) -> InvitationQuerySet:
        """Invitations whose typed name is this user's username (exactly) or e-mail (any case).

        This is the only way an invitation reaches an account: nothing about the account is looked up
        when the invitation is made, so making one says nothing about whether the account exists.
        """
        match = models.Q(invited_as=user.get_username())
        if user.email:
            match |= models.Q(invited_as__iexact=user.email)
        return self.filter(match)


class Invitation(models.Model):
    """An offer to join a tenant with a role, addressed to a username or e-mail as the inviter typed it.

    Nobody becomes a member without accepting from their own session. The token of the invitation
    link is stored only as its SHA-256; at most one of accepted/declined/revoked is ever set.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    invited_as = models.CharField("username or e-mail", max_length=254)
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    declined_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = InvitationQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # Inviting the same name again replaces the open invitation (services.do_invite).
            models.UniqueConstraint(
                Lower("invited_as"), "tenant",
                condition=models.Q(accepted_at__isnull=True, declined_at__isnull=True, revoked_at__isnull=True),
                name="invitation_one_open_per_tenant_and_name",
            ),
            models.CheckConstraint(
                condition=~(models.Q(accepted_at__isnull=False, declined_at__isnull=False)
                            | models.Q(accepted_at__isnull=False, revoked_at__isnull=False)
                            | models.Q(declined_at__isnull=False, revoked_at__isnull=False)),
                name="invitation_ends_at_most_once",
            ),
            models.CheckConstraint(condition=models.Q(expires_at__gt=models.F("created_at")),
                                   name="invitation_expires_after_creation"),
        ]

    def __str__(self) -> str:
        return f"{self.invited_as} to {self.tenant} ({self.role})"

    @property
    def is_open(self) -> bool:
        return self.accepted_at is None and self.declined_at is None and self.revoked_at is None

    def is_expired(self, now: dt.datetime | None = None) -> bool:
        return self.expires_at <= (now or timezone.now())
