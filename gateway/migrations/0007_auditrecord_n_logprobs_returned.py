"""AuditRecord learns n (choices asked for) and whether logprobs were returned (issue 19), and the append-only
trigger learns them too.

Unchanged from 0004: DELETE is refused, a final row never changes, request_id and created_at never change,
adapter_identity is write-once. New: `n` is part of what a record is about, written when the row is created
(pending or refused) and never changed; `logprobs_returned` is set once, from NULL, when the row is finalised.
"""
from django.db import migrations, models

# Columns a pending row may not change at all, and columns it may set once (from NULL) but never change.
FIXED_COLUMNS = ("request_id", "created_at", "n")
WRITE_ONCE_COLUMNS = ("adapter_identity", "logprobs_returned")
PREVIOUS = (("request_id", "created_at"), ("adapter_identity",))  # 0004's


def _function(fixed: tuple[str, ...], write_once: tuple[str, ...]) -> str:
    """0004's trigger function over these columns (a copy: a migration does not import another)."""
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
        schema_editor.execute(_function(*PREVIOUS), params=None)


class Migration(migrations.Migration):
    dependencies = [("gateway", "0006_apikey_revoked_by")]

    operations = [
        migrations.AddField(
            model_name="auditrecord",
            name="n",
            field=models.PositiveSmallIntegerField(
                blank=True, null=True, help_text="Choices asked for (OpenAI's n); empty when the body was never parsed."),
        ),
        migrations.AddField(
            model_name="auditrecord",
            name="logprobs_returned",
            field=models.BooleanField(
                blank=True, null=True, help_text="Whether the caller got logprobs; set once, when the record is final."),
        ),
        migrations.AlterField(
            model_name="auditrecord",
            name="completion_tokens",
            field=models.PositiveIntegerField(blank=True, null=True, help_text="Tokens of every choice."),
        ),
        migrations.RunPython(forwards, backwards),
    ]
