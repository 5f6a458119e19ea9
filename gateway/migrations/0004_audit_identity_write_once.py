"""The append-only trigger learns the adapter identity column.

Unchanged from 0002: DELETE is refused, a final row never changes (adapter_identity included), TRUNCATE is
refused outside test databases. New: the columns that say *what* a record is about may not change even
while it is pending — request_id and created_at never, and adapter_identity (set when the worker's result
finalises the row) only from NULL to a value, never from one identity to another. Pending -> final stays
one ordinary UPDATE.
"""
from django.db import migrations

# Columns a pending row may not change at all, and columns it may set once (from NULL) but never change.
FIXED_COLUMNS = ("request_id", "created_at")
WRITE_ONCE_COLUMNS = ("adapter_identity",)


def _function(fixed: tuple[str, ...], write_once: tuple[str, ...]) -> str:
    changed = [f"NEW.{c} IS DISTINCT FROM OLD.{c}" for c in fixed]
    changed += [f"(OLD.{c} IS NOT NULL AND NEW.{c} IS DISTINCT FROM OLD.{c})" for c in write_once]
    return r"""
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
    IF TG_OP = 'UPDATE' AND (__CHANGED__) THEN
        RAISE EXCEPTION 'audit record % cannot change its identity', OLD.request_id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
""".replace("__CHANGED__", "\n                             OR ".join(changed))


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_function(FIXED_COLUMNS, WRITE_ONCE_COLUMNS), params=None)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_function(FIXED_COLUMNS, ()), params=None)


class Migration(migrations.Migration):
    dependencies = [("gateway", "0003_auditrecord_adapter_identity")]
    operations = [migrations.RunPython(forwards, backwards)]
