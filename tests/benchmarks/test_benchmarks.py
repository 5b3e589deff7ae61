"""The benchmark commands, each in a tiny configuration: every stdout line is JSON with the
expected keys, the database paths run through the real scheduler and store on the
configured database (run once per database), and they leave no rows behind.

No timing is asserted: only the shape of the output and the clean-up.
"""

from __future__ import annotations

from io import StringIO
from typing import Any

import orjson
import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection

from scheduling.models import Event, Run, RunStatus, Session

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

SINGLE_HOST_KEYS = {
    "path",
    "backend",
    "sessions",
    "writes",
    "simulated_io_ms",
    "elapsed_ms",
    "ideal_ms",
    "ratio_to_ideal",
    "peak_concurrent_writes",
    "median_write_ms",
    "p95_write_ms",
    "runs_per_s",
    "repeats",
}
DB_PER_RUN_KEYS = SINGLE_HOST_KEYS | {
    "database",
    "users",
    "claim_ms",
    "median_finish_ms",
    "p95_finish_ms",
    "transactions",
    "largest_batch",
    "store_writers",
    "ratio_to_memory",
}
FAIRNESS_KEYS = {
    "path",
    "backend",
    "order",
    "slots",
    "per_user_limit",
    "run_ms",
    "jitter",
    "big_user_runs",
    "small_user_runs",
    "users",
    "small_p99_ms",
    "small_p99_runs",
}
FAIRNESS_DB_KEYS = FAIRNESS_KEYS | {
    "database",
    "claims",
    "median_claim_ms",
    "median_release_ms",
}
USER_KEYS = {"runs", "p50_ms", "p99_ms", "p50_runs", "p99_runs"}


def run_command(name: str, *args: str) -> list[dict[str, Any]]:
    out = StringIO()
    call_command(name, *args, stdout=out, stderr=StringIO())
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert lines, f"{name} printed nothing"
    return [orjson.loads(line) for line in lines]


def assert_nothing_left() -> None:
    assert not get_user_model().objects.filter(username__startswith="bench-").exists()
    assert Run.objects.count() == 0
    assert Session.objects.count() == 0
    assert Event.objects.count() == 0


def test_single_host_memory_and_database_lines() -> None:
    lines = run_command(
        "bench_single_host",
        "--sessions",
        "4",
        "--writes",
        "2",
        "--io-ms",
        "1",
        "--repeat",
        "1",
        "--users",
        "2",
    )
    by_path = {line["path"]: line for line in lines}
    assert [line["path"] for line in lines] == ["global_baseline", "per_run", "db_per_run"]
    for path in ("global_baseline", "per_run"):
        assert SINGLE_HOST_KEYS <= by_path[path].keys()
        assert by_path[path]["backend"] == "memory"
        assert by_path[path]["writes"] == 8
    assert "speedup" in by_path["per_run"]
    db = by_path["db_per_run"]
    assert DB_PER_RUN_KEYS <= db.keys()
    assert db["backend"] == "database"
    assert db["database"] == connection.vendor
    assert db["sessions"] == 4 and db["users"] == 2 and db["writes"] == 8
    assert_nothing_left()


def test_single_host_memory_only() -> None:
    args = ["--sessions", "2", "--writes", "1", "--repeat", "1", "--backend", "memory"]
    lines = run_command("bench_single_host", *args)
    assert [line["path"] for line in lines] == ["global_baseline", "per_run"]


def test_fairness_memory_and_database_lines() -> None:
    lines = run_command(
        "bench_fairness",
        "--slots",
        "3",
        "--big",
        "6",
        "--db-big",
        "4",
        "--small",
        "1",
        "--run-ms",
        "5",
        "--db-run-ms",
        "30",
        "--settle",
        "1",
    )
    paths = [line["path"] for line in lines]
    assert paths == [
        "fair_3x3",
        "oldest_3x3",
        "fair_3x2",
        "oldest_3x2",
        "db_fair_3x3",
        "db_oldest_3x3",
        "db_fair_3x2",
        "db_oldest_3x2",
    ]
    for line in lines:
        database = line["path"].startswith("db_")
        assert (FAIRNESS_DB_KEYS if database else FAIRNESS_KEYS) <= line.keys()
        assert line["backend"] == ("database" if database else "memory")
        assert set(line["users"]) == {"A", "B", "C", "D", "E"}
        for user, figures in line["users"].items():
            assert USER_KEYS <= figures.keys()
            assert figures["runs"] == (line["big_user_runs"] if user == "A" else 1)
        if database:
            assert line["database"] == connection.vendor
            assert line["big_user_runs"] == 4 and line["run_ms"] == 30
    assert_nothing_left()


def test_persist_lines_are_fenced() -> None:
    lines = run_command(
        "bench_persist",
        "--events",
        "10,20",
        "--commits",
        "2",
        "--sessions",
        "2",
        "--commits-per-session",
        "2",
        "--writers",
        "2",
    )
    paths = [line["path"] for line in lines]
    assert paths == ["append_one"] * 2 + ["concurrent"] * 4 + ["group_commit_speedup"] * 2
    for line in lines:
        assert line["fenced"] is True
        assert line["database"] == connection.vendor
    assert {"events", "commits", "median_ms", "p95_ms", "ratio_vs_first"} <= lines[0].keys()
    assert {
        "sessions",
        "commits_per_session",
        "group_commit",
        "writers",
        "elapsed_ms",
        "events",
        "events_per_s",
        "transactions",
        "largest_batch",
    } <= lines[2].keys()
    assert {"writers", "ratio"} <= lines[-1].keys()
    assert_nothing_left()


def test_database_paths_refuse_a_database_with_live_runs() -> None:
    owner = get_user_model().objects.create_user(username="someone")
    session = Session.objects.create(owner=owner, package_ref="r", package_name="p", agent_id="a")
    Run.objects.create(session=session, owner=owner, status=RunStatus.QUEUED)
    for name, args in (
        ("bench_single_host", ["--sessions", "2", "--writes", "1", "--repeat", "1"]),
        ("bench_fairness", ["--backend", "database", "--db-big", "2"]),
        ("bench_persist", ["--events", "10", "--commits", "1", "--sessions", "1"]),
    ):
        with pytest.raises(CommandError, match="scratch database"):
            call_command(name, *args, stdout=StringIO(), stderr=StringIO())
    assert Run.objects.get().status == RunStatus.QUEUED
