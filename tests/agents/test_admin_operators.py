"""Operator admin pages through Django's test client: packages (validate actions, release
selected), readiness reports (table, re-validate), archives, reclamation requests (the
release-idle form), and resident Applications on the capacity page."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from agents.models import AgentPackage, ReadinessReport, ReclamationRequest
from agents.services import packages
from scheduling.models import WorkerSnapshot
from tests.conftest import demo_manifest

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client, staff):
    client.force_login(staff)
    return client


def _package(user, **overrides) -> AgentPackage:
    return packages.package_save(owner=user, manifest=demo_manifest(**overrides))["package"]


def _action(client, model: str, action: str, ids: list[int], **extra):
    return client.post(
        reverse(f"admin:agents_{model}_changelist"),
        {"action": action, "_selected_action": ids, **extra},
        follow=True,
    )


def test_it_validates_packages_from_the_admin(staff_client, alice, scripted_record, skills_dir):
    package = _package(alice, skills=["returns"])
    response = _action(staff_client, "agentpackage", "validate_packages", [package.pk])
    assert response.status_code == 200
    text = response.content.decode()
    assert "valid but not ready" in text and "skills returns" in text
    assert ReadinessReport.objects.filter(package=package).count() == 2


def test_it_validates_packages_strictly_and_shows_the_refusal(
    staff_client, alice, scripted_record, skills_dir
):
    package = _package(alice, skills=["returns"])
    response = _action(staff_client, "agentpackage", "validate_packages_strictly", [package.pk])
    text = response.content.decode()
    assert "package.not_ready" in text
    assert ReadinessReport.objects.filter(package=package, strict=True, ready=False).exists()


def test_it_shows_missing_skills_at_a_glance(staff_client, alice, scripted_record, skills_dir):
    package = _package(alice, skills=["returns"], tools=["clock", "teleport"])
    listing = staff_client.get(reverse("admin:agents_readinessreport_changelist")).content
    assert b"assistant: tools teleport; skills returns" in listing
    report = ReadinessReport.objects.get(package=package)
    detail = staff_client.get(
        reverse("admin:agents_readinessreport_change", args=[report.pk])
    ).content.decode()
    assert "readiness-table" in detail
    assert "Missing skills" in detail and "<li>returns</li>" in detail
    assert "<li>teleport</li>" in detail
    assert "not ready" in detail


def test_it_revalidates_a_report(staff_client, alice, scripted_record, skills_dir):
    package = _package(alice, skills=["refunds"])
    report = ReadinessReport.objects.get(package=package)
    (skills_dir / "refunds" / "SKILL.md").unlink()
    _action(staff_client, "readinessreport", "revalidate", [report.pk])
    latest = ReadinessReport.objects.filter(package=package).order_by("-checked_at", "-pk")[0]
    assert latest.pk != report.pk
    assert latest.ready is False


def test_it_requests_release_of_selected_packages(staff_client, staff, alice, scripted_record):
    package = _package(alice)
    response = _action(staff_client, "agentpackage", "release_selected", [package.pk])
    row = ReclamationRequest.objects.get()
    assert row.scope == "selected" and row.refs == [package.ref]
    assert row.requested_by == staff
    assert b"Waiting for the worker" in response.content


def test_it_requests_an_idle_release_through_the_intermediate_form(staff_client):
    url = reverse("admin:agents_reclamationrequest_release_idle")
    form = staff_client.get(url)
    assert form.status_code == 200
    assert b"Minimum idle time" in form.content and b"Release at most" in form.content
    response = staff_client.post(url, {"min_idle_seconds": 120, "limit": 2}, follow=True)
    row = ReclamationRequest.objects.get()
    assert (row.scope, row.min_idle_seconds, row.limit, row.status) == ("idle", 120, 2, "pending")
    assert response.redirect_chain[-1][0].endswith(
        reverse("admin:agents_reclamationrequest_change", args=[row.pk])
    )


def test_it_rejects_a_negative_minimum_idle_time(staff_client):
    url = reverse("admin:agents_reclamationrequest_release_idle")
    response = staff_client.post(url, {"min_idle_seconds": -1, "limit": 2})
    assert response.status_code == 200
    assert not ReclamationRequest.objects.exists()


def test_it_shows_the_workers_answer(staff_client, staff):
    row = ReclamationRequest.objects.create(
        requested_by=staff,
        status="refused",
        outcome={"released": 0, "message": "refused: 1:abc:assistant: 1 unfinished run(s)"},
        finished_at=timezone.now(),
    )
    listing = staff_client.get(reverse("admin:agents_reclamationrequest_changelist")).content
    assert b"1 unfinished run(s)" in listing
    assert b"Release idle (safe)" in listing
    detail = staff_client.get(
        reverse("admin:agents_reclamationrequest_change", args=[row.pk])
    ).content
    assert b"Refused:" in detail


def test_it_lists_archives_read_only_with_filters(staff_client, alice, make_session):
    from agents import archives
    from scheduling.models import Run, RunStatus

    session = make_session(alice)
    run = Run.objects.create(
        session=session, owner=alice, input="x", status=RunStatus.COMPLETED, result={"text": "ok"}
    )
    record = archives.archive_terminal(run)
    listing = staff_client.get(
        reverse("admin:agents_managedagentrecord_changelist") + "?status=completed"
    )
    assert listing.status_code == 200 and b"demo" in listing.content
    detail = staff_client.get(reverse("admin:agents_managedagentrecord_change", args=[record.pk]))
    assert b'name="result"' not in detail.content  # read-only: no input for the result


def test_it_shows_resident_applications_on_the_capacity_page(staff_client):
    now = timezone.now()
    WorkerSnapshot.objects.create(
        worker_id="w1",
        host="h",
        pid=1,
        started_at=now,
        heartbeat_at=now,
        capacity={
            "executor": {
                "management": {
                    "applications": 1,
                    "resident": [
                        {
                            "owner": 3,
                            "package": "support",
                            "ref": "abcdef1234567890",
                            "agent": "assistant",
                            "state": "ready",
                            "idle_seconds": 42.0,
                            "usage": 0,
                            "unfinished_runs": 1,
                            "safe_to_release": False,
                        }
                    ],
                }
            }
        },
    )
    page = staff_client.get(reverse("admin:capacity")).content.decode()
    assert "Resident Applications (1)" in page
    assert "support" in page and "42.0 s" in page and "abcdef123456" in page
    assert "release idle (safe)" in page
