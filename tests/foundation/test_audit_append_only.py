"""The audit log is append-only: Python layer here (any database), Postgres layer in test_postgres_triggers."""
import pytest

from gateway.models import AppendOnlyError, AuditRecord, AuditStatus


def test_pending_record_is_finalised_once(world):
    record = AuditRecord.objects.create(route="/v1/completions", tenant=world.acme)
    record.status, record.http_status, record.weights_sha256 = AuditStatus.OK, 200, "a" * 64
    record.save()
    record.completion_tokens = 99
    with pytest.raises(AppendOnlyError):
        record.save()
    with pytest.raises(AppendOnlyError):
        AuditRecord.objects.filter(pk=record.pk).update(completion_tokens=5)
    assert AuditRecord.objects.get(pk=record.pk).completion_tokens is None


def test_records_cannot_be_deleted(world):
    record = AuditRecord.objects.create(route="/v1/completions", tenant=world.acme)
    with pytest.raises(AppendOnlyError):
        record.delete()
    with pytest.raises(AppendOnlyError):
        AuditRecord.objects.all().delete()
    assert AuditRecord.objects.filter(pk=record.pk).exists()
