"""What every path of ``bench_e2e`` stands on: its lines (figures, ratios, targets), the
database between paths (vacuum, analyze, checkpoint) and the subprocesses it starts (a
worker, the web processes, the peers' workers, the model server), stopped on every exit."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError
from django.db import DatabaseError, connections

from sageproject.db import database_url as _database_url
from sageproject.progress import note
from scheduling.subprocesses import Subprocess  # the other modules take `Subprocess` from here

ROOT = Path(settings.BASE_DIR)
# Pending limits high enough that the benchmark's floods are never refused.
BIG_LIMIT = 1_000_000
POLL_SECONDS = 0.25
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
