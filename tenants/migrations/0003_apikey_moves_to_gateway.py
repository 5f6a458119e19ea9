"""ApiKey moves to the gateway app (it points up at adapters through `bound_adapter`; tenants is a leaf).

State only: the table `tenants_apikey` and every row in it stay where they are, and gateway's model
keeps that table name (gateway/migrations/0005_apikey_from_tenants.py takes the model over).
"""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("tenants", "0002_invitations_and_last_used_tenant"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="ApiKey")],
            database_operations=[],
        ),
    ]
