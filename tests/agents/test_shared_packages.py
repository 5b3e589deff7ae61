"""Shared packages: staff publish a package version to every user or to named groups; other
users then open sessions on it and run it, while sessions, runs and archives stay private
to whoever made them."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from django.core.management import call_command

from agents import services
from agents.applications import ApplicationKey, build_application_sync
from agents.models import AgentPackage, Visibility
from agents.services import packages
from agents.tools import ToolRegistry
from sageproject.errors import SageError
from tests.conftest import client_for, demo_manifest

pytestmark = [pytest.mark.storage, pytest.mark.django_db]


@pytest.fixture
def shared(alice, scripted_record) -> AgentPackage:
    package, _ = packages.package_create(owner=alice, manifest=demo_manifest(name="helper"))
    return package


def open_session(user, package: str = "helper"):
    return services.session_create(owner=user, package=package, agent="assistant")


def test_a_private_package_is_its_owners_alone(alice, bob, shared):
    assert open_session(alice).package_ref == shared.ref
    with pytest.raises(SageError) as missing:
        open_session(bob)
    assert missing.value.code == "package.not_found"
    assert [p["name"] for p in client_for(bob).get("/api/v1/packages/").json()["results"]] == []


def test_a_package_shared_with_everyone_is_listed_opened_and_built_for_another_user(bob, shared):
    packages.package_publish(shared, Visibility.EVERYONE)

    listed = client_for(bob).get("/api/v1/packages/").json()["results"]
    session = open_session(bob)
    app = build_application_sync(
        ApplicationKey(owner_id=bob.pk, ref=session.package_ref, agent_id="assistant"),
        ToolRegistry(),
    )

    assert [(p["name"], p["owner"], p["visibility"]) for p in listed] == [
        ("helper", "alice", "everyone")
    ]
    assert (session.owner, session.package_ref) == (bob, shared.ref)
    assert app.package_name == "helper"


def test_a_package_shared_with_a_group_reaches_its_members_only(bob, carol, shared):
    team = Group.objects.create(name="team")
    bob.groups.add(team)
    packages.package_publish(shared, Visibility.GROUPS, [team])

    assert open_session(bob).package_ref == shared.ref
    with pytest.raises(SageError):
        open_session(carol)
    assert set(AgentPackage.objects.usable_by(bob.pk)) == {shared}
    assert not AgentPackage.objects.usable_by(carol.pk).exists()


def test_sessions_and_runs_on_a_shared_package_stay_private(alice, bob, shared):
    packages.package_publish(shared, Visibility.EVERYONE)
    session = open_session(bob)
    run, _ = services.run_submit(owner=bob, session_id=session.pk, input="hi")

    alice_api = client_for(alice)
    assert alice_api.get(f"/api/v1/sessions/{session.pk}/").status_code == 404
    assert alice_api.get(f"/api/v1/runs/{run.pk}/").status_code == 404
    with pytest.raises(SageError) as other:
        services.run_submit(owner=alice, session_id=session.pk, input="mine now?")
    assert other.value.code == "session.not_found"


def test_own_packages_come_before_shared_ones_of_the_same_name(alice, bob, shared):
    packages.package_publish(shared, Visibility.EVERYONE)
    own, _ = packages.package_create(owner=bob, manifest=demo_manifest(name="helper"))

    assert own.ref == shared.ref  # the same content: the same ref, but bob's own row
    assert packages.package_resolve(owner=bob, name_or_ref="helper").owner == bob


def test_a_version_made_private_again_no_longer_builds_for_others(bob, shared):
    packages.package_publish(shared, Visibility.EVERYONE)
    session = open_session(bob)
    packages.package_publish(shared, Visibility.PRIVATE)

    with pytest.raises(SageError) as gone:
        build_application_sync(
            ApplicationKey(owner_id=bob.pk, ref=session.package_ref, agent_id="assistant"),
            ToolRegistry(),
        )
    assert gone.value.code == "package.not_found"


def test_an_unknown_visibility_is_refused(shared):
    with pytest.raises(SageError) as refused:
        packages.package_publish(shared, "friends")
    assert refused.value.code == "package.visibility_invalid"


def test_seed_demo_publishes_the_demo_to_every_user(staff, bob):
    call_command("seed_demo", owner=staff.username, verbosity=0)

    assert AgentPackage.objects.get(name="demo").visibility == Visibility.EVERYONE
    assert open_session(bob, "demo").package_name == "demo"


def test_staff_publish_from_the_admin(staff, bob, shared):
    admin = client_for(staff)
    admin.force_login(staff)
    response = admin.post(
        "/admin/agents/agentpackage/",
        {"action": "publish_to_everyone", "_selected_action": [shared.pk]},
    )

    assert response.status_code == 302
    shared.refresh_from_db()
    assert shared.visibility == Visibility.EVERYONE


def test_the_assistants_of_a_name_are_the_version_package_resolve_means(alice, bob, shared):
    """The protocols list and resolve assistants from one query per request; for each
    name it must pick what ``package_resolve`` picks: own before shared, the active version
    before a newer inactive one."""
    from agents.protocols import common

    packages.package_publish(shared, Visibility.EVERYONE)
    other, _ = packages.package_create(owner=alice, manifest=demo_manifest(name="other"))
    packages.package_publish(other, Visibility.EVERYONE)
    mine, _ = packages.package_create(owner=bob, manifest=demo_manifest(name="other"))
    newer, _ = packages.package_create(
        owner=bob, manifest={**demo_manifest(name="other"), "version": "9.9.9"}
    )
    assert not AgentPackage.objects.get(pk=newer.pk).active  # the first version stays active

    chosen = {a.package.name: a.package.pk for a in common.assistants(bob)}
    assert chosen == {
        name: packages.package_resolve(owner=bob, name_or_ref=name).pk
        for name in ("helper", "other")
    }
    assert chosen == {"helper": shared.pk, "other": mine.pk}
