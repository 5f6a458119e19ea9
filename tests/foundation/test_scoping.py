"""Tenant scoping: another tenant's objects are *not found*, through every query a tenant path uses."""
import pytest

from adapters.models import Adapter, AdapterVersion, VersionPointerChange
from gateway.models import ApiKey, AuditRecord
from tenants.models import Membership
from tenants.scoping import TenantScopeError


@pytest.mark.parametrize("model", [Adapter, AdapterVersion, VersionPointerChange, ApiKey, Membership, AuditRecord])
def test_for_tenant_none_raises(db, model):
    with pytest.raises(TenantScopeError):
        model.objects.for_tenant(None)


def test_charlie_finds_none_of_acmes_objects(world):
    AuditRecord.objects.create(route="/v1/completions", tenant=world.acme, adapter=world.acme_adapter)
    g = world.globex
    assert not Adapter.objects.for_tenant(g).filter(pk=world.acme_adapter.pk).exists()
    assert not AdapterVersion.objects.for_tenant(g).filter(pk=world.acme_v1.pk).exists()
    assert not ApiKey.objects.for_tenant(g).filter(pk=world.acme_key.pk).exists()
    assert not AuditRecord.objects.for_tenant(g).filter(tenant=world.acme).exists()
    assert not VersionPointerChange.objects.for_tenant(g).filter(adapter=world.acme_adapter).exists()
    # Same name in both tenants: each sees only its own.
    assert Adapter.objects.for_tenant(g).get(name="support-bot").pk == world.globex_adapter.pk
    assert Adapter.objects.for_tenant(world.acme).get(name="support-bot").pk == world.acme_adapter.pk


def test_activate_refuses_a_version_of_another_adapter(world):
    from adapters.services import activate_version

    with pytest.raises(AdapterVersion.DoesNotExist):
        activate_version(world.acme_adapter, world.globex_v1, actor=world.alice, reason="mix")
    world.acme_adapter.refresh_from_db()
    assert world.acme_adapter.active_version == world.acme_v2


def test_tenant_users_have_no_admin(world, client):
    client.force_login(world.charlie)
    response = client.get(f"/admin/adapters/adapter/{world.acme_adapter.pk}/change/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    response = client.get("/admin/gateway/auditrecord/")
    assert response.status_code == 302
