"""Usage charts and the audit table read only the tenant's own AuditRecords, with correct figures."""
from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from dashboard import usage
from gateway.models import AuditRecord


def record(tenant, adapter, *, ago: timedelta, total: float | None = 0.1, status: str = "ok", tokens=(10, 5), version=2):
    return AuditRecord.objects.create(
        route="/v1/completions", tenant=tenant, adapter=adapter, adapter_name=adapter.name if adapter else "",
        version_number=version if adapter else None, created_at=timezone.now() - ago, status=status,
        http_status=200 if status == "ok" else 502, error_code="" if status == "ok" else "adapter_load_failed",
        prompt_tokens=tokens[0], completion_tokens=tokens[1], total_seconds=total, key_prefix="lf_live_x",
    )


@pytest.fixture
def traffic(world):
    acme_records = [record(world.acme, world.acme_adapter, ago=timedelta(minutes=10), total=t / 100)
                    for t in range(1, 21)]  # 20 requests, 0.01 … 0.20 s
    acme_records.append(record(world.acme, world.acme_adapter, ago=timedelta(days=2), total=5.0, version=1))
    acme_records.append(record(world.acme, world.acme_adapter, ago=timedelta(minutes=5), total=None, status="error"))
    globex_record = record(world.globex, world.globex_adapter, ago=timedelta(minutes=3), total=9.0)
    return acme_records, globex_record


def audit_rows(client, **params) -> str:
    """The audit table's HTML only (the page echoes the query elsewhere, e.g. in the switcher's next=)."""
    html = client.get(reverse("adapters:audit"), params).content.decode()
    start = html.index('id="audit-table"')
    return html[start:html.index("</table>", start)]


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]
    assert usage.percentile(values, 50) == 50.0
    assert usage.percentile(values, 95) == 95.0
    assert usage.percentile([0.3], 95) == 0.3
    assert usage.percentile([], 50) is None


def test_series_counts_requests_tokens_and_latency_per_bucket(world, traffic):
    series = usage.usage_series(world.acme, window="24h")
    assert set(series) == {world.acme_adapter.pk}  # globex's traffic is not acme's
    buckets = series[world.acme_adapter.pk]
    assert len(buckets) == 24
    assert sum(b.requests for b in buckets) == 21  # the 2-day-old record is outside 24 h
    assert sum(b.errors for b in buckets) == 1
    assert sum(b.tokens for b in buckets) == 21 * 15
    latencies = sorted(x for b in buckets for x in b.latencies)
    assert len(latencies) == 20 and usage.percentile(latencies, 95) == pytest.approx(0.19)
    week = usage.usage_series(world.acme, window="7d")[world.acme_adapter.pk]
    assert len(week) == 28 and sum(b.requests for b in week) == 22


def test_totals_give_24h_requests_and_last_use(world, traffic):
    totals = usage.adapter_totals(world.acme, since=timezone.now() - timedelta(hours=24))
    assert totals[world.acme_adapter.pk]["requests"] == 21
    assert totals[world.acme_adapter.pk]["last_used"] > timezone.now() - timedelta(minutes=6)
    assert world.globex_adapter.pk not in totals


def test_usage_page_draws_charts_for_the_tenants_adapters_only(client, world, traffic):
    client.force_login(world.alice)
    html = client.get(reverse("adapters:usage")).content.decode()
    assert "support-bot" in html and "<strong>21</strong> requests" in html
    assert html.count("<svg") == 3  # requests, tokens, latency of the one adapter with traffic
    assert "9.000" not in html  # globex's 9 s request does not leak into acme's percentiles
    week = client.get(reverse("adapters:usage"), {"window": "7d"}).content.decode()
    assert "<strong>22</strong> requests" in week


def test_detail_page_shows_the_adapters_usage(client, world, traffic):
    client.force_login(world.bob)
    html = client.get(reverse("adapters:detail", args=[world.acme_adapter.pk])).content.decode()
    assert html.count("<svg") == 3 and "Latency" in html


def test_audit_table_is_tenant_scoped_and_filterable(client, world, traffic):
    acme_records, globex_record = traffic
    client.force_login(world.alice)
    html = audit_rows(client)
    assert all(str(r.request_id) in html for r in acme_records)
    assert str(globex_record.request_id) not in html

    target = acme_records[3]
    found = audit_rows(client, q=str(target.request_id))
    assert str(target.request_id) in found and str(acme_records[4].request_id) not in found
    partial = audit_rows(client, q=str(target.request_id)[:8])
    assert str(target.request_id) in partial
    assert str(globex_record.request_id) not in audit_rows(client, q=str(globex_record.request_id))

    errors = audit_rows(client, status="error")
    assert "adapter_load_failed" in errors and str(acme_records[0].request_id) not in errors
    v1 = audit_rows(client, version=1)
    assert str(acme_records[-2].request_id) in v1 and str(acme_records[0].request_id) not in v1
    today = timezone.now().date()
    old = audit_rows(client, date_to=str(today - timedelta(days=1)))
    assert str(acme_records[-2].request_id) in old and str(acme_records[0].request_id) not in old


def test_charlie_cannot_filter_his_audit_by_an_acme_adapter(client, world, traffic):
    acme_records, globex_record = traffic
    client.force_login(world.charlie)
    page = client.get(reverse("adapters:audit"), {"adapter": world.acme_adapter.pk}).content.decode()
    assert "Select a valid choice" in page
    html = audit_rows(client, adapter=world.acme_adapter.pk)
    assert not any(str(r.request_id) in html for r in acme_records)


def test_a_garbage_request_id_finds_nothing(client, world, traffic):
    client.force_login(world.alice)
    html = audit_rows(client, q="not-a-uuid-" + "x" * 30)
    assert "No matching requests" in html
    assert uuid.UUID(str(traffic[0][0].request_id))  # sanity: ids are UUIDs
