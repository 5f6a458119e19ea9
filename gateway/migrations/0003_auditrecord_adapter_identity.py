from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("gateway", "0002_audit_append_only")]

    operations = [
        migrations.AddField(
            model_name="auditrecord",
            name="adapter_identity",
            field=models.CharField(
                blank=True, max_length=64, null=True,
                help_text="What the worker served: sha256 over the weights' sha256, rank, alpha, rsLoRA and target "
                          "modules (inference_worker.jobs.adapter_identity). Empty for base-model requests and refusals.",
            ),
        ),
    ]
