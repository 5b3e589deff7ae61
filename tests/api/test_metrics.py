"""``GET /metrics``: who may read it, and each family against what it is read from — the
database's runs, the workers' snapshots and the web processes' counter files."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from sageproject import config, counters
from scheduling import figures
from scheduling.models import Run, RunStatus, WorkerSnapshot
from scheduling.runs import db_now
from tests.conftest import client_for, demo_manifest, scripted_model
from tests.scheduling.processes import live_web_server, worker_env
from tests.scrape import TOKEN, Scrape, assert_run_families_match, metrics_dir_fixture, scrape

ROOT = Path(__file__).resolve().parents[2]
metrics_dir = metrics_dir_fixture


# ----------------------------------------------------------------------------- who may read


@pytest.mark.django_db
def test_it_refuses_a_request_without_credentials(metrics_dir):
    response = APIClient().get("/metrics")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "auth.required"
    assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'


@pytest.mark.django_db
def test_a_staff_token_reads_it_and_a_user_token_is_forbidden(metrics_dir, alice, staff):
    response = client_for(alice).get("/metrics")
    assert response.status_code == 403
    assert response.json()["error"] == {
        "code": "auth.forbidden",
        "category": "AUTHORIZATION",
        "message": "metrics are for staff",
        "retryable": False,
        "resumable": False,
        "details": {},
    }
    response = client_for(staff).get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert Scrape(response.content.decode()).types["sage_runs"] == "gauge"
    unknown = APIClient().get("/metrics", HTTP_AUTHORIZATION="Token " + "0" * 40)
    assert unknown.status_code == 401


@pytest.mark.django_db
def test_the_bearer_token_must_match(metrics_dir, settings):
    assert APIClient().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    wrong = TOKEN[:-1] + ("x" if TOKEN[-1] != "x" else "y")
    for header in (f"Bearer {wrong}", "Bearer ", "Bearer", f"Basic {TOKEN}"):
        response = APIClient().get("/metrics", HTTP_AUTHORIZATION=header)
        assert response.status_code == 401, header
        assert response.json()["error"]["code"] == "auth.required"
    settings.SAGE = {**settings.SAGE, "SAGE_METRICS_TOKEN": None}
    response = APIClient().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 401


@pytest.mark.django_db
def test_it_answers_get_only_and_stays_out_of_the_api_schema(metrics_dir, staff):
    response = APIClient().post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "request.method_not_allowed"
    schema = client_for(staff).get("/api/schema/", HTTP_ACCEPT="application/json")
    assert schema.status_code == 200
    assert not [path for path in schema.json()["paths"] if "metrics" in path]


def test_the_settings_are_checked_and_a_bad_token_is_never_echoed():
    loaded = config.load({"SAGE_METRICS_TOKEN": "short secret", "SAGE_METRICS_DIR": "rel/dir"})
    assert {(p.check_id, p.message) for p in loaded.errors} == {
        (
            "sageproject.E070",
            "SAGE_METRICS_TOKEN must be at least 16 printable characters without spaces",
        ),
        ("sageproject.E071", "SAGE_METRICS_DIR must be an absolute path (got 'rel/dir')"),
    }
    assert (loaded["SAGE_METRICS_TOKEN"], loaded["SAGE_METRICS_DIR"]) == (None, None)
    good = config.load({"SAGE_METRICS_TOKEN": TOKEN, "SAGE_METRICS_DIR": "/var/lib/sage"})
    assert good.errors == []
    assert (good["SAGE_METRICS_TOKEN"], good["SAGE_METRICS_DIR"]) == (TOKEN, "/var/lib/sage")


# ----------------------------------------------------------------------------- the database


def _runs(owner, session, queue: str, status: str, n: int, **fields) -> None:
    for _ in range(n):
        Run.objects.create(
            session=session, owner=owner, queue=queue, status=status, ready=False, **fields
        )


@pytest.mark.storage
@pytest.mark.django_db
def test_the_run_families_equal_the_database(metrics_dir, alice, make_session):
    session = make_session(alice)
    now = db_now()
    started = {"started_at": now}
    _runs(alice, session, "chat", RunStatus.COMPLETED, 3, **started)
    _runs(alice, session, "chat", RunStatus.FAILED, 1, **started)
    _runs(alice, session, "managed", RunStatus.COMPLETED, 2, **started)
    _runs(alice, session, "managed", RunStatus.CANCELLED, 2)  # cancelled before a start
    _runs(alice, session, "chat", RunStatus.INTERRUPTED, 1, **started)
    _runs(alice, session, "chat", RunStatus.RUNNING, 1, **started)
    _runs(alice, session, "chat", RunStatus.SUSPENDED, 1, **started)
    # Queued: a ready run available for 120 s, and older ones that are not their session's
    # turn yet (not waiting for a worker: they do not make the queue's age).
    Run.objects.create(
        session=session,
        owner=alice,
        queue="chat",
        status=RunStatus.QUEUED,
        ready=True,
        available_at=now - timedelta(seconds=120),
    )
    _runs(alice, session, "chat", RunStatus.QUEUED, 2, available_at=now - timedelta(hours=2))
    _runs(alice, session, "managed", RunStatus.QUEUED, 1, available_at=now - timedelta(hours=2))

    got = scrape()
    assert_run_families_match(got)
    assert got.value("sage_runs_submitted_total", queue="chat") == 10
    assert got.value("sage_runs_finished_total", queue="managed", outcome="cancelled") == 2
    chat_age = got.value("sage_queue_oldest_age_seconds", queue="chat")
    assert 120 <= chat_age < 3600
    assert got.value("sage_queue_oldest_age_seconds", queue="managed") == 0
    assert got.types["sage_runs_finished"] == "counter"


@pytest.mark.storage
@pytest.mark.django_db
def test_a_scrape_costs_a_few_queries_whatever_the_rows(metrics_dir, alice, make_session):
    session = make_session(alice)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            scrape()
        return len(captured.captured_queries)

    few = queries()
    _runs(alice, session, "chat", RunStatus.COMPLETED, 50, started_at=timezone.now())
    _runs(alice, session, "managed", RunStatus.QUEUED, 20)
    for i in range(5):
        _snapshot(f"w{i}", timezone.now(), capacity={"runs": {"active": i}})
    assert queries() == few <= 4


# ----------------------------------------------------------------------------- worker snapshots


def _snapshot(worker: str, heartbeat, *, stopped=None, capacity=None) -> WorkerSnapshot:
    return WorkerSnapshot.objects.create(
        worker_id=worker,
        host="host",
        pid=1,
        started_at=heartbeat,
        heartbeat_at=heartbeat,
        stopped_at=stopped,
        capacity=capacity or {},
    )


@pytest.mark.django_db
def test_worker_families_come_from_recent_snapshots(metrics_dir):
    counted = figures.Figures()
    counted.count(figures.LEASE_RECLAIMS, 2)
    counted.count(figures.FENCE_REJECTIONS, write="events")
    counted.count(figures.SUSPENSIONS, code="model.queue_full")
    counted.count(figures.SUSPENSIONS, code="model.queue_full")
    counted.count(figures.RATE_LIMITED, code="upstream.rate_limited")
    counted.count(figures.MODEL_TOKENS, 11, model="gpt-x", type="input")
    counted.count(figures.MODEL_TOKENS, 4, model="gpt-x", type="output")
    counted.observe(figures.START_WAIT, 0.003, queue="chat")
    counted.observe(figures.START_WAIT, 7, queue="chat")
    counted.observe(figures.FIRST_TOKEN, 0.25, model="gpt-x")
    counted.count(figures.MCP_CALLS, server="crm", outcome="ok")
    counted.count(figures.MCP_CALLS, server="crm", outcome="timeout")
    counted.observe(figures.MCP_CALL_SECONDS, 0.04, server="crm")
    capacity = {
        "runs": {"active": 3},
        "executor": {
            "model_calls": {"active": 2, "waiting": 1, "limit": 8, "rejected": 5, "timed_out": 1},
            "model_clients": {"clients": 4, "closing_clients": 1, "constructions": 9},
            "management": {"applications": 6, "limit": 32},
            "jobs": {"runtime": "InMemoryJobRuntime", "admitted": 1, "retained_terminal": 7},
            "code_tools": {"sessions": {"live": 2, "rss": 1000, "evictions": 3}},
        },
        "store": {"transactions": 40, "commits": 90, "rejected": 2, "redone": 1},
        "metrics": counted.snapshot(),
    }
    now = db_now()
    _snapshot("w-live", now - timedelta(seconds=5), capacity=capacity)
    _snapshot("w-silent", now - timedelta(seconds=120))  # killed: no stop, no heartbeat
    stopped = now - timedelta(seconds=60)
    _snapshot("w-stopped", stopped, stopped=stopped, capacity={"runs": {"active": 0}})
    old = now - timedelta(hours=2)
    _snapshot("w-old", old, stopped=old, capacity=capacity)

    got = scrape()
    assert got.value("sage_workers_live") == 1
    assert got.series("sage_worker_up") == {
        (("worker", "w-live"),): 1,
        (("worker", "w-silent"),): 1,
        (("worker", "w-stopped"),): 0,
    }
    assert 120 <= got.value("sage_worker_heartbeat_age_seconds", worker="w-silent") < 3600
    assert 5 <= got.value("sage_worker_heartbeat_age_seconds", worker="w-live") < 120
    live = {"worker": "w-live"}
    assert got.value("sage_worker_runs_executing", **live) == 3
    assert got.value("sage_model_calls_active", **live) == 2
    assert got.value("sage_model_calls_waiting", **live) == 1
    assert got.value("sage_model_calls_rejected_total", **live) == 5
    assert got.value("sage_model_calls_timed_out_total", **live) == 1
    assert got.value("sage_model_clients", **live) == 4
    assert got.value("sage_model_clients_closing", **live) == 1
    assert got.value("sage_model_client_constructions_total", **live) == 9
    assert got.value("sage_applications_resident", **live) == 6
    assert got.value("sage_jobs_active", **live) == 1
    assert got.value("sage_jobs_retained", **live) == 7
    assert got.value("sage_code_sessions_live", **live) == 2
    assert got.value("sage_code_sessions_rss_bytes", **live) == 1000
    assert got.value("sage_code_session_evictions_total", **live) == 3
    assert got.value("sage_store_transactions_total", **live) == 40
    assert got.value("sage_store_commits_total", **live) == 90
    assert got.value("sage_store_commits_rejected_total", **live) == 2
    assert got.value("sage_store_batches_redone_total", **live) == 1
    assert got.value("sage_lease_reclaims_total", **live) == 2
    assert got.value("sage_lease_reclaims_total", worker="w-stopped") == 0
    assert got.value("sage_fence_rejections_total", write="events", **live) == 1
    assert got.value("sage_run_suspensions_total", code="model.queue_full", **live) == 2
    assert got.value("sage_worker_rate_limited_total", code="upstream.rate_limited", **live) == 1
    assert got.value("sage_model_tokens_total", model="gpt-x", type="input", **live) == 11
    assert got.value("sage_model_tokens_total", model="gpt-x", type="output", **live) == 4
    wait = {"queue": "chat", **live}
    assert got.value("sage_run_start_wait_seconds_bucket", le="0.005", **wait) == 1
    assert got.value("sage_run_start_wait_seconds_bucket", le="5.0", **wait) == 1
    assert got.value("sage_run_start_wait_seconds_bucket", le="10.0", **wait) == 2
    assert got.value("sage_run_start_wait_seconds_bucket", le="+Inf", **wait) == 2
    assert got.value("sage_run_start_wait_seconds_count", **wait) == 2
    assert got.value("sage_run_start_wait_seconds_sum", **wait) == pytest.approx(7.003)
    assert got.value("sage_model_first_token_seconds_count", model="gpt-x", **live) == 1
    assert got.value("sage_mcp_calls_total", server="crm", outcome="timeout", **live) == 1
    assert got.value("sage_mcp_call_seconds_bucket", le="0.05", server="crm", **live) == 1
    assert got.types["sage_run_start_wait_seconds"] == "histogram"
    assert not got.series("sage_worker_runs_executing", worker="w-old")
    for name, kind in got.types.items():
        assert name.startswith("sage_"), name
        assert got.helps[name], name
        if kind == "counter":
            assert name not in got.samples, name  # counters' samples end in _total


# ----------------------------------------------------------------------------- web processes


def _count_in_subprocess(directory: Path, code: str, times: int) -> None:
    script = (
        "import django; django.setup()\n"
        "from sageproject import counters\n"
        f"for _ in range({times}): counters.rate_limited({code!r})\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "sageproject.settings",
        "SAGE_METRICS_DIR": str(directory),
    }
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True, timeout=120)


@pytest.mark.django_db
def test_counters_of_several_processes_add_up_and_outlive_them(metrics_dir):
    counters.rate_limited("scheduler.queue_full")  # this process, still alive
    _count_in_subprocess(metrics_dir, "scheduler.queue_full", 3)
    _count_in_subprocess(metrics_dir, "model.queue_full", 2)
    files = sorted(p.name for p in metrics_dir.glob("*.db"))
    got = scrape()
    assert got.value("sage_api_rate_limited_total", code="scheduler.queue_full") == 4
    assert got.value("sage_api_rate_limited_total", code="model.queue_full") == 2
    # The exited processes' files were folded into the archive by that scrape.
    assert files != sorted(p.name for p in metrics_dir.glob("*.db"))
    assert {p.name for p in metrics_dir.glob("*.db")} == {
        "counter_archive.db",
        f"counter_{os.getpid()}.db",
    }
    counters.rate_limited("scheduler.queue_full")
    again = scrape()
    assert again.value("sage_api_rate_limited_total", code="scheduler.queue_full") == 5
    assert again.value("sage_api_rate_limited_total", code="model.queue_full") == 2


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
def test_429s_answered_by_two_web_processes_add_up(tmp_path, alice, make_session):
    """Submissions past the pending limit through two uvicorn workers: the scrape (by
    either process) counts every 429 they answered, and the queue's depth."""
    scripted_model("scripted")
    session = make_session(alice, manifest=demo_manifest())
    key = Token.objects.get_or_create(user=alice)[0].key
    directory = tmp_path / "metrics"
    env = worker_env(
        {
            "SAGE_METRICS_DIR": str(directory),
            "SAGE_METRICS_TOKEN": TOKEN,
            "SAGE_SERVER_MAX_PENDING_RUNS": "5",
        }
    )

    async def flood(base: str, n: int) -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:

            async def submit(i: int) -> int:
                response = await client.post(
                    "/api/v1/runs/",
                    json={"session": str(session.pk), "input": f"r{i}"},
                    headers={"Authorization": f"Token {key}"},
                )
                return response.status_code

            return list(await asyncio.gather(*(submit(i) for i in range(n))))

    with live_web_server(tmp_path / "web.log", env, workers=2) as base:
        statuses = asyncio.run(flood(base, 40))
        headers = {"Authorization": f"Bearer {TOKEN}"}
        answers = [httpx.get(f"{base}/metrics", headers=headers, timeout=60) for _ in range(4)]
    assert sorted(set(statuses)) == [202, 429], statuses
    refused = statuses.count(429)
    assert refused == 40 - 5
    for answer in answers:
        assert answer.status_code == 200
        got = Scrape(answer.text)
        assert got.value("sage_api_rate_limited_total", code="scheduler.queue_full") == refused
        assert got.value("sage_queue_depth", queue="chat") == (
            Run.objects.filter(status=RunStatus.QUEUED).count()
        )
