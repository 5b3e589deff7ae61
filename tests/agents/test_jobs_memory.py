"""``InMemoryJobRuntime`` beyond the shared contract: runners, retention, limits, python_script."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from agents.jobs import (
    InMemoryJobRuntime,
    JobCompletion,
    JobCursor,
    JobSpec,
    JobState,
)
from agents.jobs.python_script import python_script_runner
from sageproject.errors import SageError
from tests.agents.conftest_jobs import script
from tests.conftest import FakeClock
from tests.waiting import awaited_until


def spec(kind: str = "echo", run: str = "run-alice", **payload: Any) -> JobSpec:
    return JobSpec(owner_run_id=run, kind=kind, payload=payload)


async def read_all(runtime: InMemoryJobRuntime, job_id: str) -> bytes:
    chunks = await runtime.read_output(JobCursor(job_id=job_id), max_bytes=1 << 20)
    return b"".join(c.data for c in chunks)


# --- runners ----------------------------------------------------------------------------


async def test_it_prefers_a_run_scoped_runner_over_the_global_one():
    runtime = InMemoryJobRuntime(builtin_runners=False)

    async def global_runner(spec, emit, cancel_event):
        await emit("stdout", "global")

    async def scoped_runner(spec, emit, cancel_event):
        await emit("stdout", "scoped")

    runtime.register_runner("work", global_runner)
    runtime.register_runner("work", scoped_runner, owner_run_id="run-alice")
    alice = await runtime.submit(spec("work"))
    bob = await runtime.submit(spec("work", run="run-bob"))
    await runtime.wait(alice.job_id)
    await runtime.wait(bob.job_id)

    assert await read_all(runtime, alice.job_id) == b"scoped"
    assert await read_all(runtime, bob.job_id) == b"global"


async def test_it_unregisters_only_the_exact_runner_given():
    runtime = InMemoryJobRuntime(builtin_runners=False)

    async def mine(spec, emit, cancel_event):
        return None

    async def other(spec, emit, cancel_event):
        return None

    runtime.register_runner("work", mine)

    assert runtime.unregister_runner("work", runner=other) is False
    assert runtime.unregister_runner("work", runner=mine) is True
    with pytest.raises(SageError, match="no runner"):
        await runtime.submit(spec("work"))


async def test_it_passes_the_runner_result_into_the_snapshot():
    runtime = InMemoryJobRuntime(builtin_runners=False)

    async def runner(spec, emit, cancel_event):
        return JobCompletion(exit_code=7, usage={"rows": 3}, output_artifacts=("a.csv",))

    runtime.register_runner("work", runner)
    done = await runtime.wait((await runtime.submit(spec("work"))).job_id)

    assert (done.exit_code, dict(done.usage), done.output_artifacts) == (7, {"rows": 3}, ("a.csv",))


async def test_it_runs_no_more_than_max_concurrent_jobs_at_once():
    runtime = InMemoryJobRuntime(max_concurrent_jobs=1, builtin_runners=False)
    release = asyncio.Event()
    started = asyncio.Event()

    async def blocking(spec, emit, cancel_event):
        started.set()
        await release.wait()

    runtime.register_runner("block", blocking)
    first = await runtime.submit(spec("block"))
    second = await runtime.submit(spec("block"))
    await started.wait()

    assert (await runtime.inspect(first.job_id)).state is JobState.RUNNING
    assert (await runtime.inspect(second.job_id)).state is JobState.CREATED
    release.set()
    assert (await runtime.wait(second.job_id)).state is JobState.COMPLETED


async def test_it_kills_a_job_cancelled_before_it_started():
    runtime = InMemoryJobRuntime(max_concurrent_jobs=1)
    running = await runtime.submit(spec("sleep"))
    queued = await runtime.submit(spec("sleep"))

    killed = await runtime.cancel(queued.job_id)

    assert killed.state is JobState.KILLED
    assert (await runtime.inspect(running.job_id)).state is not JobState.KILLED
    await runtime.close()


async def test_it_marks_a_job_killed_when_its_runner_swallows_the_cancellation():
    runtime = InMemoryJobRuntime(builtin_runners=False)
    started = asyncio.Event()

    async def stubborn(spec, emit, cancel_event):
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return JobCompletion(exit_code=0)

    runtime.register_runner("stubborn", stubborn)
    handle = await runtime.submit(spec("stubborn"))
    await started.wait()

    assert (await runtime.cancel(handle.job_id)).state is JobState.KILLED


async def test_it_keeps_running_a_job_when_the_event_callback_fails():
    async def broken(snapshot, event_type, data):
        raise RuntimeError("sink down")

    runtime = InMemoryJobRuntime(on_event=broken)
    handle = await runtime.submit(spec(chunks=["ok"]))

    assert (await runtime.wait(handle.job_id)).state is JobState.COMPLETED


async def test_a_kill_during_the_start_event_records_the_events_in_order():
    # The recording of job.started runs in a database thread; a kill arriving meanwhile
    # must wait for it, or job.killed is written first and job.started after it.
    written: list[str] = []
    recording_started, killed_recorded = asyncio.Event(), asyncio.Event()

    async def slow_sink(snapshot, event_type, data):
        if event_type == "job.started":
            recording_started.set()
            await asyncio.to_thread(lambda: (time.sleep(0.2), written.append(event_type)))
        else:
            written.append(event_type)
            if event_type == "job.killed":
                killed_recorded.set()

    runtime = InMemoryJobRuntime(on_event=slow_sink)
    handle = await runtime.submit(spec("sleep", seconds=3600))
    await recording_started.wait()

    assert (await runtime.cancel(handle.job_id)).state is JobState.KILLED
    async with asyncio.timeout(10):
        await killed_recorded.wait()
    assert written == ["job.created", "job.started", "job.killed"]
    await runtime.close()


# --- limits and retention ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_concurrent_jobs": 0},
        {"terminal_ttl_seconds": 0},
        {"max_retained_terminal_jobs": -1},
        {"max_job_output_bytes": -1},
    ],
)
def test_it_rejects_invalid_limits(kwargs):
    with pytest.raises(ValueError):
        InMemoryJobRuntime(**kwargs)


def test_it_rejects_a_spec_with_a_non_positive_output_cap():
    with pytest.raises(SageError, match="max_output_bytes"):
        JobSpec(owner_run_id="run-alice", kind="echo", max_output_bytes=0)


async def test_it_lets_a_spec_only_lower_the_per_job_cap():
    runtime = InMemoryJobRuntime(max_job_output_bytes=4)
    handle = await runtime.submit(
        JobSpec(
            owner_run_id="r", kind="echo", payload={"chunks": ["abcdefgh"]}, max_output_bytes=100
        )
    )

    assert (await runtime.wait(handle.job_id)).output_bytes == 4


async def finished(runtime: InMemoryJobRuntime, job: JobSpec | None = None) -> str:
    """Run ``job`` (an empty ``echo`` by default) to its end; returns its id."""
    handle = await runtime.submit(job or spec())
    await runtime.wait(handle.job_id)
    return handle.job_id


async def test_it_evicts_terminal_rows_after_the_ttl():
    clock = FakeClock()
    runtime = InMemoryJobRuntime(
        terminal_ttl_seconds=60, output_reconnect_window_seconds=10, clock=clock
    )
    job_id = await finished(runtime, spec(chunks=["x"]))
    clock.now += 59
    assert (await runtime.inspect(job_id)).state is JobState.COMPLETED

    clock.now += 2

    with pytest.raises(SageError, match="not found"):
        await runtime.inspect(job_id)
    assert runtime.stats()["buffered_output_bytes"] == 0


async def test_it_keeps_rows_for_the_reconnect_window_when_it_outlasts_the_ttl():
    clock = FakeClock()
    runtime = InMemoryJobRuntime(
        terminal_ttl_seconds=5, output_reconnect_window_seconds=30, clock=clock
    )
    job_id = await finished(runtime)

    clock.now += 20

    assert (await runtime.inspect(job_id)).state is JobState.COMPLETED


async def test_it_evicts_the_oldest_rows_past_the_count_cap_outside_the_window():
    clock = FakeClock()
    runtime = InMemoryJobRuntime(
        max_retained_terminal_jobs=1, output_reconnect_window_seconds=10, clock=clock
    )
    await finished(runtime)
    clock.now += 11
    new = await finished(runtime)

    ids = [j.job_id for j in await runtime.list_jobs("run-alice")]

    assert ids == [new]


async def test_it_protects_rows_inside_the_reconnect_window_from_the_count_cap():
    runtime = InMemoryJobRuntime(max_retained_terminal_jobs=1, output_reconnect_window_seconds=60)
    first = await runtime.submit(spec())
    second = await runtime.submit(spec())
    await runtime.wait(first.job_id)
    await runtime.wait(second.job_id)

    assert len(await runtime.list_jobs("run-alice")) == 2


async def test_it_applies_capacity_back_pressure_against_protected_rows():
    runtime = InMemoryJobRuntime(
        max_admitted_jobs=1, max_retained_terminal_jobs=1, output_reconnect_window_seconds=60
    )
    for _ in range(2):
        await finished(runtime)

    with pytest.raises(SageError, match="capacity") as caught:
        await runtime.submit(spec())
    assert caught.value.retryable is True
    assert await runtime.purge_terminal("run-alice") == 2
    assert (await runtime.submit(spec())).state is JobState.CREATED


async def test_it_releases_admission_when_a_job_ends():
    runtime = InMemoryJobRuntime(max_admitted_jobs=1)
    first = await finished(runtime)

    second = await runtime.submit(spec())

    assert second.job_id != first
    assert runtime.stats()["admitted"] == 1


# --- python_script ----------------------------------------------------------------------


def scripted() -> InMemoryJobRuntime:
    """A runtime that runs ``python_script``, as one built with the code tools enabled."""
    runtime = InMemoryJobRuntime()
    runtime.register_runner("python_script", python_script_runner)
    return runtime


async def test_it_leaves_python_script_to_whoever_enables_the_code_tools(monkeypatch):
    # Not even the raw environment variable adds it: agents.jobs.runtime decides.
    monkeypatch.setenv("SAGE_CODE_TOOLS", "1")
    runtime = InMemoryJobRuntime()

    with pytest.raises(SageError) as caught:
        await runtime.submit(script("print(1)"))

    assert caught.value.code == "job.kind_unsupported"


async def test_it_streams_a_scripts_stdout_stderr_and_exit_code():
    runtime = scripted()
    handle = await runtime.submit(
        script(
            "import sys\nprint('out')\nsys.stdout.flush()\n"
            "print('err', file=sys.stderr)\nsys.exit(4)"
        )
    )

    done = await runtime.wait(handle.job_id)
    chunks = await runtime.read_output(JobCursor(job_id=handle.job_id))

    assert (done.state, done.exit_code) == (JobState.COMPLETED, 4)
    assert {(str(c.stream), c.data) for c in chunks} == {("stdout", b"out\n"), ("stderr", b"err\n")}


async def test_it_gives_a_script_no_inherited_secrets(monkeypatch):
    monkeypatch.setenv("SAGE_TEST_SECRET", "hunter2")
    runtime = scripted()
    handle = await runtime.submit(script("import os\nprint(sorted(os.environ))"))

    await runtime.wait(handle.job_id)
    body = await read_all(runtime, handle.job_id)

    assert b"SAGE_TEST_SECRET" not in body
    assert b"PATH" in body


@pytest.mark.timing
async def test_it_fails_a_script_past_its_wall_clock_limit():
    runtime = scripted()
    handle = await runtime.submit(script("import time\ntime.sleep(30)", timeout_seconds=0.5))

    done = await runtime.wait(handle.job_id)

    assert done.state is JobState.FAILED
    assert "wall-clock" in done.error["message"]


async def test_it_limits_a_scripts_memory():
    runtime = scripted()
    handle = await runtime.submit(
        script(
            "try:\n    b = bytearray(512 * 1024 * 1024)\nexcept MemoryError:\n    print('capped')",
            memory_mb=128,
        )
    )

    await runtime.wait(handle.job_id)

    assert await read_all(runtime, handle.job_id) == b"capped\n"


async def test_it_kills_a_scripts_process_group_on_cancel(tmp_path):
    pid_file = tmp_path / "child.pid"
    source = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    runtime = scripted()
    handle = await runtime.submit(script(source))
    await awaited_until(lambda: read_all(runtime, handle.job_id))
    child = int(pid_file.read_text())

    killed = await runtime.cancel(handle.job_id)

    assert killed.state is JobState.KILLED
    await awaited_until(lambda: not _alive(child))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by init) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


async def test_it_rejects_a_script_payload_without_a_script():
    with pytest.raises(SageError, match="script"):
        await python_script_runner(
            JobSpec(owner_run_id="r", kind="python_script"), _noop_emit, asyncio.Event()
        )


async def _noop_emit(stream: str, data: bytes | str) -> None:
    return None
