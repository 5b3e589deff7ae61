"""Foreign keys led by a composite index lose their own index (see
``sageproject.migration_ops.covered_foreign_key``)."""

from django.conf import settings
from django.db import migrations

from sageproject.migration_ops import covered_foreign_key


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0006_claimable_index"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        covered_foreign_key("scheduling", model, name, to=to, related_name=related)
        for model, name, to, related in (
            ("event", "session", "scheduling.session", "events"),
            ("run", "owner", settings.AUTH_USER_MODEL, "runs"),
            ("run", "session", "scheduling.session", "runs"),
            ("session", "owner", settings.AUTH_USER_MODEL, "agent_sessions"),
        )
    ]
