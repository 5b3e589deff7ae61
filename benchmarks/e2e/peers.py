"""The peers: the same trivial task on procrastinate, Celery + Redis and django-tasks-db.

The parent (`run_peer`) prepares a peer's database and starts its driver, this command
again with ``--peer-driver NAME`` under ``DJANGO_SETTINGS_MODULE=benchmarks.peers.settings``;
the driver (`peer_driver`) starts the peer's workers and measures it with the method of
`benchmarks.e2e.method`. The peers' code is in `benchmarks.peers`."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import subprocess
import sys
import tempfile
import traceback
import uuid
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import orjson
from django.db import connections

from benchmarks.e2e.harness import (
    ROOT,
    Subprocess,
    child_env,
    database_url,
    libpq_conninfo,
    peer_line,
    progress,
    start_child,
    wait_until,
    write_back,
)
from benchmarks.e2e.method import Batch, Target, measure_latency, measure_throughput, warm_up

PEERS = ("procrastinate", "celery", "django-tasks-db")
INSTALL_HINT = "pip install -r requirements-bench.txt"


class RedisStartsTarget(Target):
    """A peer whose task records its start in a Redis hash (``benchmarks.peers.recorder``), run
    by the worker processes its ``setup`` starts (``children``, logging to ``log_dir``)."""

    children: list[Subprocess]

    def __init__(self, options: dict[str, Any], log_dir: Path) -> None:
        import redis

        self.options = options
        self.log_dir = log_dir
        self.redis = redis.Redis.from_url(options["redis_url"])
        self.tag = uuid.uuid4().hex[:8]
        self.keys: list[str] = []
        self.children = []

    def prepare(self, count: int, label: str) -> Batch:
        key = f"bench-e2e:{self.tag}:{label}:{uuid.uuid4().hex[:6]}"
        self.keys.append(key)
        return Batch(label, key, list(range(count)))

    def starts(self, batch: Batch, timeout: float) -> list[float]:
        count = len(batch.handles)
        wait_until(
            f"{count} tasks of {batch.label} to start",
            lambda: self.redis.hlen(batch.key) >= count,
            timeout,
            self.children,
        )
        values = self.redis.hgetall(batch.key)
        return [float(values[str(i).encode()]) for i in range(count)]

    def close(self) -> None:
        """Stop the workers, then remove what the peer left behind."""
        for child in self.children:
            child.stop()
        self.clean_up()
        if self.keys:
            self.redis.delete(*self.keys)
        self.redis.close()

    def clean_up(self) -> None:
        """Remove the peer's own leftovers besides the start hashes (its workers are stopped)."""


class CeleryPeer(RedisStartsTarget):
    name = "celery"

    def __init__(self, options: dict[str, Any], log_dir: Path) -> None:
        super().__init__(options, log_dir)
        self.queue = f"bench-e2e-{self.tag}"
        self.keys_before: set[bytes] = set()

    def setup(self) -> dict[str, Any]:
        self.redis.ping()
        self.keys_before = set(self.redis.scan_iter(count=1000))
        os.environ["BENCH_E2E_REDIS_URL"] = self.options["redis_url"]
        os.environ["BENCH_E2E_CELERY_QUEUE"] = self.queue
        from benchmarks.peers.celery_app import record_start

        self.task = record_start
        concurrency = self.options["concurrency"]
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "benchmarks.peers.celery_app",
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency}",
            "-Q",
            self.queue,
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "--loglevel=WARNING",
        ]
        self.children.append(start_child("celery-worker", argv, dict(os.environ), self.log_dir))
        return {
            "version": importlib.metadata.version("celery"),
            "broker": self.options["redis_url"],
            "worker": f"celery worker --pool=threads --concurrency={concurrency}",
            "concurrency": concurrency,
            "submit": "delay",
        }

    def submit(self, batch: Batch, index: int) -> None:
        self.task.delay(batch.key, index)

    def clean_up(self) -> None:
        # Only what appeared since setup: the queue, its binding, the start hashes.
        added = set(self.redis.scan_iter(count=1000)) - self.keys_before
        if added:
            self.redis.delete(*added)


class ProcrastinatePeer(RedisStartsTarget):
    name = "procrastinate"

    def __init__(self, options: dict[str, Any], log_dir: Path) -> None:
        super().__init__(options, log_dir)
        self.schema = f"bench_e2e_procrastinate_{self.tag}"
        self.app: Any = None
        self.created = False

    def _execute(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(libpq_conninfo(), autocommit=True) as conn:
            conn.execute(sql)

    def setup(self) -> dict[str, Any]:
        self.redis.ping()
        os.environ["BENCH_E2E_REDIS_URL"] = self.options["redis_url"]
        os.environ["BENCH_E2E_PROCRASTINATE_DSN"] = libpq_conninfo()
        os.environ["BENCH_E2E_PROCRASTINATE_SCHEMA"] = self.schema
        from benchmarks.peers.procrastinate_app import app, record_start

        self._execute(f'CREATE SCHEMA "{self.schema}"')
        self.created = True
        self.app = app.open()
        app.schema_manager.apply_schema()
        self.task = record_start
        concurrency = self.options["concurrency"]
        argv = [
            sys.executable,
            "-m",
            "procrastinate",
            "--app=benchmarks.peers.procrastinate_app.app",
            "worker",
            "--queues=bench-e2e",
            f"--concurrency={concurrency}",
        ]
        self.children.append(
            start_child("procrastinate-worker", argv, dict(os.environ), self.log_dir)
        )
        return {
            "version": importlib.metadata.version("procrastinate"),
            "schema": self.schema,
            "worker": f"procrastinate worker --concurrency={concurrency} (LISTEN/NOTIFY)",
            "concurrency": concurrency,
            "submit": "defer",
        }

    def submit(self, batch: Batch, index: int) -> None:
        self.task.defer(key=batch.key, i=index)

    def clean_up(self) -> None:
        if self.app is not None:
            self.app.close()
        if self.created:
            self._execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


class DjangoTasksDbPeer(RedisStartsTarget):
    """Runs in a driver whose database is the sibling database the parent created."""

    name = "django-tasks-db"

    def setup(self) -> dict[str, Any]:
        self.redis.ping()
        os.environ["BENCH_E2E_REDIS_URL"] = self.options["redis_url"]
        from benchmarks.peers.tasks import record_start

        self.task = record_start
        processes = self.options["db_worker_processes"]
        interval = self.options["db_worker_interval"]
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "benchmarks.peers.settings"}
        for index in range(processes):
            argv = [
                sys.executable,
                str(ROOT / "manage.py"),
                "db_worker",
                "--interval",
                str(interval),
                "--no-startup-delay",
                "--no-reload",
                "--queue-name",
                "default",
                "--verbosity",
                "0",
                "--worker-id",
                f"bench-e2e-{self.tag}-{index}",
            ]
            self.children.append(start_child(f"db-worker-{index}", argv, env, self.log_dir))
        return {
            "version": importlib.metadata.version("django-tasks-db"),
            "database": connections["default"].settings_dict["NAME"],
            "worker": f"{processes} x manage.py db_worker --interval {interval}",
            "concurrency": processes,
            "submit": "enqueue",
        }

    def submit(self, batch: Batch, index: int) -> None:
        self.task.enqueue(batch.key, index)

    def end_thread(self) -> None:
        connections.close_all()


PEER_CLASSES = {
    "celery": CeleryPeer,
    "procrastinate": ProcrastinatePeer,
    "django-tasks-db": DjangoTasksDbPeer,
}
PEER_MODULES = {
    "celery": "celery",
    "procrastinate": "procrastinate",
    "django-tasks-db": "django_tasks_db",
}
# What each peer's driver subprocess is given of this command's options: everything its
# measurement reads, so that the peers and this host run the same method.
DRIVER_OPTIONS = (
    "history",
    "n",
    "latency_n",
    "rate",
    "submit_threads",
    "concurrency",
    "redis_url",
    "db_worker_processes",
    "db_worker_interval",
    "timeout",
)


def peer_driver(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Measure one peer in this (driver) process: its line (``skipped`` or ``error`` when
    it could not be measured)."""
    if find_spec(PEER_MODULES[name]) is None:
        return peer_line(name, skipped=f"{PEER_MODULES[name]} is not installed ({INSTALL_HINT})")
    try:
        import redis

        redis.Redis.from_url(options["redis_url"], socket_timeout=2).ping()
    except Exception as exc:
        return peer_line(name, skipped=f"Redis at {options['redis_url']} unreachable: {exc}")
    timeout = options["timeout"]
    line = peer_line(name, history=options["history"])
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as logs:
        peer = PEER_CLASSES[name](options, Path(logs))
        try:
            line.update(peer.setup())
            progress(f"{name}: history, {options['history']} tasks")
            warm_up(peer, options["history"], timeout)
            write_back()
            progress(f"{name}: throughput, {options['n']} tasks")
            throughput = measure_throughput(peer, options["n"], options["submit_threads"], timeout)
            write_back()
            progress(f"{name}: latency, {options['latency_n']} at {options['rate']}/s")
            latency = measure_latency(peer, options["latency_n"], options["rate"], timeout)
        except Exception as exc:
            traceback.print_exc()
            return {**line, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        finally:
            peer.close()
    line.update(throughput)
    line["start"] = "the task's time.time(), its first act"
    line.update({f"latency_{k}": v for k, v in latency.items()})
    return line


def run_peer(peer: str, options: dict[str, Any]) -> dict[str, Any]:
    """Measure ``peer`` in a driver subprocess (django-tasks-db in a sibling database,
    created, migrated and dropped here); its line, as the driver wrote it."""
    progress(f"peer {peer}")
    forwarded: list[str] = []
    for dest in DRIVER_OPTIONS:
        forwarded += [f"--{dest.replace('_', '-')}", str(options[dest])]
    sibling = None
    with contextlib.ExitStack() as stack:
        db_url = database_url()
        if peer == "django-tasks-db":
            if find_spec("django_tasks_db") is None:
                return peer_line(peer, skipped=f"django_tasks_db is not installed ({INSTALL_HINT})")
            base = connections["default"].settings_dict["NAME"]
            sibling = f"{base[:36]}_bench_dtdb_{uuid.uuid4().hex[:8]}"
            create_database(sibling)
            stack.callback(drop_database, sibling)
            db_url = database_url(name=sibling)
        env = child_env(
            db_url, options["concurrency"], DJANGO_SETTINGS_MODULE="benchmarks.peers.settings"
        )
        if sibling is not None:
            progress(f"{peer}: migrating {sibling}")
            migrate = subprocess.run(
                [sys.executable, str(ROOT / "manage.py"), "migrate", "-v0", "--no-input"],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=options["timeout"],
            )
            if migrate.returncode != 0:
                return peer_line(peer, error=f"migrate failed: {migrate.stderr.strip()[-800:]}")
        driver = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "manage.py"),
                "bench_e2e",
                "--peer-driver",
                peer,
                *forwarded,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )

        def stop_driver() -> None:
            if driver.poll() is None:
                driver.send_signal(signal.SIGTERM)
                try:
                    driver.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    driver.kill()
                    driver.wait()

        stack.callback(stop_driver)
        try:
            out, _ = driver.communicate(timeout=options["timeout"] * 4)
        except subprocess.TimeoutExpired:
            return peer_line(peer, error="the driver timed out")
        for text in reversed(out.splitlines()):
            if text.startswith("{"):
                return orjson.loads(text)
        return peer_line(
            peer, error=f"the driver exited with status {driver.returncode} (see stderr)"
        )


def create_database(name: str) -> None:
    connection = connections["default"]
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')


def drop_database(name: str) -> None:
    connection = connections["default"]
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
