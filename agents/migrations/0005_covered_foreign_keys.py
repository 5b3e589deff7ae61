"""Foreign keys led by a composite index lose their own index (see
``sageproject.migration_ops.covered_foreign_key``)."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

from sageproject.migration_ops import covered_foreign_key


class Migration(migrations.Migration):
    dependencies = [
        ("agents", "0004_thread_metadata"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        covered_foreign_key(
            "agents",
            model_name="managedagentrecord",
            name="owner",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="archives",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
    ]
