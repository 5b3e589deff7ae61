"""The worker's management service end to end: flows, capacity suspension and release,
reclamation requests, the start-up archive sweep, archives with the worker stopped, and
the management commands."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command

from agents import services
from agents.models import ManagedAgentRecord, ReclamationRequest
from agents.services import packages
from agents.services.reclamations import reclamation_create
from scheduling.models import Event, Run, RunStatus, Session, WorkerSnapshot
from tests.conftest import client_for, demo_manifest, flow_manifest
from tests.e2e.conftest import all_terminal, wait_for

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


FLOW_MANIFEST = flow_manifest(
    {
        "assistant": {"model": "scripted", "instructions": "Echo."},
        # Unreachable from the flow: its (missing) model must never be initialised.
        "unused": {"model": "no-such-model", "instructions": "Never runs."},
    },
    name="flowpkg",
    flow="triage",
    start="ask",
    nodes={
        "ask": {"type": "agent", "agent": "assistant"},
        "time": {"type": "tool", "tool": "clock"},
        "other": {"type": "end"},
        "done": {"type": "end"},
    },
    edges=[
        {"from": "ask", "to": "time", "when": {"contains": "You said"}},
        {"from": "ask", "to": "other"},
        {"from": "time", "to": "done"},
    ],
)


def _submit(user, session, text: str = "hello") -> Run:
    run, _ = services.run_submit(owner=user, session_id=session.pk, input=text)
    return run


def test_it_runs_a_flow_session_and_archives_its_outputs(alice, scripted_record, start_worker):
    packages.package_save(owner=alice, manifest=FLOW_MANIFEST)
    session = services.session_create(owner=alice, package="flowpkg", agent="triage")
    run = _submit(alice, session)
    start_worker()
    wait_for(lambda: all_terminal([run.pk]), message="the flow run to finish")
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED, run.error
    assert run.result["flow"] == "triage"
    types = list(Event.objects.filter(run=run).order_by("seq").values_list("type", flat=True))
    assert "flow.started" in types and "flow.edge.selected" in types
    assert types[-2] == "flow.completed" and types[-1] == "run.completed"
    archive = ManagedAgentRecord.objects.get(run=run)
    assert archive.flow_outputs["ask"] == "You said: hello"
    assert set(archive.flow_outputs) == {"ask", "time", "done"}


def test_it_suspends_at_capacity_and_resumes_after_an_operator_release(
    alice, staff, scripted_record, start_worker, monkeypatch
):
    monkeypatch.setitem(django_settings.SAGE, "SAGE_SERVER_MAX_MANAGED_APPLICATIONS", 1)
    monkeypatch.setitem(django_settings.SAGE, "SAGE_AUTO_RELEASE_IDLE_SECONDS", None)
    packages.package_save(owner=alice, manifest=demo_manifest(name="one"))
    packages.package_save(owner=alice, manifest=demo_manifest(name="two"))
    first = services.session_create(owner=alice, package="one", agent="assistant")
    second = services.session_create(owner=alice, package="two", agent="assistant")
    start_worker()
    run_one = _submit(alice, first)
    wait_for(lambda: all_terminal([run_one.pk]), message="the first run")
    run_two = _submit(alice, second)
    wait_for(
        lambda: Run.objects.get(pk=run_two.pk).status == RunStatus.SUSPENDED,
        message="the second run to be suspended at capacity",
    )
    run_two.refresh_from_db()
    assert run_two.interaction["code"] == "management.capacity"
    request = reclamation_create(user=staff, min_idle_seconds=0, limit=1)
    wait_for(
        lambda: ReclamationRequest.objects.get(pk=request.pk).status != "pending",
        message="the worker to answer the release",
    )
    request.refresh_from_db()
    assert request.status == "done" and request.outcome["released"] == 1
    services.run_reply(run=run_two, decision="retry")
    wait_for(lambda: all_terminal([run_two.pk]), message="the resumed run")
    assert Run.objects.get(pk=run_two.pk).status == RunStatus.COMPLETED


def test_it_publishes_resident_applications_in_the_worker_snapshot(
    alice, scripted_record, make_session, start_worker
):
    session = make_session(alice)
    run = _submit(alice, session)
    start_worker()
    wait_for(lambda: all_terminal([run.pk]), message="the run")

    def resident() -> list:
        snapshot = WorkerSnapshot.objects.filter(stopped_at__isnull=True).first()
        if snapshot is None:
            return []
        return snapshot.capacity["executor"]["management"]["resident"]

    # A snapshot published while the run still executed lists it in use: wait for one
    # published after it ended (every 3 s).
    wait_for(
        lambda: [r["usage"] for r in resident()] == [0],
        message="a snapshot listing the Application, no longer in use",
    )
    row = resident()[0]
    assert row["package"] == "demo" and row["agent"] == "assistant"
    assert row["owner"] == alice.pk and row["usage"] == 0


def test_it_serves_archives_with_the_worker_stopped(alice, make_session, start_worker):
    session = make_session(alice)
    run = _submit(alice, session)
    worker = start_worker()
    wait_for(lambda: all_terminal([run.pk]), message="the run")
    worker.stop()
    response = client_for(alice).get(f"/api/v1/archives/{run.pk}/")
    assert response.status_code == 200
    assert response.json()["result"]["text"]


def test_it_archives_terminal_runs_left_unarchived_at_start_up(alice, start_worker):
    session = Session.objects.create(
        owner=alice, package_ref="gone", package_name="gone", agent_id="assistant"
    )
    runs = [
        Run.objects.create(
            session=session, owner=alice, input="x", status=RunStatus.COMPLETED, result={"n": i}
        )
        for i in range(3)
    ]
    start_worker()
    wait_for(
        lambda: ManagedAgentRecord.objects.filter(run__in=runs).count() == 3,
        message="the start-up sweep",
    )


# --- management commands --------------------------------------------------------------------


def _call(*args: str) -> tuple[int, str]:
    out = StringIO()
    try:
        call_command(*args, stdout=out)
    except SystemExit as exc:
        return int(exc.code or 0), out.getvalue()
    return 0, out.getvalue()


def test_it_validates_a_manifest_file_as_json(tmp_path: Path, scripted_record):
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(demo_manifest(skills=["missing-skill"])))
    code, out = _call("validate_package", str(path), "--readiness", "--json")
    assert code == 0
    body = json.loads(out)
    assert body["valid"] is True and body["readiness"]["ready"] is False
    assert body["readiness"]["agents"]["assistant"]["missing_skills"] == ["missing-skill"]


def test_it_refuses_strictly_with_the_error_envelope(tmp_path: Path, scripted_record):
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(demo_manifest(skills=["missing-skill"])))
    code, out = _call("validate_package", str(path), "--strict", "--json")
    assert code == 1
    assert json.loads(out)["error"]["code"] == "package.not_ready"


def test_it_validates_a_directory_with_bundled_files(tmp_path: Path, alice, scripted_record):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "main.md").write_text("  Be brief.\n")
    (tmp_path / "sage.yaml").write_text(
        "name: bundled\nversion: 1.0.0\nentrypoint: assistant\nagents:\n"
        "  assistant:\n    model: scripted\n    instructions: {path: prompts/main.md}\n"
    )
    code, out = _call("validate_package", str(tmp_path), "--owner", "alice", "--save", "--json")
    assert code == 0, out
    body = json.loads(out)
    assert body["reused"] is False
    package = packages.package_resolve(owner=alice, name_or_ref="bundled")
    assert package.files == {"prompts/main.md": "  Be brief.\n"}


def test_it_reports_an_invalid_manifest_with_the_envelope(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "x"}))
    code, out = _call("validate_package", str(path), "--json")
    assert code == 1
    assert json.loads(out)["error"]["code"] == "package.invalid"


def test_it_releases_idle_applications_from_the_command(alice, make_session, start_worker):
    session = make_session(alice)
    run = _submit(alice, session)
    start_worker()
    wait_for(lambda: all_terminal([run.pk]), message="the run")
    code, out = _call("release_idle", "--min-idle", "0", "--limit", "4", "--json")
    assert code == 0, out
    body = json.loads(out)
    assert body["status"] == "done" and body["outcome"]["released"] == 1


def test_it_says_clearly_when_no_worker_answers(db):
    code, out = _call("release_idle", "--json", "--wait", "0.3")
    assert code == 1
    error = json.loads(out)["error"]
    assert error["code"] == "management.no_worker"
    assert "is a worker running" in error["message"]
    assert ReclamationRequest.objects.get().status == "refused"  # withdrawn, not left pending


def test_it_prints_worker_capacity(alice, make_session, start_worker):
    start_worker()
    wait_for(lambda: WorkerSnapshot.objects.exists(), message="a snapshot")
    code, out = _call("capacity", "--json")
    assert code == 0
    workers = json.loads(out)["workers"]
    assert workers and "management" in workers[0]["capacity"]["executor"]
