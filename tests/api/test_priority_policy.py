"""Priorities above 0 are for staff: at equal load a higher priority puts one user's runs
ahead of everyone else's, so a user who is not staff may only lower their own."""

from __future__ import annotations

import pytest

from agents import services
from sageproject.errors import SageError
from scheduling.models import Run

pytestmark = pytest.mark.django_db


def _submit(api, session, priority: int):
    body = {"session": str(session.pk), "input": "x", "priority": priority}
    return api.post("/api/v1/runs/", body, format="json")


@pytest.mark.parametrize("priority", [1, 100])
def test_it_refuses_a_raised_priority_from_a_user(alice, alice_api, make_session, priority):
    response = _submit(alice_api, make_session(alice), priority)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "run.priority_forbidden"
    assert not Run.objects.filter(owner=alice).exists()


@pytest.mark.parametrize("priority", [0, -1, -100])
def test_it_lets_a_user_lower_their_own_runs(alice, alice_api, make_session, priority):
    response = _submit(alice_api, make_session(alice), priority)
    assert response.status_code == 202
    assert response.json()["priority"] == priority


def test_it_lets_staff_raise_a_priority(staff, staff_api, make_session):
    response = _submit(staff_api, make_session(staff), 100)
    assert response.status_code == 202
    assert response.json()["priority"] == 100


def test_it_refuses_a_raised_priority_in_the_service_too(alice, make_session):
    session = make_session(alice)
    with pytest.raises(SageError) as forbidden:
        services.run_submit(owner=alice, session_id=session.pk, input="x", priority=5)
    assert forbidden.value.code == "run.priority_forbidden"
    assert forbidden.value.http_status == 403
