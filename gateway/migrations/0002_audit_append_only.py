"""Postgres makes the audit log append-only.

- DELETE is always rejected.
- UPDATE is allowed only while the stored row is pending (it is finalised once); a final row never changes.
- TRUNCATE is rejected, except in a Django *test* database (name starting with ``test_``) on a
  connection that sets ``lorafleet.allow_test_flush = 'on'``: the test runner empties every table
  between transactional tests with one TRUNCATE. Production databases are never named ``test_*``.

On SQLite the Python layer (AuditRecord.save/delete and its queryset) enforces the same.
"""
from django.db import migrations

CREATE = r"""
CREATE OR REPLACE FUNCTION lorafleet_audit_append_only() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'audit records are append-only: DELETE is not allowed'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.status <> 'pending' THEN
        RAISE EXCEPTION 'audit record % is final and never changes', OLD.request_id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF TG_OP = 'UPDATE' AND (NEW.request_id IS DISTINCT FROM OLD.request_id
                             OR NEW.created_at IS DISTINCT FROM OLD.created_at) THEN
        RAISE EXCEPTION 'audit record % cannot change its identity', OLD.request_id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION lorafleet_audit_no_truncate() RETURNS trigger AS $$
BEGIN
    IF current_database() LIKE 'test\_%'
       AND coalesce(current_setting('lorafleet.allow_test_flush', true), '') = 'on' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'audit records are append-only: TRUNCATE is not allowed'
        USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER audit_append_only BEFORE UPDATE OR DELETE ON gateway_auditrecord
    FOR EACH ROW EXECUTE FUNCTION lorafleet_audit_append_only();
CREATE TRIGGER audit_no_truncate BEFORE TRUNCATE ON gateway_auditrecord
    FOR EACH STATEMENT EXECUTE FUNCTION lorafleet_audit_no_truncate();
"""

DROP = """
DROP TRIGGER IF EXISTS audit_append_only ON gateway_auditrecord;
DROP TRIGGER IF EXISTS audit_no_truncate ON gateway_auditrecord;
DROP FUNCTION IF EXISTS lorafleet_audit_append_only();
DROP FUNCTION IF EXISTS lorafleet_audit_no_truncate();
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE, params=None)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [("gateway", "0001_initial")]
    operations = [migrations.RunPython(forwards, backwards)]
