"""``/metrics`` after a scripted workload through real workers: every family against the
database's own counts.

Phase A: a worker whose budget allows one model call at a time (one more may wait 50 ms)
takes four concurrent runs: some complete, the others are suspended with
``model.queue_full`` / ``model.queue_timeout``. Phase B: a second worker (code tools on,
renewals 20 s apart) retries them and runs a tool loop, a background job, a
``python_session`` call, a provider 429 (suspended) and a provider 500 (failed); one run is
cancelled before any worker sees it. Then one run loses its lease mid-stream (the test
expires it): its first execution's write is refused (a fence rejection), the run is
reclaimed (a crash) and its second execution completes. Last, submissions past the pending
limit are refused (429). The scrape while worker B runs and the one after both stopped are
compared with rows and events.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone
from rest_framework.test import APIClient

from agents import services
from agents.code_tools import CodeToolsRuntime
from agents.executor import RunExecutor
from agents.models import JobRecord
from agents.services import packages
from pooling.budget import ModelConcurrencyBudget
from pooling.interpreters import InterpreterLimits
from pooling.sessions import SessionPool
from scheduling.models import Event, Run, RunQueue, RunStatus, WorkerSnapshot
from scheduling.runs import db_now
from tests.conftest import client_for, demo_manifest, scripted_model, words
from tests.e2e.conftest import wait_for
from tests.scrape import assert_run_families_match, metrics_dir_fixture, scrape

pytestmark = [pytest.mark.storage, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

metrics_dir = metrics_dir_fixture

SETTLED = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.SUSPENDED, RunStatus.CANCELLED)


class Workload:
    """Packages (one per model), sessions and runs, remembering each run's model."""

    def __init__(self) -> None:
        self.model_of: dict[str, str] = {}

    def package(self, user, model: str, tools: list[str] | None = None) -> None:
        manifest = demo_manifest(name=f"p-{model}", model=model, tools=tools or ["clock"])
        packages.package_create(owner=user, manifest=manifest)

    def submit(self, user, model: str, text: str = "go") -> str:
        session = services.session_create(owner=user, package=f"p-{model}", agent="assistant")
        run, _ = services.run_submit(owner=user, session_id=session.pk, input=text)
        self.model_of[str(run.pk)] = model
        return str(run.pk)


def settled(run_ids) -> bool:
    return not Run.objects.filter(pk__in=run_ids).exclude(status__in=SETTLED).exists()


def events(kind: str) -> list[dict]:
    return [e.payload for e in Event.objects.filter(type=kind)]


def by(items, key) -> dict:
    counts: dict = {}
    for item in items:
        counts[key(item)] = counts.get(key(item), 0) + 1
    return counts


def completed_usage(model: str, model_of: dict[str, str]) -> tuple[int, int, int]:
    """(model calls, input tokens, output tokens) of the completed runs on ``model``."""
    calls = tokens_in = tokens_out = 0
    for run in Run.objects.filter(status=RunStatus.COMPLETED):
        if model_of[str(run.pk)] != model:
            continue
        calls += run.result["steps"]
        tokens_in += run.result["usage"]["input_tokens"]
        tokens_out += run.result["usage"]["output_tokens"]
    return calls, tokens_in, tokens_out


def snapshot_after(worker_id: str, moment) -> None:
    """Wait for a snapshot of ``worker_id`` published after ``moment`` and its pool's
    refresh (every second)."""
    wait_for(
        lambda: WorkerSnapshot.objects.filter(
            worker_id=worker_id, heartbeat_at__gt=moment + timedelta(seconds=1.1)
        ).exists(),
        message=f"a snapshot of {worker_id}",
    )


@pytest.mark.timing
def test_each_family_agrees_with_the_database(
    alice, bob, carol, staff, start_worker, metrics_dir, settings
):
    work = Workload()
    scripted_model("slow", {"text": words(6)}, token_delay_ms=80)
    scripted_model(
        "tooly", {"text": "", "tool_calls": [{"name": "clock", "arguments": {}}]}, {"text": "ok"}
    )
    scripted_model("limited", error={"status": 429, "retry_after": 3})
    scripted_model("broken", error={"status": 500})
    scripted_model(
        "jobber",
        {
            "text": "",
            "tool_calls": [
                {"name": "run_job", "arguments": {"kind": "echo", "input": {"chunks": ["hi"]}}}
            ],
        },
        {"text": "started"},
    )
    scripted_model(
        "coder",
        {"text": "", "tool_calls": [{"name": "python_session", "arguments": {"code": "x = 41"}}]},
        {"text": "done"},
    )
    scripted_model("slowpoke", {"text": words(20)}, token_delay_ms=150)
    for user in (alice, bob):
        work.package(user, "slow")
    work.package(alice, "tooly")
    work.package(alice, "jobber", tools=["run_job"])
    work.package(alice, "coder", tools=["python_session"])
    work.package(bob, "limited")
    work.package(bob, "broken")
    work.package(carol, "slowpoke")

    # Phase A: four runs at once through one model-call slot.
    phase_a = [work.submit(user, "slow") for user in (alice, alice, bob, bob)]
    budget = ModelConcurrencyBudget(1, max_waiting=1, wait_timeout_seconds=0.05)
    worker_a = start_worker(executor=RunExecutor(budget=budget))
    wait_for(lambda: settled(phase_a), message="phase A to settle")
    worker_a.stop()
    a_id = worker_a.worker.worker_id
    suspended = list(Run.objects.filter(pk__in=phase_a, status=RunStatus.SUSPENDED))
    assert suspended, "one model-call slot for four runs suspends some"

    # Phase B: retries, a tool loop, a job, a kernel, a provider 429 and 500, a cancel.
    for run in suspended:
        services.run_reply(run=run, decision="retry")
    phase_b = [
        *(str(run.pk) for run in suspended),
        work.submit(alice, "tooly"),
        work.submit(alice, "jobber"),
        work.submit(alice, "coder"),
        work.submit(bob, "limited"),
        work.submit(bob, "broken"),
    ]
    cancelled = work.submit(bob, "broken")
    services.run_cancel(run=Run.objects.get(pk=cancelled))
    code_tools = CodeToolsRuntime(
        enabled=True,
        max_interpreters=1,
        limits=InterpreterLimits(
            cpu_seconds=5, memory_bytes=256 * 1024 * 1024, wall_seconds=10.0, output_bytes=4096
        ),
        session_pool=SessionPool(rss_limit=0, max_live=4),
    )
    worker_b = start_worker(
        executor=RunExecutor(code_tools=code_tools), lease_seconds=60, heartbeat_seconds=30
    )
    b_id = worker_b.worker.worker_id
    wait_for(lambda: settled(phase_b), timeout=60, message="phase B to settle")
    wait_for(
        lambda: (
            not JobRecord.objects.exclude(state="completed").exists() and JobRecord.objects.exists()
        ),
        message="the job to complete",
    )

    # A run whose lease is lost mid-stream: refused once, reclaimed once, then completed.
    lost = work.submit(carol, "slowpoke")
    wait_for(
        lambda: Run.objects.filter(pk=lost, status=RunStatus.RUNNING).exists(),
        message="the slow run to start",
    )
    Run.objects.filter(pk=lost).update(lease_expires_at=db_now() - timedelta(hours=1))
    wait_for(
        lambda: Run.objects.filter(pk=lost, status=RunStatus.COMPLETED).exists(),
        message="the slow run to complete",
    )
    assert Run.objects.filter(pk=lost).values_list("attempts", "crashes").get() == (2, 1)
    phase_b.append(lost)

    # While worker B runs: its gauges, from its latest snapshot.
    snapshot_after(b_id, timezone.now())
    got = scrape()
    b = {"worker": b_id}
    assert got.value("sage_worker_up", **b) == 1
    assert got.value("sage_worker_up", worker=a_id) == 0
    assert got.value("sage_workers_live") == 1
    assert 0 <= got.value("sage_worker_heartbeat_age_seconds", **b) <= 30
    b_runs = Run.objects.filter(pk__in=phase_b)
    apps = b_runs.values_list("owner_id", "session__package_ref", "session__agent_id")
    assert got.value("sage_applications_resident", **b) == apps.distinct().count()
    kernels = {
        e.session_id
        for e in Event.objects.filter(type="tool.call.succeeded")
        if e.payload.get("name") == "python_session"
    }
    assert got.value("sage_code_sessions_live", **b) == len(kernels) == 1
    assert got.value("sage_code_sessions_rss_bytes", **b) > 0
    assert got.value("sage_code_session_evictions_total", **b) == 0
    ended_jobs = JobRecord.objects.filter(state="completed").count()
    assert got.value("sage_jobs_retained", **b) == ended_jobs == 1
    assert (
        got.value("sage_jobs_active", **b) == JobRecord.objects.exclude(state="completed").count()
    )
    clients = {(r.owner_id, work.model_of[str(r.pk)]) for r in b_runs.exclude(pk=cancelled)}
    assert got.value("sage_model_client_constructions_total", **b) == len(clients)
    assert got.value("sage_model_clients", **b) == len(clients)
    assert got.value("sage_model_calls_active", **b) == 0
    assert got.value("sage_worker_runs_executing", **b) == 0
    worker_b.stop()

    # Past the pending limit: refused with 429 (counted by the web process).
    queued = Run.objects.filter(status=RunStatus.QUEUED).count()
    settings.SAGE = {**settings.SAGE, "SAGE_SERVER_MAX_PENDING_RUNS": queued + 1}
    api = client_for(bob)
    answers = []
    for _ in range(3):
        session = services.session_create(owner=bob, package="p-broken", agent="assistant")
        answers.append(
            api.post(
                "/api/v1/runs/", {"session": str(session.pk), "input": "x"}, format="json"
            ).status_code
        )
    assert sorted(answers) == [202, 429, 429]

    # After both workers stopped: the final figures of each, against rows and events.
    got = scrape(APIClient())
    assert got.value("sage_workers_live") == 0
    assert got.value("sage_api_rate_limited_total", code="scheduler.queue_full") == 2
    assert_run_families_match(got)
    for queue in RunQueue.values:
        claims = Run.objects.filter(queue=queue).aggregate(n=Sum("attempts"))["n"] or 0
        assert got.total("sage_run_start_wait_seconds_count", queue=queue) == claims
    assert got.value("sage_queue_oldest_age_seconds", queue="chat") >= 0

    suspensions = events("run.suspended")
    for code, n in by(suspensions, lambda p: p["code"]).items():
        assert got.total("sage_run_suspensions_total", code=code) == n, code
    assert got.total("sage_run_suspensions_total") == len(suspensions)
    limited = [p for p in events("interaction.requested") if p["category"] == "RATE_LIMITED"]
    assert {p["code"] for p in limited} >= {"upstream.rate_limited"}
    for code, n in by(limited, lambda p: p["code"]).items():
        assert got.total("sage_worker_rate_limited_total", code=code) == n, code
    assert got.total("sage_worker_rate_limited_total") == len(limited)
    queue_full = sum(1 for p in suspensions if p["code"] == "model.queue_full")
    timed_out = sum(1 for p in suspensions if p["code"] == "model.queue_timeout")
    assert got.total("sage_model_calls_rejected_total") == queue_full
    assert got.total("sage_model_calls_timed_out_total") == timed_out
    assert got.value("sage_model_client_constructions_total", worker=a_id) == 2  # alice, bob

    executed = Run.objects.filter(started_at__isnull=False)
    for outcome in ("completed", "failed", "cancelled", "interrupted"):
        assert got.total("sage_run_execution_seconds_count", outcome=outcome) == (
            executed.filter(status=outcome).count()
        ), outcome
    assert got.total("sage_run_execution_seconds_count", outcome="suspended") == len(suspensions)

    assert got.total("sage_lease_reclaims_total") == Run.objects.aggregate(n=Sum("crashes"))["n"]
    assert got.total("sage_fence_rejections_total") == 1
    # Every execution's outcome was a commit of a worker's store (some carried several).
    outcomes = executed.exclude(status="running").count() + len(suspensions)
    assert got.total("sage_store_commits_total") >= outcomes
    # A transaction carries commits made durable or refused (a failed one, all refused).
    assert 0 < got.total("sage_store_transactions_total") <= (
        got.total("sage_store_commits_total") + got.total("sage_store_commits_rejected_total")
    )

    for model in set(work.model_of.values()):
        calls, tokens_in, tokens_out = completed_usage(model, work.model_of)
        if model == "slowpoke":  # two executions streamed it; one's result was refused
            calls, tokens_in, tokens_out = 2 * calls, 2 * tokens_in, 2 * tokens_out
        assert got.total("sage_model_first_token_seconds_count", model=model) == calls, model
        assert got.total("sage_model_tokens_total", model=model, type="input") == tokens_in
        assert got.total("sage_model_tokens_total", model=model, type="output") == tokens_out
    assert got.total("sage_model_tokens_total", type="output") > 0
