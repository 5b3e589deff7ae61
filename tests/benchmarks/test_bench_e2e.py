"""``manage.py bench_e2e`` for this host only (no peers), in a tiny configuration on the test
database: a real ``runworker`` subprocess and a real ``uvicorn`` web process against it.

Checks that every stdout line is JSON with the expected keys and that the benchmark leaves
no rows behind. No timing is asserted.
"""

from __future__ import annotations

from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from pooling.models import ModelRecord
from scheduling.models import WorkerSnapshot
from tests.benchmarks.test_benchmarks import assert_nothing_left as assert_no_bench_rows
from tests.benchmarks.test_benchmarks import run_command

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

COMMON = {"path", "database", "host"}
CLAIM_KEYS = COMMON | {"limit", "users", "repeat", "by_queued", "ratio"}
CLAIM_SIZE_KEYS = {"median_ms", "p90_ms", "min_ms", "claimed_per_call"}
DISTRIBUTION = {"p50_ms", "p99_ms", "mean_ms", "max_ms"}
THROUGHPUT_KEYS = COMMON | {
    "concurrency",
    "users",
    "n",
    "submit_threads",
    "submit_s",
    "submits_per_s",
    "first_submit_to_last_start_s",
    "started_per_s",
    "runs_ended",
    "start",
}
LATENCY_KEYS = (
    COMMON
    | DISTRIBUTION
    | {
        "concurrency",
        "users",
        "n",
        "rate_per_s",
        "achieved_rate_per_s",
        "late_submits",
        "min_ms",
        "runs_ended",
        "start",
    }
)
HTTP_KEYS = (
    COMMON
    | DISTRIBUTION
    | {
        "clients",
        "seconds",
        "requests",
        "req_per_s",
        "status",
        "sessions_reused",
        "drain_s",
        "web_workers",
        "worker",
    }
)
TOKEN_KEYS = (
    COMMON
    | DISTRIBUTION
    | {
        "runs",
        "tokens_per_run",
        "token_gap_ms",
        "tokens",
        "tokens_expected",
        "dropped",
        "concurrent_streams",
        "model",
    }
)
EVENT_KEYS = (
    COMMON
    | DISTRIBUTION
    | {"event", "n", "concurrent_streams", "note"}
    | {f"submit_to_client_{k}" for k in DISTRIBUTION}
)

TINY = [
    "--n",
    "6",
    "--latency-n",
    "4",
    "--rate",
    "20",
    "--concurrency",
    "4",
    "--users",
    "2",
    "--claim-queued",
    "5,40",
    "--claim-repeat",
    "2",
    "--history",
    "8",
    "--timeout",
    "120",
]


def run_bench(*args: str) -> list[dict[str, Any]]:
    return run_command("bench_e2e", *TINY, *args)


def assert_nothing_left() -> None:
    assert_no_bench_rows()
    assert WorkerSnapshot.objects.count() == 0
    assert not ModelRecord.objects.filter(name="scripted").exists()


def check_host_lines(by_path: dict[str, dict[str, Any]]) -> None:
    claim = by_path["claim"]
    assert CLAIM_KEYS <= claim.keys()
    assert set(claim["by_queued"]) == {"5", "40"}
    for size, figures in claim["by_queued"].items():
        assert CLAIM_SIZE_KEYS <= figures.keys()
        assert figures["claimed_per_call"] == min(32, int(size))

    throughput = by_path["throughput"]
    assert THROUGHPUT_KEYS <= throughput.keys()
    assert throughput["n"] == 6
    assert throughput["history"] == 8  # the runs executed before the paths, kept
    assert throughput["runs_ended"] == {"completed": 6}
    assert throughput["started_per_s"] > 0

    latency = by_path["latency"]
    assert LATENCY_KEYS <= latency.keys()
    assert latency["n"] == 4 and latency["rate_per_s"] == 20
    assert latency["runs_ended"] == {"completed": 4}
    for line in by_path.values():
        assert not any(key.startswith("ratio_to_") for key in line)
        assert line["database"] == connection.vendor and line["host"] == "sage"


# The targets a line carries: the on PostgreSQL, the start of a run's p50 on the
# embedded SQLite default, none on MySQL.
TARGET_KEYS = {
    "postgresql": {
        "claim": {"target_ratio_max"},
        "throughput": {"target_started_per_s"},
        "latency": {"target_p50_ms", "target_p99_ms"},
        "http_admission": {"target_req_per_s", "target_p99_ms"},
    },
    "sqlite": {"latency": {"target_p50_ms"}},
}


def test_host_paths_without_peers() -> None:
    # Off PostgreSQL a named peer is skipped with a line of its own (and no ratio appears);
    # on PostgreSQL a real peer run is too big for a unit test, so none is asked for.
    postgres = connection.vendor == "postgresql"
    peers = "none" if postgres else "celery"
    lines = run_bench(
        "--peers",
        peers,
        "--http-seconds",
        "1",
        "--http-clients",
        "3",
        "--sse-n",
        "2",
        "--sse-tokens",
        "3",
        "--sse-token-gap-ms",
        "5",
    )
    paths = [line["path"] for line in lines]
    host_paths = [
        "claim",
        "throughput",
        "latency",
        "http_admission",
        "http_admission_with_worker",
        "token_to_sse",
        "event_to_sse",
    ]
    assert paths == (host_paths if postgres else ["peer", *host_paths])
    for line in lines:
        assert {"cpus", "load_1m"} <= line.keys() and line["cpu_speed"] > 0
        if Path("/proc/stat").exists() and "skipped" not in line:
            # A measured path's line; a peer skipped at once may come before a clock tick.
            assert 0 <= line["steal_pct"] <= 100
    if not postgres:
        peer = lines.pop(0)
        assert peer["peer"] == "celery" and "PostgreSQL only" in peer["skipped"]
    by_path = {line["path"]: line for line in lines}
    check_host_lines(by_path)

    for path, worker in (("http_admission", "paused"), ("http_admission_with_worker", "running")):
        http = by_path[path]
        assert HTTP_KEYS <= http.keys()
        assert http["worker"] == worker
        assert http["clients"] == 3 and http["requests"] > 0
        assert sum(http["status"].values()) == http["requests"]
        assert set(http["status"]) <= {"202", "429"}
        # SQLite runs in the web processes: no database processes of its own.
        parts = {"web", "client"} | ({"database"} if connection.vendor != "sqlite" else set())
        assert set(http["cpu_ms_per_request"]) == parts
        assert all(ms >= 0 for ms in http["cpu_ms_per_request"].values())
        assert http["cpu_ms_per_request"]["web"] > 0
    expected = TARGET_KEYS.get(connection.vendor, {})
    for path, line in by_path.items():
        assert {key for key in line if key.startswith("target_")} == expected.get(path, set())
    if connection.vendor == "sqlite":
        assert by_path["latency"]["target_p50_ms"] == 20

    # Live deltas are best effort (a slow client loses some, counted): at least one arrives.
    tokens = by_path["token_to_sse"]
    assert TOKEN_KEYS <= tokens.keys()
    assert tokens["runs"] == 2 and tokens["tokens_expected"] == 6
    assert 0 < tokens["tokens"] <= 6

    event = by_path["event_to_sse"]
    assert EVENT_KEYS <= event.keys()
    assert event["n"] == 2 and event["event"] == "run.completed"
    assert_nothing_left()


def test_bad_options_are_refused() -> None:
    with pytest.raises(CommandError, match="unknown peer"):
        call_command("bench_e2e", "--peers", "rq", stdout=StringIO())
    with pytest.raises(CommandError, match="--n must be positive"):
        call_command("bench_e2e", "--n", "0", stdout=StringIO())
    with pytest.raises(CommandError, match="--history must be positive"):
        call_command("bench_e2e", "--history", "0", stdout=StringIO())


def test_write_back_asks_postgresql_for_a_checkpoint_or_skips_without_the_privilege() -> None:
    from django.test.utils import CaptureQueriesContext

    from benchmarks.e2e.harness import write_back

    with CaptureQueriesContext(connection) as asked:
        write_back()
    statements = [query["sql"] for query in asked.captured_queries]
    if connection.vendor != "postgresql":
        assert statements == []  # nothing to ask for
        return
    assert statements == ["CHECKPOINT"]
    role = f"bench_nopriv_{connection.settings_dict['NAME']}"[:60]
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE ROLE "{role}"')
    try:
        with connection.cursor() as cursor:
            cursor.execute(f'SET ROLE "{role}"')
        with CaptureQueriesContext(connection) as refused:
            write_back()  # refused by the server: the path goes on without it
        assert [query["sql"] for query in refused.captured_queries] == ["CHECKPOINT"]
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_user")
            assert cursor.fetchone() == (role,)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET ROLE")
            cursor.execute(f'DROP ROLE "{role}"')


def test_the_peers_are_given_every_option_of_the_method() -> None:
    """The peers execute the same history and the same paths as this host: each option the
    shared measurement reads reaches their driver subprocess."""
    from benchmarks.e2e.peers import DRIVER_OPTIONS

    method = {"history", "n", "latency_n", "rate", "submit_threads", "concurrency", "timeout"}
    assert method <= set(DRIVER_OPTIONS)
