"""``/healthz`` (the process answers) and ``/readyz`` (database, migrations, a fresh worker
heartbeat): unauthenticated JSON, 503 naming what failed, nothing a stranger should read."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.recorder import MigrationRecorder
from django.utils import timezone
from rest_framework.test import APIClient

from scheduling.models import WorkerSnapshot


def snapshot(name: str = "w1", *, age: float = 0.0, stopped: bool = False) -> WorkerSnapshot:
    """A worker's snapshot whose heartbeat is ``age`` seconds old."""
    now = timezone.now()
    return WorkerSnapshot.objects.create(
        worker_id=f"host-{name}:4242:{name}",
        host=f"host-{name}",
        pid=4242,
        started_at=now - timedelta(hours=1),
        heartbeat_at=now - timedelta(seconds=age),
        stopped_at=now if stopped else None,
    )


def readyz() -> tuple[int, dict]:
    response = APIClient().get("/readyz")
    assert response["Content-Type"] == "application/json"
    assert response["Cache-Control"] == "no-store"
    return response.status_code, response.json()


def test_healthz_answers_without_touching_the_database():
    # No database fixture: any query would raise here.
    response = APIClient().get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_is_ready_with_a_fresh_worker_heartbeat():
    snapshot(age=2)
    status, body = readyz()
    assert status == 200, body
    assert body["status"] == "ready"
    assert body["failed"] == []
    assert [(c["name"], c["status"]) for c in body["checks"]] == [
        ("database", "ok"),
        ("migrations", "ok"),
        ("workers", "ok"),
    ]


@pytest.mark.django_db
def test_readyz_is_503_naming_the_workers_without_any_worker():
    status, body = readyz()
    assert status == 503
    assert body["status"] == "not_ready"
    assert body["failed"] == ["workers"]
    workers = next(c for c in body["checks"] if c["name"] == "workers")
    assert workers == {
        "name": "workers",
        "status": "fail",
        "detail": "no worker heartbeat in the last 30 s",
    }


@pytest.mark.django_db
@pytest.mark.parametrize(
    "stale",
    [{"age": 31}, {"age": 0, "stopped": True}],
    ids=["heartbeat-older-than-30s", "worker-stopped"],
)
def test_readyz_is_503_when_the_only_worker_is_stale_or_stopped(stale):
    snapshot(**stale)
    status, body = readyz()
    assert status == 503
    assert body["failed"] == ["workers"]
    # One fresh worker is enough.
    snapshot("w2", age=1)
    assert readyz()[0] == 200


@pytest.mark.django_db
def test_readyz_is_503_naming_the_migrations_when_one_is_not_applied():
    snapshot(age=0)
    applied = MigrationRecorder(connection).migration_qs
    applied.filter(app="scheduling").order_by("-id").first().delete()
    status, body = readyz()
    assert status == 503
    # The worker check reads tables a pending migration may change: not checked.
    assert body["failed"] == ["migrations", "workers"]
    details = {c["name"]: c["detail"] for c in body["checks"]}
    assert details["migrations"] == "1 migrations not applied"
    assert details["workers"] == "not checked"


@pytest.mark.django_db
def test_a_not_ready_answer_is_not_logged_as_a_server_error(caplog):
    with caplog.at_level("INFO", logger="django.request"):
        assert readyz()[0] == 503
    assert [r for r in caplog.records if r.name == "django.request"] == []


@pytest.mark.django_db
def test_readyz_shows_no_host_worker_or_version():
    snapshot("secretive", age=0)
    response = APIClient().get("/readyz")
    text = response.content.decode()
    assert response.status_code == 200
    for leak in ("host-secretive", "4242", "SQLite", "PostgreSQL", "MariaDB", "MySQL"):
        assert leak not in text


def test_the_probes_are_not_in_the_api_schema(alice_api):
    response = alice_api.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert paths  # the schema itself is there
    assert not [p for p in paths if "healthz" in p or "readyz" in p]
