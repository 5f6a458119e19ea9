"""AuditRecord learns what the worker's scheduling by share did to a request (issue 46): cached_tokens, the prompt
tokens whose KV came from its prefix cache, and preemptions, the times a sequence of it was preempted and
recomputed. Both are set when the row is finalised, like prompt_tokens; the append-only trigger (0002, 0004, 0007)
needs no change: a final row never changes, these columns included. Existing rows read 0. The columns carry a
database default as well, so a web process of the previous release, still inserting rows during a deploy, works."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('gateway', '0008_auditrecord_adapter_dtype'),
    ]

    operations = [
        migrations.AddField(
            model_name='auditrecord',
            name='cached_tokens',
            field=models.PositiveIntegerField(db_default=0, default=0, help_text="Prompt tokens whose KV came from the worker's prefix cache (usage.prompt_tokens_details)."),
        ),
        migrations.AddField(
            model_name='auditrecord',
            name='preemptions',
            field=models.PositiveIntegerField(db_default=0, default=0, help_text='Times the worker preempted a sequence of this request to share the worker fairly and recomputed it; the answer is the same as without.'),
        ),
    ]
