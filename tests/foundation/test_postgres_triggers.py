"""Invariants enforced by PostgreSQL itself: raw SQL that bypasses Django is refused (DESIGN.md)."""
import pytest
from django.db import DatabaseError, transaction

from gateway.models import AuditRecord, AuditStatus


def _raw(connection, sql, params=()):
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)


def test_raw_update_of_a_versions_sha256_fails(world, postgres):
    with pytest.raises(DatabaseError, match="immutable"):
        _raw(postgres, "UPDATE adapters_adapterversion SET sha256 = %s WHERE id = %s", ["f" * 64, world.acme_v1.pk])


def test_raw_update_of_a_versions_rank_and_storage_key_fails(world, postgres):
    for column, value in [("rank", 64), ("storage_key", "adapters/elsewhere"), ("alpha", 1.0)]:
        with pytest.raises(DatabaseError, match="immutable"):
            _raw(postgres, f"UPDATE adapters_adapterversion SET {column} = %s WHERE id = %s", [value, world.acme_v1.pk])


def test_raw_delete_of_audit_rows_fails(world, postgres):
    AuditRecord.objects.create(route="/v1/completions", tenant=world.acme)
    with pytest.raises(DatabaseError, match="append-only"):
        _raw(postgres, "DELETE FROM gateway_auditrecord")
    assert AuditRecord.objects.count() == 1


def test_raw_truncate_of_audit_fails(world, postgres):
    AuditRecord.objects.create(route="/v1/completions", tenant=world.acme)
    with transaction.atomic():
        with postgres.cursor() as cursor:
            # The test runner's flush escape hatch is on for test connections; a real client has it off.
            cursor.execute("SET LOCAL lorafleet.allow_test_flush = 'off'")
            # Fire the deferred FK checks of the rows above now, so TRUNCATE meets only our trigger.
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            with postgres.cursor() as cursor:
                cursor.execute("TRUNCATE gateway_auditrecord CASCADE")
    assert AuditRecord.objects.count() == 1


def test_pending_row_can_be_finalised_once_then_never_changes(world, postgres):
    record = AuditRecord.objects.create(route="/v1/completions", tenant=world.acme)
    _raw(postgres, "UPDATE gateway_auditrecord SET status = 'ok', http_status = 200 WHERE id = %s", [record.pk])
    with pytest.raises(DatabaseError, match="final"):
        _raw(postgres, "UPDATE gateway_auditrecord SET completion_tokens = 1 WHERE id = %s", [record.pk])
    with pytest.raises(DatabaseError, match="final"):
        _raw(postgres, "UPDATE gateway_auditrecord SET status = 'pending' WHERE id = %s", [record.pk])
    assert AuditRecord.objects.get(pk=record.pk).status == AuditStatus.OK


def test_the_adapter_identity_is_set_once_when_finalised_and_never_changes(world, postgres):
    record = AuditRecord.objects.create(route="/v1/completions", tenant=world.acme)
    assert record.adapter_identity is None
    _raw(postgres, "UPDATE gateway_auditrecord SET status = 'ok', adapter_identity = %s WHERE id = %s",
         ["1" * 64, record.pk])  # pending -> final, with the identity the worker served
    with pytest.raises(DatabaseError, match="final"):
        _raw(postgres, "UPDATE gateway_auditrecord SET adapter_identity = %s WHERE id = %s", ["2" * 64, record.pk])
    with pytest.raises(DatabaseError, match="final"):
        _raw(postgres, "UPDATE gateway_auditrecord SET adapter_identity = NULL WHERE id = %s", [record.pk])
    assert AuditRecord.objects.get(pk=record.pk).adapter_identity == "1" * 64


def test_a_pending_row_cannot_swap_its_adapter_identity(world, postgres):
    record = AuditRecord.objects.create(route="/v1/completions", tenant=world.acme, adapter_identity="1" * 64)
    for value in ("2" * 64, None):
        with pytest.raises(DatabaseError, match="identity"):
            _raw(postgres, "UPDATE gateway_auditrecord SET adapter_identity = %s WHERE id = %s", [value, record.pk])
    _raw(postgres, "UPDATE gateway_auditrecord SET status = 'error', http_status = 502 WHERE id = %s", [record.pk])
    assert AuditRecord.objects.get(pk=record.pk).adapter_identity == "1" * 64
