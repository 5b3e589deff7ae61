"""The archive's owner loses its own index: ``archive_owner_recent`` leads with it (see
``sageproject.migration_ops.covered_foreign_key``)."""

from django.conf import settings
from django.db import migrations

from sageproject.migration_ops import covered_foreign_key


class Migration(migrations.Migration):
    dependencies = [("agents", "0004_thread_metadata")]

    operations = [
        covered_foreign_key(
            "agents",
            "managedagentrecord",
            "owner",
            to=settings.AUTH_USER_MODEL,
            related_name="archives",
        )
    ]
