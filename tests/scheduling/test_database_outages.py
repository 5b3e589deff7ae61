"""Database outages seen by real ``manage.py runworker`` processes.

1. A worker frozen inside its claim transaction (``SAGE_STOP_AT=claim.before_commit``: it
   granted a run and holds the claim lock on the fence-sequence row) does not stall the
   other workers: the server ends the idle transaction after ``CLAIM_IDLE_TIMEOUT_MS``
   (PostgreSQL's ``idle_in_transaction_session_timeout``, MySQL's lowered ``wait_timeout``),
   the grant rolls back and another worker claims and completes the queued runs — the
   frozen worker's run included, exactly once. Resumed, the frozen worker meets its ended
   connection as a transient claim error, and claims and completes runs again. Storage
   test: PostgreSQL and MySQL; skipped on SQLite (see `SQLITE_REASON`).

2. The database restarted twice under load (``pg_ctl restart -m fast`` of a throwaway
   PostgreSQL cluster of the test's own, `tests.pgcluster`): every run a worker was
   executing or about to claim still completes, once (a restart is no worker crash: no
   run is reaped and executed again), with exactly one terminal event, in its session's
   submission order, and every session's events stay contiguous.

Assertions are on database rows (runs, events, sessions, worker snapshots), not on logs;
logs are attached to failure messages only.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from sageproject.db import database_url
from scheduling.models import TERMINAL_STATUSES, Event, Run, RunStatus, Session, WorkerSnapshot
from scheduling.runs import CLAIM_IDLE_TIMEOUT_MS, TERMINAL_EVENTS
from tests import waiting
from tests.conftest import demo_manifest
from tests.pgcluster import throwaway_cluster
from tests.scheduling.processes import ROOT, WorkerProcess, worker_env

# Worker B must have completed every queued run within this long after worker A froze
# holding the claim lock. The server ends A's transaction after CLAIM_IDLE_TIMEOUT_MS
# (2 s); without that, only the connection-wide 15 s PostgreSQL timeout would free the
# lock (on MySQL, nothing for 8 hours), which this bound tells apart.
FROZEN_CLAIM_BOUND = 12.0

SQLITE_REASON = (
    "SQLite has no server that could end a frozen process's transaction: the claim runs in "
    "a BEGIN IMMEDIATE transaction, so a worker frozen inside it keeps the database file's "
    "write (RESERVED) lock until the process dies, and every other worker's claim waits "
    "for it (busy_timeout 30 s) and then fails with 'database is locked'"
)


# ------------------------------------------------------------------------------ processes


def suite_database_url() -> str:
    """A DATABASE_URL that points a subprocess at this test's database."""
    return database_url()


def outage_env(database_url: str, **extra: str) -> dict[str, str]:
    """The environment overrides of a worker (and ``manage.py``) on ``database_url``: a
    30 s lease renewed every 10 s, then ``extra``."""
    return {
        "DATABASE_URL": database_url,
        "SAGE_LEASE_SECONDS": "30",
        "SAGE_HEARTBEAT_SECONDS": "10",
        **extra,
    }


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes; every one is ended when the test ends, however it ends."""
    started: list[WorkerProcess] = []

    def start(name: str, env: dict[str, str], *args: str) -> WorkerProcess:
        worker = WorkerProcess(name, tmp_path, env, args)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.terminate(20)


def wait_until(
    predicate: Callable[[], Any],
    *,
    timeout: float,
    message: str | Callable[[], str],
    interval: float = 0.1,
    workers: tuple[WorkerProcess, ...] = (),
) -> Any:
    """`tests.waiting.wait_until`, failing at once when one of ``workers`` exits; the
    failure carries their logs."""

    def exited() -> str | None:
        dead = [w for w in workers if not w.alive]
        return f"worker {dead[0].name} exited with status {dead[0].returncode}" if dead else None

    def text() -> str:
        logs = "\n".join(f"--- {w.name} log ---\n{w.tail()}" for w in workers)
        return f"{message() if callable(message) else message}\n{logs}"

    return waiting.wait_until(
        predicate, timeout=timeout, interval=interval, message=text, abort=exited
    )


# ------------------------------------------------------------------------------ 1: frozen claim


def _statuses(run_ids: list[Any]) -> str:
    """Status counts, and what went wrong with any run that ended otherwise."""
    counts: dict[str, int] = {}
    odd = []
    for pk, status, error in Run.objects.filter(pk__in=run_ids).values_list(
        "pk", "status", "error"
    ):
        counts[status] = counts.get(status, 0) + 1
        if status in TERMINAL_STATUSES and status != RunStatus.COMPLETED:
            odd.append(f"{pk} {status}: {error}")
    return f"{counts}" + "".join(f"\n  {line}" for line in odd)


def _all_completed(run_ids: list[Any]) -> bool:
    return Run.objects.filter(pk__in=run_ids, status=RunStatus.COMPLETED).count() == len(run_ids)


def _snapshot(worker: WorkerProcess) -> dict[str, Any] | None:
    row = WorkerSnapshot.objects.filter(pid=worker.pid).order_by("-heartbeat_at").first()
    return row.capacity if row is not None else None


def _assert_run_histories(run_ids: list[Any]) -> None:
    """Every run completed once: one terminal event; every session's seqs contiguous."""
    terminal_types = set(TERMINAL_EVENTS.values())
    for run in Run.objects.filter(pk__in=run_ids):
        assert run.status == RunStatus.COMPLETED, (run.pk, run.status, run.error)
        terminal = list(
            Event.objects.filter(run_id=run.pk, type__in=terminal_types).values_list(
                "type", flat=True
            )
        )
        assert terminal == ["run.completed"], f"run {run.pk}: terminal events {terminal}"
    sessions = Session.objects.filter(runs__pk__in=run_ids).distinct()
    for session in sessions:
        seqs = list(
            Event.objects.filter(session=session).order_by("seq").values_list("seq", flat=True)
        )
        assert seqs == list(range(1, len(seqs) + 1)), f"session {session.pk}: seqs {seqs}"
        assert session.persisted_events == len(seqs)


@pytest.mark.timing
@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
def test_a_worker_frozen_inside_its_claim_does_not_stall_the_others(
    alice, bob, carol, make_session, spawn
):
    if connection.vendor == "sqlite":
        pytest.skip(SQLITE_REASON)
    assert CLAIM_IDLE_TIMEOUT_MS < FROZEN_CLAIM_BOUND * 1000 / 3
    url = suite_database_url()
    sessions = [make_session(user) for user in (alice, alice, bob, bob, carol, carol)]

    def submit(session, text: str) -> Any:
        from agents import services

        run, _ = services.run_submit(owner=session.owner, session_id=session.pk, input=text)
        return run.pk

    # B first, so it is warm (imported, connected, claiming) when A freezes; it is
    # stopped meanwhile (while idle: nothing is queued) so that A alone claims run 0.
    b = spawn("b", outage_env(url))
    wait_until(
        lambda: _snapshot(b) is not None, timeout=60, message="worker B to start", workers=(b,)
    )
    b.signal(signal.SIGSTOP)

    first = submit(sessions[0], "hello from the frozen claim")
    a = spawn("a", outage_env(url, SAGE_STOP_AT="claim.before_commit"))
    wait_until(
        lambda: a.state() == "T",
        timeout=60,
        message="worker A to stop itself inside its claim transaction",
        workers=(a,),
    )
    frozen_at = time.monotonic()
    # A's grant is not committed: to everyone else the run is still queued, unleased.
    row = Run.objects.values("status", "lease_owner", "attempts").get(pk=first)
    assert row == {"status": RunStatus.QUEUED, "lease_owner": "", "attempts": 0}, (
        f"worker A stopped, but its grant of run 0 is already committed ({row}): the claim "
        "thread ran past its crash point before the process stop took hold (os.kill of "
        "the process from a non-main thread; see scheduling/faults.py), so A is not frozen "
        "inside its claim transaction and this test cannot run its scenario"
    )

    b.signal(signal.SIGCONT)
    more = [submit(session, f"hello {i}") for i, session in enumerate(sessions[1:], start=1)]
    batch = [first, *more]
    wait_until(
        lambda: _all_completed(batch),
        timeout=FROZEN_CLAIM_BOUND - (time.monotonic() - frozen_at),
        message=lambda: (
            f"worker B to complete every queued run within {FROZEN_CLAIM_BOUND:.0f}s of worker "
            f"A freezing inside its claim transaction (statuses: {_statuses(batch)}; A is "
            f"{a.state()})"
        ),
        workers=(b,),
    )
    b_done = time.monotonic() - frozen_at
    assert a.state() == "T", "worker A must still be frozen while B works"

    # The run A granted inside its rolled-back transaction was executed once, by B.
    run = Run.objects.get(pk=first)
    assert (run.status, run.attempts, run.crashes) == (RunStatus.COMPLETED, 1, 0), (
        f"run 0 after A's rolled-back grant: {run.status}, attempts {run.attempts}, "
        f"crashes {run.crashes}"
    )
    _assert_run_histories(batch)

    # Only A is left; resumed, it finds its connection ended and claims again.
    assert b.terminate(20) == 0, b.tail()
    a.signal(signal.SIGCONT)
    after = [submit(session, f"after the thaw {i}") for i, session in enumerate(sessions[1:3])]
    wait_until(
        lambda: _all_completed(after),
        timeout=30,
        message=lambda: f"resumed worker A to complete new runs (statuses: {_statuses(after)})",
        workers=(a,),
    )

    def a_reports_recovery() -> dict[str, Any] | None:
        capacity = _snapshot(a)
        if capacity is None or capacity["runs"]["completed"] < len(after):
            return None
        return capacity

    capacity = wait_until(
        a_reports_recovery,
        timeout=15,
        message=lambda: f"worker A's snapshot to count its runs (it has {_snapshot(a)})",
        workers=(a,),
    )
    scheduler = capacity["scheduler"]
    assert scheduler["claim_errors"] >= 1, (
        f"worker A's claim after the thaw should have failed once (its connection was "
        f"ended): {scheduler}\n{a.tail()}"
    )
    assert scheduler["permanent_error"] is None, scheduler
    assert a.alive
    _assert_run_histories([*batch, *after])
    run = Run.objects.get(pk=first)
    assert (run.status, run.attempts) == (RunStatus.COMPLETED, 1)
    print(f"\n[{connection.vendor}] B completed {len(batch)} runs {b_done:.1f}s after A froze")


# ------------------------------------------------------------------------------ 2: restarts

USERS = 4
SESSIONS_PER_USER = 2
RUNS_PER_SESSION = 5
WORDS = 16
TOKEN_DELAY_MS = 50  # about 0.8 s of streaming per run

SEED = """
import json
from django.contrib.auth import get_user_model
from agents import services
from agents.services import packages
from pooling.models import ModelRecord, Protocol

spec = json.loads({spec!r})
ModelRecord.objects.create(
    owner=None, name="steady", protocol=Protocol.SCRIPTED, model="steady",
    options=spec["model_options"],
)
run_ids = []
for u in range(spec["users"]):
    user = get_user_model().objects.create_user(username=f"user{{u}}", password=None)
    packages.package_create(owner=user, manifest=spec["manifest"])
    for s in range(spec["sessions"]):
        session = services.session_create(
            owner=user, package=spec["manifest"]["name"], agent="assistant"
        )
        for r in range(spec["runs"]):
            run, _ = services.run_submit(
                owner=user, session_id=session.pk, input=f"user {{u}} session {{s}} run {{r}}"
            )
            run_ids.append(str(run.pk))
print("RUN_IDS=" + json.dumps(run_ids))
"""


def manage(env: dict[str, str], *args: str, timeout: float = 180) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, (
        f"manage.py {args[0]} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout


class ClusterRows:
    """Reads the cluster's run and event rows with psycopg (the test's own Django
    connection points at the suite's database); a query during a restart answers None."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.run = Run._meta.db_table
        self.event = Event._meta.db_table
        self.session = Session._meta.db_table

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]] | None:
        import psycopg

        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                return conn.execute(sql, params).fetchall()
        except psycopg.OperationalError:
            return None

    def statuses(self) -> dict[str, int] | None:
        rows = self.query(f"SELECT status, count(*) FROM {self.run} GROUP BY status")
        return None if rows is None else dict(rows)


@pytest.fixture
def cluster():
    with throwaway_cluster(database="sage_outage") as c:
        yield c


@pytest.mark.slow
def test_every_run_completes_when_the_database_restarts_twice_under_load(cluster, spawn):
    url = cluster.url("sage_outage")
    env = outage_env(url)
    manage(worker_env(env), "migrate", "--noinput", "-v", "0")
    spec = {
        "users": USERS,
        "sessions": SESSIONS_PER_USER,
        "runs": RUNS_PER_SESSION,
        "manifest": demo_manifest(name="outage", model="steady", tools=[]),
        "model_options": {
            "token_delay_ms": TOKEN_DELAY_MS,
            "script": [{"text": " ".join(["steady"] * WORDS)}],
        },
    }
    out = manage(worker_env(env), "shell", "-c", SEED.format(spec=json.dumps(spec)))
    run_ids = json.loads(next(x for x in out.splitlines() if x.startswith("RUN_IDS="))[8:])
    total = USERS * SESSIONS_PER_USER * RUNS_PER_SESSION
    assert len(run_ids) == total
    rows = ClusterRows(cluster.dsn("sage_outage"))

    worker = spawn("worker", env, "--max-concurrent", "4")
    done = RunStatus.COMPLETED

    def unfinished(counts: dict[str, int]) -> int:
        return sum(n for status, n in counts.items() if status not in TERMINAL_STATUSES)

    def executing(min_completed: int) -> dict[str, int] | None:
        """The statuses once runs are executing and ``min_completed`` have completed, or
        once none is left (runs that failed are reported below)."""
        counts = rows.statuses()
        if counts is None:
            return None
        if counts.get(done, 0) >= min_completed and counts.get(RunStatus.RUNNING, 0) >= 1:
            return counts
        return counts if unfinished(counts) == 0 else None

    restarts = []
    completed = 0
    for n in (1, 2):
        # Restart while runs are executing, after the worker has completed a few since
        # it started (or since the previous restart: it recovered from that one).
        counts = wait_until(
            lambda c=completed: executing(c + 3),
            timeout=90,
            message=lambda n=n: f"runs executing before restart {n} (statuses {rows.statuses()})",
            workers=(worker,),
        )
        if unfinished(counts) == 0:
            break  # every run ended early: the checks below say how
        completed = counts.get(done, 0)
        assert unfinished(counts) >= 4, f"too few runs left to restart under load: {counts}"
        started = time.monotonic()
        cluster.restart(mode="fast")
        restarts.append((counts, time.monotonic() - started))

    def finished() -> dict[str, int] | None:
        counts = rows.statuses()
        return counts if counts is not None and unfinished(counts) == 0 else None

    counts = wait_until(
        finished,
        timeout=180,
        interval=0.5,
        message=lambda: f"every run to end (statuses {rows.statuses()})",
        workers=(worker,),
    )
    if counts != {done: total}:
        others = rows.query(
            f"SELECT id::text, status, attempts, crashes, error::text FROM {rows.run} "
            "WHERE status <> %s ORDER BY finished_at",
            done,
        )
        listing = "\n".join(str(row) for row in others or [])
        raise AssertionError(
            f"runs after two restarts: {counts}; not completed:\n{listing}\n{worker.tail()}"
        )

    # A database restart is not a worker crash: nothing was reaped and executed again
    # (the dispatcher retries the outcome's commit through a restart).
    reexecuted = rows.query(
        f"SELECT id::text, attempts, crashes FROM {rows.run} WHERE attempts <> 1 OR crashes <> 0"
    )
    assert reexecuted == [], (
        f"runs executed more than once (id, attempts, crashes): {reexecuted}\n{worker.tail()}"
    )
    terminal = rows.query(
        f"SELECT r.id::text, count(e.id) FROM {rows.run} r LEFT JOIN {rows.event} e "
        f"ON e.run_id = r.id AND e.type = ANY(%s) GROUP BY r.id",
        list(TERMINAL_EVENTS.values()),
    )
    assert terminal is not None
    assert sorted(str(pk) for pk, _ in terminal) == sorted(run_ids)
    wrong = {pk: n for pk, n in terminal if n != 1}
    assert not wrong, f"runs without exactly one terminal event: {wrong}"
    sessions = rows.query(
        f"SELECT s.id::text, s.persisted_events, array_agg(e.seq ORDER BY e.seq) "
        f"FROM {rows.session} s JOIN {rows.event} e ON e.session_id = s.id GROUP BY s.id"
    )
    assert sessions is not None and len(sessions) == USERS * SESSIONS_PER_USER
    for session_id, persisted, seqs in sessions:
        assert seqs == list(range(1, len(seqs) + 1)), f"session {session_id}: seqs {seqs}"
        assert persisted == len(seqs), f"session {session_id}: persisted {persisted}"
    completions = rows.query(
        f"SELECT session_id::text, array_agg(e.run_id::text ORDER BY e.seq) FROM {rows.event} e "
        "WHERE e.type = 'run.completed' GROUP BY session_id"
    )
    assert completions is not None
    order = {str(pk): i for i, pk in enumerate(run_ids)}
    for session_id, finished_runs in completions:
        assert finished_runs == sorted(finished_runs, key=order.__getitem__), (
            f"session {session_id}: runs completed out of submission order"
        )
    assert len(restarts) == 2, f"the database was restarted {len(restarts)} times, not twice"
    assert worker.alive, worker.tail()
    print(f"\nrestarted at (statuses, seconds down): {restarts}")
