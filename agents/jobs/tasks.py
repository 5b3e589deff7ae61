"""Celery side of ``CeleryJobRuntime``: the runner registry and the task that runs one job.

Runners cannot travel over a broker, so they are registered *in the worker process* by
kind: the built-ins (``echo`` and ``sleep`` diagnostics; ``python_script`` when
``SAGE_CODE_TOOLS=1``) plus whatever the modules named in ``SAGE_JOB_RUNNER_MODULES``
(comma-separated) register through ``register_runner`` when imported. A job worker loads
no Django settings: it reads these settings (and ``SAGE_JOBS_REDIS_URL``, the Redis of job
state when it is not the broker's) through ``sageproject.config`` itself.

The task is synchronous (Celery) and drives the async runner on a per-thread event loop, so
it works with ``--pool=threads`` (recommended: jobs mostly wait on I/O or subprocesses) and
``--pool=prefork``. Cancellation is cooperative: a watcher polls the job's Redis cancel flag,
sets the runner's ``cancel_event`` and cancels its task. The same watcher reports the worker
alive for the job every third of ``SAGE_JOB_LOST_SECONDS`` (`RedisJobStore.beat`): a job
whose worker stops reporting (killed, its host gone or cut off) is failed by any other
process's sweep (``job.worker_lost``), and a worker that finds its job ended that way, or
that could not report for that long, stops the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import threading
from typing import Any

from celery import signals
from redis.asyncio import Redis

from agents.jobs.base import (
    JobCompletion,
    JobSpec,
    JobState,
    JobStream,
    Runner,
    killed_error,
    kind_unsupported_error,
    runner_failed_error,
    to_bytes,
)
from agents.jobs.builtins import builtin_runners, code_runners
from agents.jobs.redis_store import RedisJobStore, is_terminal
from sageproject import config
from sageproject.celery import app, redis_url

logger = logging.getLogger(__name__)

TASK_NAME = "sage.jobs.run"
# How often a running job checks its cancel flag, and a waiting job retries for a slot.
POLL_SECONDS = 0.05

RUNNERS: dict[str, Runner] = {}
# This process's settings, read without Django (a job worker has none).
SETTINGS = config.load()


def register_runner(kind: str, runner: Runner) -> None:
    """Register ``runner`` for ``kind`` in this worker process (replaces an existing one)."""
    RUNNERS[kind] = runner


def unregister_runner(kind: str) -> bool:
    """Remove the runner for ``kind``; returns True if there was one."""
    return RUNNERS.pop(kind, None) is not None


def registered_kinds() -> frozenset[str]:
    """The kinds this process would run: what a submitter accepts by default."""
    return frozenset(RUNNERS)


def _load_runners() -> None:
    RUNNERS.update(builtin_runners())
    if SETTINGS["SAGE_CODE_TOOLS"]:
        RUNNERS.update(code_runners())
    for module in SETTINGS["SAGE_JOB_RUNNER_MODULES"]:
        importlib.import_module(module)


@signals.worker_init.connect
def _stop_on_configuration_errors(**kwargs: Any) -> None:
    """A job worker with an invalid setting stops at start-up with one line per problem,
    as ``manage.py`` does (a Django process checks its settings itself)."""
    config.exit_on_errors(SETTINGS, program="sage-jobs")


_load_runners()

_local = threading.local()


def _thread_store(prefix: str) -> tuple[asyncio.AbstractEventLoop, RedisJobStore]:
    # One loop and one connection pool per worker thread, reused across jobs: opening a
    # connection per job would dominate the cost of trivial jobs.
    loop = getattr(_local, "loop", None)
    if loop is None:
        loop = asyncio.new_event_loop()
        _local.loop = loop
        _local.client = Redis.from_url(SETTINGS["SAGE_JOBS_REDIS_URL"] or redis_url())
        _local.stores = {}
    stores: dict[str, RedisJobStore] = _local.stores
    store = stores.get(prefix)
    if store is None:
        store = stores[prefix] = RedisJobStore(_local.client, prefix)
    return loop, store


async def execute_job(
    store: RedisJobStore,
    job_id: str,
    runners: dict[str, Runner],
    *,
    worker: str = "",
    lost_seconds: float | None = None,
) -> None:
    """Run one admitted job to a terminal state, recording everything in ``store``;
    ``worker`` (this worker's name) is recorded on the job and reports for it every third
    of ``lost_seconds`` (default ``SAGE_JOB_LOST_SECONDS``)."""
    lost = float(lost_seconds or SETTINGS["SAGE_JOB_LOST_SECONDS"])
    while True:
        outcome = await store.start(job_id, worker=worker, lost_seconds=lost)
        if outcome == "started":
            break
        if outcome == "gone":
            # Killed before it started (or unknown): the revoke may have raced the message.
            return
        # Every cluster-wide slot is taken (max_concurrent_jobs): wait for one.
        await asyncio.sleep(POLL_SECONDS)

    row = await store.row(job_id)
    if row is None:
        return
    spec = JobSpec.from_dict(json.loads(row[b"spec"]))
    runner = runners.get(spec.kind)
    if runner is None:
        await store.finish(job_id, JobState.FAILED, error=kind_unsupported_error(spec.kind))
        return

    async def emit(stream: str, data: bytes | str) -> None:
        body = to_bytes(data)
        if body:
            await store.emit(job_id, str(JobStream(stream)), body)

    cancel_event = asyncio.Event()
    work = asyncio.ensure_future(runner(spec, emit, cancel_event))

    def stop_work() -> None:
        cancel_event.set()
        work.cancel()

    async def watch_cancel() -> None:
        loop = asyncio.get_running_loop()
        reported = loop.time()
        while not work.done():
            try:
                if await store.cancel_requested(job_id):
                    stop_work()
                    return
                if loop.time() - reported >= lost / 3:
                    if not await store.beat(job_id, lost):
                        logger.warning("job %s ended while it ran here (lost); stopping it", job_id)
                        stop_work()
                        return
                    reported = loop.time()
            except Exception as exc:  # Redis unreachable: the job may be failed as lost
                if loop.time() - reported >= lost:
                    logger.warning("job %s: no report for %gs (%r); stopping it", job_id, lost, exc)
                    stop_work()
                    return
            await asyncio.sleep(POLL_SECONDS)

    watcher = asyncio.ensure_future(watch_cancel())
    try:
        result = await work
    except asyncio.CancelledError:
        await _finish_killed(store, job_id)
    except Exception as exc:
        logger.info("job %s (%s) failed: %r", job_id, spec.kind, exc)
        await store.finish(job_id, JobState.FAILED, error=runner_failed_error(exc))
    else:
        if await store.cancel_requested(job_id):
            await _finish_killed(store, job_id)
        else:
            completion = result if result is not None else JobCompletion()
            await store.finish(
                job_id,
                JobState.COMPLETED,
                exit_code=completion.exit_code,
                usage=completion.usage,
                artifacts=tuple(completion.output_artifacts),
            )
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _finish_killed(store: RedisJobStore, job_id: str) -> None:
    raw = await store.client.hget(store.key("job", job_id), "kill_error")
    error: dict[str, Any] = json.loads(raw) if raw else killed_error("cancelled")
    await store.finish(job_id, JobState.KILLED, error=error)


@app.task(name=TASK_NAME, ignore_result=True)
def run_job(job_id: str, prefix: str) -> str:
    """Celery entry point: run job ``job_id`` stored under ``prefix``; returns its final state."""
    loop, store = _thread_store(prefix)
    worker = run_job.request.hostname or ""
    loop.run_until_complete(execute_job(store, job_id, RUNNERS, worker=worker))
    state = loop.run_until_complete(store.states([job_id]))[0]
    if state is not None and not is_terminal(state):
        logger.warning("job %s left the worker in state %s", job_id, state)
    return state or "gone"
