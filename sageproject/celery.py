"""The Celery app: background jobs (``agents.jobs``) on Celery workers over Redis.

Importable without Django settings: the broker comes straight from ``REDIS_URL`` so a job
worker host needs no database configuration. Start a worker with::

    celery -A sageproject.celery worker --pool=threads --concurrency=8 -Q sage-jobs
"""

from __future__ import annotations

import os

from celery import Celery

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_QUEUE = "sage-jobs"


def redis_url() -> str:
    """The broker URL: ``REDIS_URL``, or a local Redis in development."""
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


app = Celery("sage")
app.conf.update(
    broker_url=redis_url(),
    # Job state and output live in Redis under the job runtime's own keys; Celery results
    # would only duplicate them.
    task_ignore_result=True,
    task_default_queue=DEFAULT_QUEUE,
    task_serializer="json",
    accept_content=["json"],
    # A job may run for hours: take one message at a time so others go to idle workers.
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    include=["agents.jobs.tasks"],
)
