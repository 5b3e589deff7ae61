"""Simulated hosts for tests: network namespaces on one bridge, with a PostgreSQL cluster and
a Redis of the test's own on the bridge's address.

`Site` builds, in this order, and removes everything in reverse however the test ends:

- a Linux bridge (``sgbr<tag>``) with the address ``10.X.Y.1/24`` of an unused subnet, in
  this (the root) namespace: the site's "network";
- a throwaway PostgreSQL cluster (`tests.pgcluster.PostgresCluster`) listening on that
  address only (``pg_hba``: trust for the subnet), migrated, and a Redis server
  (``redis-server --bind <address> --save "" --appendonly no``) on it too — never the
  machine's shared servers;
- hosts: one namespace each (``ip netns add``), joined to the bridge by a veth pair, with its
  own address (``10.X.Y.10+n``). `Host.cut` takes the host's cable out (its veth leaves the
  bridge: both ends stay up, every frame is dropped, nothing tells the host), `Host.restore`
  puts it back;
- processes in hosts (``ip netns exec <host> …``): ``manage.py runworker`` (`Site.worker`) and
  Celery job workers (`Site.celery`), each a `scheduling.subprocesses.Subprocess` with its
  log in the test's temporary directory.

Creating namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` tool;
`require_namespaces` skips the test with the reason where they cannot be made, and fails it
under ``CI=true``. The database is read with psycopg from this namespace (`ClusterRows`,
through the bridge address); runs are admitted with ``manage.py shell`` (`Site.django`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from scheduling.subprocesses import ROOT, Subprocess
from tests.pgcluster import CI, PostgresCluster, free_port, require_cluster_support
from tests.scheduling.test_database_outages import ClusterRows, wait_until

DATABASE = "sage"
# A host's processes come up within this long (Django imports, the first snapshot).
START_SECONDS = 90.0


class NamespacesUnavailable(RuntimeError):
    """This machine cannot make network namespaces (the reason is the message)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip <args>``; raises with its stderr when it fails (unless ``check`` is false)."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def _probe() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "the 'ip' tool (iproute2) is not installed"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (the simulated hosts' Redis)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    name = f"sgprobe{uuid.uuid4().hex[:6]}"
    made = ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    ip("netns", "del", name, check=False)
    return None


def require_namespaces() -> None:
    """Skip the test where namespaces (or the servers) cannot be made; fail under CI=true."""
    reason = _probe()
    if reason is None:
        require_cluster_support()
        return
    if CI:
        pytest.fail(f"{reason} (simulated hosts are required under CI=true)")
    pytest.skip(f"simulated hosts unavailable: {reason}")


def _free_subnet() -> str:
    """``10.X.Y`` of a /24 no route or address of this machine uses."""
    routes = ip("-4", "route", "show", "table", "all").stdout + ip("-4", "addr").stdout
    for _ in range(200):
        prefix = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if f"{prefix}." not in routes:
            return prefix
    raise NamespacesUnavailable("no free 10.x.y.0/24 subnet")


@dataclass
class Host:
    """One simulated host: a namespace on the site's bridge."""

    name: str
    namespace: str
    address: str
    cable: str  # the veth end on the bridge (in the root namespace)
    bridge: str
    cut_at: float | None = None

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Unplug: the cable leaves the bridge; frames either way are dropped silently."""
        ip("link", "set", self.cable, "nomaster")
        self.cut_at = time.monotonic()

    def restore(self) -> None:
        ip("link", "set", self.cable, "master", self.bridge)
        self.cut_at = None


class Network:
    """A bridge with the gateway address and the hosts on it."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:4]
        self.tag = tag
        self.bridge = f"sgbr{tag}"
        self.prefix = _free_subnet()
        self.gateway = f"{self.prefix}.1"
        self.hosts: list[Host] = []
        self._up = False

    def up(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self._up = True
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        host = Host(
            name=name,
            namespace=f"sg{self.tag}{name}",
            address=f"{self.prefix}.{10 + index}",
            cable=f"sgv{self.tag}{index}",
            bridge=self.bridge,
        )
        peer = f"sgp{self.tag}{index}"
        ip("netns", "add", host.namespace)
        self.hosts.append(host)
        ip("link", "add", host.cable, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", host.namespace)
        ip("link", "set", host.cable, "master", self.bridge, "up")
        ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", peer)
        ip("-n", host.namespace, "link", "set", peer, "up")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        return host

    def down(self) -> None:
        """Remove every namespace (its veth pair goes with it) and the bridge."""
        for host in self.hosts:
            ip("link", "del", host.cable, check=False)
            ip("netns", "del", host.namespace, check=False)
        self.hosts.clear()
        if self._up:
            ip("link", "del", self.bridge, check=False)
            self._up = False


def start_cluster(root: Path, address: str, subnet: str) -> PostgresCluster:
    """A throwaway PostgreSQL cluster listening on ``address`` only, trusting ``subnet``."""
    bindir = require_cluster_support()
    cluster = PostgresCluster(bindir, root, free_port())
    cluster.host = address
    cluster.init()
    with (cluster.data / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {subnet}.0/24 trust\n")
    with (cluster.data / "postgresql.conf").open("a") as conf:
        # Several workers' pools, and backends of cut-off clients ended within seconds.
        conf.write(
            "max_connections = 400\ntcp_keepalives_idle = 5\n"
            "tcp_keepalives_interval = 2\ntcp_keepalives_count = 3\n"
        )
    cluster.start()
    cluster.create_database(DATABASE)
    return cluster


@dataclass
class Site:
    """The simulated site: network, database, Redis, hosts and their processes."""

    network: Network
    cluster: PostgresCluster
    redis_url: str
    logs: Path
    rows: ClusterRows
    secret_key: str = field(default_factory=lambda: uuid.uuid4().hex * 2)
    children: list[Subprocess] = field(default_factory=list)
    _admin: subprocess.Popen[str] | None = None

    @property
    def database_url(self) -> str:
        return self.cluster.url(DATABASE, pool_max="8")

    def host(self, name: str) -> Host:
        return self.network.add_host(name)

    def env(self, **overrides: Any) -> dict[str, str]:
        """A process's environment: this one's without the test runner's variables, the
        site's database, Redis and secret key, then ``overrides`` (None removes one)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("SAGE_TEST_DB_NAME", "SAGE_CRASH_AT", "SAGE_STOP_AT", "SAGE_TORTURE")
        }
        env.update(
            DATABASE_URL=self.database_url,
            SECRET_KEY=self.secret_key,
            PYTHONUNBUFFERED="1",
            LOG_LEVEL="INFO",
            PYTHONPATH=str(ROOT),
        )
        for name, value in overrides.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = str(value)
        return env

    def _start(
        self, name: str, host: Host | None, argv: list[str], env: dict[str, str]
    ) -> Subprocess:
        command = host.command(argv) if host is not None else argv
        child = Subprocess(name, command, env, self.logs / f"{name}.log")
        self.children.append(child)
        return child

    def worker(self, host: Host, *args: str, **env: Any) -> Subprocess:
        """``manage.py runworker`` on ``host`` (environment overrides as keywords)."""
        argv = [sys.executable, "manage.py", "runworker", *args]
        return self._start(f"worker-{host.name}", host, argv, self.env(**env))

    def celery(self, host: Host, **env: Any) -> Subprocess:
        """A Celery job worker on ``host``, node ``<host name>@…``, queue ``sage-jobs``."""
        argv = [
            sys.executable, "-m", "celery", "-A", "sageproject.celery", "worker",
            "--pool=threads", "--concurrency=4", "-Q", "sage-jobs", "-n", f"{host.name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel=INFO",
        ]  # fmt: skip
        return self._start(f"celery-{host.name}", host, argv, self.env(**env))

    def call(self, function: str, **arguments: Any) -> Any:
        """``tests.hosts.seed.<function>(**arguments)`` on the site's database, in the
        site's one Django process (started on first use); returns its result."""
        if self._admin is None or self._admin.poll() is not None:
            self._admin = subprocess.Popen(
                [sys.executable, "-m", "tests.hosts.seed"],
                cwd=ROOT,
                env=self.env(LOG_LEVEL="WARNING"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=(self.logs / "seed.log").open("ab"),
                text=True,
            )
            assert self._answer() == "READY"
        assert self._admin.stdin is not None
        self._admin.stdin.write(json.dumps({"function": function, "arguments": arguments}) + "\n")
        self._admin.stdin.flush()
        answer = self._answer()
        if answer.startswith("ERROR="):
            raise AssertionError(f"seed.{function} failed:\n{json.loads(answer[6:])}")
        return json.loads(answer.removeprefix("RESULT="))

    def _answer(self) -> str:
        assert self._admin is not None and self._admin.stdout is not None
        while True:
            line = self._admin.stdout.readline()
            if not line:
                raise AssertionError(f"the seed process ended ({self._admin.wait()})")
            if line.startswith(("READY", "RESULT=", "ERROR=")):
                return line.strip()

    def close_admin(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            if admin.stdin is not None:
                admin.stdin.close()
            try:
                admin.wait(20)
            except subprocess.TimeoutExpired:
                admin.kill()
                admin.wait()

    def describe(self, chars: int = 2500) -> str:
        """Every process's state and the end of its log, for failure messages."""
        return "\n".join(
            f"--- {c.name} pid={c.pid} returncode={c.returncode} ---\n{c.tail(chars)}"
            for c in self.children
        )

    def wait(
        self,
        predicate: Callable[[], Any],
        *,
        timeout: float,
        message: str | Callable[[], str],
        running: tuple[Subprocess, ...] = (),
        interval: float = 0.2,
    ) -> Any:
        """`tests.scheduling.test_database_outages.wait_until` (``running`` are the processes
        that must not exit meanwhile), failing with the end of every process's log."""
        try:
            return wait_until(
                predicate, timeout=timeout, message=message, interval=interval, workers=running
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None

    def snapshot(self, child: Subprocess) -> dict[str, Any] | None:
        """The capacity a worker process published last (its `WorkerSnapshot`), or None."""
        rows = self.rows.query(
            "SELECT capacity::text FROM scheduling_workersnapshot WHERE pid = %s "
            "ORDER BY heartbeat_at DESC LIMIT 1",
            child.pid,
        )
        return json.loads(rows[0][0]) if rows else None

    def worker_id(self, child: Subprocess) -> str | None:
        rows = self.rows.query(
            "SELECT worker_id FROM scheduling_workersnapshot WHERE pid = %s "
            "ORDER BY heartbeat_at DESC LIMIT 1",
            child.pid,
        )
        return rows[0][0] if rows else None

    def stop(self, child: Subprocess, grace: float = 20.0) -> int:
        """SIGTERM ``child`` (SIGKILL after ``grace``); its exit status."""
        return child.stop(grace)


@contextmanager
def site(tmp_path: Path, *, redis: bool = True) -> Iterator[Site]:
    """A `Site`: bridge, cluster (migrated) and Redis up; everything removed afterwards."""
    require_namespaces()
    logs = tmp_path / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        network = Network()
        stack.callback(network.down)
        network.up()
        # Its own directory under /tmp: the server runs as the postgres user, who cannot
        # enter the test's temporary directory.
        cluster_root = Path(tempfile.mkdtemp(prefix="sage-hosts-pg-"))
        cluster = start_cluster(cluster_root, network.gateway, network.prefix)

        def stop_cluster() -> None:
            try:
                cluster.stop(mode="immediate")
            except Exception:
                cluster.kill()
            shutil.rmtree(cluster_root, ignore_errors=True)

        stack.callback(stop_cluster)
        redis_url = ""
        if redis:
            port = free_port()
            redis_server = Subprocess(
                "redis",
                [
                    "redis-server", "--port", str(port), "--bind", network.gateway,
                    "--save", "", "--appendonly", "no", "--protected-mode", "no",
                    "--tcp-keepalive", "5",
                ],
                {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                logs / "redis.log",
            )  # fmt: skip
            stack.callback(redis_server.stop, 10)
            redis_url = f"redis://{network.gateway}:{port}/0"
        the_site = Site(
            network=network,
            cluster=cluster,
            redis_url=redis_url,
            logs=logs,
            rows=ClusterRows(cluster.dsn(DATABASE)),
        )

        def stop_children() -> None:
            for child in reversed(the_site.children):
                with suppress(Exception):
                    child.stop(15)

        stack.callback(stop_children)
        stack.callback(the_site.close_admin)
        the_site.call("migrate")
        if redis:
            import redis as redis_client

            client = redis_client.Redis.from_url(redis_url, socket_timeout=2)
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.ping()
                    break
                except redis_client.RedisError:
                    assert time.monotonic() < deadline, (logs / "redis.log").read_text()
                    time.sleep(0.1)
            client.close()
        yield the_site
