"""Tenant scoping that cannot be forgotten.

Every tenant-owned model's manager offers ``for_tenant(tenant)``; passing ``None`` raises instead of
returning everything, so a missing tenant is a loud bug, never a data leak. Lookups of another
tenant's objects simply find nothing (callers turn that into 404).
"""
from __future__ import annotations

from django.db import models


class TenantScopeError(RuntimeError):
    """A tenant-scoped query was made without a tenant."""


class TenantScopedQuerySet(models.QuerySet):
    #: the lookup from this model to its Tenant, e.g. "tenant" or "adapter__tenant"
    tenant_path = "tenant"

    def for_tenant(self, tenant) -> TenantScopedQuerySet:
        if tenant is None or getattr(tenant, "pk", None) is None:
            raise TenantScopeError(f"{self.model.__name__}.objects.for_tenant() needs a saved tenant, got {tenant!r}.")
        return self.filter(**{self.tenant_path: tenant})


def scoped_queryset(path: str) -> type[TenantScopedQuerySet]:
    return type(f"ScopedBy_{path}", (TenantScopedQuerySet,), {"tenant_path": path})
