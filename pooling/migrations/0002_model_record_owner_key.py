"""Shared model-record names unique on every database.

``model_record_shared_name`` (unique ``name`` where ``owner IS NULL``) needs partial
indexes: MySQL and MariaDB never created it, so shared records there may share a name.
``owner_key`` (the owner's id, or 0 for a shared record) is a stored generated column, never
null, so one plain unique constraint on (owner_key, name) replaces both old constraints.

Before the constraint is added, shared records that share a name are told apart: the
oldest keeps the name (lookups picked one of them at random until now) and each other one
is renamed ``<name>~<id>``, kept rather than deleted so that no configuration or credential
is lost; an operator may delete them in the admin.
"""

import django.db.models.functions.comparison
from django.conf import settings
from django.db import migrations, models
from django.db.models import Count, Min


def rename_duplicate_shared_names(apps, schema_editor):
    ModelRecord = apps.get_model("pooling", "ModelRecord")
    records = ModelRecord.objects.using(schema_editor.connection.alias)
    shared = records.filter(owner__isnull=True)
    duplicated = (
        shared.values("name").annotate(rows=Count("id"), first=Min("id")).filter(rows__gt=1)
    )
    for group in list(duplicated):
        for record in shared.filter(name=group["name"]).exclude(id=group["first"]):
            suffix = f"~{record.id}"
            record.name = group["name"][: 100 - len(suffix)] + suffix
            record.save(update_fields=["name"])


class Migration(migrations.Migration):

    dependencies = [
        ("pooling", "0001_initial"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="modelrecord",
            name="owner_key",
            field=models.GeneratedField(
                db_persist=True,
                expression=django.db.models.functions.comparison.Coalesce("owner", 0),
                output_field=models.BigIntegerField(),
            ),
        ),
        migrations.RunPython(rename_duplicate_shared_names, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="modelrecord",
            constraint=models.UniqueConstraint(
                fields=("owner_key", "name"),
                name="model_record_owner_key_name",
                violation_error_message=(
                    "A model record with this name already exists (for this owner, or shared)."
                ),
            ),
        ),
        migrations.RemoveConstraint(
            model_name="modelrecord",
            name="model_record_owner_name",
        ),
        migrations.RemoveConstraint(
            model_name="modelrecord",
            name="model_record_shared_name",
        ),
    ]
