from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from agents import services
from pooling.models import ModelRecord, Protocol
from scheduling.models import Run, RunStatus, WorkerSnapshot

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client, staff):
    client.force_login(staff)
    return client


def test_it_lists_every_model_in_the_admin(staff_client, alice, make_session):
    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="x")
    for name in ("scheduling_run", "scheduling_session", "scheduling_event",
                 "scheduling_workersnapshot", "pooling_modelrecord", "agents_agentpackage",
                 "agents_managedagentrecord", "agents_readinessreport",
                 "agents_reclamationrequest"):
        response = staff_client.get(reverse(f"admin:{name}_changelist"))
        assert response.status_code == 200, name
    response = staff_client.get(reverse("admin:scheduling_run_change", args=[run.pk]))
    assert response.status_code == 200
    assert b"lease_token" in response.content or b"Lease token" in response.content


def test_it_never_shows_model_credentials(staff_client):
    record = ModelRecord(name="gpt", protocol=Protocol.OPENAI, model="gpt")
    record.api_key = "sk-very-secret"
    record.save()
    for url in (reverse("admin:pooling_modelrecord_changelist"),
                reverse("admin:pooling_modelrecord_change", args=[record.pk])):
        content = staff_client.get(url).content.decode()
        assert "sk-very-secret" not in content
        assert record.encrypted_credentials not in content


def test_it_keeps_credentials_when_the_form_leaves_them_empty(staff_client):
    record = ModelRecord(name="gpt", protocol=Protocol.OPENAI, model="gpt")
    record.api_key = "sk-keep"
    record.save()
    url = reverse("admin:pooling_modelrecord_change", args=[record.pk])
    response = staff_client.post(url, {"name": "gpt", "protocol": "openai", "base_url": "",
                                       "model": "gpt-2", "options": "{}", "api_key": ""})
    assert response.status_code == 302
    record.refresh_from_db()
    assert (record.model, record.api_key) == ("gpt-2", "sk-keep")


def test_it_cancels_runs_from_the_admin(staff_client, alice, make_session):
    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="x")
    response = staff_client.post(reverse("admin:scheduling_run_changelist"),
                                 {"action": "cancel_runs", "_selected_action": [str(run.pk)]})
    assert response.status_code == 302
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED


def test_it_shows_the_capacity_page(staff_client):
    now = timezone.now()
    WorkerSnapshot.objects.create(
        worker_id="w1", host="h", pid=1, started_at=now, heartbeat_at=now,
        capacity={"runs": {"active": 3, "max_concurrent": 8},
                  "executor": {"model_calls": {"limit": 8, "active": 2},
                               "pools": {"python": {"history": [[0, 1, 0], [60, 4, 2]]}}}},
    )
    response = staff_client.get(reverse("admin:capacity"))
    assert response.status_code == 200
    content = response.content.decode()
    assert "runs.max_concurrent" in content
    assert "executor.model_calls.active" in content
    assert "<polyline" in content
    assert staff_client.get(reverse("admin:index")).content.count(b"Capacity") >= 1


def test_it_keeps_non_staff_out_of_the_admin(client, alice):
    client.force_login(alice)
    response = client.get(reverse("admin:capacity"))
    assert response.status_code == 302


def test_it_names_the_owners_of_resident_applications(staff_client, alice):
    now = timezone.now()
    WorkerSnapshot.objects.create(
        worker_id="w2", host="h", pid=2, started_at=now, heartbeat_at=now,
        capacity={"executor": {"management": {"resident": [
            {"owner": alice.pk, "package": "demo", "ref": "ab" * 32, "agent": "assistant",
             "state": "ready", "idle_seconds": 3.0, "usage": 0, "unfinished_runs": 0,
             "safe_to_release": True},
        ]}}},
    )
    content = staff_client.get(reverse("admin:capacity")).content.decode()
    assert "<td>alice</td>" in content
