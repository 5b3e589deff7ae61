"""The Django task (``django.tasks``, Django 6) that django-tasks-db's ``db_worker`` runs
(``TASKS`` in `benchmarks.peers.settings`)."""

from __future__ import annotations

from django.tasks import task

from benchmarks.peers import recorder


@task
def record_start(key: str, i: int) -> None:
    recorder.record(key, i)
