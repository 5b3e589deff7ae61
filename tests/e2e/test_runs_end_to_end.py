from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from agents.models import ManagedAgentRecord
from pooling.models import ModelRecord
from scheduling.models import Event, Run, RunStatus
from tests.conftest import client_for, demo_manifest, scripted_model, words
from tests.e2e.conftest import all_terminal, wait_for

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


def _open_session(api, package: str = "demo") -> str:
    response = api.post(
        "/api/v1/sessions/", {"package": package, "agent": "assistant"}, format="json"
    )
    assert response.status_code == 201, response.content
    return response.json()["id"]


def _submit(api, session_id: str, text: str) -> str:
    response = api.post("/api/v1/runs/", {"session": session_id, "input": text}, format="json")
    assert response.status_code == 202, response.content
    return response.json()["id"]


def _assert_contiguous(session_id) -> None:
    seqs = list(
        Event.objects.filter(session_id=session_id).order_by("seq").values_list("seq", flat=True)
    )
    assert seqs == list(range(1, len(seqs) + 1))


def test_it_completes_twenty_runs_for_two_users(alice, bob, make_session, start_worker):
    apis = {"alice": client_for(alice), "bob": client_for(bob)}
    make_session(alice)
    make_session(bob)
    runs: dict[str, tuple[str, str]] = {}
    sessions: dict[str, str] = {}
    for i in range(10):
        for name, api in apis.items():
            # Two runs per session: the second continues the first one's history.
            if i % 2 == 0:
                sessions[name] = _open_session(api)
            session = sessions[name]
            prompt = f"please calculate {i}+{i}" if i % 3 == 0 else f"hello {name} {i}"
            runs[_submit(api, session, prompt)] = (name, session)
    start_worker(max_concurrent=4)
    wait_for(lambda: all_terminal(list(runs)), message="20 runs to finish")
    for run_id, (name, session_id) in runs.items():
        body = apis[name].get(f"/api/v1/runs/{run_id}/").json()
        assert body["status"] == "completed", body
        assert body["result"]["text"]
        archive = apis[name].get(f"/api/v1/archives/{run_id}/")
        assert archive.status_code == 200
        assert archive.json()["status"] == "completed"
        _assert_contiguous(session_id)
    assert ManagedAgentRecord.objects.count() == 20
    calc = [r for r in Run.objects.filter(pk__in=list(runs)) if "calculate 3+3" in r.input]
    assert calc and calc[0].result["text"] == "The result is 6."


def test_it_runs_a_tool_loop_with_durable_events(alice, make_session, start_worker):
    api = client_for(alice)
    make_session(alice)
    session = _open_session(api)
    run_id = _submit(api, session, "please calculate (2+3)*4")
    start_worker()
    wait_for(lambda: all_terminal([run_id]), message="the run to finish")
    events = api.get(f"/api/v1/sessions/{session}/events/").json()["results"]
    assert [e["type"] for e in events] == [
        "run.started",
        "message.completed",
        "message.completed",
        "tool.call.started",
        "tool.call.succeeded",
        "message.completed",
        "run.completed",
    ]
    assert events[4]["payload"]["output"] == "20"
    assert events[-1]["payload"]["result"]["text"] == "The result is 20."


def _slow_model(name: str = "slow") -> ModelRecord:
    return scripted_model(name, {"text": words(200, "word")}, token_delay_ms=200)


def test_it_cancels_a_running_run(alice, start_worker):
    from agents.services import packages

    _slow_model()
    packages.package_create(owner=alice, manifest=demo_manifest(name="slowpkg", model="slow"))
    api = client_for(alice)
    session = _open_session(api, "slowpkg")
    run_id = _submit(api, session, "talk slowly")
    start_worker()
    wait_for(
        lambda: Run.objects.get(pk=run_id).status == RunStatus.RUNNING, message="the run to start"
    )
    assert api.post(f"/api/v1/runs/{run_id}/cancel/").status_code == 202
    wait_for(lambda: all_terminal([run_id]), message="the run to be cancelled")
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.CANCELLED
    assert run.error["code"] == "run.cancelled"
    assert ManagedAgentRecord.objects.get(run_id=run_id).status == "cancelled"
    assert Event.objects.filter(run_id=run_id, type="run.cancelled").exists()


@pytest.mark.timing
def test_it_requeues_unfinished_runs_on_shutdown(alice, start_worker):
    from agents.services import packages

    _slow_model()
    packages.package_create(owner=alice, manifest=demo_manifest(name="slowpkg", model="slow"))
    api = client_for(alice)
    run_id = _submit(api, _open_session(api, "slowpkg"), "talk slowly")
    worker = start_worker(grace_seconds=0.2)
    wait_for(
        lambda: Run.objects.get(pk=run_id).status == RunStatus.RUNNING, message="the run to start"
    )
    worker.stop()
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.QUEUED
    assert run.error["code"] == "scheduler.worker_shutdown"
    assert run.error["resumable"] is True
    assert run.lease_owner == ""


def test_it_requeues_a_run_whose_worker_died(alice, make_session, start_worker):
    api = client_for(alice)
    make_session(alice)
    run_id = _submit(api, _open_session(api), "hello")
    # A worker claimed it and died: the run is 'running' under a lease that has expired.
    Run.objects.filter(pk=run_id).update(
        status=RunStatus.RUNNING,
        lease_owner="dead-worker",
        lease_token=1,
        attempts=1,
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    start_worker()
    wait_for(lambda: all_terminal([run_id]), message="the run to be recovered")
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.COMPLETED
    assert run.attempts == 2
    assert run.lease_owner == ""


def test_it_fails_a_run_on_an_upstream_error_without_leaking_the_body(alice, start_worker):
    from agents.services import packages

    scripted_model(
        "broken", error={"status": 400, "body": "<html><title>secret-proxy-page</title></html>"}
    )
    packages.package_create(owner=alice, manifest=demo_manifest(name="broken", model="broken"))
    api = client_for(alice)
    session = _open_session(api, "broken")
    run_id = _submit(api, session, "hello")
    start_worker()
    wait_for(lambda: all_terminal([run_id]), message="the run to fail")
    body = api.get(f"/api/v1/runs/{run_id}/").json()
    assert body["status"] == "failed"
    assert body["error"]["code"] == "upstream.error"
    events = api.get(f"/api/v1/sessions/{session}/events/").content.decode()
    assert "<html>" not in str(body) and "<html>" not in events


def test_a_one_step_run_commits_once_and_a_long_ones_start_is_durable_while_it_runs(
    alice, make_session, start_worker
):
    """The start of a run (run.started, the user's message) goes with the execution's
    first commit when that comes within START_COMMIT_DELAY, else alone at that age."""
    from scheduling import store

    scripted_model("slow", {"text": words(20)}, token_delay_ms=100)
    make_session(alice)
    make_session(alice, manifest=demo_manifest(name="slowpkg", model="slow"))
    api = client_for(alice)
    start_worker(max_concurrent=2)

    quick = _submit(api, _open_session(api), "hello")
    wait_for(lambda: all_terminal([quick]), message="the quick run to finish")
    commits = store._default.snapshot()["commits"]
    quick = _submit(api, _open_session(api), "hello again")
    wait_for(lambda: all_terminal([quick]), message="the second quick run to finish")
    # Its start, its answer and its end: one commit.
    assert store._default.snapshot()["commits"] - commits == 1
    assert list(
        Event.objects.filter(run_id=quick).order_by("seq").values_list("type", flat=True)
    ) == ["run.started", "message.completed", "message.completed", "run.completed"]

    slow = _submit(api, _open_session(api, "slowpkg"), "take your time")
    wait_for(
        lambda: Event.objects.filter(run_id=slow, type="run.started").exists(),
        message="the slow run's start to be durable",
    )
    # Durable while the model still streams (about two seconds).
    assert Run.objects.get(pk=slow).status == RunStatus.RUNNING
    assert Event.objects.filter(run_id=slow, type="message.completed").count() == 1
    wait_for(lambda: all_terminal([slow]), message="the slow run to finish")
