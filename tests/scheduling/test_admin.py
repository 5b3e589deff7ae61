"""The operators' side of scheduling: the run admin's cancel action (through the Run state
machine) and the one query for live workers that the capacity page, API and command use."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from scheduling import runs
from scheduling.models import Event, Run, RunStatus, Session, WorkerSnapshot

pytestmark = pytest.mark.django_db


def _session(owner: Any) -> Session:
    return Session.objects.create(owner=owner, package_ref="ref", package_name="pkg", agent_id="a")


def _run(owner: Any, **fields: Any) -> Run:
    return Run.objects.create(session=_session(owner), owner=owner, input="hi", **fields)


def test_the_admin_cancels_selected_runs_through_the_state_machine(client, staff, alice):
    queued, _ = runs.admit(owner=alice, session_id=_session(alice).pk, input="hi")
    running = _run(
        alice,
        status=RunStatus.RUNNING,
        lease_owner="worker",
        lease_token=1,
        lease_expires_at=timezone.now() + timedelta(minutes=5),
    )
    finished = _run(alice, status=RunStatus.COMPLETED)
    client.force_login(staff)
    response = client.post(
        reverse("admin:scheduling_run_changelist"),
        {
            "action": "cancel_runs",
            "_selected_action": [str(queued.pk), str(running.pk), str(finished.pk)],
        },
        follow=True,
    )
    assert response.status_code == 200
    assert "Cancellation requested for 2 run(s)." in response.content.decode()
    # A queued run ends at once, with its terminal event.
    queued.refresh_from_db()
    assert (queued.status, queued.error["code"]) == (RunStatus.CANCELLED, "run.cancelled")
    assert list(Event.objects.filter(run=queued).values_list("type", flat=True)) == [
        "run.cancelled"
    ]
    # A running one is asked to stop: its worker ends it at its next step.
    running.refresh_from_db()
    assert (running.status, running.cancel_requested, running.stop_request) == (
        RunStatus.RUNNING,
        True,
        "cancel",
    )
    # A finished one is left alone.
    finished.refresh_from_db()
    assert (finished.status, finished.cancel_requested) == (RunStatus.COMPLETED, False)


def test_live_workers_are_the_running_ones_newest_heartbeat_first(db):
    now = timezone.now()
    for i in range(25):
        WorkerSnapshot.objects.create(
            worker_id=f"w{i}",
            host="h",
            pid=i,
            started_at=now,
            heartbeat_at=now - timedelta(seconds=i),
            capacity={"runs": {"active": i}},
        )
    WorkerSnapshot.objects.create(
        worker_id="stopped", host="h", pid=99, started_at=now, heartbeat_at=now, stopped_at=now
    )
    live = list(WorkerSnapshot.objects.live())
    assert [s.worker_id for s in live] == [f"w{i}" for i in range(20)]
    assert live[1].summary() == {
        "worker_id": "w1",
        "host": "h",
        "pid": 1,
        "started_at": now,
        "heartbeat_at": now - timedelta(seconds=1),
        "capacity": {"runs": {"active": 1}},
    }
    assert [s.worker_id for s in WorkerSnapshot.objects.live(limit=2)] == ["w0", "w1"]
