"""``CeleryJobRuntime`` beyond the shared contract: real Redis, real Celery worker processes.

Skipped when Redis is unreachable, except under ``CI=true`` where that is a failure.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from agents.jobs import CeleryJobRuntime, JobCursor, JobSpec, JobState
from sageproject.errors import SageError
from tests.agents import conftest_jobs
from tests.agents.conftest_jobs import (
    REDIS_URL,
    REPO,
    CeleryWorker,
    celery_app,
    celery_runtime,
    delete_keys,
    require_redis,
    script,
    wait_until_worker_ready,
)
from tests.waiting import awaited_until

# The module-scoped worker fixture, bound here so pytest finds it.
celery_worker = conftest_jobs.celery_worker

pytestmark = [pytest.mark.redis, pytest.mark.celery]

KINDS = frozenset({"echo", "sleep", "python_script"})


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    require_redis()
    value = f"sagetest:{uuid.uuid4().hex[:12]}"
    yield value
    delete_keys(f"{value}:*")


@pytest.fixture
async def runtimes(celery_worker, prefix) -> AsyncIterator[Any]:
    """``make(**kwargs)`` builds runtimes sharing one prefix and the module's worker queue."""
    built: list[CeleryJobRuntime] = []
    app = celery_app()

    def make(**kwargs: Any) -> CeleryJobRuntime:
        kwargs.setdefault("queue", celery_worker.queue)
        kwargs.setdefault("kinds", KINDS)
        runtime = celery_runtime(prefix, celery_app=app, **kwargs)
        built.append(runtime)
        return runtime

    yield make
    for runtime in built:
        await runtime.close()


async def wait_for_state(runtime: CeleryJobRuntime, job_id: str, state: JobState) -> None:
    async def reached() -> bool:
        return (await runtime.inspect(job_id)).state is state

    await awaited_until(reached)


async def read_all(runtime: CeleryJobRuntime, job_id: str) -> bytes:
    chunks = await runtime.read_output(JobCursor(job_id=job_id), max_bytes=1 << 20)
    return b"".join(c.data for c in chunks)


async def test_it_runs_jobs_in_the_worker_process(runtimes, celery_worker):
    runtime = runtimes()
    handle = await runtime.submit(script("import os\nprint(os.getppid())"))

    done = await runtime.wait(handle.job_id)

    assert done.state is JobState.COMPLETED
    assert int(await read_all(runtime, handle.job_id)) == celery_worker.pid
    assert done.external_handle_ref == handle.job_id


async def test_it_reads_a_job_from_another_process(runtimes, prefix):
    runtime = runtimes()
    handle = await runtime.submit(
        JobSpec(owner_run_id="run-alice", kind="echo", payload={"chunks": ["from ", "worker"]})
    )
    await runtime.wait(handle.job_id)
    reader = (
        "import asyncio, json, sys\n"
        "from agents.jobs import CeleryJobRuntime, JobCursor\n"
        "async def main():\n"
        f"    rt = CeleryJobRuntime(redis_url={REDIS_URL!r}, key_prefix={prefix!r})\n"
        f"    snap = await rt.inspect({handle.job_id!r})\n"
        f"    out = await rt.read_output(JobCursor(job_id={handle.job_id!r}))\n"
        "    await rt.close()\n"
        "    print(json.dumps([str(snap.state), b''.join(c.data for c in out).decode()]))\n"
        "asyncio.run(main())\n"
    )

    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", reader, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(60):
        stdout, _ = await process.communicate()

    assert process.returncode == 0
    assert json.loads(stdout) == ["completed", "from worker"]


async def test_it_keeps_state_and_output_after_the_worker_is_gone(prefix):
    require_redis()
    worker = CeleryWorker(f"sagetest-gone-{uuid.uuid4().hex[:8]}", concurrency=1)
    app = celery_app()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            ready = pool.submit(asyncio.run, wait_until_worker_ready(worker, app))
            await asyncio.wrap_future(ready)
        runtime = celery_runtime(prefix, celery_app=app, queue=worker.queue)
        handle = await runtime.submit(
            JobSpec(owner_run_id="run-alice", kind="echo", payload={"chunks": ["kept"]})
        )
        await runtime.wait(handle.job_id)
        await runtime.close()
    finally:
        worker.stop()
    assert worker.process.poll() is not None
    later = CeleryJobRuntime(redis_url=REDIS_URL, key_prefix=prefix, celery_app=app)

    snapshot = await later.inspect(handle.job_id)
    body = await read_all(later, handle.job_id)
    await later.close()

    assert (snapshot.state, body) == (JobState.COMPLETED, b"kept")


async def test_it_enforces_admission_across_runtime_instances(runtimes):
    first = runtimes(max_admitted_jobs=2)
    second = runtimes(max_admitted_jobs=2)
    for _ in range(2):
        await first.submit(JobSpec(owner_run_id="run-alice", kind="sleep"))

    with pytest.raises(SageError) as caught:
        await second.submit(JobSpec(owner_run_id="run-bob", kind="sleep"))

    assert caught.value.code == "job.queue_full"


async def test_it_runs_no_more_than_max_concurrent_jobs_across_workers(runtimes):
    runtime = runtimes(max_concurrent_jobs=1)
    first = await runtime.submit(JobSpec(owner_run_id="run-alice", kind="sleep"))
    second = await runtime.submit(JobSpec(owner_run_id="run-alice", kind="sleep"))
    await wait_for_state(runtime, first.job_id, JobState.RUNNING)

    assert (await runtime.inspect(second.job_id)).state is JobState.CREATED
    await runtime.cancel(first.job_id)
    await wait_for_state(runtime, second.job_id, JobState.RUNNING)


async def test_it_kills_a_job_no_worker_has_started(runtimes):
    # Nobody consumes this queue, so the job stays CREATED until revoked.
    runtime = runtimes(queue=f"sagetest-idle-{uuid.uuid4().hex[:8]}")
    handle = await runtime.submit(JobSpec(owner_run_id="run-alice", kind="echo"))

    killed = await runtime.cancel(handle.job_id)

    assert killed.state is JobState.KILLED
    assert (await runtime.stats())["admitted"] == 0
    delete_keys(f"*{runtime._queue}*")


async def test_it_fails_a_job_whose_kind_the_worker_lacks(runtimes):
    runtime = runtimes(kinds={"exotic"})
    handle = await runtime.submit(JobSpec(owner_run_id="run-alice", kind="exotic"))

    done = await runtime.wait(handle.job_id)

    assert (done.state, done.error["code"]) == (JobState.FAILED, "job.kind_unsupported")


async def test_it_refuses_run_scoped_runners(runtimes):
    runtime = runtimes()

    async def runner(spec, emit, cancel_event):
        return None

    with pytest.raises(SageError) as caught:
        runtime.register_runner("custom", runner, owner_run_id="run-alice")

    assert caught.value.code == "job.runner_not_local"


async def test_it_cancels_a_running_script_on_the_worker(runtimes):
    runtime = runtimes()
    handle = await runtime.submit(script("import time\nprint('up', flush=True)\ntime.sleep(60)"))
    await awaited_until(lambda: read_all(runtime, handle.job_id))

    killed = await runtime.cancel(handle.job_id)

    assert killed.state is JobState.KILLED
    assert (await runtime.stats())["running"] == 0
