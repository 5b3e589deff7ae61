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
  OpenAI-compatible model served by ``benchpeers.model_server`` (a subprocess started here;
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
``DJANGO_SETTINGS_MODULE=benchpeers.settings`` (``sageproject.settings`` plus
``django_tasks_db``); the peers' code is in ``benchpeers/`` and their packages in
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

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.metadata
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import orjson
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connections
from django.test.utils import override_settings

from sageproject.db import database_url as _database_url
from sageproject.progress import note
from scheduling.subprocesses import Subprocess

ROOT = Path(settings.BASE_DIR)
PEERS = ("procrastinate", "celery", "django-tasks-db")
INSTALL_HINT = "pip install -r requirements-bench.txt"
BIG_LIMIT = 1_000_000
LEASE = timedelta(seconds=30)
CLAIM_LIMIT = 32
CLAIM_USERS = 4
CLAIM_WARMUP = 2
POLL_SECONDS = 0.25
SSE_CONCURRENCY = 10
# The targets each line carries, by database: PostgreSQL's for every path; the embedded
# SQLite default's for the start of a run only; none elsewhere.
TARGETS = {
    "postgresql": {
        "throughput": {"target_started_per_s": 450},
        "latency": {"target_p50_ms": 3, "target_p99_ms": 5},
        "http_admission": {"target_req_per_s": 500, "target_p99_ms": 100},
        "claim": {"target_ratio_max": 1.5},
    },
    "sqlite": {"latency": {"target_p50_ms": 20}},
}


def targets(path: str) -> dict[str, Any]:
    """The targets of ``path`` on the configured database (see `TARGETS`)."""
    return TARGETS.get(connections["default"].vendor, {}).get(path, {})


# Inherited variables that must not reach a subprocess (the test runner's, fault injection).
_CLEARED_ENV = ("SAGE_TEST_DB_NAME", "SAGE_CRASH_AT", "SAGE_STOP_AT", "DJANGO_SETTINGS_MODULE")


def progress(message: str) -> None:
    note(message, prefix="bench_e2e")  # a terminal only (sageproject.progress)


def pct_ms(ordered: list[float], q: float) -> float:
    """sorted[min(n-1, int(q n))] in ms, of an already sorted list of seconds."""
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)


def distribution(seconds: list[float], prefix: str = "") -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        f"{prefix}p50_ms": pct_ms(ordered, 0.50),
        f"{prefix}p99_ms": pct_ms(ordered, 0.99),
        f"{prefix}mean_ms": round(statistics.fmean(ordered) * 1000, 3),
        f"{prefix}max_ms": round(ordered[-1] * 1000, 3),
    }


def ratio_key(peer: str) -> str:
    return "ratio_to_" + peer.replace("-", "_")


def peer_line(peer: str, **outcome: Any) -> dict[str, Any]:
    """A peer's line: ``path: peer``, its name, then ``outcome`` (``skipped`` or ``error``
    and why, when it could not be measured)."""
    return {"path": "peer", "peer": peer, **outcome}


def host_line(path: str, context: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """The host's line of a run-start path (``throughput``, ``latency``): its figures,
    timed from ``Run.started_at``, and the path's targets."""
    return {
        "path": path,
        **context,
        **measured,
        "start": "Run.started_at (the claim, database clock)",
        **targets(path),
    }


# ----------------------------------------------------------------------------- database


def database_url(alias: str = "default", name: str | None = None) -> str:
    """`sageproject.db.database_url`, failing as a command error."""
    try:
        return _database_url(alias, name)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def libpq_conninfo(alias: str = "default") -> str:
    """A libpq connection string for this process's PostgreSQL database."""
    from psycopg.conninfo import make_conninfo

    s = connections[alias].settings_dict
    params = {
        "host": s["HOST"] or "127.0.0.1",
        "port": s["PORT"] or None,
        "user": s["USER"] or None,
        "password": s["PASSWORD"] or None,
        "dbname": s["NAME"],
    }
    return make_conninfo(**{k: v for k, v in params.items() if v})


def tidy_tables() -> None:
    """Vacuum (PostgreSQL) and analyze the tables runs write, not timed: a path is measured
    without the dead rows of the paths before it, as each peer starts on tables of its
    own (a server running without autovacuum would otherwise keep them all)."""
    from django.apps import apps

    connection = connections["default"]
    tables = [
        model._meta.db_table
        for label in ("scheduling", "agents")
        for model in apps.get_app_config(label).get_models()
        if model._meta.managed
    ]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"VACUUM (ANALYZE) {', '.join(f'"{t}"' for t in tables)}")
        elif connection.vendor == "mysql":
            for table in tables:
                cursor.execute(f"ANALYZE TABLE `{table}`")
                cursor.fetchall()
        else:
            cursor.execute("ANALYZE")
    write_back()


def cpu_jiffies() -> tuple[int, int] | None:
    """The machine's stolen and total CPU time so far (Linux ``/proc/stat``, in clock
    ticks): steal is the time a virtual machine's CPUs waited for the hypervisor, which
    gave it to other machines. None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal (guest time is counted in user).
    ticks = [int(value) for value in fields[1:9]]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def cpu_speed(seconds: float = 0.2) -> float:
    """How fast one CPU runs Python now: millions of iterations per second of a fixed loop,
    for ``seconds``. The same machine gives about the same figure from run to run; a shared
    virtual machine whose host is busy can run at half of it without any steal."""
    count = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(10_000):
            count += 1
    return round(count / seconds / 1e6, 1)


def write_back() -> None:
    """Before a timed path, untimed (this host's, after its vacuum, and each peer's): on
    PostgreSQL a ``CHECKPOINT``, so the pages the paths before it dirtied — and the vacuum —
    are written now rather than by the checkpointer while this path is measured. A user
    without the privilege (``pg_checkpoint``, or a superuser) skips it."""
    connection = connections["default"]
    if connection.vendor != "postgresql":
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute("CHECKPOINT")
    except DatabaseError as exc:
        progress(f"no checkpoint before the path ({exc})")


# ----------------------------------------------------------------------------- processes


def start_child(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Subprocess:
    """Start ``argv`` as `Subprocess` ``name``, its output in ``<log_dir>/<name>.log``."""
    return Subprocess(name, argv, env, log_dir / f"{name}.log")


def cpu_by_process(processes: list[Any]) -> dict[int, float]:
    """CPU time (user + system) used so far by each of ``processes`` (psutil), by process
    id; processes that are gone or not ours are left out."""
    import psutil

    used = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            used[process.pid] = times.user + times.system
    return used


def process_tree(pid: int) -> list[Any]:
    """The process ``pid`` and its descendants (psutil), or none once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def database_processes() -> list[Any]:
    """The database server's processes on this machine (psutil: PostgreSQL's postmaster
    and backends, MariaDB's server); none for SQLite (the database runs in its callers)
    or a server elsewhere."""
    import psutil

    names = {"postgresql": ("postgres",), "mysql": ("mariadbd", "mysqld")}.get(
        connections["default"].vendor, ()
    )
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] in names]


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two `cpu_by_process` readings (a process that began
    between them counts whole)."""
    return sum(used - before.get(pid, 0.0) for pid, used in after.items())


def check_running(child: Subprocess) -> None:
    """Raise `CommandError`, with the end of its log, once ``child`` has exited."""
    if not child.alive:
        raise CommandError(
            f"{child.name} exited with status {child.returncode}; its log ends:\n{child.tail()}"
        )


def child_env(db_url: str, concurrency: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED_ENV}
    env.update(
        {
            "DATABASE_URL": db_url,
            "SECRET_KEY": settings.SECRET_KEY,
            "PYTHONUNBUFFERED": "1",
            "LOG_LEVEL": "WARNING",
            "SAGE_SERVER_MAX_CONCURRENT_RUNS": str(concurrency),
            "SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER": str(concurrency),
            "SAGE_MAX_CONCURRENT_MODEL_CALLS": str(concurrency),
            "SAGE_SERVER_MAX_PENDING_RUNS": str(BIG_LIMIT),
            "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": str(BIG_LIMIT),
        }
    )
    env.update(extra)
    return env


def wait_until(
    what: str, ready: Callable[[], bool], timeout: float, children: list[Subprocess] = ()
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for child in children:
            check_running(child)
        if time.monotonic() > deadline:
            tails = "".join(f"\n--- {c.name} ---\n{c.tail()}" for c in children)
            raise CommandError(f"timed out after {timeout:.0f} s waiting for {what}{tails}")
        time.sleep(POLL_SECONDS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread, so clean-up runs as for Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- the method


@dataclass
class Batch:
    """One path's submissions: per index, what to submit and (afterwards) what it made."""

    label: str
    key: str
    handles: list[Any]
    results: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.handles)


class Target:
    """What the throughput and latency functions drive: this host or a peer."""

    name = ""

    def prepare(self, count: int, label: str) -> Batch:  # untimed
        raise NotImplementedError

    def submit(self, batch: Batch, index: int) -> None:  # the ordinary in-process call
        raise NotImplementedError

    def starts(self, batch: Batch, timeout: float) -> list[float]:
        """Wait until every submission started; each one's start (epoch seconds)."""
        raise NotImplementedError

    def settle(self, batch: Batch, timeout: float) -> dict[str, Any]:
        """Wait until the batch is finished; figures about how it ended."""
        return {}

    def end_thread(self) -> None:
        """Called at the end of each submitting thread."""


def submit_all(target: Target, batch: Batch, threads: int) -> None:
    count = len(batch.handles)
    if threads <= 1:
        for index in range(count):
            target.submit(batch, index)
        return
    errors: list[BaseException] = []

    def share(first: int) -> None:
        try:
            for index in range(first, count, threads):
                target.submit(batch, index)
        except BaseException as exc:
            errors.append(exc)
        finally:
            target.end_thread()

    pool = [threading.Thread(target=share, args=(t,), daemon=True) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]


def warm_up(target: Target, count: int, timeout: float) -> None:
    batch = target.prepare(count, "warmup")
    submit_all(target, batch, 1)
    target.starts(batch, timeout)
    target.settle(batch, timeout)


def measure_throughput(target: Target, n: int, threads: int, timeout: float) -> dict[str, Any]:
    """N submissions as fast as possible; N / (first submit → start of the last one)."""
    batch = target.prepare(n, "throughput")
    first = time.time()
    submit_all(target, batch, threads)
    submitted = time.time()
    starts = target.starts(batch, timeout)
    last = max(starts)
    ended = target.settle(batch, timeout)
    return {
        "n": n,
        "submit_threads": threads,
        "submit_s": round(submitted - first, 3),
        "submits_per_s": round(n / (submitted - first), 1),
        "first_submit_to_last_start_s": round(last - first, 3),
        "started_per_s": round(n / (last - first), 1),
        **ended,
    }


def settle_collector() -> None:
    """Before a timed path: what this process built so far (sessions, handles, the earlier
    paths' samples) out of the garbage collector's sight. A full collection of the load
    generator's heap is a pause of the client, not of what is measured — it showed as
    20 to 30 ms stalls between the web process and the stream client."""
    gc.collect()
    gc.freeze()


def measure_latency(target: Target, n: int, rate: float, timeout: float) -> dict[str, Any]:
    """N submissions at a steady ``rate``; start minus the time just before each submit call."""
    batch = target.prepare(n, "latency")
    settle_collector()
    stamps = [0.0] * n
    returned = [0.0] * n
    interval = 1.0 / rate
    late = 0
    began = time.perf_counter()
    for index in range(n):
        delay = began + index * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        elif delay < -interval:
            late += 1
        stamps[index] = time.time()
        target.submit(batch, index)
        returned[index] = time.time()
    elapsed = time.perf_counter() - began
    starts = target.starts(batch, timeout)
    ended = target.settle(batch, timeout)
    latencies = [start - stamp for start, stamp in zip(starts, stamps, strict=True)]
    # The submit call alone (its commit included): the rest of the latency is the wake-up
    # and the claim.
    calls = [back - stamp for back, stamp in zip(returned, stamps, strict=True)]
    return {
        "n": n,
        "rate_per_s": rate,
        "achieved_rate_per_s": round(n / elapsed, 1) if elapsed > 0 else None,
        "late_submits": late,
        **distribution(latencies),
        "min_ms": round(min(latencies) * 1000, 3),
        **distribution(calls, "submit_call_"),
        **ended,
    }


# ----------------------------------------------------------------------------- this host


class HostTarget(Target):
    """Runs of the ``demo`` package on the ``scripted`` model, one session per run,
    submitted with ``agents.services.run_submit``; start = ``Run.started_at``."""

    name = "sage"

    def __init__(self, owners: list[tuple[Any, Any]], children: list[Subprocess]) -> None:
        self.owners = owners  # (user, package)
        self.user_ids = [user.pk for user, _ in owners]
        self.children = children  # checked while waiting: a dead worker fails the wait
        self.tag = uuid.uuid4().hex[:8]

    def prepare(self, count: int, label: str, owners: list[int] | None = None) -> Batch:
        """``count`` fresh sessions dealt round-robin over the owners (or those at the
        indexes ``owners``); their title tags the batch."""
        from scheduling.models import Session

        title = f"bench-e2e-{self.tag}-{label}-{uuid.uuid4().hex[:6]}"
        dealt = [self.owners[i] for i in owners] if owners is not None else self.owners
        rows = []
        for index in range(count):
            user, package = dealt[index % len(dealt)]
            rows.append(
                Session(
                    owner=user,
                    package_ref=package.ref,
                    package_name=package.name,
                    agent_id="assistant",
                    title=title,
                )
            )
        created = Session.objects.bulk_create(rows, batch_size=2000)
        return Batch(label, title, [(s.owner, s.pk) for s in created])

    def submit(self, batch: Batch, index: int) -> None:
        from agents.services import run_submit

        owner, session_id = batch.handles[index]
        run, _ = run_submit(owner=owner, session_id=session_id, input="ping")
        batch.results[index] = run.pk

    def end_thread(self) -> None:
        connections.close_all()

    def _runs(self, batch: Batch) -> Any:
        from scheduling.models import Run

        return Run.objects.filter(session__title=batch.key)

    def _mine(self, statuses: Any) -> Any:
        """Runs of the benchmark's users in ``statuses`` (the ``(owner, status)`` index: a
        cheap poll; the paths run one after another, so these are the batch's)."""
        from scheduling.models import Run

        return Run.objects.filter(owner_id__in=self.user_ids, status__in=statuses)

    def starts(self, batch: Batch, timeout: float) -> list[float]:
        from scheduling.models import RunStatus

        queued = self._mine([RunStatus.QUEUED])
        wait_until(
            f"the runs of {batch.label} to start",
            lambda: not queued.exists(),
            timeout,
            self.children,
        )
        started = dict(self._runs(batch).values_list("pk", "started_at"))
        missing = [pk for pk in batch.results if started.get(pk) is None]
        if missing:
            raise CommandError(f"{len(missing)} run(s) of {batch.label} never started")
        return [started[pk].timestamp() for pk in batch.results]

    def settle(self, batch: Batch, timeout: float) -> dict[str, Any]:
        from scheduling.models import UNFINISHED_STATUSES

        unfinished = self._mine(UNFINISHED_STATUSES)
        wait_until(
            f"the runs of {batch.label} to finish",
            lambda: not unfinished.exists(),
            timeout,
            self.children,
        )
        ended = Counter(self._runs(batch).values_list("status", flat=True))
        return {"runs_ended": dict(sorted(ended.items()))}


def bench_owners(count: int, prefix: str) -> list[tuple[Any, Any]]:
    """Throwaway users ``bench-<hex>-<prefix><i>``, each with the ``demo`` package."""
    from agents.management.commands.seed_demo import DEMO_MANIFEST
    from agents.services import packages
    from scheduling.management.commands.bench_persist import bench_users

    users = bench_users(f"{prefix}{i}" for i in range(count))
    return [
        (user, packages.package_create(owner=user, manifest=DEMO_MANIFEST)[0])
        for user in users.values()
    ]


def ensure_scripted_record() -> Any:
    """The shared ``scripted`` model record; returns it if created here (to delete), else None."""
    from pooling.models import ModelRecord, Protocol

    record, created = ModelRecord.objects.get_or_create(
        owner=None,
        name="scripted",
        defaults={"protocol": Protocol.SCRIPTED, "model": "scripted-echo", "options": {}},
    )
    return record if created else None


async def claim_path(owners: list[Any], sizes: list[int], repeat: int) -> dict[str, Any]:
    from sageproject.db import db_call
    from scheduling.management.commands.bench_persist import queue_runs
    from scheduling.models import Session
    from scheduling.protocol import LeaseReleaseReason
    from scheduling.worker import DatabaseScheduler

    def seed(size: int) -> None:
        for index, owner in enumerate(owners):
            count = size // len(owners) + (1 if index < size % len(owners) else 0)
            if count:
                queue_runs(owner, count)
        tidy_tables()

    def clear() -> None:
        Session.objects.filter(owner__in=owners).delete()

    by_size: dict[str, Any] = {}
    for size in sizes:
        progress(f"claim: {size} queued runs")
        await db_call(seed, size)
        scheduler = DatabaseScheduler(max_pending_items=max(1024, size))
        worker_id = f"bench-e2e-claim-{uuid.uuid4().hex[:6]}"
        timings: list[float] = []
        try:
            for rep in range(CLAIM_WARMUP + repeat):
                started = time.perf_counter()
                leases = await scheduler.claim_many(
                    worker_id, lease_duration=LEASE, limit=CLAIM_LIMIT
                )
                elapsed = time.perf_counter() - started
                if len(leases) != min(CLAIM_LIMIT, size):
                    raise CommandError(
                        f"claimed {len(leases)} runs of {size} queued, expected "
                        f"{min(CLAIM_LIMIT, size)}"
                    )
                for lease in leases:
                    await scheduler.release(lease, LeaseReleaseReason.WORKER_SHUTDOWN)
                if rep >= CLAIM_WARMUP:
                    timings.append(elapsed)
        finally:
            await scheduler.close()
            await db_call(clear)
        ordered = sorted(timings)
        by_size[str(size)] = {
            "median_ms": round(statistics.median(ordered) * 1000, 3),
            "p90_ms": pct_ms(ordered, 0.90),
            "min_ms": round(ordered[0] * 1000, 3),
            "claimed_per_call": min(CLAIM_LIMIT, size),
        }
    small, large = by_size[str(min(sizes))], by_size[str(max(sizes))]
    return {
        "path": "claim",
        "limit": CLAIM_LIMIT,
        "users": len(owners),
        "repeat": repeat,
        "by_queued": by_size,
        "ratio": round(large["median_ms"] / small["median_ms"], 3),
        **targets("claim"),
    }


class KeepAliveClient:
    """A minimal HTTP/1.1 client on one keep-alive connection (asyncio streams): the
    load generator of ``http_admission``. It costs a small part of what a full client
    (httpx) costs per request, so on a machine shared with the server the figure is the
    server's. Understands what this API answers: ``Content-Length`` bodies."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + "\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        length = None
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            # Anything else (a chunked body) would leave the next answer misread.
            raise CommandError(f"{status_line.decode().strip()} came without Content-Length")
        await self.reader.readexactly(length)
        return int(status_line.split()[1])

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


async def http_admission(
    base: str, clients: list[tuple[str, list[str]]], seconds: float
) -> dict[str, Any]:
    from urllib.parse import urlsplit

    address = urlsplit(base)
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    reused = 0
    connections_ = [KeepAliveClient(address.hostname, address.port) for _ in clients]

    async def post(client: KeepAliveClient, token: str, session: str) -> int:
        body = orjson.dumps({"session": session, "input": "ping"})
        return await client.post_json("/api/v1/runs/", body, {"Authorization": f"Token {token}"})

    try:
        # Warm-up (untimed): one request per client opens its connection.
        await asyncio.gather(
            *(
                post(client, token, sessions[0])
                for client, (token, sessions) in zip(connections_, clients, strict=True)
            )
        )
        deadline = time.perf_counter() + seconds

        async def one(client: KeepAliveClient, token: str, sessions: list[str]) -> None:
            nonlocal reused
            index = 1
            while time.perf_counter() < deadline:
                if index >= len(sessions):
                    reused += 1  # queued behind its session's earlier run
                started = time.perf_counter()
                code = await post(client, token, sessions[index % len(sessions)])
                latencies.append(time.perf_counter() - started)
                statuses[code] += 1
                index += 1

        began = time.perf_counter()
        await asyncio.gather(
            *(
                one(client, token, sessions)
                for client, (token, sessions) in zip(connections_, clients, strict=True)
            )
        )
        elapsed = time.perf_counter() - began
    finally:
        for client in connections_:
            await client.close()
    return {
        "path": "http_admission",
        "clients": len(clients),
        "seconds": round(elapsed, 3),
        "requests": len(latencies),
        "req_per_s": round(len(latencies) / elapsed, 1),
        **distribution(latencies),
        "status": {str(code): n for code, n in sorted(statuses.items())},
        "sessions_reused": reused,
    }


@dataclass
class SseSample:
    tokens: list[float]  # arrival minus the token's send time, per token (s)
    event: float  # run.completed: arrival minus its created_at (s)
    total: float  # run.completed: arrival minus the time just before the submit call (s)
    dropped: int


async def sse_samples(
    base: str, token: str, owner: Any, sessions: list[Any], wait_s: float
) -> list[SseSample]:
    """One run per session, each submitted once its SSE stream is open; what the client saw."""
    import httpx

    from agents.services import run_submit
    from sageproject.db import db_call

    def submit(session_id: Any) -> str:
        run, _ = run_submit(owner=owner, session_id=session_id, input="ping")
        return str(run.pk)

    headers = {"Authorization": f"Token {token}"}
    gate = asyncio.Semaphore(SSE_CONCURRENCY)
    limits = httpx.Limits(max_connections=SSE_CONCURRENCY + 2)

    async def one(client: httpx.AsyncClient, session_id: Any) -> SseSample:
        async with gate:
            url = f"/api/v1/sessions/{session_id}/stream/?after=0&timeout=120"
            async with client.stream("GET", url, headers=headers) as response:
                if response.status_code != 200:
                    raise CommandError(f"GET {url} answered {response.status_code}")
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("retry:"):
                        break  # subscribed (live) and reading the durable events
                submitted = time.time()
                run_id = await db_call(submit, session_id)
                event, tokens, dropped = "", [], 0
                async for line in lines:
                    if line.startswith(": dropped"):
                        dropped = int(line.split()[2])
                    elif line.startswith("event: "):
                        event = line[len("event: ") :]
                    elif line.startswith("data: ") and event in ("message.delta", "run.completed"):
                        received = time.time()
                        data = orjson.loads(line[len("data: ") :])
                        if data.get("run") != run_id:
                            continue
                        if event == "run.completed":
                            created = datetime.fromisoformat(data["created_at"]).timestamp()
                            return SseSample(
                                tokens, received - created, received - submitted, dropped
                            )
                        for word in str((data.get("payload") or {}).get("text", "")).split():
                            with contextlib.suppress(ValueError):
                                tokens.append(received - float(word))
                    elif not line:
                        event = ""
        raise CommandError(f"the stream of session {session_id} ended before run.completed")

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=wait_s) as client:
        return list(await asyncio.gather(*(one(client, s) for s in sessions)))


def sse_lines(samples: list[SseSample], tokens_per_run: int, gap_ms: float) -> list[dict]:
    tokens = [t for sample in samples for t in sample.tokens]
    token_line: dict[str, Any] = {
        "path": "token_to_sse",
        "runs": len(samples),
        "tokens_per_run": tokens_per_run,
        "token_gap_ms": gap_ms,
        "tokens": len(tokens),
        "tokens_expected": len(samples) * tokens_per_run,
        "dropped": sum(sample.dropped for sample in samples),
        "concurrent_streams": min(SSE_CONCURRENCY, len(samples)),
        "model": "benchpeers.model_server (OpenAI-compatible; each token is its send time)",
    }
    if tokens:
        token_line.update(distribution(tokens))
    else:
        token_line["note"] = "no message.delta event reached the client"
    event_line = {
        "path": "event_to_sse",
        "event": "run.completed",
        "n": len(samples),
        "concurrent_streams": min(SSE_CONCURRENCY, len(samples)),
        **distribution([sample.event for sample in samples]),
        **distribution([sample.total for sample in samples], prefix="submit_to_client_"),
        "note": "durable event: its created_at to its arrival at a connected SSE client",
    }
    return [token_line, event_line]


# ----------------------------------------------------------------------------- peers


class RedisStartsTarget(Target):
    """A peer whose task records its start in a Redis hash (``benchpeers.recorder``), run
    by the worker processes its ``setup`` starts (``children``, logging to ``log_dir``)."""

    children: list[Subprocess]

    def __init__(self, options: dict[str, Any], log_dir: Path) -> None:
        import redis

        self.options = options
        self.log_dir = log_dir
        self.redis = redis.Redis.from_url(options["redis_url"])
        self.tag = uuid.uuid4().hex[:8]
        self.keys: list[str] = []
        self.children = []

    def prepare(self, count: int, label: str) -> Batch:
        key = f"bench-e2e:{self.tag}:{label}:{uuid.uuid4().hex[:6]}"
        self.keys.append(key)
        return Batch(label, key, list(range(count)))

    def starts(self, batch: Batch, timeout: float) -> list[float]:
        count = len(batch.handles)
        wait_until(
            f"{count} tasks of {batch.label} to start",
            lambda: self.redis.hlen(batch.key) >= count,
            timeout,
            self.children,
        )
        values = self.redis.hgetall(batch.key)
        return [float(values[str(i).encode()]) for i in range(count)]

    def close(self) -> None:
        """Stop the workers, then remove what the peer left behind."""
        for child in self.children:
            child.stop()
        self.clean_up()
        if self.keys:
            self.redis.delete(*self.keys)
        self.redis.close()

    def clean_up(self) -> None:
        """Remove the peer's own leftovers besides the start hashes (its workers are stopped)."""


class CeleryPeer(RedisStartsTarget):
    name = "celery"

    def __init__(self, options: dict[str, Any], log_dir: Path) -> None:
        super().__init__(options, log_dir)
        self.queue = f"bench-e2e-{self.tag}"
        self.keys_before: set[bytes] = set()

    def setup(self) -> dict[str, Any]:
        self.redis.ping()
        self.keys_before = set(self.redis.scan_iter(count=1000))
        os.environ["BENCH_E2E_REDIS_URL"] = self.options["redis_url"]
        os.environ["BENCH_E2E_CELERY_QUEUE"] = self.queue
        from benchpeers.celery_app import record_start

        self.task = record_start
        concurrency = self.options["concurrency"]
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "benchpeers.celery_app",
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency}",
            "-Q",
            self.queue,
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "--loglevel=WARNING",
        ]
        self.children.append(start_child("celery-worker", argv, dict(os.environ), self.log_dir))
        return {
            "version": importlib.metadata.version("celery"),
            "broker": self.options["redis_url"],
            "worker": f"celery worker --pool=threads --concurrency={concurrency}",
            "concurrency": concurrency,
            "submit": "delay",
        }

    def submit(self, batch: Batch, index: int) -> None:
        self.task.delay(batch.key, index)

    def clean_up(self) -> None:
        # Only what appeared since setup: the queue, its binding, the start hashes.
        added = set(self.redis.scan_iter(count=1000)) - self.keys_before
        if added:
            self.redis.delete(*added)


class ProcrastinatePeer(RedisStartsTarget):
    name = "procrastinate"

    def __init__(self, options: dict[str, Any], log_dir: Path) -> None:
        super().__init__(options, log_dir)
        self.schema = f"bench_e2e_procrastinate_{self.tag}"
        self.app: Any = None
        self.created = False

    def _execute(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(libpq_conninfo(), autocommit=True) as conn:
            conn.execute(sql)

    def setup(self) -> dict[str, Any]:
        self.redis.ping()
        os.environ["BENCH_E2E_REDIS_URL"] = self.options["redis_url"]
        os.environ["BENCH_E2E_PROCRASTINATE_DSN"] = libpq_conninfo()
        os.environ["BENCH_E2E_PROCRASTINATE_SCHEMA"] = self.schema
        from benchpeers.procrastinate_app import app, record_start

        self._execute(f'CREATE SCHEMA "{self.schema}"')
        self.created = True
        self.app = app.open()
        app.schema_manager.apply_schema()
        self.task = record_start
        concurrency = self.options["concurrency"]
        argv = [
            sys.executable,
            "-m",
            "procrastinate",
            "--app=benchpeers.procrastinate_app.app",
            "worker",
            "--queues=bench-e2e",
            f"--concurrency={concurrency}",
        ]
        self.children.append(
            start_child("procrastinate-worker", argv, dict(os.environ), self.log_dir)
        )
        return {
            "version": importlib.metadata.version("procrastinate"),
            "schema": self.schema,
            "worker": f"procrastinate worker --concurrency={concurrency} (LISTEN/NOTIFY)",
            "concurrency": concurrency,
            "submit": "defer",
        }

    def submit(self, batch: Batch, index: int) -> None:
        self.task.defer(key=batch.key, i=index)

    def clean_up(self) -> None:
        if self.app is not None:
            self.app.close()
        if self.created:
            self._execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


class DjangoTasksDbPeer(RedisStartsTarget):
    """Runs in a driver whose database is the sibling database the parent created."""

    name = "django-tasks-db"

    def setup(self) -> dict[str, Any]:
        self.redis.ping()
        os.environ["BENCH_E2E_REDIS_URL"] = self.options["redis_url"]
        from benchpeers.tasks import record_start

        self.task = record_start
        processes = self.options["db_worker_processes"]
        interval = self.options["db_worker_interval"]
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "benchpeers.settings"}
        for index in range(processes):
            argv = [
                sys.executable,
                str(ROOT / "manage.py"),
                "db_worker",
                "--interval",
                str(interval),
                "--no-startup-delay",
                "--no-reload",
                "--queue-name",
                "default",
                "--verbosity",
                "0",
                "--worker-id",
                f"bench-e2e-{self.tag}-{index}",
            ]
            self.children.append(start_child(f"db-worker-{index}", argv, env, self.log_dir))
        return {
            "version": importlib.metadata.version("django-tasks-db"),
            "database": connections["default"].settings_dict["NAME"],
            "worker": f"{processes} x manage.py db_worker --interval {interval}",
            "concurrency": processes,
            "submit": "enqueue",
        }

    def submit(self, batch: Batch, index: int) -> None:
        self.task.enqueue(batch.key, index)

    def end_thread(self) -> None:
        connections.close_all()


PEER_CLASSES = {
    "celery": CeleryPeer,
    "procrastinate": ProcrastinatePeer,
    "django-tasks-db": DjangoTasksDbPeer,
}
PEER_MODULES = {
    "celery": "celery",
    "procrastinate": "procrastinate",
    "django-tasks-db": "django_tasks_db",
}
# What each peer's driver subprocess is given of this command's options: everything its
# measurement reads, so that the peers and this host run the same method.
DRIVER_OPTIONS = (
    "history",
    "n",
    "latency_n",
    "rate",
    "submit_threads",
    "concurrency",
    "redis_url",
    "db_worker_processes",
    "db_worker_interval",
    "timeout",
)


def peer_driver(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Measure one peer in this (driver) process: its line (``skipped`` or ``error`` when
    it could not be measured)."""
    if find_spec(PEER_MODULES[name]) is None:
        return peer_line(name, skipped=f"{PEER_MODULES[name]} is not installed ({INSTALL_HINT})")
    try:
        import redis

        redis.Redis.from_url(options["redis_url"], socket_timeout=2).ping()
    except Exception as exc:
        return peer_line(name, skipped=f"Redis at {options['redis_url']} unreachable: {exc}")
    timeout = options["timeout"]
    line = peer_line(name, history=options["history"])
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as logs:
        peer = PEER_CLASSES[name](options, Path(logs))
        try:
            line.update(peer.setup())
            progress(f"{name}: history, {options['history']} tasks")
            warm_up(peer, options["history"], timeout)
            write_back()
            progress(f"{name}: throughput, {options['n']} tasks")
            throughput = measure_throughput(peer, options["n"], options["submit_threads"], timeout)
            write_back()
            progress(f"{name}: latency, {options['latency_n']} at {options['rate']}/s")
            latency = measure_latency(peer, options["latency_n"], options["rate"], timeout)
        except Exception as exc:
            traceback.print_exc()
            return {**line, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        finally:
            peer.close()
    line.update(throughput)
    line["start"] = "the task's time.time(), its first act"
    line.update({f"latency_{k}": v for k, v in latency.items()})
    return line


# ----------------------------------------------------------------------------- command


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CommandError("--claim-queued takes comma-separated integers") from None
    if len(sizes) < 1 or sizes[0] < 1:
        raise CommandError("--claim-queued sizes must be positive")
    return sizes


def parse_peers(text: str) -> list[str]:
    text = text.strip().lower()
    if text in ("", "none"):
        return []
    if text == "all":
        return list(PEERS)
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise CommandError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
    return names


class Command(BaseCommand):
    help = (
        "End-to-end figures of this host (claim time, runs started/s, submit→start latency, "
        "HTTP admission, model token→SSE client, durable event→SSE client) side by side "
        "with procrastinate, Celery + Redis and django-tasks-db doing trivial tasks "
        "(bench-only packages: requirements-bench.txt; "
        "each peer measured in a subprocess with DJANGO_SETTINGS_MODULE=benchpeers.settings). "
        "One JSON line per path. Use a scratch database; SQLite runs without peers."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--n", type=int, default=5000, help="throughput submissions")
        parser.add_argument("--latency-n", type=int, default=500, help="latency submissions")
        parser.add_argument("--rate", type=float, default=50.0, help="latency submits per s")
        parser.add_argument(
            "--submit-threads",
            type=int,
            default=1,
            help="threads sharing the throughput submissions (peers get the same)",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=32,
            help="runs executing at once in our worker; Celery/procrastinate worker concurrency",
        )
        parser.add_argument("--users", type=int, default=8, help="owners of the runs")
        parser.add_argument(
            "--history",
            type=int,
            default=2000,
            help="runs (tasks) each target executes before its paths, kept as its history",
        )
        parser.add_argument(
            "--claim-queued", default="100,10000", help="queue sizes of the claim path"
        )
        parser.add_argument("--claim-repeat", type=int, default=15)
        parser.add_argument("--skip-claim", action="store_true")
        parser.add_argument("--http-clients", type=int, default=50)
        parser.add_argument("--http-seconds", type=float, default=10.0)
        parser.add_argument("--web-workers", type=int, default=2, help="uvicorn --workers")
        parser.add_argument(
            "--skip-http",
            action="store_true",
            help="skip http_admission, token_to_sse and event_to_sse",
        )
        parser.add_argument(
            "--sse-n", type=int, default=100, help="runs of token_to_sse and event_to_sse"
        )
        parser.add_argument("--sse-tokens", type=int, default=20, help="tokens per run")
        parser.add_argument(
            "--sse-token-gap-ms", type=float, default=10.0, help="between a run's tokens"
        )
        parser.add_argument(
            "--peers",
            default="all",
            help="none, all, or a comma-separated subset of " + ", ".join(PEERS),
        )
        parser.add_argument(
            "--redis-url",
            default="redis://127.0.0.1:6379/13",
            help="Redis for Celery's broker and the peers' start times",
        )
        parser.add_argument(
            "--db-worker-processes",
            type=int,
            default=None,
            help="django-tasks-db db_worker processes (default min(concurrency, 2 x CPUs))",
        )
        parser.add_argument("--db-worker-interval", type=float, default=0.05)
        parser.add_argument(
            "--timeout", type=float, default=600.0, help="longest wait of any one step (s)"
        )
        parser.add_argument("--peer-driver", default=None, help=argparse.SUPPRESS)

    def _write(self, line: dict[str, Any]) -> None:
        self.stdout.write(orjson.dumps(line).decode())
        self.stdout.flush()

    def _emit(self, line: dict[str, Any]) -> None:
        """Write a result line with what the machine was doing: its size and load while the
        path ran (a shared machine skews figures), the share of its CPU time the hypervisor
        gave to others since the line before, and its speed now."""
        line = {**line, "cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)}
        now, mark = cpu_jiffies(), self._cpu_mark
        # Lines written together (token_to_sse and event_to_sse) share their interval.
        if now is not None and mark is not None and now[1] > mark[1]:
            self._steal = round(100 * (now[0] - mark[0]) / (now[1] - mark[1]), 1)
            self._cpu_mark = now
        if self._steal is not None:
            line["steal_pct"] = self._steal
        line["cpu_speed"] = cpu_speed()
        self._write(line)

    def handle(self, *args: Any, **options: Any) -> None:
        self._cpu_mark, self._steal = cpu_jiffies(), None
        for name in (
            "n",
            "latency_n",
            "submit_threads",
            "concurrency",
            "users",
            "claim_repeat",
            "history",
        ):
            if options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be positive")
        if options["rate"] <= 0 or options["http_seconds"] <= 0 or options["timeout"] <= 0:
            raise CommandError("--rate, --http-seconds and --timeout must be positive")
        for name in ("http_clients", "sse_n", "sse_tokens", "web_workers"):
            if options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be positive")
        if options["sse_token_gap_ms"] < 0:
            raise CommandError("--sse-token-gap-ms must not be negative")
        if options["db_worker_processes"] is None:
            options["db_worker_processes"] = min(options["concurrency"], 2 * (os.cpu_count() or 1))
        if options["peer_driver"]:
            with sigterm_as_exit():
                # Bare: the parent writes the line again with the machine's figures.
                self._write(peer_driver(options["peer_driver"], options))
            return
        # The HTTP client's per-request INFO lines would bury the progress and the results.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        sizes = parse_sizes(options["claim_queued"])
        peers = parse_peers(options["peers"])
        vendor = connections["default"].vendor
        from scheduling.management.commands.bench_persist import require_scratch_queue

        require_scratch_queue()
        with sigterm_as_exit():
            peer_lines: dict[str, dict[str, Any]] = {}
            for peer in peers:
                if vendor != "postgresql":
                    line = peer_line(
                        peer, skipped=f"peers run on PostgreSQL only (this is {vendor})"
                    )
                else:
                    line = self._run_peer(peer, options)
                peer_lines[peer] = line
                self._emit(line)
            measured = {peer: line for peer, line in peer_lines.items() if "started_per_s" in line}
            limits = {
                "SAGE_SERVER_MAX_PENDING_RUNS": BIG_LIMIT,
                "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": BIG_LIMIT,
            }
            with override_settings(SAGE={**settings.SAGE, **limits}):
                self._host(options, sizes, vendor, measured)

    # ------------------------------------------------------------------ peers

    def _run_peer(self, peer: str, options: dict[str, Any]) -> dict[str, Any]:
        progress(f"peer {peer}")
        forwarded: list[str] = []
        for dest in DRIVER_OPTIONS:
            forwarded += [f"--{dest.replace('_', '-')}", str(options[dest])]
        sibling = None
        with contextlib.ExitStack() as stack:
            db_url = database_url()
            if peer == "django-tasks-db":
                if find_spec("django_tasks_db") is None:
                    return peer_line(
                        peer, skipped=f"django_tasks_db is not installed ({INSTALL_HINT})"
                    )
                base = connections["default"].settings_dict["NAME"]
                sibling = f"{base[:36]}_bench_dtdb_{uuid.uuid4().hex[:8]}"
                self._create_database(sibling)
                stack.callback(self._drop_database, sibling)
                db_url = database_url(name=sibling)
            env = child_env(
                db_url, options["concurrency"], DJANGO_SETTINGS_MODULE="benchpeers.settings"
            )
            if sibling is not None:
                progress(f"{peer}: migrating {sibling}")
                migrate = subprocess.run(
                    [sys.executable, str(ROOT / "manage.py"), "migrate", "-v0", "--no-input"],
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=options["timeout"],
                )
                if migrate.returncode != 0:
                    return peer_line(peer, error=f"migrate failed: {migrate.stderr.strip()[-800:]}")
            driver = subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "manage.py"),
                    "bench_e2e",
                    "--peer-driver",
                    peer,
                    *forwarded,
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )

            def stop_driver() -> None:
                if driver.poll() is None:
                    driver.send_signal(signal.SIGTERM)
                    try:
                        driver.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        driver.kill()
                        driver.wait()

            stack.callback(stop_driver)
            try:
                out, _ = driver.communicate(timeout=options["timeout"] * 4)
            except subprocess.TimeoutExpired:
                return peer_line(peer, error="the driver timed out")
            for text in reversed(out.splitlines()):
                if text.startswith("{"):
                    return orjson.loads(text)
            return peer_line(
                peer, error=f"the driver exited with status {driver.returncode} (see stderr)"
            )

    def _create_database(self, name: str) -> None:
        connection = connections["default"]
        with connection.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')

    def _drop_database(self, name: str) -> None:
        connection = connections["default"]
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    # ------------------------------------------------------------------ this host

    def _host(
        self,
        options: dict[str, Any],
        sizes: list[int],
        vendor: str,
        peers: dict[str, dict[str, Any]],
    ) -> None:
        from scheduling.management.commands.bench_persist import delete_users

        common = {"database": vendor, "host": "sage", "history": options["history"]}
        timeout = options["timeout"]
        concurrency = options["concurrency"]
        with contextlib.ExitStack() as stack:
            self._stack = stack
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-e2e-")))
            # Registered before anything is created, so a failure half-way cleans up too.
            owners: list[tuple[Any, Any]] = []
            claim_owners: list[Any] = []
            created: list[Any] = []
            stack.callback(self._delete_rows, owners, claim_owners, created, delete_users)
            owners += bench_owners(options["users"], "u")
            claim_owners += [user for user, _ in bench_owners(CLAIM_USERS, "claim")]
            if (record := ensure_scripted_record()) is not None:
                created.append(record)

            if not options["skip_claim"]:
                progress("claim path")
                line = asyncio.run(claim_path(claim_owners, sizes, options["claim_repeat"]))
                self._emit({**line, **common})
            connections.close_all()  # the claim path's threads are gone; so are theirs

            progress("starting the worker")
            env = child_env(database_url(), concurrency)
            worker = start_child(
                "worker", [sys.executable, str(ROOT / "manage.py"), "runworker"], env, logs
            )
            stack.callback(self._stop_worker, worker)
            host = HostTarget(owners, [worker])
            wait_until("the worker to start", lambda: self._worker_up(worker), 60, [worker])
            progress(f"history: {options['history']} runs")
            warm_up(host, options["history"], timeout)
            context = {**common, "concurrency": concurrency, "users": len(owners)}

            tidy_tables()
            progress(f"throughput: {options['n']} runs")
            measured = measure_throughput(host, options["n"], options["submit_threads"], timeout)
            line = host_line("throughput", context, measured)
            for peer, theirs in peers.items():
                line[ratio_key(peer)] = round(line["started_per_s"] / theirs["started_per_s"], 3)
            self._emit(line)

            tidy_tables()
            progress(f"latency: {options['latency_n']} runs at {options['rate']}/s")
            measured = measure_latency(host, options["latency_n"], options["rate"], timeout)
            line = host_line("latency", context, measured)
            for peer, theirs in peers.items():
                line[ratio_key(peer)] = {
                    q: round(line[f"{q}_ms"] / theirs[f"latency_{q}_ms"], 3)
                    for q in ("p50", "p99")
                    if theirs.get(f"latency_{q}_ms")
                }
            self._emit(line)

            if options["skip_http"]:
                return
            web = self._start_web(options, env, logs, stack)
            self._http_paths(options, host, owners, web, worker, common)

    def _http_paths(
        self,
        options: dict[str, Any],
        host: HostTarget,
        owners: list[tuple[Any, Any]],
        web: tuple[str, Subprocess],
        worker: Subprocess,
        common: dict[str, Any],
    ) -> None:
        from rest_framework.authtoken.models import Token

        base, server = web
        children = [worker, server]
        self._children = children
        tokens = [Token.objects.get_or_create(user=user)[0].key for user, _ in owners]
        # Admission alone (the worker paused: on this machine kind executing 500 runs/s
        # takes both CPUs by itself, see the throughput path), then with the worker
        # executing what is admitted as it arrives.
        for paused in (True, False):
            line = self._admission_window(options, host, owners, tokens, base, children, paused)
            path = "http_admission" if paused else "http_admission_with_worker"
            path_targets = targets("http_admission") if paused else {}
            self._emit({**line, "path": path, **common, **path_targets})

        user, _ = owners[0]
        live = self._live_model(options, user, worker.log.parent)
        progress(f"token_to_sse and event_to_sse: {options['sse_n']} runs")
        # The first round opens each web process's live channel; it is not measured.
        warm = live.prepare(min(SSE_CONCURRENCY, options["sse_n"]), "sse-warmup")
        asyncio.run(sse_samples(base, tokens[0], user, [s for _, s in warm.handles], 120))
        batch = live.prepare(options["sse_n"], "sse")
        tidy_tables()  # as before every path: not the admission windows' dead rows
        settle_collector()
        samples = asyncio.run(
            sse_samples(base, tokens[0], user, [s for _, s in batch.handles], options["timeout"])
        )
        connections.close_all()
        for line in sse_lines(samples, options["sse_tokens"], options["sse_token_gap_ms"]):
            self._emit({**line, **common})

    def _admission_window(
        self,
        options: dict[str, Any],
        host: HostTarget,
        owners: list[tuple[Any, Any]],
        tokens: list[str],
        base: str,
        children: list[Subprocess],
        paused: bool,
    ) -> dict[str, Any]:
        """One ``http_admission`` window into fresh sessions, the worker paused (SIGSTOP,
        holding no run) or running; then the admitted runs drained."""
        from scheduling.models import UNFINISHED_STATUSES, Run

        worker, server = children
        clients = options["http_clients"]
        per_client = max(20, int(options["http_seconds"] * 15))
        # Client c posts as owner c mod users, into fresh sessions of that owner.
        batch = host.prepare(clients * per_client, "http")
        by_owner: dict[Any, list[str]] = {}
        for user, session in batch.handles:
            by_owner.setdefault(user.pk, []).append(str(session))
        plan = []
        for c in range(clients):
            owner_index = c % len(owners)
            peers_of_c = list(range(owner_index, clients, len(owners)))
            mine = by_owner[owners[owner_index][0].pk][peers_of_c.index(c) :: len(peers_of_c)]
            plan.append((tokens[owner_index], mine))
        tidy_tables()
        state = "paused" if paused else "running"
        progress(f"http_admission: {clients} clients, {options['http_seconds']} s, worker {state}")
        if paused:
            os.kill(worker.pid, signal.SIGSTOP)
        web, database, client = (
            cpu_by_process(process_tree(server.pid)),
            cpu_by_process(database_processes()),
            time.process_time(),
        )
        try:
            line = asyncio.run(http_admission(base, plan, options["http_seconds"]))
        finally:
            if paused:
                os.kill(worker.pid, signal.SIGCONT)
        per_request = 1000 / max(1, line["requests"])  # ms per request, from seconds
        spent = {
            "web": cpu_spent(web, cpu_by_process(process_tree(server.pid))),
            # None without database processes here: SQLite runs in the web processes
            # (counted there), a server elsewhere is not measured.
            "database": (
                cpu_spent(database, cpu_by_process(database_processes())) if database else None
            ),
            "client": time.process_time() - client,
        }
        line["cpu_ms_per_request"] = {
            name: round(seconds * per_request, 3)
            for name, seconds in spent.items()
            if seconds is not None
        }
        check_running(server)
        progress("waiting for the worker to drain the admitted runs")
        began = time.perf_counter()
        user_ids = [user.pk for user, _ in owners]
        wait_until(
            "the admitted runs to finish",
            lambda: (
                not Run.objects.filter(
                    owner_id__in=user_ids, status__in=UNFINISHED_STATUSES
                ).exists()
            ),
            options["timeout"],
            children,
        )
        line["drain_s"] = round(time.perf_counter() - began, 3)
        line["web_workers"] = options["web_workers"]
        line["worker"] = state
        return line

    def _live_model(self, options: dict[str, Any], user: Any, logs: Path) -> HostTarget:
        """The ``bench-live`` model (benchpeers.model_server) and a package whose agent uses
        it, for ``user``; both go with the user. Returns a target whose sessions use it."""
        from agents.management.commands.seed_demo import DEMO_MANIFEST
        from agents.services import packages
        from pooling.models import ModelRecord, Protocol

        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "benchpeers.model_server",
            "--port",
            str(port),
            "--tokens",
            str(options["sse_tokens"]),
            "--gap-ms",
            str(options["sse_token_gap_ms"]),
        ]
        server = start_child("model-server", argv, child_env(database_url(), 1), logs)
        self._stack.callback(server.stop)

        def up() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return True
            return False

        wait_until("the model server", up, 30, [server])
        record = ModelRecord(
            owner=user,
            name="bench-live",
            protocol=Protocol.OPENAI,
            base_url=f"http://127.0.0.1:{port}/v1",
            model="bench-live",
            options={"timeout": 60},
        )
        record.api_key = "bench"
        record.save()
        agent = {**DEMO_MANIFEST["agents"]["assistant"], "model": "bench-live", "tools": []}
        manifest = {**DEMO_MANIFEST, "name": "bench-live", "agents": {"assistant": agent}}
        package, _ = packages.package_create(owner=user, manifest=manifest)
        return HostTarget([(user, package)], self._children)

    def _start_web(
        self,
        options: dict[str, Any],
        env: dict[str, str],
        logs: Path,
        stack: contextlib.ExitStack,
    ) -> tuple[str, Subprocess]:
        import urllib.request

        port = free_port()
        argv = [
            sys.executable,
            str(ROOT / "manage.py"),
            "runweb",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(options["web_workers"]),
            "--log-level",
            "warning",
        ]
        progress(f"starting the web server ({options['web_workers']} workers)")
        server = start_child("web", argv, env, logs)
        stack.callback(server.stop)
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=1) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_until("the web server", up, 60, [server])
        return base, server

    def _worker_up(self, worker: Subprocess) -> bool:
        from scheduling.models import WorkerSnapshot

        return WorkerSnapshot.objects.filter(
            pid=worker.pid, host=socket.gethostname(), stopped_at__isnull=True
        ).exists()

    def _stop_worker(self, worker: Subprocess) -> None:
        from scheduling.models import WorkerSnapshot

        worker.stop()
        WorkerSnapshot.objects.filter(pid=worker.pid, host=socket.gethostname()).delete()

    def _delete_rows(
        self,
        owners: list[tuple[Any, Any]],
        claim_owners: list[Any],
        created: list[Any],
        delete_users: Callable[[list[Any]], None],
    ) -> None:
        progress("cleaning up")
        connections.close_all()
        delete_users([user for user, _ in owners] + claim_owners)
        for record in created:
            record.delete()
