"""Verbs on API keys, and the rules they keep (views and commands only parse and answer).

- Only an owner or admin of a tenant sees, issues and revokes its keys (``tenants.services.require_manager``,
  the same rule as for members). ``created_by=None`` / ``actor=None`` is a trusted caller: the
  ``create_api_key`` command, the demo setup. In Django's admin, a staff user allowed to change keys
  (the operator) may revoke any.
- A key is bound only to a live adapter of its own tenant; any other adapter is "no such adapter", the
  same answer as for one that does not exist (existence is not leaked across tenants).
- The secret exists in clear only in ``issue_api_key``'s return value; revoking records when and who,
  and revoking twice changes nothing.
"""
from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from adapters.models import Adapter
from tenants.models import Tenant
from tenants.services import require_manager

from .keys import generate_key, hash_secret
from .models import ApiKey

KEYS = "API keys"


def _require_key_manager(tenant: Tenant, actor) -> None:
    if actor is None:
        return  # a trusted caller (management command, demo setup)
    if getattr(actor, "is_staff", False) and actor.has_perm("gateway.change_apikey"):
        return  # the operator, in Django's admin
    require_manager(tenant, actor, what=KEYS)


def api_keys_for(tenant: Tenant, *, actor) -> QuerySet[ApiKey]:
    """The tenant's keys, for someone allowed to manage them (NotAllowed otherwise)."""
    _require_key_manager(tenant, actor)
    return ApiKey.objects.for_tenant(tenant).select_related("bound_adapter", "created_by", "revoked_by")


def api_key_for(tenant: Tenant, pk: int, *, actor) -> ApiKey:
    """One key of the tenant (ApiKey.DoesNotExist for another tenant's), for someone allowed to manage it."""
    return api_keys_for(tenant, actor=actor).get(pk=pk)


@transaction.atomic
def issue_api_key(tenant: Tenant, name: str, *, bound_adapter: Adapter | None = None,
                  expires_at: dt.datetime | None = None, created_by=None) -> tuple[ApiKey, str]:
    """Create a key and return it with its full secret — the only time the secret exists in clear.

    `created_by` is the user issuing it; when given, they must manage the tenant (owner or admin).
    """
    _require_key_manager(tenant, created_by)
    if bound_adapter is not None and (bound_adapter.tenant_id != tenant.pk or bound_adapter.is_deleted):
        # Same answer as a missing adapter: another tenant's objects do not exist for this one.
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
    """Refuse the key from now on; the first revocation's time and actor stay (revoking again is a no-op)."""
    _require_key_manager(key.tenant, actor)
    stored = ApiKey.objects.select_for_update().get(pk=key.pk)
    if stored.revoked_at is None:
        stored.revoked_at, stored.revoked_by = timezone.now(), actor
        stored.save(update_fields=["revoked_at", "revoked_by"])
    key.revoked_at, key.revoked_by_id = stored.revoked_at, stored.revoked_by_id
    return key
