"""Real ``manage.py runworker`` processes against the test database, for fault tests.

A test starts workers through the ``worker_processes`` fixture (register it in a test module
with ``from tests.scheduling.processes import worker_processes_fixture`` and
``worker_processes = worker_processes_fixture``)::

    def test_it(worker_processes):
        worker = worker_processes.start("a", SAGE_CRASH_AT="finish.after_commit")
        worker.wait_killed(timeout=30)             # died of SIGKILL (its crash point)
        expire_leases(worker)                      # dead: its leases need not run out
        fresh = worker_processes.start("b")
        ...
        fresh.terminate()                          # SIGTERM, then wait for a clean exit

Every process started through the fixture is stopped at teardown, on failure too. Keyword
arguments of ``start`` are environment overrides (``None`` removes a variable). Waits
raise ``AssertionError`` naming what was awaited, with the tail of each worker's log, so a
failing test says why without hanging.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone

from sageproject.db import database_url
from scheduling.subprocesses import ROOT, Subprocess
from tests.waiting import wait_until

# Worker settings for tests: a renewal every second and leases long enough that a loaded
# machine (a worker's event loop stalled for seconds, e.g. importing a vendor SDK) does not
# lose them; a test that kills a worker ends its leases with `expire_leases` rather than
# waiting them out. A quick drain on SIGTERM.
DEFAULT_ENV = {
    "SAGE_LEASE_SECONDS": "10",
    "SAGE_HEARTBEAT_SECONDS": "1",
    "SAGE_SHUTDOWN_GRACE_SECONDS": "2",
    "LOG_LEVEL": "INFO",
    "PYTHONUNBUFFERED": "1",
    # The tests' MCP servers listen on loopback, which the MCP policy refuses by default.
    "SAGE_MCP_ALLOWED_HOSTS": "127.0.0.1",
}
# Inherited variables that must never reach a worker unless a test sets them.
_CLEARED = ("SAGE_TEST_DB_NAME", "SAGE_CRASH_AT", "SAGE_STOP_AT")


def worker_env(overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a worker subprocess: this one's, the test database, the test's
    ``SECRET_KEY`` (so it decrypts the model records the test wrote), `DEFAULT_ENV`, then
    ``overrides`` (``None`` removes a variable)."""
    env = {**os.environ}
    for name in _CLEARED:
        env.pop(name, None)
    env.update(DEFAULT_ENV)
    env["DATABASE_URL"] = database_url()  # this test's database
    env["SECRET_KEY"] = settings.SECRET_KEY
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


class WorkerProcess(Subprocess):
    """One ``manage.py runworker`` subprocess (``args`` added to its command line) with
    `worker_env` and the ``env`` overrides; its output goes to ``worker-<name>.log``."""

    def __init__(
        self,
        name: str,
        log_dir: Path,
        env: Mapping[str, str | None] | None = None,
        args: Sequence[str] = (),
    ) -> None:
        self.env = dict(env or {})
        self.started_at = time.monotonic()
        argv = [sys.executable, "manage.py", "runworker", *args]
        super().__init__(name, argv, worker_env(env), log_dir / f"worker-{name}.log")

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.name} pid={self.pid} returncode={self.returncode}>"

    @property
    def owner_marker(self) -> str:
        """A substring of this worker's lease owner (worker ids are ``host:pid:suffix``)."""
        return f":{self.pid}:"

    @property
    def killed(self) -> bool:
        """True once the process has died of SIGKILL."""
        return self.proc.poll() == -signal.SIGKILL

    def state(self) -> str:
        """The process state letter from /proc (``T``: stopped), or ``gone``."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return "gone"
        return stat.rsplit(")", 1)[1].split()[0]

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        if self.alive:
            self.proc.kill()
        self.proc.wait(10)

    def wait_exit(self, timeout: float) -> int:
        """Wait for the process to end; returns its return code (negative: the signal)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {self.name} (pid {self.pid}) still running after {timeout}s\n"
                f"--- its log ---\n{self.tail()}"
            ) from None

    def wait_killed(
        self,
        timeout: float,
        *,
        unless: Callable[[], bool] | None = None,
        grace: float = 5.0,
        poll: float = 0.05,
    ) -> None:
        """Wait for the process to die of SIGKILL (a crash point); fails otherwise.

        ``unless`` (optional) says the point can no longer be reached (e.g. the run it was
        meant for has ended): once it has held for ``grace`` seconds with the process still
        alive, fail at once instead of waiting out ``timeout``."""
        deadline = time.monotonic() + timeout
        gave_up_at: float | None = None
        while self.alive:
            now = time.monotonic()
            if unless is not None and gave_up_at is None and unless():
                gave_up_at = now
            if gave_up_at is not None and now - gave_up_at >= grace:
                raise AssertionError(
                    f"worker {self.name} (pid {self.pid}, env {self.env}) never reached its "
                    f"crash point\n--- its log ---\n{self.tail()}"
                )
            if now >= deadline:
                raise AssertionError(
                    f"worker {self.name} (pid {self.pid}, env {self.env}) still running after "
                    f"{timeout}s\n--- its log ---\n{self.tail()}"
                )
            time.sleep(poll)
        code = self.proc.wait()
        if code != -signal.SIGKILL:
            raise AssertionError(
                f"worker {self.name} exited with {code}, not SIGKILL\n--- its log ---\n"
                f"{self.tail()}"
            )

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (the graceful stop: drain, requeue, exit) and wait; SIGKILL at the
        deadline. Returns the exit code."""
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)  # a frozen (SIGSTOP) worker can't stop
        return self.stop(timeout)


def expire_leases(worker: WorkerProcess) -> int:
    """End now the leases a dead worker still holds, instead of waiting them out: its
    process is gone, so nothing can renew them (the next claim or reap treats them as a
    crash). Returns how many runs it held."""
    from scheduling.models import Run, RunStatus

    if worker.alive:
        raise RuntimeError(f"worker {worker.name} is alive; its leases are not dead")
    return Run.objects.filter(
        status=RunStatus.RUNNING, lease_owner__contains=worker.owner_marker
    ).update(lease_expires_at=timezone.now() - timedelta(hours=1))


class WorkerProcesses:
    """What the ``worker_processes`` fixture yields: starts workers, stops them all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[WorkerProcess] = []

    def start(self, name: str | None = None, **env: str | None) -> WorkerProcess:
        """Start a worker named ``name`` (default ``w<n>``) with environment overrides."""
        worker = WorkerProcess(name or f"w{len(self.started) + 1}", self.log_dir, env)
        self.started.append(worker)
        return worker

    def stop_all(self, timeout: float = 30.0) -> None:
        for worker in self.started:
            if worker.alive:
                worker.terminate(timeout)

    def describe(self, chars: int = 1500) -> str:
        """Each worker's state and the tail of its log, for failure messages."""
        parts = []
        for worker in self.started:
            parts.append(
                f"--- worker {worker.name} pid={worker.pid} returncode={worker.returncode} "
                f"env={worker.env} ---\n{worker.tail(chars)}"
            )
        return "\n".join(parts) or "(no workers started)"

    def wait_for(
        self,
        predicate: Callable[[], bool],
        *,
        timeout: float,
        message: str,
        running: Iterable[WorkerProcess] = (),
        poll: float = 0.05,
    ) -> None:
        """Poll ``predicate`` until it holds; at the deadline fail with ``message`` and the
        workers' logs. Fails at once when a worker in ``running`` has exited (a worker that
        stopped on an error will not make the predicate true)."""
        running = tuple(running)

        def exited() -> str | None:
            dead = [w for w in running if not w.alive]
            names = ", ".join(f"{w.name} ({w.returncode})" for w in dead)
            return f"worker {names} exited" if dead else None

        wait_until(
            predicate,
            timeout=timeout,
            interval=poll,
            message=lambda: f"{message}\n{self.describe()}",
            abort=exited,
        )


@pytest.fixture(name="worker_processes")
def worker_processes_fixture(tmp_path: Path) -> Iterator[WorkerProcesses]:
    """Start ``runworker`` subprocesses on the test database; all are stopped afterwards."""
    workers = WorkerProcesses(tmp_path)
    try:
        yield workers
    finally:
        for worker in workers.started:
            try:
                worker.terminate(timeout=15)
            except Exception:  # teardown goes on to the next worker whatever happens
                worker.proc.kill()


@contextlib.contextmanager
def live_web_server(log_path: Path, env: Mapping[str, str], *, workers: int = 1) -> Iterator[str]:
    """``uvicorn sagehost.asgi:application`` (the production handler) with ``env`` and
    ``workers`` processes on a free loopback port, up when this yields its base URL;
    stopped (SIGTERM, then SIGKILL after 20 s) on exit."""
    from tests.pgcluster import free_port

    port = free_port()
    log = log_path.open("wb")
    argv = [sys.executable, "-m", "uvicorn", "sagehost.asgi:application"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
    argv += ["--lifespan", "off", "--no-access-log", "--log-level", "warning"]
    server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the web server did not come up"
                time.sleep(0.2)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
