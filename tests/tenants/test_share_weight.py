"""A tenant's share weight (issue 46): staff set it in the admin, 1 to 100; the database refuses anything else,
because the worker's engine divides a contended worker by the sum of the competing tenants' weights."""
from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction
from django.urls import reverse

from tenants.models import MAX_SHARE_WEIGHT, Tenant


def change(admin_client, tenant: Tenant, weight: str):
    """The tenant's admin form, posted as a browser posts it, with another share weight."""
    return admin_client.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), {
        "slug": tenant.slug, "name": tenant.name, "created_at_0": "2026-11-30", "created_at_1": "06:00:00",
        "may_use_base": "on", "requests_per_minute": str(tenant.requests_per_minute),
        "max_concurrent_requests": str(tenant.max_concurrent_requests), "share_weight": weight,
        "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0"})


def test_tenants_share_equally_by_default(world):
    assert (world.acme.share_weight, world.globex.share_weight) == (1, 1)


def test_staff_set_a_tenants_share_weight_in_the_admin(world, admin_client):
    page = admin_client.get(reverse("admin:tenants_tenant_change", args=[world.acme.pk])).content.decode()
    assert 'name="share_weight"' in page and "weight / sum of competing weights" in page
    assert change(admin_client, world.acme, "3").status_code == 302
    world.acme.refresh_from_db()
    assert world.acme.share_weight == 3
    listed = admin_client.get(reverse("admin:tenants_tenant_changelist")).content.decode()
    assert "column-share_weight" in listed


@pytest.mark.parametrize("weight", ["0", "-1", str(MAX_SHARE_WEIGHT + 1), "1.5", ""])
def test_the_admin_refuses_a_weight_out_of_range(world, admin_client, weight):
    r = change(admin_client, world.acme, weight)
    assert r.status_code == 200  # the form again, with the error
    assert "share_weight" in r.context["adminform"].form.errors
    world.acme.refresh_from_db()
    assert world.acme.share_weight == 1


@pytest.mark.parametrize("weight", [0, MAX_SHARE_WEIGHT + 1])
def test_the_database_refuses_a_weight_out_of_range(world, weight):
    with pytest.raises(IntegrityError), transaction.atomic():
        Tenant.objects.filter(pk=world.acme.pk).update(share_weight=weight)
    assert Tenant.objects.get(pk=world.acme.pk).share_weight == 1
