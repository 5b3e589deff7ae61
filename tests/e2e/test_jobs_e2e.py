"""A run that starts a background job through the agent tools, end to end."""

from __future__ import annotations

import pytest

from agents.models import JobRecord
from agents.services import packages
from scheduling.models import Event, Run, RunStatus
from tests.conftest import client_for, demo_manifest, scripted_model
from tests.e2e.conftest import all_terminal, wait_for

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


def test_it_runs_a_background_job_started_by_an_agent(alice, bob, start_worker):
    scripted_model(
        "jobber",
        {"text": "", "tool_calls": [{"name": "run_job", "arguments": {
            "kind": "echo", "input": {"chunks": ["hello from a job"]}}}]},
        {"text": "Started it."},
    )
    packages.package_create(owner=alice, manifest=demo_manifest(
        name="jobs", model="jobber", tools=["run_job", "job_status"]))
    api = client_for(alice)
    session = api.post("/api/v1/sessions/", {"package": "jobs", "agent": "assistant"},
                       format="json").json()["id"]
    run_id = api.post("/api/v1/runs/", {"session": session, "input": "start a job"},
                      format="json").json()["id"]
    start_worker()
    wait_for(lambda: all_terminal([run_id]), message="the run to finish")
    assert Run.objects.get(pk=run_id).status == RunStatus.COMPLETED
    wait_for(lambda: JobRecord.objects.filter(run_id=run_id, state="completed").exists(),
             message="the job to complete")
    job = JobRecord.objects.get(run_id=run_id)
    assert (job.kind, job.output_truncated) == ("echo", False)
    assert job.output_bytes == len("hello from a job")
    wait_for(lambda: Event.objects.filter(session_id=session, type="job.completed").exists(),
             message="the job.completed event")
    types = list(Event.objects.filter(session_id=session).order_by("seq")
                 .values_list("type", flat=True))
    assert "job.created" in types and "job.completed" in types
    seqs = list(Event.objects.filter(session_id=session).order_by("seq")
                .values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))
    listing = api.get(f"/api/v1/runs/{run_id}/jobs/").json()["results"]
    assert [(j["kind"], j["state"]) for j in listing] == [("echo", "completed")]
    assert client_for(bob).get(f"/api/v1/runs/{run_id}/jobs/").status_code == 404
