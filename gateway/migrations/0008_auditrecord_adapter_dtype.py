"""AuditRecord learns how the worker held the served adapter's weights (adapter_dtype): a 16-bit adapter pool
(run_worker --adapter-dtype) applies rounded weights, and "which weights produced this response?" should say so.
Rows written before this migration read "" (unknown). The append-only trigger is unchanged: the column is set when
the row is finalised, like weights_sha256, and a final row never changes."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('gateway', '0007_auditrecord_n_logprobs_returned'),
    ]

    operations = [
        migrations.AddField(
            model_name='auditrecord',
            name='adapter_dtype',
            field=models.CharField(blank=True, help_text="How the worker held the adapter's weights as it applied them: float32, or float16 / bfloat16 from a 16-bit adapter pool (docs/SERVING.md). Empty for base-model requests and refusals.", max_length=16),
        ),
    ]
