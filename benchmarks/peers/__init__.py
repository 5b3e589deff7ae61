"""Bench-only support for ``manage.py bench_e2e``: its peers (the same trivial task on other
task queues) and a fake streaming model.

Bench-only: nothing here is imported by the product, and it is no Django app of its own
(``make run`` and ``make test`` need none of these packages). Install the peers' packages
with ``pip install -r requirements-bench.txt``.

- `benchmarks.peers.recorder`: what every peer's task does — write ``time.time()`` (its start)
  into a Redis hash, the only thing a "trivial task" does here.
- `benchmarks.peers.celery_app`: a Celery 5 app over Redis (``delay``) and its task.
- `benchmarks.peers.procrastinate_app`: a procrastinate app on PostgreSQL (``defer``), in its own
  PostgreSQL schema named by ``BENCH_E2E_PROCRASTINATE_SCHEMA``.
- `benchmarks.peers.tasks`: a Django task (``enqueue``) for django-tasks-db's database backend.
- `benchmarks.peers.model_server`: an OpenAI-compatible streaming model whose tokens are their
  send times, for ``bench_e2e``'s ``token_to_sse`` path (standard library only).
- `benchmarks.peers.settings`: ``sageproject.settings`` plus ``django_tasks_db`` and ``TASKS``;
  ``bench_e2e`` runs each peer's driver (and django-tasks-db's ``db_worker``) in a
  subprocess with ``DJANGO_SETTINGS_MODULE=benchmarks.peers.settings``.

Configuration comes from the environment the benchmark sets for its subprocesses:
``BENCH_E2E_REDIS_URL``, ``BENCH_E2E_CELERY_QUEUE``, ``BENCH_E2E_PROCRASTINATE_DSN``,
``BENCH_E2E_PROCRASTINATE_SCHEMA``, ``BENCH_E2E_POOL_MAX``.
"""
