"""A live Sage Host on loopback for the torture checks: ``manage.py runweb --workers 2``
(two uvicorn processes, the production start) and ``manage.py runworker`` as subprocesses
on the test database, their output in log files.

The checks talk to it over HTTP only (``httpx``), as any client would; they read the
database directly only to set up users and tokens and to look for leaks. The worker can be
stopped and started again between checks (the flood needs a host where nothing claims the
runs it admits); the web process lives as long as the host.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from scheduling.subprocesses import Subprocess
from tests.pgcluster import free_port
from tests.scheduling.processes import worker_env
from tests.waiting import WaitTimeout, wait_until

STARTUP_TIMEOUT = 90.0  # two shared cores, a Django start-up per process
RUN_TIMEOUT = 60.0
TERMINAL = frozenset({"completed", "failed", "cancelled", "interrupted"})

# The host's limits. Pending limits are what the flood check measures against: the host
# admits exactly ``PENDING_HOST`` queued runs (every user's limit is higher in sum).
PENDING_HOST = 150
PENDING_PER_USER = 100
HOST_ENV = {
    "SAGE_SERVER_MAX_PENDING_RUNS": str(PENDING_HOST),
    "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": str(PENDING_PER_USER),
    "SAGE_SERVER_MAX_CONCURRENT_RUNS": "8",
    "SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER": "8",
    "SAGE_MAX_CONCURRENT_MODEL_CALLS": "8",
    "SAGE_AUTO_RELEASE_IDLE_SECONDS": "0",
    # The MCP canary's echoing server listens on loopback.
    "SAGE_MCP_ALLOWED_HOSTS": "127.0.0.1",
}


class LiveHost:
    """The web process and (while wanted) one worker; see the module docstring."""

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = worker_env({**HOST_ENV, **(env or {})})
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.web: Subprocess | None = None
        self.worker: Subprocess | None = None
        self.workers_started = 0

    # -- processes ---------------------------------------------------------------------------

    def start(self) -> LiveHost:
        argv = [sys.executable, "manage.py", "runweb", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--workers", "2", "--log-level", "info"]
        self.web = Subprocess("web", argv, self.env, self.log_dir / "web.log")
        self._wait("the web process", self._web_up, [self.web])
        self.ensure_worker()
        return self

    def ensure_worker(self) -> None:
        """Start a worker unless one is running; returns once it claims."""
        if self.worker is not None and self.worker.alive:
            return
        self.workers_started += 1
        log = self.log_dir / f"worker-{self.workers_started}.log"
        argv = [sys.executable, "manage.py", "runworker"]
        self.worker = Subprocess("worker", argv, self.env, log)
        self._wait("the worker", lambda: " started: up to " in self.worker.output(), [self.worker])

    def stop_worker(self) -> None:
        """Stop the worker gracefully (SIGTERM: running runs are finished or requeued)."""
        if self.worker is not None:
            self.worker.stop()

    def stop(self) -> None:
        for child in (self.worker, self.web):
            if child is not None:
                child.stop()

    def logs(self) -> dict[str, str]:
        """Every log file of the host (all workers it started) by file name."""
        return {p.name: p.read_text(errors="replace") for p in sorted(self.log_dir.glob("*.log"))}

    def describe(self, chars: int = 2000) -> str:
        return "\n".join(f"--- {name} ---\n{text[-chars:]}" for name, text in self.logs().items())

    def _web_up(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait(self, what: str, ready: Callable[[], bool], children: list[Subprocess]) -> None:
        def exited() -> str | None:
            dead = [child.name for child in children if not child.alive]
            return f"{dead[0]} exited" if dead else None

        try:
            wait_until(ready, timeout=STARTUP_TIMEOUT, interval=0.1, message=what, abort=exited)
        except WaitTimeout as exc:
            raise RuntimeError(f"{exc}\n{self.describe()}") from None

    # -- clients -----------------------------------------------------------------------------

    def client(self, token: str | None = None, **options: Any) -> httpx.Client:
        headers = {"Authorization": f"Token {token}"} if token else {}
        options.setdefault("timeout", 30)
        return httpx.Client(base_url=self.base_url, headers=headers, **options)

    def wait_run(
        self, api: httpx.Client, run_id: str, *, until: frozenset[str] = TERMINAL
    ) -> dict[str, Any]:
        """Poll ``GET /api/v1/runs/{id}/`` until its status is in ``until``; the last body.
        Raises ``AssertionError`` (with the worker's log) at ``RUN_TIMEOUT``."""
        body: dict[str, Any] = {}

        def reached() -> dict[str, Any] | None:
            nonlocal body
            response = api.get(f"/api/v1/runs/{run_id}/")
            body = response.json()
            return body if response.status_code == 200 and body.get("status") in until else None

        try:
            return wait_until(reached, timeout=RUN_TIMEOUT, interval=0.1, message=f"run {run_id}")
        except WaitTimeout:
            raise AssertionError(
                f"run {run_id} still {body.get('status')!r} after {RUN_TIMEOUT}s\n{self.describe()}"
            ) from None


def make_user(name: str, *, staff: bool = False, password: str | None = None) -> tuple[Any, str]:
    """A committed user (``<name>-<hex>``) and its API token key. A ``password`` is hashed
    with PBKDF2, which the host's processes accept (the test settings hash with MD5)."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.hashers import PBKDF2PasswordHasher
    from rest_framework.authtoken.models import Token

    user = get_user_model().objects.create(
        username=f"{name}-{uuid.uuid4().hex[:6]}", is_staff=staff, is_superuser=staff
    )
    if password is not None:
        hasher = PBKDF2PasswordHasher()
        user.password = hasher.encode(password, hasher.salt())
        user.save(update_fields=["password"])
    return user, Token.objects.create(user=user).key
