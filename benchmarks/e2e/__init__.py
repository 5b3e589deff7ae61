"""``manage.py bench_e2e``: this host end to end, side by side with other task queues.

One invocation measures, on the configured database, one JSON line per path (stdout; progress
on stderr only when it is a terminal):

- ``claim``: time of one ``DatabaseScheduler().claim_many(worker, lease_duration=30 s,
  limit=32)`` with ``--claim-queued`` queued runs (default 100 and 10,000; rows bulk
  inserted, one session each, over four users, tables vacuumed and analyzed, no worker
  running). Median and p90 of ``--claim-repeat`` claims per size after two warm-up claims;
  the claimed runs are requeued (``release(..., worker_shutdown)``, untimed) between claims,
  so the queue keeps its size. ``ratio``: median at the largest size over the smallest
  (target ≤ 1.5).
- ``throughput``: ``--n`` runs (default 5,000) submitted as fast as the benchmark process can
  with the ordinary in-process call (``agents.services.run_submit``, one session per run,
  spread over ``--users`` users; ``--submit-threads`` threads, default 1), while a
  ``manage.py runworker`` subprocess executes them on the keyless ``scripted`` model (the
  ``demo`` package). ``started_per_s`` = N / (first submit → ``Run.started_at`` of the last
  run to start) (target ≥ 450). Also the submit rate alone and how the runs ended.
- ``latency``: ``--latency-n`` submissions (default 500) at a steady ``--rate`` (default
  50/s); each is timestamped (``time.time()``) just before its submit call; latency =
  ``Run.started_at`` minus that time (p50 target ≤ 3 ms, p99 ≤ 5 ms). ``started_at`` is set by
  the claim from the database's clock; the database runs on this machine, so both are this
  machine's wall clock (on SQLite ``started_at`` has millisecond resolution).
- ``http_admission``: the web processes as production starts them (``manage.py runweb
  --workers 2`` on 127.0.0.1: uvicorn, a listening socket per process) and
  ``--http-clients`` (default 50) concurrent clients (one process; each a keep-alive
  connection of a minimal HTTP/1.1 client, `KeepAliveClient`) POSTing
  ``/api/v1/runs/`` with API tokens for ``--http-seconds`` (default 10): requests/s, p50/p99,
  the answers by status (202, 429, …) and how long the worker took to drain what was admitted
  (target ≥ 500 req/s, p99 ≤ 100 ms). Admission alone: the worker is paused (SIGSTOP, holding
  no run) for the window — on a 2-CPU machine, executing 500 runs/s takes both CPUs by
  itself (the throughput path) — and drains the runs after. ``http_admission_with_worker``
  is the same with the worker executing the runs as they are admitted. Both lines carry
  ``cpu_ms_per_request``: the CPU time (user + system) the web processes, the database's
  processes (not on SQLite, which runs in the web processes) and the clients' process
  spent during the window, per request — steadier from run to run than the tail on a
  shared machine, and where a change to the request's cost shows.
- ``token_to_sse``: model token to SSE client. The runs of this path use an
  OpenAI-compatible model served by ``benchmarks.peers.model_server`` (a subprocess started here;
  a model record ``bench-live`` of the benchmark's user points the worker's ``openai``
  adapter at it): each run streams ``--sse-tokens`` tokens (default 20), ``--sse-token-gap-ms``
  apart (default 10), and each token's text is the server's ``time.time()`` when it sent it.
  A client already connected to ``GET /api/v1/sessions/{id}/stream/`` receives them as live
  ``message.delta`` events; latency = arrival minus that time, over every token of
  ``--sse-n`` runs (default 100, 10 streams at a time, after an untimed warm-up round).
  ``tokens`` of ``tokens_expected`` arrived; ``dropped`` counts the deltas the stream itself
  reported dropped (``: dropped N``); deltas lost before the web process are only visible
  as ``tokens < tokens_expected``.
- ``event_to_sse``: the same runs' durable ``run.completed`` event, from its ``created_at``
  to its arrival at the client, and from just before the submit call to that arrival.

Every line also says what the machine was doing: ``cpus``, ``load_1m``, on Linux
``steal_pct`` — the share of the machine's CPU time since the line before that its
hypervisor gave to other machines — and ``cpu_speed`` (`cpu_speed`: millions of iterations
per second of a fixed Python loop on one CPU, just before the line is written). A shared
virtual machine can run at half its usual speed while its host is busy, with no steal: the
figures of runs made at different speeds are not comparable, those of one run are.

Before the latency path (this host's and each peer's) and the streaming paths, what the
benchmark process built so far is moved out of the garbage collector's sight
(`settle_collector`): a collection of the load generator's own heap is not the server's time.

Peers (``--peers``, default all; PostgreSQL only): the same trivial task — the task writes
``time.time()`` into a Redis hash as its first act — measured with the same throughput and
latency functions, the same N, rate and submit threads, started by the peer's ordinary
in-process call, each with a worker subprocess of comparable concurrency:

- ``procrastinate``: ``defer``; its schema in a PostgreSQL schema of its own
  (``bench_e2e_procrastinate_<tag>``) in the same database, created and dropped here; worker
  ``procrastinate worker --concurrency C`` (LISTEN/NOTIFY, async task).
- ``celery``: Celery 5 over Redis (``--redis-url``, default ``redis://127.0.0.1:6379/13``),
  ``delay``; worker ``celery worker --pool=threads --concurrency C``.
- ``django-tasks-db``: ``enqueue`` (Django 6's ``django.tasks``) on django-tasks-db's
  database backend, in a sibling database (``<name>_bench_dtdb_<tag>``, created, migrated
  and dropped here: its migrations cannot be reversed); ``--db-worker-processes``
  ``manage.py db_worker`` processes (it runs one task at a time per process; default
  ``min(C, 2 * CPUs)``), polling every ``--db-worker-interval`` s (default 0.05; it has no
  push).

Each peer runs in a driver subprocess (this command with ``--peer-driver NAME``) under
``DJANGO_SETTINGS_MODULE=benchmarks.peers.settings`` (``sageproject.settings`` plus
``django_tasks_db``); the peers' code is in ``benchmarks/peers/`` and their packages in
``requirements-bench.txt`` — neither is needed by ``make run`` or ``make test``. A peer that
cannot run prints ``{"path": "peer", "peer": NAME, "skipped": REASON}``. A peer's line has
``started_per_s``, ``submits_per_s``, ``latency_p50_ms``, ``latency_p99_ms``, …; ``start``
there is the task's own timestamp. The host's ``throughput`` line carries
``ratio_to_<peer>`` = ours / the peer's ``started_per_s`` (> 1: we start more runs per
second); its ``latency`` line ``ratio_to_<peer>`` = ``{"p50", "p99"}`` ours / the peer's
(< 1: we start sooner).

Each target (this host and each peer) first executes ``--history`` runs or tasks (default
2,000; untimed, also the warm-up), which stay in its tables while its paths run, as a
server that has been running keeps its finished work. Measured on tables created for the
benchmark, a path would time a database the planner believes empty: PostgreSQL plans an
index lookup on a table of a page or two as a sequential scan, and a connection keeps that
plan while the table grows under the path (measured: each foreign-key check of an event's
run, made as the transaction commits, read the whole run table, and throughput was 260
runs/s against 410 to 590 after a history of 2,000 runs).

Before each of this host's paths the tables runs write are vacuumed (PostgreSQL) and
analyzed, untimed, so that no path pays for the dead rows of the one before (the peers start
on fresh tables of their own; a server without autovacuum would keep them all). Before each
timed path, this host's and each peer's, PostgreSQL is asked for a ``CHECKPOINT``
(`write_back`): the pages the paths before it dirtied are written then, not by the
checkpointer while the path is measured.

Every worker runs at log level WARNING (no line per task anywhere). This host's worker gets
``SAGE_SERVER_MAX_CONCURRENT_RUNS`` = ``..._PER_USER`` = ``SAGE_MAX_CONCURRENT_MODEL_CALLS``
= ``--concurrency`` (default 32) and pending limits high enough for the benchmark
(``SAGE_SERVER_MAX_PENDING_RUNS`` and ``..._PER_USER``, also raised in this process and the
web process); nothing else is tuned.

Clean-up, on failure and on SIGTERM/Ctrl-C too: every subprocess started here is stopped;
the benchmark's users (``bench-<hex>-…``) with their packages, sessions, runs, events,
archives, tokens and ``bench-live`` model record, its worker's snapshot row, the
``scripted`` model record if it created it, the procrastinate schema, the django-tasks-db
database and the Redis keys it added are removed. Like the other database benchmarks it
refuses to start while the database holds queued or running runs: use a scratch database.
SQLite (the embedded default) runs every path but the peers.

Run it::

    .venv/bin/pip install -r requirements-bench.txt         # the peers (bench only)
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_e2e .venv/bin/python manage.py migrate
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_e2e .venv/bin/python manage.py bench_e2e
    .venv/bin/python manage.py bench_e2e --peers none       # SQLite, the embedded default
"""
