"""A user whose read permission is revoked (``services.READ_REVOKED_GROUP``) reads nothing
of runs, sessions and archives: every read path answers 403 ``run.read_forbidden``, while
another user's objects still answer 404."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from agents import archives, services
from scheduling.models import Event, Run, RunStatus

pytestmark = pytest.mark.django_db


@pytest.fixture
def finished(alice, make_session) -> Run:
    """A completed, archived run of alice's with one event."""
    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="x")
    Event.objects.create(
        session=session, seq=1, run=run, type="message.completed", data='{"text": "secret"}'
    )
    Run.objects.filter(pk=run.pk).update(status=RunStatus.COMPLETED, result={"text": "secret"})
    run.refresh_from_db()
    archives.archive_terminal(run)
    return run


def _reads(run: Run) -> list[str]:
    session = run.session_id
    return [
        "/api/v1/runs/",
        f"/api/v1/runs/{run.pk}/",
        "/api/v1/sessions/",
        f"/api/v1/sessions/{session}/",
        f"/api/v1/sessions/{session}/events/",
        f"/api/v1/sessions/{session}/export/",
        "/api/v1/archives/",
        f"/api/v1/archives/{run.pk}/",
        f"/api/v1/runs/{run.pk}/jobs/",
    ]


def _revoke(user) -> None:
    group, _ = Group.objects.get_or_create(name=services.READ_REVOKED_GROUP)
    user.groups.add(group)


def test_it_serves_every_read_path_to_the_owner(alice_api, finished):
    for url in _reads(finished):
        assert alice_api.get(url).status_code == 200, url


def test_it_answers_403_on_every_read_path_after_revocation(alice, alice_api, finished):
    _revoke(alice)
    stream = f"/api/v1/sessions/{finished.session_id}/stream/?timeout=1"
    for url in [*_reads(finished), stream]:
        response = alice_api.get(url)
        assert response.status_code == 403, url
        assert response.json()["error"]["code"] == "run.read_forbidden", url
        assert b"secret" not in response.content, url


def test_it_answers_403_to_cancel_and_reply_whose_answers_carry_the_run(alice, alice_api, finished):
    _revoke(alice)
    cancel = alice_api.post(f"/api/v1/runs/{finished.pk}/cancel/")
    reply = alice_api.post(
        f"/api/v1/runs/{finished.pk}/reply/", {"decision": "retry"}, format="json"
    )
    for response in (cancel, reply):
        assert response.status_code == 403
        assert b"secret" not in response.content


def test_it_answers_403_to_a_repeated_idempotency_key_after_revocation(
    alice, alice_api, make_session
):
    session = make_session(alice)
    body = {"session": str(session.pk), "input": "x"}
    first = alice_api.post("/api/v1/runs/", body, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert first.status_code == 202
    _revoke(alice)
    again = alice_api.post("/api/v1/runs/", body, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert again.status_code == 403
    assert again.json()["error"]["code"] == "run.read_forbidden"


def test_it_still_admits_new_runs_after_revocation(alice, alice_api, make_session):
    session = make_session(alice)
    _revoke(alice)
    response = alice_api.post(
        "/api/v1/runs/", {"session": str(session.pk), "input": "x"}, format="json"
    )
    assert response.status_code == 202


def test_it_still_answers_404_for_another_users_objects(bob, bob_api, finished):
    _revoke(bob)
    stream = f"/api/v1/sessions/{finished.session_id}/stream/?timeout=1"
    lists = ("/api/v1/runs/", "/api/v1/sessions/", "/api/v1/archives/")
    for url in [*_reads(finished), stream]:
        if url not in lists:
            assert bob_api.get(url).status_code == 404, url


def test_it_restores_reads_when_the_user_leaves_the_group(alice, alice_api, finished):
    _revoke(alice)
    assert alice_api.get(f"/api/v1/runs/{finished.pk}/").status_code == 403
    alice.groups.clear()
    response = alice_api.get(f"/api/v1/runs/{finished.pk}/")
    assert response.status_code == 200
    assert response.json()["result"] == {"text": "secret"}
