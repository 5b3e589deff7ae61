"""REST: packages create / validate / activate / fork / list pagination; strict runs;
archive read permission."""

from __future__ import annotations

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import Group

from agents import archives, services
from agents.services import packages
from scheduling.models import Run, RunStatus, Session
from tests.conftest import demo_manifest

pytestmark = pytest.mark.django_db


def _create(api, manifest: dict):
    return api.post("/api/v1/packages/", {"manifest": manifest}, format="json")


def test_it_creates_a_package_with_its_readiness(alice_api, scripted_record, skills_dir):
    response = _create(alice_api, demo_manifest(skills=["returns"]))
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["reused"] is False and body["valid"] is True
    assert body["readiness"]["agents"]["assistant"]["missing_skills"] == ["returns"]


def test_it_answers_a_repeated_save_as_reused(alice_api, scripted_record):
    _create(alice_api, demo_manifest())
    response = _create(alice_api, demo_manifest())
    assert response.status_code == 200
    assert response.json()["reused"] is True


def test_it_answers_409_for_a_changed_version(alice_api, scripted_record):
    _create(alice_api, demo_manifest())
    response = _create(alice_api, demo_manifest(instructions="changed"))
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "package.version_conflict"


def test_it_refuses_an_invalid_manifest_with_the_field(alice_api):
    manifest = demo_manifest()
    manifest["files"] = {"../escape": "x"}
    response = _create(alice_api, manifest)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "package.invalid"
    assert response.json()["error"]["details"]["field"].startswith("files")


def test_it_refuses_saves_in_strict_mode_with_the_list(
    alice_api, scripted_record, skills_dir, monkeypatch
):
    monkeypatch.setitem(django_settings.SAGE, "SAGE_REQUIRE_READINESS", True)
    response = _create(alice_api, demo_manifest(skills=["returns"]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "package.not_ready"
    assert error["details"]["agents"]["assistant"]["missing_skills"] == ["returns"]


def test_it_validates_a_saved_package(alice_api, scripted_record, skills_dir):
    package_id = _create(alice_api, demo_manifest(skills=["refunds"])).json()["id"]
    response = alice_api.post(f"/api/v1/packages/{package_id}/validate/", {}, format="json")
    assert response.status_code == 200
    assert response.json()["readiness"]["ready"] is True


def test_it_validates_strictly_by_query_flag(alice_api, scripted_record, skills_dir):
    package_id = _create(alice_api, demo_manifest(skills=["returns"])).json()["id"]
    lenient = alice_api.post(f"/api/v1/packages/{package_id}/validate/", {}, format="json")
    assert lenient.status_code == 200 and lenient.json()["readiness"]["ready"] is False
    strict = alice_api.post(f"/api/v1/packages/{package_id}/validate/?strict=1", {}, format="json")
    assert strict.status_code == 400
    assert strict.json()["error"]["code"] == "package.not_ready"


def test_it_activates_with_the_expected_ref(alice_api, scripted_record):
    first = _create(alice_api, demo_manifest()).json()
    fork = alice_api.post(
        f"/api/v1/packages/{first['id']}/fork/", {"version": "2.0.0"}, format="json"
    )
    assert fork.status_code == 201
    second = fork.json()
    response = alice_api.post(
        f"/api/v1/packages/{second['id']}/activate/",
        {"expected_ref": first["ref"]},
        format="json",
    )
    assert response.status_code == 200
    assert response.json()["previous_ref"] == first["ref"]


def test_it_answers_409_for_a_stale_expected_ref(alice_api, scripted_record):
    first = _create(alice_api, demo_manifest()).json()
    second = alice_api.post(
        f"/api/v1/packages/{first['id']}/fork/", {"version": "2.0.0"}, format="json"
    ).json()
    response = alice_api.post(
        f"/api/v1/packages/{second['id']}/activate/", {"expected_ref": "stale"}, format="json"
    )
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "package.active_conflict"


def test_it_hides_another_users_package_from_actions(alice_api, bob_api, scripted_record):
    package_id = _create(alice_api, demo_manifest()).json()["id"]
    response = bob_api.post(f"/api/v1/packages/{package_id}/validate/", {}, format="json")
    assert response.status_code == 404


def test_it_scopes_the_inventory_per_owner(alice_api, bob_api, scripted_record):
    _create(alice_api, demo_manifest())
    assert alice_api.get("/api/v1/packages/").json()["count"] == 1
    assert bob_api.get("/api/v1/packages/").json()["count"] == 0


def test_it_limits_page_sizes_to_one_to_a_hundred(alice_api):
    assert alice_api.get("/api/v1/packages/?page_size=100").status_code == 200
    for bad in (0, 101):
        response = alice_api.get(f"/api/v1/packages/?page_size={bad}")
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "request.invalid"  # every list's rule


def test_it_refuses_runs_in_strict_mode_when_not_ready(
    alice, alice_api, scripted_record, skills_dir, monkeypatch
):
    _create(alice_api, demo_manifest(skills=["returns"]))
    session = alice_api.post(
        "/api/v1/sessions/", {"package": "demo", "agent": "assistant"}, format="json"
    ).json()["id"]
    monkeypatch.setitem(django_settings.SAGE, "SAGE_REQUIRE_READINESS", True)
    response = alice_api.post("/api/v1/runs/", {"session": session, "input": "hi"}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "package.not_ready"
    assert "returns" in response.json()["error"]["message"]


def test_it_answers_403_for_an_archive_after_revocation(alice, alice_api):
    session = Session.objects.create(
        owner=alice, package_ref="r", package_name="p", agent_id="assistant"
    )
    run = Run.objects.create(
        session=session, owner=alice, input="x", status=RunStatus.COMPLETED, result={"text": "a"}
    )
    archives.archive_terminal(run)
    assert alice_api.get(f"/api/v1/archives/{run.pk}/").status_code == 200
    group, _ = Group.objects.get_or_create(name=services.READ_REVOKED_GROUP)
    alice.groups.add(group)
    response = alice_api.get(f"/api/v1/archives/{run.pk}/")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "run.read_forbidden"


def test_it_keeps_the_package_ref_the_content_hash(alice_api, scripted_record):
    body = _create(alice_api, demo_manifest()).json()
    assert body["ref"] == packages.parse_manifest(demo_manifest()).ref
