"""ApiKey comes over from the tenants app with its table (tenants/migrations/0003 lets go of it).

State only for the model: the table keeps its name, `tenants_apikey`, and every row. The content type
(and so the admin permissions and log entries that point at it) is relabelled to the gateway.
"""
import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


def relabel_content_type(apps, schema_editor, *, old="tenants", new="gateway"):
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    if not ContentType.objects.using(db).filter(app_label=new, model="apikey").exists():
        ContentType.objects.using(db).filter(app_label=old, model="apikey").update(app_label=new)


def relabel_back(apps, schema_editor):
    relabel_content_type(apps, schema_editor, old="gateway", new="tenants")


class Migration(migrations.Migration):

    dependencies = [
        ("adapters", "0002_initial"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("gateway", "0004_audit_identity_write_once"),
        ("tenants", "0003_apikey_moves_to_gateway"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="ApiKey",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                        ("name", models.CharField(max_length=100)),
                        ("key_id", models.CharField(max_length=16, unique=True)),
                        ("secret_hash", models.CharField(max_length=64)),
                        ("last4", models.CharField(max_length=4)),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        ("expires_at", models.DateTimeField(blank=True, null=True)),
                        ("revoked_at", models.DateTimeField(blank=True, null=True)),
                        ("last_used_at", models.DateTimeField(blank=True, null=True)),
                        ("bound_adapter", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name="bound_keys", to="adapters.adapter")),
                        ("created_by", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, to=settings.AUTH_USER_MODEL)),
                        ("tenant", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="api_keys", to="tenants.tenant")),
                    ],
                    options={
                        "db_table": "tenants_apikey",
                        "ordering": ["-created_at"],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(relabel_content_type, relabel_back),
    ]
