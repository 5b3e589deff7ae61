"""The Django task (``django.tasks``, Django 6) that django-tasks-db's ``db_worker`` runs
(``TASKS`` in `benchpeers.settings`)."""

from __future__ import annotations

from django.tasks import task

from benchpeers import recorder


@task
def record_start(key: str, i: int) -> None:
    recorder.record(key, i)
