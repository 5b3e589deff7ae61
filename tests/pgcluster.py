"""A throwaway PostgreSQL cluster of a test's own, which the test may restart at will.

``initdb`` into a temporary directory (trust authentication), ``pg_ctl start`` listening on
a free port of 127.0.0.1 (its Unix socket in the same directory), one database created;
`PostgresCluster.restart` and `PostgresCluster.stop` act on that data directory only, so
the machine's shared server (port 5432) is never touched.

``initdb`` refuses to run as root: as root the server programs run as the ``postgres``
OS user (``runuser -u postgres --``) over a directory chowned to it; as any other user
they run as that user. The binaries are looked for under ``/usr/lib/postgresql/*/bin``
(or ``SAGE_TEST_PG_BINDIR``). Where they (or the ``postgres`` user, as root) are missing,
`require_cluster_support` skips the test — and fails it under ``CI=true``.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

# As ``tests.conftest.CI`` (not imported: this module stays usable without Django set up).
CI = os.environ.get("CI", "").lower() == "true"
SHARED_PORT = 5432
START_TIMEOUT = 60


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a cluster of the test's own (the reason is the message)."""


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.parent.name)) or (0,)


def find_bindir() -> Path | None:
    """The newest PostgreSQL server binaries' directory, or None."""
    override = os.environ.get("SAGE_TEST_PG_BINDIR")
    candidates = (
        [Path(override) / "initdb"]
        if override
        else sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=_version_key)
    )
    found = [c for c in candidates if c.exists() and (c.parent / "pg_ctl").exists()]
    return found[-1].parent if found else None


def _run_as() -> tuple[list[str], pwd.struct_passwd | None]:
    """The command prefix that runs a server program, and the account it runs as (None:
    this process's own user)."""
    if os.geteuid() != 0:
        return [], None
    try:
        account = pwd.getpwnam("postgres")
    except KeyError:
        raise ClusterUnavailable(
            "running as root, and there is no 'postgres' OS user to run the server as "
            "(initdb refuses root)"
        ) from None
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", "postgres", "--"], account
    if shutil.which("su"):
        # sh -c '"$0" "$@"' program args…: the program and its arguments, unquoted once.
        return ["su", "-s", "/bin/sh", "-c", '"$0" "$@"', "postgres", "--"], account
    raise ClusterUnavailable("running as root, and neither runuser nor su is installed")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if port == SHARED_PORT:  # never, as 5432 is taken by the shared server; but be sure
        return free_port()
    return port


class PostgresCluster:
    """One cluster: ``root`` holds ``data/`` (the cluster), ``server.log`` and the socket."""

    def __init__(self, bindir: Path, root: Path, port: int) -> None:
        if port == SHARED_PORT:
            raise ValueError("a throwaway cluster must not use the shared server's port")
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.port = port
        self.host = "127.0.0.1"
        self.user = "postgres"
        self._prefix, self._account = _run_as()

    # ------------------------------------------------------------------ commands

    def _server(self, program: str, *args: str, timeout: float = START_TIMEOUT) -> str:
        """Run a server program (initdb, pg_ctl) as the cluster's OS user."""
        command = [*self._prefix, str(self.bindir / program), *args]
        result = subprocess.run(
            command,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args)} exited {result.returncode}:\n"
                f"{result.stdout}{result.stderr}\n--- server log ---\n{self.log_tail()}"
            )
        return result.stdout

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def init(self) -> None:
        if self._account is not None:
            os.chown(self.root, self._account.pw_uid, self._account.pw_gid)
        self.root.chmod(0o700)
        self._server(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            self.user,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses={self.host} "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self._server(
            "pg_ctl", "start", "-w", "-t", str(START_TIMEOUT), "-D", str(self.data),
            "-l", str(self.log), "-o", options,
        )  # fmt: skip

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m <mode>``: every session is ended, the server comes back on
        the same port; returns once it accepts connections."""
        self._server(
            "pg_ctl", "restart", "-w", "-t", str(START_TIMEOUT), "-m", mode,
            "-D", str(self.data), "-l", str(self.log),
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._server("pg_ctl", "stop", "-w", "-m", mode, "-D", str(self.data))

    def kill(self) -> None:
        """Last resort when ``pg_ctl stop`` failed: SIGQUIT (immediate shutdown) to this
        cluster's postmaster, by the pid in its own ``postmaster.pid``."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGQUIT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.1)

    def is_running(self) -> bool:
        result = subprocess.run(
            [*self._prefix, str(self.bindir / "pg_ctl"), "status", "-D", str(self.data)],
            cwd=self.root,
            capture_output=True,
            check=False,
        )
        return result.returncode == 0

    def create_database(self, name: str) -> None:
        subprocess.run(
            [
                str(self.bindir / "createdb"),
                "-h", self.host, "-p", str(self.port), "-U", self.user, name,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )  # fmt: skip

    def url(self, database: str = "postgres", **query: str) -> str:
        """A ``DATABASE_URL`` for ``database`` on this cluster."""
        suffix = "?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else ""
        return f"postgres://{self.user}@{self.host}:{self.port}/{database}{suffix}"

    def dsn(self, database: str = "postgres") -> str:
        """A libpq connection string (psycopg) for ``database`` on this cluster."""
        return (
            f"host={self.host} port={self.port} user={self.user} dbname={database} "
            "connect_timeout=3"
        )


def require_cluster_support() -> Path:
    """The binaries' directory; skips the test where a cluster cannot be run (fails it
    under CI=true)."""
    reason = None
    bindir = find_bindir()
    if bindir is None:
        reason = "PostgreSQL server binaries (initdb, pg_ctl) not found under " + os.environ.get(
            "SAGE_TEST_PG_BINDIR", "/usr/lib/postgresql/*/bin"
        )
    else:
        try:
            _run_as()
        except ClusterUnavailable as exc:
            reason = str(exc)
    if reason is not None:
        if CI:
            pytest.fail(f"{reason} (a throwaway PostgreSQL cluster is required under CI=true)")
        pytest.skip(reason)
    assert bindir is not None
    return bindir


@contextmanager
def throwaway_cluster(*, database: str = "sage") -> Iterator[PostgresCluster]:
    """A started cluster with ``database`` created; stopped and deleted afterwards, however
    the block ends."""
    bindir = require_cluster_support()
    root = Path(tempfile.mkdtemp(prefix="sage-pgcluster-"))
    cluster = PostgresCluster(bindir, root, free_port())
    try:
        cluster.init()
        cluster.start()
        cluster.create_database(database)
        yield cluster
    finally:
        try:
            cluster.stop(mode="immediate")
        except Exception:
            cluster.kill()
            raise
        finally:
            shutil.rmtree(root, ignore_errors=True)
