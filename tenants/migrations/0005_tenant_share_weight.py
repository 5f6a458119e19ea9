"""Tenant.share_weight (issue 46): the weight the engine shares a contended worker by, 1 to 100 (a check
constraint keeps a zero, which the engine would divide by, out of the database). Existing tenants get 1: equal
shares, as before."""

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0004_tenant_dedicated_pool'),
    ]

    operations = [
        migrations.AddField(
            model_name='tenant',
            name='share_weight',
            field=models.PositiveSmallIntegerField(default=1, help_text="From 1 to 100. When tenants compete for a worker's running sequences and KV blocks, each gets weight / sum of competing weights of them; a tenant alone may use all of them. Equal weights (the default, 1) share equally.", validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(100)]),
        ),
        migrations.AddConstraint(
            model_name='tenant',
            constraint=models.CheckConstraint(condition=models.Q(('share_weight__gte', 1), ('share_weight__lte', 100)), name='tenant_share_weight_in_range'),
        ),
    ]
