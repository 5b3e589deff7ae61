"""Tools that wait for the user's approval (a manifest agent's ``approval``): the run
suspends before any call of the step acts, and the reply approves or rejects them."""

from __future__ import annotations

import pytest

from agents import services
from agents.engine import NOT_APPROVED_TOOL_ERROR, REJECTED_TOOL_ERROR, history_from_events
from agents.manifest import parse_manifest
from agents.services import packages
from sageproject.errors import ValidationError
from scheduling.models import Event, Run, RunStatus
from tests.conftest import client_for, demo_manifest
from tests.e2e import conftest as e2e
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

start_worker = e2e.start_worker  # the fixture: a real worker in a thread


def _events(session) -> list[tuple[str, dict]]:
    return [(e.type, e.payload) for e in Event.objects.filter(session=session).order_by("seq")]


def _suspended_for_approval(user, scripted_record) -> tuple[Run, object]:
    manifest = demo_manifest(name="careful", approval=["calculator"])
    packages.package_create(owner=user, manifest=manifest)
    session = services.session_create(owner=user, package="careful", agent="assistant")
    run, _ = services.run_submit(owner=user, session_id=session.pk, input="calculate 2+2")
    wait_for(
        lambda: Run.objects.get(pk=run.pk).status == RunStatus.SUSPENDED,
        message="the run to wait for approval",
    )
    return Run.objects.get(pk=run.pk), session


def test_an_approved_call_runs_after_the_reply(alice, scripted_record, start_worker):
    start_worker()
    run, session = _suspended_for_approval(alice, scripted_record)
    interaction = run.interaction
    assert interaction["type"] == "approval"
    assert interaction["allowed_decisions"] == ["approve", "reject", "edit"]
    [call] = interaction["tool_calls"]
    assert call["name"] == "calculator"
    assert interaction["waiting"] == [call["id"]]
    types = [t for t, _ in _events(session)]
    # The step's message is durable; nothing acted.
    assert "tool.call.started" not in types
    assert types[-2:] == ["run.suspended", "interaction.requested"]

    services.run_reply(run=run, decision="approve", interaction_id=interaction["id"])
    wait_for(
        lambda: Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED,
        message="the approved run to complete",
    )
    events = _events(session)
    succeeded = [p for t, p in events if t == "tool.call.succeeded"]
    assert [(p["id"], p["output"]) for p in succeeded] == [(call["id"], "4")]
    assert Run.objects.get(pk=run.pk).result["text"] == "The result is 4."
    resolved = [p for t, p in events if t == "interaction.resolved"]
    assert resolved == [{"interaction_id": interaction["id"], "decision": "approve"}]


def test_a_rejected_call_is_answered_and_never_runs(alice, scripted_record, start_worker):
    start_worker()
    run, session = _suspended_for_approval(alice, scripted_record)
    services.run_reply(run=run, decision="reject")
    wait_for(
        lambda: Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED,
        message="the rejected run to complete",
    )
    events = _events(session)
    assert "tool.call.started" not in [t for t, _ in events]
    failed = [p for t, p in events if t == "tool.call.failed"]
    assert [p["error"] for p in failed] == [REJECTED_TOOL_ERROR]
    # The model was called again with the rejection as the call's answer.
    assert [t for t, _ in events].count("message.completed") == 3


def test_a_decision_the_approval_does_not_allow_is_refused(alice, scripted_record, start_worker):
    start_worker()
    run, _ = _suspended_for_approval(alice, scripted_record)
    with pytest.raises(ValidationError) as refused:
        services.run_reply(run=run, decision="retry")
    assert refused.value.code == "run.decision_invalid"
    assert Run.objects.get(pk=run.pk).status == RunStatus.SUSPENDED


def test_a_cancelled_approval_leaves_a_history_a_provider_accepts(
    alice, scripted_record, start_worker
):
    start_worker()
    run, session = _suspended_for_approval(alice, scripted_record)
    services.run_cancel(run=run)
    history = history_from_events(_events(session))
    call_id = run.interaction["tool_calls"][0]["id"]
    assert history[-1] == {
        "role": "tool",
        "tool_call_id": call_id,
        "name": "calculator",
        "content": f"error: {NOT_APPROVED_TOOL_ERROR}",
    }
    # While the approval is being answered, the step's calls stay open.
    assert history_from_events(_events(session), open_calls=[call_id])[-1]["role"] == "assistant"


def test_an_edited_call_runs_with_the_users_arguments(alice, scripted_record, start_worker):
    start_worker()
    run, session = _suspended_for_approval(alice, scripted_record)
    interaction = run.interaction
    call_id = interaction["waiting"][0]
    edits = {call_id: {"expression": "3*3"}}
    services.run_reply(run=run, decision="edit", interaction_id=interaction["id"], edits=edits)
    wait_for(
        lambda: Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED,
        message="the edited run to complete",
    )
    events = _events(session)
    started = [p for t, p in events if t == "tool.call.started"]
    assert [(p["id"], p["arguments"]) for p in started] == [(call_id, {"expression": "3*3"})]
    assert Run.objects.get(pk=run.pk).result["text"] == "The result is 9."
    resolved = [p for t, p in events if t == "interaction.resolved"]
    assert resolved == [{"interaction_id": interaction["id"], "decision": "edit", "edits": edits}]
    # The history a later turn gives the model has the call as it was sent.
    [asked] = [m for m in history_from_events(events) if m.get("tool_calls")]
    assert asked["tool_calls"][0]["arguments"] == {"expression": "3*3"}


def test_an_edit_is_given_over_rest(alice, scripted_record, start_worker):
    start_worker()
    run, _ = _suspended_for_approval(alice, scripted_record)
    call_id = run.interaction["waiting"][0]
    response = client_for(alice).post(
        f"/api/v1/runs/{run.pk}/reply/",
        {"decision": "edit", "edits": {call_id: {"expression": "5*5"}}},
        format="json",
    )
    assert response.status_code == 202, response.content
    wait_for(
        lambda: Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED,
        message="the edited run to complete",
    )
    assert Run.objects.get(pk=run.pk).result["text"] == "The result is 25."


@pytest.mark.parametrize(
    "body",
    [
        {"decision": "edit", "edits": {"call_elsewhere": {"expression": "1"}}},
        {"decision": "edit", "edits": {"WAITING": ["not", "an", "object"]}},
        {"decision": "edit"},
        {"decision": "approve", "edits": {"WAITING": {"expression": "1"}}},
    ],
)
def test_an_invalid_edit_is_refused_and_changes_nothing(alice, scripted_record, start_worker, body):
    start_worker()
    run, session = _suspended_for_approval(alice, scripted_record)
    call_id = run.interaction["waiting"][0]
    if "edits" in body:
        body = {
            **body,
            "edits": {k.replace("WAITING", call_id): v for k, v in body["edits"].items()},
        }
    before = len(_events(session))
    response = client_for(alice).post(f"/api/v1/runs/{run.pk}/reply/", body, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == "run.decision_invalid"
    after = Run.objects.get(pk=run.pk)
    assert (after.status, after.interaction) == (RunStatus.SUSPENDED, run.interaction)
    assert len(_events(session)) == before


def test_approval_names_only_the_agents_tools():
    with pytest.raises(ValidationError) as invalid:
        parse_manifest(demo_manifest(approval=["shell"]))
    assert invalid.value.details["field"] == "agents.assistant.approval.0"
    # Without it the manifest (and its ref) is what it was.
    assert "approval" not in parse_manifest(demo_manifest()).agent("assistant")
    assert parse_manifest(demo_manifest(approval=["clock"])).agent("assistant")["approval"] == [
        "clock"
    ]
