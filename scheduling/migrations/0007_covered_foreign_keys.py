"""Foreign keys led by a composite index lose their own index (see
``sageproject.migration_ops.covered_foreign_key``)."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

from sageproject.migration_ops import covered_foreign_key


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0006_claimable_index"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        covered_foreign_key(
            "scheduling",
            model_name="event",
            name="session",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="events",
                to="scheduling.session",
            ),
        ),
        covered_foreign_key(
            "scheduling",
            model_name="run",
            name="owner",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="runs",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
        covered_foreign_key(
            "scheduling",
            model_name="run",
            name="session",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="runs",
                to="scheduling.session",
            ),
        ),
        covered_foreign_key(
            "scheduling",
            model_name="session",
            name="owner",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="agent_sessions",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
    ]
