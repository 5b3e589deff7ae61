"""GET /api/v1/runs/{run_id}/jobs: a run's background jobs, owner-scoped."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from rest_framework.test import APIClient

from agents.models import JobRecord
from scheduling.models import Run


def job(run: Run, job_id: str, kind: str, state: str, **fields: Any) -> JobRecord:
    return JobRecord.objects.create(
        job_id=job_id, run=run, owner=run.owner, kind=kind, state=state, **fields
    )


@pytest.fixture
def alice_run(alice, make_session) -> Run:
    run = Run.objects.create(session=make_session(alice), owner=alice, input="go")
    job(run, "job-1", "echo", "completed", output_bytes=12, output_chunks=2, output_truncated=True)
    killed = {"code": "job.killed", "message": "job killed: cancelled"}
    job(run, "job-2", "sleep", "killed", error=killed)
    return run


def url(run_id) -> str:
    return f"/api/v1/runs/{run_id}/jobs"


@pytest.mark.django_db
def test_it_lists_the_owners_run_jobs(alice_api, alice_run):
    response = alice_api.get(url(alice_run.pk))

    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["job_id"] for r in results] == ["job-1", "job-2"]
    first = results[0]
    # Everything a client gets, and nothing else (no owner, run or cancel flag).
    assert {k: v for k, v in first.items() if not k.endswith("_at")} == {
        "job_id": "job-1",
        "kind": "echo",
        "state": "completed",
        "output_bytes": 12,
        "output_chunks": 2,
        "output_truncated": True,
        "error": None,
    }
    assert {"created_at", "updated_at"} <= set(first)
    assert results[1]["error"]["code"] == "job.killed"


@pytest.mark.django_db
def test_it_accepts_a_trailing_slash(alice_api, alice_run):
    assert alice_api.get(url(alice_run.pk) + "/").status_code == 200


@pytest.mark.django_db
def test_it_answers_an_empty_list_for_a_run_without_jobs(alice, alice_api, make_session):
    run = Run.objects.create(session=make_session(alice), owner=alice, input="go")

    response = alice_api.get(url(run.pk))

    assert response.json() == {"results": []}


@pytest.mark.django_db
def test_it_hides_another_users_run_as_not_found(bob_api, alice_run):
    response = bob_api.get(url(alice_run.pk))

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "run.not_found"


@pytest.mark.django_db
def test_it_answers_not_found_for_an_unknown_run(alice_api):
    response = alice_api.get(url(uuid.uuid4()))

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "run.not_found"


@pytest.mark.django_db
def test_it_shows_any_run_to_staff(staff_api, alice_run):
    response = staff_api.get(url(alice_run.pk))

    assert response.status_code == 200
    assert len(response.json()["results"]) == 2


@pytest.mark.django_db
def test_it_requires_authentication(alice_run):
    response = APIClient().get(url(alice_run.pk))

    assert response.status_code == 401
