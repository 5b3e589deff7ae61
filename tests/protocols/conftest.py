"""Protocol tests drive the host as clients do: the official SDKs against a real uvicorn
on loopback (the production handler, `live_host`) on this test's database, with a worker
(``start_worker``: a real `Worker` in a thread of the test process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rest_framework.authtoken.models import Token

from tests.e2e.conftest import start_worker  # noqa: F401  (the fixture, for these tests)
from tests.scheduling.processes import live_web_server, worker_env

# The live host's pending limit per user: low, so that a test fills the queue with a few
# runs (no worker claiming them).
PENDING_PER_USER = 3


@pytest.fixture(scope="module")
def live_host(tmp_path_factory, django_db_setup) -> Iterator[str]:
    """``uvicorn sagehost.asgi:application`` on the test database (one per module),
    with `PENDING_PER_USER`; yields its base URL."""
    env = worker_env({"SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": str(PENDING_PER_USER)})
    with live_web_server(tmp_path_factory.mktemp("live-host") / "web.log", env) as base:
        yield base


def token(user) -> str:
    """``user``'s API token (created once)."""
    return Token.objects.get_or_create(user=user)[0].key
