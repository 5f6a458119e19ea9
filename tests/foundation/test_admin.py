"""Django admin, for platform staff: the activate-a-version action and the audit log's CSV export."""
import csv
import io

import pytest
from django.urls import reverse

from adapters.models import VersionPointerChange
from gateway.models import AuditRecord, AuditStatus


@pytest.fixture
def staff(world, admin_client):
    return admin_client


def test_activate_action_asks_for_a_reason_and_records_the_move(world, staff):
    url = reverse("admin:adapters_adapter_activate", args=[world.acme_adapter.pk])
    assert b"reason" in staff.get(url).content
    response = staff.post(url, {"version": world.acme_v1.pk, "reason": ""})
    assert response.status_code == 200  # the form again: no reason, no move
    world.acme_adapter.refresh_from_db()
    assert world.acme_adapter.active_version == world.acme_v2
    response = staff.post(url, {"version": world.acme_v1.pk, "reason": "v2 answers badly"})
    assert response.status_code == 302
    world.acme_adapter.refresh_from_db()
    assert world.acme_adapter.active_version == world.acme_v1
    change = VersionPointerChange.objects.filter(adapter=world.acme_adapter).first()
    assert (change.from_version, change.to_version, change.reason) == (world.acme_v2, world.acme_v1, "v2 answers badly")


def test_activate_refuses_a_version_of_another_adapter(world, staff):
    url = reverse("admin:adapters_adapter_activate", args=[world.acme_adapter.pk])
    staff.post(url, {"version": world.globex_v1.pk, "reason": "mix"})
    world.acme_adapter.refresh_from_db()
    assert world.acme_adapter.active_version == world.acme_v2


def test_audit_admin_is_read_only_and_exports_the_filtered_rows(world, staff):
    ok = AuditRecord.objects.create(route="/v1/completions", tenant=world.acme, status=AuditStatus.OK,
                                    weights_sha256="b" * 64)
    AuditRecord.objects.create(route="/v1/completions", tenant=world.globex, status=AuditStatus.ERROR,
                               error_code="adapter_not_found")
    change_url = reverse("admin:gateway_auditrecord_change", args=[ok.pk])
    assert staff.post(change_url, {"status": "error"}).status_code == 403
    assert staff.post(reverse("admin:gateway_auditrecord_delete", args=[ok.pk]), {"post": "yes"}).status_code == 403
    changelist = reverse("admin:gateway_auditrecord_changelist")
    assert str(ok.request_id) in staff.get(changelist, {"q": str(ok.request_id)}).content.decode()
    response = staff.get(reverse("admin:gateway_auditrecord_csv"), {"status__exact": "ok"})
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [r["request_id"] for r in rows] == [str(ok.request_id)]
    assert rows[0]["weights_sha256"] == "b" * 64


def test_staff_revoke_keys_with_the_admin_action_and_it_records_who(world, staff):
    from django.contrib.auth import get_user_model

    from gateway.models import ApiKey

    response = staff.post(reverse("admin:gateway_apikey_changelist"),
                          {"action": "revoke", "_selected_action": [world.acme_key.pk]})
    assert response.status_code == 302
    key = ApiKey.objects.get(pk=world.acme_key.pk)
    admin_user = get_user_model().objects.get(username="admin")
    assert key.revoked_at is not None and key.revoked_by == admin_user
    assert ApiKey.objects.get(pk=world.globex_key.pk).revoked_at is None


def test_a_tenant_cap_at_or_above_a_workers_threads_is_refused(staff, settings):
    """At its cap, a tenant with as many requests in flight as a worker has task threads would hold every
    thread, and other tenants' jobs would wait in the queue where no fair scheduler sees them."""
    from tenants.models import Tenant

    settings.LORAFLEET_WORKER_CONCURRENCY = 128

    def add(slug: str, cap: int):
        return staff.post(reverse("admin:tenants_tenant_add"), {
            "slug": slug, "name": slug, "created_at_0": "2026-11-30", "created_at_1": "06:00:00",
            "may_use_base": "on", "requests_per_minute": "600", "max_concurrent_requests": str(cap), "share_weight": "1",
            "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0"})

    refused = add("greedy", 128)
    assert refused.status_code == 200
    assert "below a worker&#x27;s task threads (LORAFLEET_WORKER_CONCURRENCY = 128)" in refused.content.decode()
    assert not Tenant.objects.filter(slug="greedy").exists()
    assert add("modest", 127).status_code == 302
    assert Tenant.objects.get(slug="modest").max_concurrent_requests == 127
    assert Tenant().max_concurrent_requests < settings.LORAFLEET_WORKER_CONCURRENCY  # the defaults agree
