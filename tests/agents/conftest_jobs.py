"""Fixtures for the job runtime tests: a real Celery worker over real Redis, and the
database side (runs, labelled jobs, their events and ``JobRecord`` rows).

Imported explicitly by the job test modules (``from tests.agents.conftest_jobs import ...``)
so no shared ``conftest.py`` is needed. Redis DB 14 holds broker and job keys; every test
gets its own key prefix, and everything written is deleted afterwards.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from asgiref.sync import sync_to_async
from celery import Celery

from agents.jobs import InMemoryJobRuntime, JobSpec
from agents.models import JobRecord
from scheduling.models import Event, Run

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("SAGE_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
WORKER_START_TIMEOUT = 40.0


def redis_available() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def require_redis() -> None:
    """Skip without Redis, except under CI where a missing Redis is a failure."""
    if redis_available():
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"Redis is required under CI but {REDIS_URL} is unreachable")
    pytest.skip(f"Redis not reachable at {REDIS_URL} (set CI=true to make this a failure)")


def delete_keys(pattern: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=pattern, count=1000))
    if keys:
        client.delete(*keys)


class CeleryWorker:
    """A ``celery worker`` subprocess consuming one private queue."""

    def __init__(self, queue: str, *, concurrency: int = 4, code_tools: bool = True) -> None:
        self.queue = queue
        env = {
            **os.environ,
            "REDIS_URL": REDIS_URL,
            "SAGE_CODE_TOOLS": "1" if code_tools else "0",
            "PYTHONPATH": str(REPO),
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "sageproject.celery",
                "worker",
                "--pool=threads",
                f"--concurrency={concurrency}",
                "-Q",
                queue,
                "-n",
                f"{queue}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel=WARNING",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        delete_keys(f"*{self.queue}*")


def celery_app() -> Celery:
    app = Celery("sage-tests")
    app.conf.update(broker_url=REDIS_URL, task_ignore_result=True, broker_connection_retry=False)
    return app


def celery_runtime(prefix: str, **kwargs: Any) -> Any:
    """A ``CeleryJobRuntime`` on the test Redis under ``prefix``, polling fast; ``kwargs``
    (``celery_app``, ``queue``, limits...) go to its constructor."""
    from agents.jobs import CeleryJobRuntime

    kwargs.setdefault("poll_interval_seconds", 0.02)
    kwargs.setdefault("cancel_timeout_seconds", 15.0)
    return CeleryJobRuntime(redis_url=REDIS_URL, key_prefix=prefix, **kwargs)


def script(source: str, *, run: str = "run-alice", **limits: Any) -> JobSpec:
    """A ``python_script`` job running ``source``; ``limits`` go into its payload."""
    return JobSpec(owner_run_id=run, kind="python_script", payload={"script": source, **limits})


async def wait_until_worker_ready(worker: CeleryWorker, app: Celery) -> None:
    """Run diagnostic ``echo`` jobs until one completes: the worker is consuming."""
    runtime = celery_runtime(f"sagetest:ready:{worker.queue}", celery_app=app, queue=worker.queue)
    try:
        handle = await runtime.submit(JobSpec(owner_run_id="ready", kind="echo"))
        async with asyncio.timeout(WORKER_START_TIMEOUT):
            await runtime.wait(handle.job_id)
    finally:
        await runtime.close()
        delete_keys(f"sagetest:ready:{worker.queue}:*")


@pytest.fixture(scope="module")
def celery_worker() -> Iterator[CeleryWorker]:
    """A real Celery worker subprocess (threads pool) on a queue unique to this module."""
    require_redis()
    worker = CeleryWorker(f"sagetest-{uuid.uuid4().hex[:8]}")
    try:
        # In a thread: the fixture may be requested from inside a running event loop.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(asyncio.run, wait_until_worker_ready(worker, celery_app())).result()
        yield worker
    finally:
        worker.stop()


RuntimeFactory = Callable[..., Awaitable[Any]]


@pytest.fixture(params=["memory", "celery"])
async def make_runtime(request: pytest.FixtureRequest) -> AsyncIterator[RuntimeFactory]:
    """``await make_runtime(**limits)`` builds a runtime of the parametrized kind.

    Every runtime built is closed at teardown, and a Celery one's Redis keys deleted.
    """
    built: list[Any] = []
    prefixes: list[str] = []
    worker: CeleryWorker | None = None
    app: Celery | None = None
    if request.param == "celery":
        worker = request.getfixturevalue("celery_worker")
        app = celery_app()

    async def make(**kwargs: Any) -> Any:
        if request.param == "memory":
            runtime: Any = InMemoryJobRuntime(**kwargs)
        else:
            assert worker is not None
            prefix = f"sagetest:{uuid.uuid4().hex[:12]}"
            prefixes.append(prefix)
            runtime = celery_runtime(prefix, celery_app=app, queue=worker.queue, **kwargs)
        built.append(runtime)
        return runtime

    make.kind = request.param  # type: ignore[attr-defined]
    yield make
    for runtime in built:
        await runtime.close()
    for prefix in prefixes:
        delete_keys(f"{prefix}:*")


# --- the database side -------------------------------------------------------------------


@pytest.fixture
def run_of(make_session) -> Callable[[Any], Run]:
    """``run_of(user)``: a new run in a new session of ``user``."""

    def make(user: Any) -> Run:
        return Run.objects.create(session=make_session(user), owner=user, input="go")

    return make


def labelled(run: Run, kind: str, payload: dict[str, Any] | None = None, **kw: Any) -> JobSpec:
    """A job of ``run`` labelled as the tools label it: its events go to the run's session."""
    return JobSpec(
        owner_run_id=str(run.pk),
        kind=kind,
        payload=payload or {},
        labels={"session_id": str(run.session_id), "owner_id": str(run.owner_id)},
        **kw,
    )


@pytest.fixture
async def recorded() -> AsyncIterator[InMemoryJobRuntime]:
    """An in-memory runtime whose events are recorded (``JobEventRecorder``)."""
    from agents.jobs.records import JobEventRecorder
    from scheduling.store import close_default_coordinator

    runtime = InMemoryJobRuntime(on_event=JobEventRecorder())
    yield runtime
    await runtime.close()
    await close_default_coordinator()


@sync_to_async
def session_events(session_id: Any) -> list[tuple[int, str, dict[str, Any], Any]]:
    """The session's events as ``(seq, type, payload, run id)``, in order."""
    rows = Event.objects.filter(session_id=session_id).order_by("seq")
    return [(e.seq, e.type, orjson.loads(e.data), e.run_id) for e in rows]


async def event_types(session_id: Any) -> list[str]:
    return [event_type for _, event_type, _, _ in await session_events(session_id)]


@sync_to_async
def record_of(job_id: str) -> JobRecord:
    return JobRecord.objects.get(job_id=job_id)


@sync_to_async
def request_cancel(job_id: str) -> None:
    """What the admin's "Cancel selected jobs" does to the job's row."""
    JobRecord.objects.filter(job_id=job_id).update(cancel_requested=True)
