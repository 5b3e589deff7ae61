"""Celery 5 over Redis: the broker is ``BENCH_E2E_REDIS_URL``, the queue
``BENCH_E2E_CELERY_QUEUE``. The benchmark starts its worker as::

    celery -A benchmarks.peers.celery_app worker --pool=threads --concurrency=N -Q QUEUE \\
        --without-heartbeat --without-gossip --without-mingle
"""

from __future__ import annotations

import os

from celery import Celery

from benchmarks.peers import recorder

QUEUE = os.environ.get("BENCH_E2E_CELERY_QUEUE") or "bench-e2e"

app = Celery("bench_e2e")
app.conf.update(
    broker_url=recorder.redis_url(),
    task_default_queue=QUEUE,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # No pidbox/event keys in the benchmark's Redis database: only the queue and its binding.
    worker_enable_remote_control=False,
    worker_send_task_events=False,
)


@app.task(name="benchmarks.peers.record_start")
def record_start(key: str, i: int) -> None:
    recorder.record(key, i)
