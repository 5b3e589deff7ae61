from __future__ import annotations

from django.apps import AppConfig


class AgentsConfig(AppConfig):
    name = "agents"
    verbose_name = "Agents"

    def ready(self) -> None:
        # A run's terminal transition (scheduling.runs) writes its archive row in the same
        # transaction; the archive belongs to this app, so it registers the writer.
        from agents.archives import archive_records, archive_statement
        from scheduling import runs

        runs.set_archiver(archive_records, archive_statement)

        # A changed model record (a rotated key) reaches the workers at once: their next
        # run compares its Application's records with the database again.
        from django.db.models.signals import post_delete, post_save

        from pooling.models import ModelRecord

        post_save.connect(_records_changed, sender=ModelRecord, dispatch_uid="sage-records")
        post_delete.connect(_records_changed, sender=ModelRecord, dispatch_uid="sage-records-del")


def _records_changed(sender, using: str = "default", **kwargs) -> None:
    from scheduling import wakeups

    wakeups.notify("records", using=using)
