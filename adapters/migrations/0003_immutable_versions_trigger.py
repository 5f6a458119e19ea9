"""Postgres enforces AdapterVersion immutability: UPDATE of a content column is rejected.

On SQLite the Python layer (AdapterVersion.save / the queryset's update) enforces the same.
"""
from django.db import migrations

IMMUTABLE_COLUMNS = [
    "adapter_id", "number", "sha256", "storage_key", "size_bytes", "rank", "alpha", "use_rslora",
    "target_modules", "dtype", "parameter_count", "peft_config", "created_at",
]

_checks = " OR ".join(f"NEW.{c} IS DISTINCT FROM OLD.{c}" for c in IMMUTABLE_COLUMNS)

CREATE = f"""
CREATE OR REPLACE FUNCTION lorafleet_adapterversion_immutable() RETURNS trigger AS $$
BEGIN
    IF {_checks} THEN
        RAISE EXCEPTION 'adapter versions are immutable: % (id %) cannot change its weights or metadata',
            TG_TABLE_NAME, OLD.id USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER adapterversion_immutable BEFORE UPDATE ON adapters_adapterversion
    FOR EACH ROW EXECUTE FUNCTION lorafleet_adapterversion_immutable();
"""

DROP = """
DROP TRIGGER IF EXISTS adapterversion_immutable ON adapters_adapterversion;
DROP FUNCTION IF EXISTS lorafleet_adapterversion_immutable();
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE, params=None)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [("adapters", "0002_initial")]
    operations = [migrations.RunPython(forwards, backwards)]
