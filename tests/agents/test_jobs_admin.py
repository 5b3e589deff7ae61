"""The JobRecord admin: changelist, read-only rows and the "Cancel selected jobs" action."""

from __future__ import annotations

import pytest
from django.test import Client

import agents.jobs.admin  # noqa: F401  (registers the admin, as agents/admin.py does)
from agents.models import JobRecord
from scheduling.models import Run

CHANGELIST = "/admin/agents/jobrecord/"


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


@pytest.fixture
def job_of(make_session):
    def make(user, job_id: str, *, state: str = "running", **fields) -> JobRecord:
        session = make_session(user)
        run = Run.objects.create(session=session, owner=user, input="go")
        return JobRecord.objects.create(
            job_id=job_id, run=run, owner=user, kind="sleep", state=state, **fields
        )

    return make


@pytest.mark.django_db
def test_it_lists_jobs_with_state_size_and_truncation(staff_client, alice, job_of):
    job_of(alice, "job-aaa", output_bytes=4096, output_truncated=True)

    response = staff_client.get(CHANGELIST)

    assert response.status_code == 200
    body = response.content.decode()
    assert "job-aaa" in body
    assert "4096" in body
    assert "Cancel selected jobs" in body


@pytest.mark.django_db
def test_it_filters_jobs_by_state(staff_client, alice, job_of):
    job_of(alice, "job-running")
    job_of(alice, "job-done", state="completed")

    body = staff_client.get(CHANGELIST, {"state": "completed"}).content.decode()

    assert "job-done" in body
    assert "job-running" not in body


@pytest.mark.django_db
def test_it_searches_jobs_by_owner(staff_client, alice, bob, job_of):
    job_of(alice, "job-alice")
    job_of(bob, "job-bob")

    body = staff_client.get(CHANGELIST, {"q": "bob"}).content.decode()

    assert "job-bob" in body
    assert "job-alice" not in body


@pytest.mark.django_db
def test_it_marks_selected_unfinished_jobs_for_cancellation(staff_client, alice, job_of):
    running = job_of(alice, "job-running")
    done = job_of(alice, "job-done", state="completed")

    response = staff_client.post(
        CHANGELIST,
        {"action": "cancel_jobs", "_selected_action": [running.pk, done.pk]},
        follow=True,
    )

    assert response.status_code == 200
    assert "Cancellation requested for 1 job(s)" in response.content.decode()
    running.refresh_from_db()
    done.refresh_from_db()
    assert running.cancel_requested is True
    assert done.cancel_requested is False


@pytest.mark.django_db
def test_it_shows_a_job_read_only(staff_client, alice, job_of):
    job = job_of(alice, "job-ro")

    response = staff_client.post(f"{CHANGELIST}{job.pk}/change/", {"state": "completed"})

    assert response.status_code == 403
    job.refresh_from_db()
    assert job.state == "running"


@pytest.mark.django_db
def test_it_offers_no_add_or_delete(staff_client):
    assert staff_client.get(f"{CHANGELIST}add/").status_code == 403
    body = staff_client.get(CHANGELIST).content.decode()
    assert "delete_selected" not in body


@pytest.mark.django_db
def test_it_keeps_non_staff_users_out(alice, job_of):
    job_of(alice, "job-private")
    client = Client()
    client.force_login(alice)

    response = client.get(CHANGELIST)

    assert response.status_code == 302  # to the admin login
