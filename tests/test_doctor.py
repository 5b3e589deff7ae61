"""``manage.py doctor [--json]``: each check's status and what to do, exit status 1 on a
failure — a stopped worker, an unreachable Redis, a run stuck past its lease."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from io import StringIO

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from sagehost import health
from scheduling.models import Run, RunStatus
from tests.api.test_health import snapshot
from tests.pgcluster import free_port
from tests.scheduling.processes import ROOT, worker_env

pytestmark = pytest.mark.storage


def doctor(*args: str) -> tuple[int, str]:
    """The command's exit status and standard output."""
    out = StringIO()
    try:
        call_command("doctor", *args, stdout=out)
    except SystemExit as exc:
        return int(exc.code), out.getvalue()
    return 0, out.getvalue()


def doctor_json() -> tuple[int, dict[str, dict]]:
    """The exit status and the checks by name."""
    code, out = doctor("--json")
    body = json.loads(out)
    checks = {c["name"]: c for c in body["checks"]}
    assert body["status"] == health.worst(
        health.Check(n, c["status"], "") for n, c in checks.items()
    )
    return code, checks


@pytest.fixture
def no_redis(monkeypatch):
    monkeypatch.setitem(django_settings.SAGE, "REDIS_URL", None)
    monkeypatch.setitem(django_settings.SAGE, "SAGE_JOBS_REDIS_URL", None)


def closed_port_url(password: str = "") -> str:
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{free_port()}/0"


@pytest.mark.django_db
def test_a_healthy_host_passes(no_redis):
    snapshot(age=1)
    code, checks = doctor_json()
    assert code == 0
    assert [n for n, c in checks.items() if c["status"] == "fail"] == []
    assert checks["settings"]["status"] == "ok"
    assert checks["database"]["status"] == "ok"
    assert checks["migrations"]["detail"] == "all applied"
    assert checks["redis"]["detail"] == "not configured (REDIS_URL unset)"
    assert checks["workers"]["status"] == "ok"
    assert checks["workers"]["workers"][0]["worker_id"] == "host-w1:4242:w1"
    assert checks["queue"]["detail"] == "no queued runs"
    assert checks["stuck_runs"]["status"] == "ok"
    assert checks["clock"]["status"] == "ok"


@pytest.mark.django_db
def test_it_flags_a_stopped_worker(no_redis):
    snapshot(age=120)  # stopped publishing two minutes ago (killed, paused)
    code, checks = doctor_json()
    assert code == 1
    workers = checks["workers"]
    assert workers["status"] == "fail"
    assert workers["detail"].startswith("no worker heartbeat in the last 30 s")
    assert "manage.py runworker" in workers["action"]
    assert [(w["worker_id"], w["age_seconds"] >= 120) for w in workers["workers"]] == [
        ("host-w1:4242:w1", True)
    ]


@pytest.mark.django_db
def test_it_warns_about_a_stale_worker_next_to_a_live_one(no_redis):
    snapshot("old", age=90)
    snapshot("new", age=1)
    code, checks = doctor_json()
    assert code == 0
    assert checks["workers"]["status"] == "warn"
    assert "1 live, 1 stale" in checks["workers"]["detail"]


@pytest.mark.django_db
def test_it_flags_a_run_stuck_past_its_lease(no_redis, alice, make_session):
    snapshot(age=1)
    session = make_session(alice)
    stuck = Run.objects.create(
        session=session,
        owner=alice,
        status=RunStatus.RUNNING,
        lease_owner="gone:1:x",
        lease_token=1,
        lease_expires_at=timezone.now() - timedelta(minutes=5),
    )
    code, checks = doctor_json()
    assert code == 1
    found = checks["stuck_runs"]
    assert found["status"] == "fail"
    assert found["stuck"] == 1
    assert found["oldest_run"] == str(stuck.pk)
    assert found["expired_seconds"] >= 300
    assert "start a worker" in found["action"]
    # A lease that is only just past (the reaper has not come round yet) is not stuck.
    Run.objects.filter(pk=stuck.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=5))
    assert doctor_json()[1]["stuck_runs"]["status"] == "ok"


@pytest.mark.django_db
def test_it_warns_about_a_run_queued_for_long(no_redis, alice, make_session):
    snapshot(age=1)
    session = make_session(alice)
    waiting = Run.objects.create(
        session=session, owner=alice, created_at=timezone.now() - timedelta(minutes=10)
    )
    code, checks = doctor_json()
    assert code == 0
    assert checks["queue"]["status"] == "warn"
    assert checks["queue"]["oldest_run"] == str(waiting.pk)
    assert checks["queue"]["oldest_wait_seconds"] >= 600


@pytest.mark.django_db
def test_it_flags_an_unreachable_redis_without_showing_its_password(monkeypatch):
    snapshot(age=1)
    monkeypatch.setitem(django_settings.SAGE, "REDIS_URL", closed_port_url("hunter2pw"))
    monkeypatch.setitem(django_settings.SAGE, "SAGE_JOBS_REDIS_URL", None)
    code, checks = doctor_json()
    assert code == 1
    assert checks["redis"]["status"] == "fail"
    assert checks["redis"]["detail"].startswith("unreachable at 127.0.0.1:")
    assert checks["redis"]["action"] == "start Redis or fix REDIS_URL"
    code, text = doctor()
    assert code == 1
    assert "hunter2pw" not in text
    assert "hunter2pw" not in json.dumps(checks)


@pytest.mark.django_db
def test_it_pings_each_configured_redis(monkeypatch, redis_url):
    snapshot(age=1)
    monkeypatch.setitem(django_settings.SAGE, "REDIS_URL", redis_url)
    monkeypatch.setitem(django_settings.SAGE, "SAGE_JOBS_REDIS_URL", closed_port_url())
    code, checks = doctor_json()
    assert code == 1
    assert checks["redis"]["status"] == "ok"
    assert checks["redis"]["detail"].startswith("Redis ")
    assert checks["jobs_redis"]["status"] == "fail"
    assert checks["jobs_redis"]["action"] == "start Redis or fix SAGE_JOBS_REDIS_URL"


@pytest.mark.django_db
def test_the_text_report_is_one_aligned_line_per_check(no_redis):
    code, text = doctor()
    assert code == 1  # no worker
    lines = text.splitlines()
    checks = [line for line in lines if not line.startswith(" ")]
    assert [line.split()[1] for line in checks] == [
        "settings", "database", "migrations", "redis", "workers", "queue", "stuck_runs",
        "clock", *(["statistics"] if connection.vendor == "postgresql" else []),
        *(["disk"] if "disk" in text else []),
    ]  # fmt: skip
    assert {line.index(line.split()[2]) for line in checks} == {18}  # details line up
    assert lines[lines.index(next(x for x in checks if " workers " in x)) + 1].startswith(
        "      → start a worker"
    )


@pytest.mark.django_db(transaction=True)
def test_the_command_reads_redis_from_the_environment_and_exits_1():
    snapshot(age=1)
    env = worker_env({"REDIS_URL": closed_port_url("s3cretpw"), "SAGE_JOB_RUNTIME": "memory"})
    result = subprocess.run(
        [sys.executable, "manage.py", "doctor", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["redis"]["status"] == "fail"
    assert checks["workers"]["status"] == "ok"  # the same database as this test's
    assert "s3cretpw" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("skew", "status"), [(0.2, "ok"), (-2.0, "warn"), (12.0, "fail")]
)  # fmt: skip
def test_clock_skew_thresholds(skew, status):
    check = health.clock_check(skew)
    assert check.status == status
    assert check.data["skew_seconds"] == skew
    assert ("behind" in check.detail) == (skew < 0)


@pytest.mark.parametrize(
    ("free", "status"), [(2 << 30, "ok"), (500 << 20, "warn"), (50 << 20, "fail")]
)  # fmt: skip
def test_sqlite_disk_thresholds(free, status):
    check = health.disk_check("/data", free)
    assert check.status == status
    assert check.data["free_bytes"] == free


def _table(name="scheduling_run", live=100, changed=0, enabled=True) -> health.TableStatistics:
    return health.TableStatistics(name, live, changed, enabled)


@pytest.mark.parametrize(
    ("autovacuum", "table", "status", "found"),
    [
        (True, _table(), "ok", "statistics current"),
        (False, _table(), "warn", "autovacuum is off"),
        (True, _table(enabled=False), "warn", "autovacuum is off for scheduling_run"),
        (True, _table(live=100, changed=9_999), "ok", "statistics current"),
        (True, _table(live=100, changed=10_000), "warn", "changed 10,000 rows"),
        (True, _table(live=50_000, changed=40_000), "ok", "statistics current"),
        (True, _table(live=50_000, changed=50_000), "warn", "(50,000 live)"),
    ],
)  # fmt: skip
def test_statistics_thresholds(autovacuum, table, status, found):
    check = health.statistics_check(autovacuum, [table])
    assert (check.status, found in check.detail) == (status, True), check.detail
    assert (
        check.data["tables"]["scheduling_run"]["changed_since_analyze"]
        == table.changed_since_analyze
    )
    assert bool(check.action) == (status == "warn")


@pytest.mark.django_db
def test_the_statistics_check_reads_the_servers_autovacuum_and_the_run_tables(no_redis):
    _, checks = doctor_json()
    if connection.vendor != "postgresql":
        assert "statistics" not in checks  # PostgreSQL's planner only
        return
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        on = cursor.fetchone()[0] == "on"
    statistics = checks["statistics"]
    assert statistics["autovacuum"] is on
    assert set(statistics["tables"]) == {"scheduling_run", "scheduling_event", "scheduling_session"}
    assert ("autovacuum is off" in statistics["detail"]) == (not on)
