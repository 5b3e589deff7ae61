"""The run and session services called directly (the REST API, the admin and the commands
all go through them): what each checks and what it leaves in the database."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.db import transaction

from agents import archives, services
from agents.models import ManagedAgentRecord, ThreadMetadata
from agents.services import packages
from sageproject.errors import SageError
from scheduling import runs
from scheduling.models import Event, Run, RunStatus, Session
from scheduling.runs import Fence
from tests.conftest import demo_manifest

pytestmark = [pytest.mark.storage, pytest.mark.django_db]


def error_of(call, *args, **kwargs) -> SageError:
    with pytest.raises(SageError) as raised:
        call(*args, **kwargs)
    return raised.value


def suspend(run: Run, interaction_id: str = "i1") -> None:
    """Claim ``run`` and park it as a worker does when a model call is refused."""
    (grant,), _ = runs.claim(worker_id="w", duration=timedelta(seconds=60), limit=1)
    fence = Fence(run_id=grant.row["pk"], lease_owner="w", lease_token=grant.token)
    assert str(fence.run_id) == str(run.pk)
    with transaction.atomic():
        runs.Suspend(
            fence,
            {"id": interaction_id, "type": "retry", "allowed_decisions": ["retry", "cancel"]},
        )("default")


# --- sessions ----------------------------------------------------------------------------


def test_a_session_opens_on_an_agent_or_a_flow_of_the_owners_package(alice, scripted_record):
    manifest = demo_manifest()
    manifest["flows"] = {
        "pipeline": {"start": "a", "nodes": {"a": {"type": "agent", "agent": "assistant"}}}
    }
    packages.package_create(owner=alice, manifest=manifest)

    session = services.session_create(owner=alice, package="demo", agent="assistant")
    flow = services.session_create(owner=alice, package="demo", agent="pipeline")

    assert (session.owner, session.agent_id, session.package_name) == (alice, "assistant", "demo")
    assert flow.agent_id == "pipeline"


def test_an_imported_session_holds_the_history_as_events_of_no_run(alice, scripted_record):
    packages.package_create(owner=alice, manifest=demo_manifest())

    session = services.session_import(
        owner=alice,
        package="demo",
        agent="assistant",
        history=[("user", "hi"), ("assistant", "hello")],
    )

    events = list(Event.objects.filter(session=session).order_by("seq"))
    assert [(e.seq, e.run_id, e.type) for e in events] == [
        (1, None, "message.completed"),
        (2, None, "message.completed"),
    ]
    assert [e.payload for e in events] == [
        {"role": "user", "content": "hi", "imported": True},
        {"role": "assistant", "content": "hello", "imported": True},
    ]
    assert session.kind == "branch"


def test_an_import_with_an_unknown_agent_leaves_no_session(alice, scripted_record):
    packages.package_create(owner=alice, manifest=demo_manifest())

    error = error_of(
        services.session_import, owner=alice, package="demo", agent="x", history=[("user", "a")]
    )

    assert error.code == "session.agent_not_found"
    assert not Session.objects.filter(owner=alice).exists()


def test_a_session_names_an_agent_the_package_has(alice, scripted_record):
    packages.package_create(owner=alice, manifest=demo_manifest())

    error = error_of(services.session_create, owner=alice, package="demo", agent="nobody")

    assert error.code == "session.agent_not_found"
    assert error.details["fields"]["agent"] == ["unknown agent 'nobody'"]


def test_another_users_package_is_not_found(alice, bob, scripted_record):
    packages.package_create(owner=alice, manifest=demo_manifest())

    error = error_of(services.session_create, owner=bob, package="demo", agent="assistant")

    assert error.code == "package.not_found"


# --- threads (a LangGraph thread is a session) ---------------------------------------------


def test_a_thread_opens_bound_to_nothing_with_its_metadata(alice):
    thread = services.thread_create(owner=alice, metadata={"project": "gemini"})

    assert (thread.owner, thread.package_ref, thread.agent_id) == (alice, "", "")
    assert ThreadMetadata.objects.get(session=thread).metadata == {"project": "gemini"}


def test_a_thread_id_already_taken_is_thread_exists(alice, bob):
    taken = services.thread_create(owner=alice)

    error = error_of(services.thread_create, owner=bob, thread_id=taken.pk)

    assert error.code == "thread.exists"
    assert Session.objects.get(pk=taken.pk).owner == alice


def test_a_thread_is_bound_once_to_the_agent_of_its_first_run(alice, scripted_record):
    demo, _ = packages.package_create(owner=alice, manifest=demo_manifest())
    other, _ = packages.package_create(owner=alice, manifest=demo_manifest("other"))
    thread = services.thread_create(owner=alice)

    services.thread_bind(session=thread, package=demo, agent="assistant")
    error = error_of(services.thread_bind, session=thread, package=other, agent="assistant")

    assert (thread.package_ref, thread.package_name, thread.agent_id) == (
        demo.ref,
        "demo",
        "assistant",
    )
    assert error.code == "thread.assistant_conflict"
    assert "demo/assistant" in error.message and "other/assistant" in error.message


def test_a_thread_metadata_update_merges_the_keys(alice):
    thread = services.thread_create(owner=alice, metadata={"project": "gemini", "stage": 1})

    merged = services.thread_metadata_update(session=thread, metadata={"stage": 2})

    assert merged == {"project": "gemini", "stage": 2}
    assert ThreadMetadata.objects.get(session=thread).metadata == merged


def test_a_thread_delete_cancels_its_queued_run_then_removes_the_session(alice, make_session):
    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="hi")

    services.thread_delete(session=session)

    assert not Session.objects.filter(pk=session.pk).exists()
    assert not Run.objects.filter(pk=run.pk).exists()


def test_a_thread_whose_run_is_still_running_is_not_deleted(alice, make_session):
    session = make_session(alice)
    services.run_submit(owner=alice, session_id=session.pk, input="hi")
    runs.claim(worker_id="w", duration=timedelta(seconds=60), limit=1)

    error = error_of(services.thread_delete, session=session)

    assert error.code == "session.busy"
    assert Session.objects.filter(pk=session.pk).exists()


def test_a_rollback_removes_the_events_of_the_finished_runs_after_the_point(alice, make_session):
    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="hi")
    services.run_cancel(run=run)
    assert Event.objects.filter(session=session, run=run).exists()

    replaced = services.session_rollback(session=session, after_seq=0)

    assert replaced == [run.pk]
    assert not Event.objects.filter(session=session).exists()
    assert Session.objects.get(pk=session.pk).persisted_events == 0


def test_a_rollback_refuses_imported_turns(alice, make_session):
    session = make_session(alice)
    runs.append_event(session.pk, None, "message.completed", {"role": "user", "content": "x"})

    error = error_of(services.session_rollback, session=session, after_seq=0)

    assert error.code == "checkpoint.not_replaceable"
    assert Event.objects.filter(session=session).count() == 1


def test_a_rollback_refuses_an_unfinished_run(alice, make_session):
    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="hi")
    runs.append_event(session.pk, run.pk, "message.completed", {"role": "user", "content": "hi"})

    error = error_of(services.session_rollback, session=session, after_seq=0)

    assert error.code == "session.busy"
    assert Event.objects.filter(session=session, run=run).exists()


# --- runs --------------------------------------------------------------------------------


def test_a_submit_admits_a_queued_run_once_per_idempotency_key(alice, make_session):
    session = make_session(alice)

    run, created = services.run_submit(
        owner=alice, session_id=session.pk, input="hi", idempotency_key="k"
    )
    again, created_again = services.run_submit(
        owner=alice, session_id=session.pk, input="other", idempotency_key="k"
    )

    assert (created, created_again) == (True, False)
    assert again.pk == run.pk and run.status == RunStatus.QUEUED
    assert Run.objects.filter(session=session).count() == 1


def test_a_submit_into_another_users_session_is_not_found(alice, bob, make_session):
    session = make_session(alice)

    error = error_of(services.run_submit, owner=bob, session_id=session.pk, input="hi")

    assert error.code == "session.not_found"
    assert not Run.objects.exists()


def test_a_priority_above_zero_is_for_staff(alice, staff, make_session):
    error = error_of(
        services.run_submit, owner=alice, session_id=make_session(alice).pk, input="x", priority=5
    )
    run, _ = services.run_submit(
        owner=staff, session_id=make_session(staff).pk, input="x", priority=5
    )

    assert error.code == "run.priority_forbidden"
    assert run.priority == 5


def test_a_cancel_ends_a_queued_run_with_its_archive_and_is_idempotent(alice, make_session):
    run, _ = services.run_submit(owner=alice, session_id=make_session(alice).pk, input="x")

    cancelled = services.run_cancel(run=run)
    again = services.run_cancel(run=cancelled)

    assert cancelled.status == again.status == RunStatus.CANCELLED
    assert ManagedAgentRecord.objects.get(run=run).status == RunStatus.CANCELLED


def test_a_reply_needs_a_suspended_run(alice, make_session):
    run, _ = services.run_submit(owner=alice, session_id=make_session(alice).pk, input="x")

    error = error_of(services.run_reply, run=run, decision="retry")

    assert error.code == "run.not_suspended"


def test_a_reply_checks_the_interaction_and_the_decision(alice, make_session):
    run, _ = services.run_submit(owner=alice, session_id=make_session(alice).pk, input="x")
    suspend(run)
    run.refresh_from_db()

    stale = error_of(services.run_reply, run=run, decision="retry", interaction_id="old")
    invalid = error_of(services.run_reply, run=run, decision="approve")

    assert stale.code == "interaction.revision_conflict"
    assert invalid.code == "run.decision_invalid"
    assert Run.objects.get(pk=run.pk).status == RunStatus.SUSPENDED


def test_a_retry_reply_queues_the_run_again_and_a_cancel_reply_ends_it(alice, make_session):
    first, _ = services.run_submit(owner=alice, session_id=make_session(alice).pk, input="x")
    suspend(first)
    first.refresh_from_db()

    resumed = services.run_reply(run=first, decision="retry", interaction_id="i1")

    assert resumed.status == RunStatus.QUEUED
    assert resumed.interaction["resolution"] == {"interaction_id": "i1", "decision": "retry"}

    suspend(resumed, "i2")
    resumed.refresh_from_db()
    ended = services.run_reply(run=resumed, decision="cancel")
    assert ended.status == RunStatus.CANCELLED


def test_revoking_the_read_permission_denies_reads_of_archives_too(alice, bob, make_session):
    run, _ = services.run_submit(owner=alice, session_id=make_session(alice).pk, input="x")
    services.run_cancel(run=run)

    assert archives.archive_read(user=alice, run_id=run.pk).status == RunStatus.CANCELLED
    assert error_of(archives.archive_read, user=bob, run_id=run.pk).code == "archive.not_found"
    alice.groups.add(Group.objects.get_or_create(name=services.READ_REVOKED_GROUP)[0])
    assert error_of(services.check_read_permission, alice).code == "run.read_forbidden"
    assert error_of(archives.archive_read, user=alice, run_id=run.pk).code == ("run.read_forbidden")
