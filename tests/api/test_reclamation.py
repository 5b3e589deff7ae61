"""REST ``reclamations`` (staff) and the executor answering the requests."""

from __future__ import annotations

import pytest

from agents.applications import Application
from agents.executor import RunExecutor
from agents.models import ReclamationRequest
from agents.services.reclamations import reclamation_create


@pytest.mark.django_db
def test_it_records_a_release_request_for_staff(staff_api):
    response = staff_api.post(
        "/api/v1/reclamations/", {"min_idle_seconds": 60, "limit": 3}, format="json"
    )
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["status"] == "pending" and body["scope"] == "idle"
    assert body["min_idle_seconds"] == 60 and body["limit"] == 3
    assert staff_api.get(f"/api/v1/reclamations/{body['id']}/").json()["id"] == body["id"]
    assert staff_api.get("/api/v1/reclamations/").json()["count"] == 1


@pytest.mark.django_db
def test_it_keeps_reclamations_staff_only(alice_api):
    assert alice_api.get("/api/v1/reclamations/").status_code == 403
    response = alice_api.post("/api/v1/reclamations/", {}, format="json")
    assert response.status_code == 403


@pytest.mark.django_db
def test_it_needs_refs_for_a_selected_release(staff_api):
    response = staff_api.post("/api/v1/reclamations/", {"scope": "selected"}, format="json")
    assert response.status_code == 400
    assert "refs" in response.json()["error"]["details"]["fields"]


@pytest.mark.django_db(transaction=True)
async def test_it_answers_a_request_by_releasing_a_safe_application(staff):
    from asgiref.sync import sync_to_async

    executor = RunExecutor()
    # A resident Application with nothing unfinished: build it through a stub builder.
    async def builder(key):
        return Application(key=key, package_name="pkg", manifest=None, agents={})

    executor.service._builder = builder
    async with executor.service.application(staff.pk, "ref", "assistant"):
        pass
    row = await sync_to_async(reclamation_create)(user=staff, min_idle_seconds=0, limit=4)
    assert await executor.process_reclamations() == 1
    fresh = await sync_to_async(ReclamationRequest.objects.get)(pk=row.pk)
    assert fresh.status == "done"
    assert fresh.outcome["released"] == 1
    assert fresh.outcome["message"] == "released 1 Application"
    assert fresh.finished_at is not None
    await executor.close()


@pytest.mark.django_db(transaction=True)
async def test_it_refuses_a_request_and_says_why(staff):
    from asgiref.sync import sync_to_async

    executor = RunExecutor()
    row = await sync_to_async(reclamation_create)(user=staff, min_idle_seconds=0, limit=1)
    await executor.process_reclamations()
    fresh = await sync_to_async(ReclamationRequest.objects.get)(pk=row.pk)
    assert fresh.status == "refused"
    assert fresh.outcome["message"] == "refused: no resident Application matched"
    # Answered once: a second poll takes nothing.
    assert await executor.process_reclamations() == 0
    await executor.close()
