"""Verbs that change tenants, members and API keys."""
from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from .keys import generate_key, hash_secret
from .models import ApiKey, Membership, Role, Tenant


@transaction.atomic
def create_tenant(slug: str, name: str = "", *, owner=None) -> Tenant:
    tenant = Tenant(slug=slug, name=name or slug)
    tenant.full_clean()
    tenant.save()
    if owner is not None:
        add_member(tenant, owner, Role.OWNER)
    return tenant


@transaction.atomic
def add_member(tenant: Tenant, user, role: str) -> Membership:
    membership, _ = Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": role})
    return membership


@transaction.atomic
def issue_api_key(tenant: Tenant, name: str, *, bound_adapter=None, expires_at=None, created_by=None) -> tuple[ApiKey, str]:
    """Create a key and return it with its full secret — the only time the secret exists in clear."""
    if bound_adapter is not None and bound_adapter.tenant_id != tenant.pk:
        # Same answer as a missing adapter: another tenant's objects do not exist for this one.
        from adapters.models import Adapter

        raise Adapter.DoesNotExist("No such adapter.")
    if expires_at is not None and expires_at <= timezone.now():
        raise ValueError("The expiry must be in the future.")
    full, key_id, secret = generate_key()
    key = ApiKey.objects.create(
        tenant=tenant,
        name=name or "key",
        key_id=key_id,
        secret_hash=hash_secret(secret),
        last4=full[-4:],
        bound_adapter=bound_adapter,
        expires_at=expires_at,
        created_by=created_by,
    )
    return key, full


@transaction.atomic
def revoke_api_key(key: ApiKey, *, actor=None) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
    return key
