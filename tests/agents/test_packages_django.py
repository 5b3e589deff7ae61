"""Packages with the database: save, readiness reports, strict mode, fork, activate,
concurrent saves, run admission in strict mode and archive read permission."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import Group

from agents import archives, services
from agents.models import AgentPackage, ManagedAgentRecord, ReadinessReport
from agents.services import packages
from sageproject.errors import SageError
from scheduling.models import Run, RunStatus
from tests.conftest import demo_manifest

pytestmark = pytest.mark.django_db


def write_skill(root: Path, name: str) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "SKILL.md").write_text(
        f"---\nname: {name}\ndescription: How to handle {name}\n---\nThe body.\n"
    )


@pytest.fixture
def skills_dir(tmp_path, settings) -> Path:
    root = tmp_path / "skills"
    root.mkdir()
    write_skill(root, "refunds")
    settings.SAGE_SKILL_DIRS = [str(root)]
    return root


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setitem(django_settings.SAGE, "SAGE_REQUIRE_READINESS", True)


def skilled(name: str = "skilled", version: str = "1.0.0", skill: str = "refunds") -> dict:
    return demo_manifest(name=name, version=version, skills=[skill])


def test_it_reports_a_removed_skill_as_valid_but_not_ready(alice, scripted_record, skills_dir):
    body = packages.package_save(owner=alice, manifest=skilled(skill="returns"))
    assert body["valid"] is True and body["reused"] is False
    assert body["readiness"]["ready"] is False
    assert body["readiness"]["agents"]["assistant"]["missing_skills"] == ["returns"]
    report = ReadinessReport.objects.get(package=body["package"])
    assert report.valid and not report.ready
    assert report.agents["assistant"]["missing_skills"] == ["returns"]


def test_it_reports_ready_when_everything_is_found(alice, scripted_record, skills_dir):
    body = packages.package_save(owner=alice, manifest=skilled())
    assert body["readiness"]["ready"] is True


def test_it_refuses_a_new_version_in_strict_mode(alice, scripted_record, skills_dir, strict):
    with pytest.raises(SageError) as refused:
        packages.package_save(owner=alice, manifest=skilled(skill="returns"))
    assert refused.value.code == "package.not_ready"
    assert refused.value.details["agents"]["assistant"]["missing_skills"] == ["returns"]
    assert not AgentPackage.objects.exists()


def test_it_revalidates_a_repeated_save_in_strict_mode(
    alice, scripted_record, skills_dir, monkeypatch
):
    packages.package_save(owner=alice, manifest=skilled())
    monkeypatch.setitem(django_settings.SAGE, "SAGE_REQUIRE_READINESS", True)
    again = packages.package_save(owner=alice, manifest=skilled())
    assert again["reused"] is True
    assert again["readiness"]["ready"] is True  # a real report, not the cached answer
    (skills_dir / "refunds" / "SKILL.md").unlink()
    (skills_dir / "refunds").rmdir()
    with pytest.raises(SageError) as refused:
        packages.package_save(owner=alice, manifest=skilled())
    assert refused.value.code == "package.not_ready"
    assert ReadinessReport.objects.filter(ready=False).count() == 1


def test_it_answers_a_repeated_save_without_rechecking_outside_strict_mode(
    alice, scripted_record
):
    packages.package_save(owner=alice, manifest=demo_manifest())
    again = packages.package_save(owner=alice, manifest=demo_manifest())
    assert again["reused"] is True and again["readiness"] is None


def test_it_keeps_versions_immutable(alice, scripted_record):
    packages.package_save(owner=alice, manifest=demo_manifest())
    with pytest.raises(SageError) as conflict:
        packages.package_save(owner=alice, manifest=demo_manifest(instructions="other"))
    assert conflict.value.code == "package.version_conflict"
    assert conflict.value.http_status == 409


@pytest.mark.django_db(transaction=True)
def test_it_saves_twelve_concurrent_identical_saves_once(alice, scripted_record, monkeypatch):
    checks = []
    real = packages.package_readiness

    def counted(*args, **kwargs):
        checks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(packages, "package_readiness", counted)
    barrier = threading.Barrier(12)

    def save(_: int) -> bool:
        from django.db import connection

        barrier.wait()
        try:
            return packages.package_save(owner=alice, manifest=demo_manifest())["reused"]
        finally:
            connection.close()

    with ThreadPoolExecutor(12) as pool:
        reused = list(pool.map(save, range(12)))
    assert reused.count(False) == 1
    assert len(checks) == 1
    assert AgentPackage.objects.count() == 1


def test_it_forks_to_a_new_version(alice, scripted_record):
    original = packages.package_save(owner=alice, manifest=demo_manifest())["package"]
    fork = packages.package_fork(owner=alice, package=original, version="1.1.0")
    assert fork["reused"] is False
    assert fork["package"].version == "1.1.0"
    assert fork["package"].ref != original.ref
    assert fork["package"].active is False


def test_it_activates_with_the_expected_current_ref(alice, scripted_record):
    first = packages.package_save(owner=alice, manifest=demo_manifest())["package"]
    second = packages.package_fork(owner=alice, package=first, version="2.0.0")["package"]
    result = packages.package_activate(owner=alice, package=second, expected_ref=first.ref)
    assert result == {"ref": second.ref, "previous_ref": first.ref, "package": "demo"}
    assert AgentPackage.objects.get(active=True).pk == second.pk


def test_it_refuses_activation_with_a_stale_ref(alice, scripted_record):
    first = packages.package_save(owner=alice, manifest=demo_manifest())["package"]
    second = packages.package_fork(owner=alice, package=first, version="2.0.0")["package"]
    packages.package_activate(owner=alice, package=second, expected_ref=first.ref)
    with pytest.raises(SageError) as conflict:
        packages.package_activate(owner=alice, package=first, expected_ref=first.ref)
    assert conflict.value.code == "package.active_conflict"
    assert conflict.value.http_status == 409


def test_it_refuses_to_fork_another_users_package(alice, bob, scripted_record):
    package = packages.package_save(owner=alice, manifest=demo_manifest())["package"]
    with pytest.raises(SageError) as missing:
        packages.package_fork(owner=bob, package=package, version="9.0.0")
    assert missing.value.code == "package.not_found"


def test_it_refuses_run_submission_in_strict_mode_when_not_ready(
    alice, scripted_record, skills_dir, monkeypatch
):
    packages.package_save(owner=alice, manifest=skilled(skill="returns"))
    session = services.session_create(owner=alice, package="skilled", agent="assistant")
    monkeypatch.setitem(django_settings.SAGE, "SAGE_REQUIRE_READINESS", True)
    with pytest.raises(SageError) as refused:
        services.run_submit(owner=alice, session_id=session.pk, input="hello")
    assert refused.value.code == "package.not_ready"
    assert "missing skills returns" in refused.value.message
    assert not Run.objects.exists()


def test_it_validates_a_saved_package_and_stores_the_report(alice, scripted_record):
    package = packages.package_save(owner=alice, manifest=demo_manifest(tools=["nope"]))[
        "package"
    ]
    body = packages.package_validate(owner=alice, package=package, strict=False)
    assert body["readiness"]["agents"]["assistant"]["missing_tools"] == ["nope"]
    assert ReadinessReport.objects.filter(package=package).count() == 2  # save + validate


def test_it_checks_model_records_the_owner_can_see(alice, bob, scripted_record):
    from pooling.models import ModelRecord, Protocol

    ModelRecord.objects.create(owner=bob, name="private", protocol=Protocol.SCRIPTED)
    body = packages.package_save(owner=alice, manifest=demo_manifest(model="private"))
    assert body["readiness"]["agents"]["assistant"]["missing_model"] == "private"


def _archived(user):
    from scheduling.models import Session

    session = Session.objects.create(
        owner=user, package_ref="r", package_name="p", agent_id="assistant"
    )
    run = Run.objects.create(
        session=session, owner=user, input="x", status=RunStatus.COMPLETED, result={"text": "ok"}
    )
    archives.archive_terminal(run)
    return run


def test_it_reads_an_archive_for_its_owner(alice):
    run = _archived(alice)
    assert archives.archive_read(user=alice, run_id=run.pk).result == {"text": "ok"}


def test_it_hides_another_users_archive(alice, bob):
    run = _archived(alice)
    with pytest.raises(SageError) as missing:
        archives.archive_read(user=bob, run_id=run.pk)
    assert missing.value.http_status == 404


def test_it_refuses_an_archive_after_read_permission_was_revoked(alice):
    run = _archived(alice)
    group, _ = Group.objects.get_or_create(name=services.READ_REVOKED_GROUP)
    alice.groups.add(group)
    with pytest.raises(SageError) as forbidden:
        archives.archive_read(user=alice, run_id=run.pk)
    assert forbidden.value.http_status == 403
    assert ManagedAgentRecord.objects.filter(run=run).exists()


def test_it_finds_the_code_tools_when_they_are_enabled(alice, scripted_record, monkeypatch):
    manifest = demo_manifest(tools=["python"])
    off = packages.package_validate(owner=alice, manifest=manifest)
    assert off["readiness"]["agents"]["assistant"]["missing_tools"] == ["python"]
    monkeypatch.setitem(django_settings.SAGE, "SAGE_CODE_TOOLS", True)
    on = packages.package_validate(owner=alice, manifest=manifest)
    assert on["readiness"]["agents"]["assistant"]["missing_tools"] == []
