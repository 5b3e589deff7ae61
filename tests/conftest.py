"""Shared fixtures: the cast (alice, bob, carol, staff), API clients, service checks."""

from __future__ import annotations

import os
import socket

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

CI = os.environ.get("CI", "").lower() == "true"


def service_reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Skip when a service is down on a plain machine; fail under CI, where it is required."""
    if service_reachable(host, port):
        return
    message = f"{name} is not reachable at {host}:{port}"
    if CI:
        pytest.fail(f"{message} (required under CI=true)")
    pytest.skip(message)


@pytest.fixture
def redis_url() -> str:
    url = os.environ.get("SAGE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    require_service("Redis", "127.0.0.1", 6379)
    return url


def _user(django_user_model, name: str, *, staff: bool = False):
    return django_user_model.objects.create_user(
        username=name, password=f"{name}-password", is_staff=staff, is_superuser=staff
    )


@pytest.fixture
def alice(db, django_user_model):
    return _user(django_user_model, "alice")


@pytest.fixture
def bob(db, django_user_model):
    return _user(django_user_model, "bob")


@pytest.fixture
def carol(db, django_user_model):
    return _user(django_user_model, "carol")


@pytest.fixture
def staff(db, django_user_model):
    return _user(django_user_model, "staff", staff=True)


def client_for(user) -> APIClient:
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


@pytest.fixture
def alice_api(alice) -> APIClient:
    return client_for(alice)


@pytest.fixture
def bob_api(bob) -> APIClient:
    return client_for(bob)


@pytest.fixture
def staff_api(staff) -> APIClient:
    return client_for(staff)


@pytest.fixture
def scripted_record(db):
    from pooling.models import ModelRecord, Protocol

    record, _ = ModelRecord.objects.get_or_create(
        owner=None, name="scripted", defaults={"protocol": Protocol.SCRIPTED, "model": "scripted"}
    )
    return record


def scripted_model(name: str, *script: dict, token_delay_ms: int = 0, **options):
    """The shared model record ``name`` of the keyless scripted model (created once): its
    ``script`` steps (``{"text": ..., "tool_calls": [...]}``, one per model call), tokens
    ``token_delay_ms`` apart, and any other option it knows (``error``, …)."""
    from pooling.models import ModelRecord, Protocol

    if script:
        options["script"] = list(script)
    if token_delay_ms:
        options["token_delay_ms"] = token_delay_ms
    record, _ = ModelRecord.objects.get_or_create(
        owner=None,
        name=name,
        defaults={"protocol": Protocol.SCRIPTED, "model": name, "options": options},
    )
    return record


def words(count: int, word: str = "w") -> str:
    """``count`` words of text for a scripted step (one streamed token each)."""
    return " ".join([word] * count)


def demo_manifest(name: str = "demo", version: str = "1.0.0", **agent_overrides) -> dict:
    agent = {
        "model": "scripted",
        "instructions": "You are a test assistant.",
        "tools": ["clock", "calculator"],
        "max_steps": 8,
        **agent_overrides,
    }
    return {
        "name": name,
        "version": version,
        "entrypoint": "assistant",
        "agents": {"assistant": agent},
    }


@pytest.fixture
def make_session(scripted_record):
    """Create a package (if needed) and a session for a user; returns the Session."""
    from agents import services
    from agents.services import packages

    def make(user, *, manifest: dict | None = None, kind: str = "master"):
        package, _ = packages.package_create(owner=user, manifest=manifest or demo_manifest())
        return services.session_create(
            owner=user, package=package.name, agent="assistant", kind=kind
        )

    return make


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # PBKDF2 makes every created user cost ~0.3 s; tests don't need real hashing strength.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(scope="session", autouse=True)
def _release_stray_connections(django_db_setup, django_db_blocker):
    """Worker threads keep their own database connections; PostgreSQL refuses to drop a
    test database while any is open, so end them before pytest-django drops it."""
    yield
    from django.db import connection

    with django_db_blocker.unblock():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )


def flow_manifest(
    agents: dict,
    *,
    start: str,
    nodes: dict,
    edges: list[dict] | None = None,
    name: str = "p",
    flow: str = "main",
) -> dict:
    """A package manifest of ``agents`` entered at its one flow, ``flow``: the ``nodes`` run
    from ``start`` along the ``edges``."""
    return {
        "name": name,
        "version": "1.0.0",
        "entrypoint": flow,
        "agents": agents,
        "flows": {flow: {"start": start, "nodes": nodes, "edges": edges or []}},
    }


class FakeClock:
    """A monotonic clock the test moves by hand (``clock.now += seconds``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def skills_dir(tmp_path, settings):
    """A skills directory holding one skill, ``refunds``, set as the host's only one."""
    root = tmp_path / "skills"
    (root / "refunds").mkdir(parents=True)
    (root / "refunds" / "SKILL.md").write_text(
        "---\nname: refunds\ndescription: Refund rules\n---\nBody.\n"
    )
    settings.SAGE_SKILL_DIRS = [str(root)]
    return root
