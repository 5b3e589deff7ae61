"""``manage.py bench_mcp`` in a tiny configuration on the test database: an SDK-built MCP
server on loopback and a real ``runworker`` subprocess. Checks the one JSON line's keys
and that the benchmark leaves no rows behind; no timing is asserted."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from agents.models import McpConnection
from pooling.models import ModelRecord
from scheduling.models import WorkerSnapshot
from tests.benchmarks.test_benchmarks import assert_nothing_left, run_command

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

MACHINE_KEYS = {"cpus", "load_1m", "cpu_speed"}
FIGURES = {"p50_ms", "p99_ms", "mean_ms"}
OVERHEAD_KEYS = {
    "path",
    "calls",
    "warmup",
    "bare_sdk",
    "sage",
    "added_p50_ms",
    "added_mean_ms",
    "added_paired_p50_ms",
    "target_added_p50_ms",
}
CONCURRENT_KEYS = {
    "runs",
    "users",
    "calls_per_run",
    "runs_completed",
    "runs_ended",
    "seconds",
    "runs_per_s",
    "calls_succeeded",
    "calls_failed",
    "calls_failed_because",
    "calls_per_s",
    "server_calls",
    "pool_full_retries",
    "max_sessions_configured",
    "max_sessions_held_snapshot",
    "max_sessions_open_server",
    "sessions_opened_server",
    "held_within_limit",
}


def test_it_writes_one_line_with_both_paths_and_leaves_nothing():
    args = ["--calls", "20", "--runs", "6", "--users", "2", "--calls-per-run", "2"]
    (line,) = run_command("bench_mcp", *args, "--max-sessions", "4")
    assert {"path", "database", "overhead", "concurrent"} | MACHINE_KEYS <= line.keys()
    assert line["database"] == connection.vendor
    overhead = line["overhead"]
    assert OVERHEAD_KEYS <= overhead.keys()
    assert FIGURES <= overhead["bare_sdk"].keys() and FIGURES <= overhead["sage"].keys()
    concurrent = line["concurrent"]
    assert CONCURRENT_KEYS <= concurrent.keys()
    assert concurrent["runs_completed"] == 6
    assert concurrent["calls_succeeded"] + concurrent["calls_failed"] == 12
    assert concurrent["max_sessions_configured"] == 4
    assert concurrent["held_within_limit"] is True
    assert_nothing_left()
    assert not McpConnection.objects.exists()
    assert not ModelRecord.objects.filter(name__startswith="bench-mcp-").exists()
    assert not WorkerSnapshot.objects.exists()


def test_it_skips_the_concurrent_path_when_asked():
    (line,) = run_command("bench_mcp", "--calls", "5", "--skip-concurrent")
    assert "concurrent" not in line and OVERHEAD_KEYS <= line["overhead"].keys()


def test_it_refuses_sizes_below_one():
    with pytest.raises(CommandError, match="--runs must be positive"):
        call_command("bench_mcp", "--runs", "0", stdout=StringIO(), stderr=StringIO())
