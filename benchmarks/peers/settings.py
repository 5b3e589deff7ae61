"""``sageproject.settings`` plus django-tasks-db, for the benchmark's peer subprocesses only.

Used as ``DJANGO_SETTINGS_MODULE=benchmarks.peers.settings`` by ``manage.py bench_e2e`` for its
peer drivers and django-tasks-db's ``db_worker``; the product never loads it. Without the
django-tasks-db package installed the other peers still run (its app is left out).
"""

from importlib.util import find_spec

from sageproject.settings import *  # noqa: F403
from sageproject.settings import INSTALLED_APPS

if find_spec("django_tasks_db") is not None:
    INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["default"]}}
