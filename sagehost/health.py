"""The host's health checks: what ``/readyz`` and ``manage.py doctor`` report.

Each check is a small function returning a `Check`: its name, ``ok`` / ``warn`` /
``fail``, what it found and, unless ok, what to do. ``/readyz`` runs `readiness` (the
database reachable, every migration applied, a worker heartbeat fresher than
``scheduling.models.SNAPSHOT_STALE_AFTER``); ``manage.py doctor`` runs `doctor` (those,
and the settings, Redis when configured, the oldest queued run, runs stuck past their
lease, the clock skew between this host and the database, PostgreSQL's autovacuum and table
statistics, and free disk space for SQLite).

Times of rows are compared on the database's clock (`scheduling.runs.db_now`; SQLite's is
this host's). A check never shows a password: a database is named by host, port, name and
user, a Redis by host, port and number. ``Check.summary`` is the text ``/readyz`` shows
to anyone (no host names, no versions, no error text); ``detail`` is the operator's.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone

logger = logging.getLogger("sage.health")

OK, WARN, FAIL = "ok", "warn", "fail"
_RANK = {OK: 0, WARN: 1, FAIL: 2}

# A running run whose lease expired longer ago than this has no worker reaping it.
STUCK_AFTER = timedelta(seconds=30)
# The oldest claimable queued run waiting longer than this is a warning.
QUEUED_WARN_AFTER = timedelta(minutes=5)
# This host's clock against the database's.
SKEW_WARN_SECONDS = 1.0
SKEW_FAIL_SECONDS = 10.0
# Free space next to a SQLite database file.
DISK_WARN_BYTES = 1 << 30  # 1 GiB
DISK_FAIL_BYTES = 100 << 20  # 100 MiB
# PostgreSQL: a table with more rows changed since its last ANALYZE than it holds (and at
# least this many) has statistics too stale for the plans the run path depends on.
STALE_CHANGES_MIN = 10_000
REDIS_TIMEOUT_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class Check:
    """One check's result: ``status`` is ``ok``, ``warn`` or ``fail``; ``action`` says
    what to do about a warning or a failure; ``data`` holds its figures (``--json``)."""

    name: str
    status: str
    detail: str
    action: str = ""
    summary: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "action": self.action,
            **self.data,
        }


def worst(checks: Iterable[Check]) -> str:
    """The worst status among ``checks`` (``ok`` when there are none)."""
    return max((c.status for c in checks), key=_RANK.__getitem__, default=OK)


def _seconds(delta: timedelta) -> float:
    return round(delta.total_seconds(), 1)


def _reason(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


# --- settings -----------------------------------------------------------------------


def check_settings() -> Check:
    """The problems ``sageproject.config`` found in this process's environment."""
    problems = settings.SAGE_CONFIG.errors
    if problems:
        return Check(
            "settings",
            FAIL,
            "; ".join(f"{p.check_id} {p.message}" for p in problems),
            "fix each variable named (docs/OPERATIONS.md, System checks)",
            data={"problems": [p.check_id for p in problems]},
        )
    if settings.DEBUG:
        return Check(
            "settings", WARN, "valid; DEBUG is on", "unset DEBUG on a host others can reach"
        )
    return Check("settings", OK, "valid")


# --- the database -------------------------------------------------------------------


def database_label(alias: str = DEFAULT_DB_ALIAS) -> str:
    """Where the database is, without its password: ``host:port/name (user u)``, or the
    SQLite file."""
    s = connections[alias].settings_dict
    if connections[alias].vendor == "sqlite":
        return str(s["NAME"])
    host = s.get("HOST") or "local socket"
    port = f":{s['PORT']}" if s.get("PORT") else ""
    user = f" (user {s['USER']})" if s.get("USER") else ""
    return f"{host}{port}/{s.get('NAME')}{user}"


def _server_version(alias: str) -> str:
    connection = connections[alias]
    vendor = connection.vendor
    sql = {
        "postgresql": "SHOW server_version",
        "mysql": "SELECT VERSION()",
        "sqlite": "SELECT sqlite_version()",
    }.get(vendor, "SELECT 1")
    with connection.cursor() as cursor:
        cursor.execute(sql)
        version = str(cursor.fetchone()[0]).split()[0]
    if vendor == "postgresql":
        return f"PostgreSQL {version}"
    if vendor == "mysql":
        name = "MariaDB" if connection.mysql_is_mariadb else "MySQL"
        return f"{name} {version.split('-')[0]}"
    if vendor == "sqlite":
        return f"SQLite {version}"
    return vendor


def _refused(alias: str) -> OSError | None:
    """The error of a TCP connection to the database server's port (None when it opens,
    or for SQLite and Unix sockets): a server that is down answers at once, where
    PostgreSQL's connection pool would wait out its timeout (30 s)."""
    s = connections[alias].settings_dict
    host = s.get("HOST") or ""
    if connections[alias].vendor == "sqlite" or not host or host.startswith("/"):
        return None
    default = {"postgresql": 5432, "mysql": 3306}.get(connections[alias].vendor, 0)
    try:
        socket.create_connection((host, int(s.get("PORT") or default)), timeout=3).close()
    except OSError as exc:
        return exc
    return None


def check_database(alias: str = DEFAULT_DB_ALIAS, *, probe: bool = False) -> Check:
    """A round trip to the database, naming its server and version; ``probe`` first
    tries the server's port (``doctor``: a down server is reported at once)."""
    try:
        if probe and (refused := _refused(alias)) is not None:
            raise refused
        version = _server_version(alias)
    except Exception as exc:
        return Check(
            "database",
            FAIL,
            f"unreachable at {database_label(alias)} ({_reason(exc)})",
            "start the database or fix DATABASE_URL",
            summary="the database is unreachable",
        )
    return Check(
        "database",
        OK,
        f"{version} at {database_label(alias)}",
        summary="reachable",
        data={"version": version},
    )


def check_migrations(alias: str = DEFAULT_DB_ALIAS) -> Check:
    """Every migration of the code applied to the database."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[alias])
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if plan:
        names = [f"{m.app_label}.{m.name}" for m, _backwards in plan]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return Check(
            "migrations",
            FAIL,
            f"{len(names)} not applied: {shown}",
            "run manage.py migrate",
            summary=f"{len(names)} migrations not applied",
            data={"unapplied": names},
        )
    return Check("migrations", OK, "all applied", summary="all applied")


def check_workers(now: datetime) -> Check:
    """Live workers (not stopped) and their heartbeat ages; fails without a fresh one."""
    from scheduling.models import SNAPSHOT_STALE_AFTER, WorkerSnapshot

    workers = [
        {"worker_id": w.worker_id, "age_seconds": _seconds(now - w.heartbeat_at)}
        for w in WorkerSnapshot.objects.live()
    ]
    fresh = [w for w in workers if w["age_seconds"] <= SNAPSHOT_STALE_AFTER.total_seconds()]
    stale = [w for w in workers if w not in fresh]
    listed = ", ".join(
        f"{w['worker_id']} {w['age_seconds']:g} s" + (" (stale)" if w in stale else "")
        for w in workers
    )
    limit = f"{SNAPSHOT_STALE_AFTER.total_seconds():g} s"
    data = {"workers": workers}
    if not fresh:
        return Check(
            "workers",
            FAIL,
            f"no worker heartbeat in the last {limit}" + (f": {listed}" if listed else ""),
            "start a worker (manage.py runworker), or see why it stopped (its log)",
            summary=f"no worker heartbeat in the last {limit}",
            data=data,
        )
    if stale:
        return Check(
            "workers",
            WARN,
            f"{len(fresh)} live, {len(stale)} stale: {listed}",
            "a stale worker is paused, overloaded or dead; one gone for good leaves its "
            "snapshot behind: delete it in the admin (Worker snapshots)",
            summary=f"{len(fresh)} live",
            data=data,
        )
    return Check(
        "workers", OK, f"{len(fresh)} live: {listed}", summary=f"{len(fresh)} live", data=data
    )


# --- runs ---------------------------------------------------------------------------


def check_queue(now: datetime) -> Check:
    """The oldest queued run a worker could claim (its session's turn) and its wait."""
    from scheduling.runs.selectors import queued_in_turn

    oldest = queued_in_turn().order_by("created_at").values_list("pk", "created_at").first()
    if oldest is None:
        return Check("queue", OK, "no queued runs")
    run_id, created_at = oldest
    wait = _seconds(now - created_at)
    data = {"oldest_run": str(run_id), "oldest_wait_seconds": wait}
    detail = f"oldest queued run {run_id} waiting {wait:g} s"
    if now - created_at > QUEUED_WARN_AFTER:
        return Check(
            "queue",
            WARN,
            detail,
            "check the workers and their capacity (manage.py capacity); at their limits, "
            "raise SAGE_SERVER_MAX_CONCURRENT_RUNS or add a worker",
            data=data,
        )
    return Check("queue", OK, detail, data=data)


def check_stuck_runs(now: datetime) -> Check:
    """Runs still ``running`` whose lease expired more than `STUCK_AFTER` ago: no worker
    is claiming (a claim reaps dead leases), so nothing ends or requeues them."""
    from scheduling.runs.selectors import running_past_lease

    stuck = running_past_lease(now - STUCK_AFTER).order_by("lease_expires_at")
    count = stuck.count()
    if not count:
        return Check("stuck_runs", OK, "no run is past its lease")
    run_id, expired = stuck.values_list("pk", "lease_expires_at").first()
    past = _seconds(now - expired)
    return Check(
        "stuck_runs",
        FAIL,
        f"{count} running past their lease; run {run_id} expired {past:g} s ago",
        "start a worker: its next claim requeues or fails dead leases; if workers run, "
        "look in their logs for claim errors",
        data={"stuck": count, "oldest_run": str(run_id), "expired_seconds": past},
    )


# --- the host -----------------------------------------------------------------------


def check_clock(alias: str = DEFAULT_DB_ALIAS) -> Check:
    """This host's clock minus the database's (taken at the middle of the round trip)."""
    from scheduling.runs import db_now

    if connections[alias].vendor == "sqlite":
        return Check("clock", OK, "SQLite uses this host's clock", data={"skew_seconds": 0.0})
    before = timezone.now()
    database = db_now(alias)
    after = timezone.now()
    return clock_check(((before + (after - before) / 2) - database).total_seconds())


def clock_check(skew: float) -> Check:
    """The clock check of a measured skew (seconds this host is ahead of the database):
    a warning from `SKEW_WARN_SECONDS`, a failure from `SKEW_FAIL_SECONDS`."""
    data = {"skew_seconds": round(skew, 3)}
    detail = f"this host is {abs(skew):.3f} s {'ahead of' if skew >= 0 else 'behind'} the database"
    if abs(skew) >= SKEW_WARN_SECONDS:
        return Check(
            "clock",
            FAIL if abs(skew) >= SKEW_FAIL_SECONDS else WARN,
            detail,
            "synchronise the clocks (NTP): heartbeat ages and queue waits mix both",
            data=data,
        )
    return Check("clock", OK, detail, data=data)


def check_disk(alias: str = DEFAULT_DB_ALIAS) -> Check | None:
    """Free space where the SQLite database file lives; None on other databases."""
    s = connections[alias].settings_dict
    if connections[alias].vendor != "sqlite" or str(s["NAME"]).startswith((":memory:", "file:")):
        return None
    directory = os.path.dirname(os.path.abspath(str(s["NAME"])))
    return disk_check(directory, shutil.disk_usage(directory).free)


def disk_check(directory: str, free: int) -> Check:
    """The disk check of ``free`` bytes in ``directory``: a warning under 1 GiB
    (`DISK_WARN_BYTES`), a failure under 100 MiB (`DISK_FAIL_BYTES`)."""
    data = {"free_bytes": free}
    detail = f"{free / (1 << 30):.2f} GiB free in {directory}"
    if free < DISK_WARN_BYTES:
        return Check(
            "disk",
            FAIL if free < DISK_FAIL_BYTES else WARN,
            detail,
            "free space on that filesystem, or move the database (DATABASE_URL)",
            data=data,
        )
    return Check("disk", OK, detail, data=data)


@dataclass(frozen=True, slots=True)
class TableStatistics:
    """What PostgreSQL's statistics say of one of the run path's tables."""

    name: str
    live_rows: int
    changed_since_analyze: int
    autovacuum_enabled: bool


def check_statistics(alias: str = DEFAULT_DB_ALIAS) -> Check | None:
    """PostgreSQL only (None elsewhere): autovacuum on, and the statistics of the run,
    event and session tables not far behind what the tables hold."""
    from scheduling.models import Event, Run, Session

    connection = connections[alias]
    if connection.vendor != "postgresql":
        return None
    names = [model._meta.db_table for model in (Run, Event, Session)]
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        autovacuum = cursor.fetchone()[0] == "on"
        cursor.execute(
            "SELECT c.relname, COALESCE(s.n_live_tup, 0), COALESCE(s.n_mod_since_analyze, 0),"
            " NOT COALESCE(c.reloptions, '{}') @> ARRAY['autovacuum_enabled=false']"
            " FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
            " WHERE c.oid = ANY(%s::regclass[]) ORDER BY c.relname",
            [names],
        )
        tables = [TableStatistics(*row) for row in cursor.fetchall()]
    return statistics_check(autovacuum, tables)


def statistics_check(autovacuum: bool, tables: list[TableStatistics]) -> Check:
    """The statistics check: a warning when autovacuum is off (for the server or one of
    ``tables``), or when a table has changed more since its last ANALYZE than it holds.

    Why it matters: a connection keeps the plan it made for a statement (the run path's are
    prepared, and so are the foreign-key checks each commit makes) until the table's
    statistics change. Planned while a table was small, an index lookup is a sequential
    scan, which reads the whole table once it has grown."""
    data = {
        "autovacuum": autovacuum,
        "tables": {
            t.name: {
                "live_rows": t.live_rows,
                "changed_since_analyze": t.changed_since_analyze,
                "autovacuum_enabled": t.autovacuum_enabled,
            }
            for t in tables
        },
    }
    problems: list[str] = []
    if not autovacuum:
        problems.append("autovacuum is off")
    elif off := [t.name for t in tables if not t.autovacuum_enabled]:
        problems.append(f"autovacuum is off for {', '.join(off)}")
    for t in tables:
        if t.changed_since_analyze < max(STALE_CHANGES_MIN, t.live_rows):
            continue
        problems.append(
            f"{t.name} has changed {t.changed_since_analyze:,} rows since its last ANALYZE"
            f" ({t.live_rows:,} live)"
        )
    if problems:
        return Check(
            "statistics",
            WARN,
            "; ".join(problems),
            "turn autovacuum on (or ANALYZE these tables as they grow): plans made while a"
            " table was small read all of it once it is large",
            data=data,
        )
    return Check("statistics", OK, "autovacuum on; statistics current", data=data)


def redis_label(url: str) -> str:
    """A Redis URL without its credentials: ``host:port/db`` (or the socket path)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    port = parts.port or 6379
    return f"{parts.hostname or 'localhost'}:{port}{parts.path or '/0'}"


def check_redis() -> list[Check]:
    """A ping of each configured Redis (``REDIS_URL``, ``SAGE_JOBS_REDIS_URL``)."""
    import redis

    urls = {
        "redis": settings.SAGE.get("REDIS_URL"),
        "jobs_redis": settings.SAGE.get("SAGE_JOBS_REDIS_URL"),
    }
    configured = {name: url for name, url in urls.items() if url}
    if not configured:
        return [Check("redis", OK, "not configured (REDIS_URL unset)")]
    checks = []
    for name, url in configured.items():
        where = redis_label(url)
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
            socket_timeout=REDIS_TIMEOUT_SECONDS,
        )
        try:
            version = client.info("server").get("redis_version", "?")
        except Exception as exc:
            setting = "REDIS_URL" if name == "redis" else "SAGE_JOBS_REDIS_URL"
            reason = type(exc).__name__
            checks.append(
                Check(
                    name,
                    FAIL,
                    f"unreachable at {where} ({reason})",
                    f"start Redis or fix {setting}",
                )
            )
        else:
            checks.append(Check(name, OK, f"Redis {version} at {where}"))
        finally:
            client.close()
    return checks


# --- running them -------------------------------------------------------------------


def _guarded(name: str, fn: Callable[[], Any]) -> list[Check]:
    """``fn``'s checks; an unexpected error is that check's failure, never a crash."""
    try:
        result = fn()
    except Exception as exc:
        logger.warning("health check %s failed: %s", name, _reason(exc))
        return [
            Check(
                name,
                FAIL,
                f"the check failed ({_reason(exc)})",
                "see the log",
                summary="the check failed",
            )
        ]
    if result is None:
        return []
    return result if isinstance(result, list) else [result]


# The checks that read the database: "not checked" when it is unreachable.
_NEED_DATABASE = ("migrations", "workers", "queue", "stuck_runs", "clock", "statistics")
# The checks that read the host's tables: "not checked" while migrations are pending.
_NEED_TABLES = ("workers", "queue", "stuck_runs", "statistics")


def _checks(names: tuple[str, ...], *, probe: bool = False) -> list[Check]:
    from scheduling.runs import db_now

    now: list[datetime] = []

    def db_time() -> datetime:
        if not now:
            now.append(db_now())
        return now[0]

    runners: dict[str, Callable[[], Any]] = {
        "settings": check_settings,
        "database": lambda: check_database(probe=probe),
        "migrations": check_migrations,
        "redis": check_redis,
        "workers": lambda: check_workers(db_time()),
        "queue": lambda: check_queue(db_time()),
        "stuck_runs": lambda: check_stuck_runs(db_time()),
        "clock": check_clock,
        "statistics": check_statistics,
        "disk": check_disk,
    }
    checks: list[Check] = []
    # Why the checks that need the database, or its tables, cannot run.
    blocked: dict[str, str] = {}
    for name in names:
        reason = blocked.get(name)
        if reason:
            checks.append(Check(name, FAIL, f"not checked: {reason}", summary="not checked"))
            continue
        found = _guarded(name, runners[name])
        failed = any(c.status == FAIL for c in found)
        if name == "database" and failed:
            blocked.update(dict.fromkeys(_NEED_DATABASE, "the database is unreachable"))
        elif name == "migrations" and failed:
            blocked.update(dict.fromkeys(_NEED_TABLES, "migrations are not applied"))
        checks += found
    return checks


READINESS = ("database", "migrations", "workers")
DOCTOR = (
    "settings",
    "database",
    "migrations",
    "redis",
    "workers",
    "queue",
    "stuck_runs",
    "clock",
    "statistics",
    "disk",
)


def readiness() -> list[Check]:
    """What ``/readyz`` checks: the database, the migrations, a fresh worker heartbeat."""
    return _checks(READINESS)


def doctor() -> list[Check]:
    """Everything ``manage.py doctor`` reports, in its order."""
    return _checks(DOCTOR, probe=True)
