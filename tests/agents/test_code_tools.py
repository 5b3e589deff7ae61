"""Tests for agents.code_tools: the python / python_session tools against real subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agents.code_tools import (
    DIED_NOTICE,
    EVICTED_NOTICE,
    KILLED_NOTICE,
    CodeToolsRuntime,
    discovery_tools,
)
from agents.manifest import parse_manifest
from agents.readiness import check_readiness
from agents.tools import ToolContext, ToolError, build_registry
from pooling.interpreters import InterpreterLimits
from pooling.sessions import SessionPool, cgroup_limit
from tests.waiting import awaited_until

MIB = 1024 * 1024
LIMITS = InterpreterLimits(
    cpu_seconds=5, memory_bytes=256 * MIB, wall_seconds=10.0, output_bytes=4096
)


def ctx(session: str | None = "s-1", **extras: Any) -> ToolContext:
    return ToolContext(owner_id=7, session_id=session, run_id="r-1", extras=extras)


def make_runtime(**kwargs: Any) -> CodeToolsRuntime:
    kwargs.setdefault("enabled", True)
    kwargs.setdefault("max_interpreters", 2)
    kwargs.setdefault("limits", LIMITS)
    kwargs.setdefault("session_pool", SessionPool(rss_limit=0, max_live=8))
    return CodeToolsRuntime(**kwargs)


@pytest.fixture
async def runtime() -> AsyncIterator[CodeToolsRuntime]:
    rt = make_runtime()
    yield rt
    await rt.close()


def descendants() -> set[int]:
    return {proc.pid for proc in psutil.Process().children(recursive=True)}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- enabling --------------------------------------------------------------------------------


def test_it_is_disabled_by_default(settings: Any) -> None:
    settings.SAGE = {**settings.SAGE, "SAGE_CODE_TOOLS": False}
    runtime = CodeToolsRuntime.from_settings()
    assert runtime.enabled is False
    assert runtime.tools() == []
    assert runtime.capacity()["pools"] == {}


def test_it_offers_both_tools_sized_by_the_run_concurrency_when_enabled(settings: Any) -> None:
    settings.SAGE = {**settings.SAGE, "SAGE_CODE_TOOLS": True,
                     "SAGE_SERVER_MAX_CONCURRENT_RUNS": 5}
    runtime = CodeToolsRuntime.from_settings()
    assert [tool.name for tool in runtime.tools()] == ["python", "python_session"]
    assert runtime.pools["python"].stats().max == 5
    assert runtime.pools["python"].stats().resident == 1


def test_it_reports_declared_code_tools_as_missing_while_disabled() -> None:
    manifest = parse_manifest({
        "name": "coder", "version": "1.0.0", "entrypoint": "main",
        "agents": {"main": {"model": "scripted", "tools": ["python", "python_session"]}},
    })
    off = check_readiness(manifest, tools=build_registry(extra=make_runtime(
        enabled=False).tools()), skills=None, model_names={"scripted"}, strict=False)
    on = check_readiness(manifest, tools=build_registry(extra=make_runtime().tools()),
                         skills=None, model_names={"scripted"}, strict=False)
    assert off.agents["main"]["missing_tools"] == ["python", "python_session"]
    assert off.ready is False
    assert on.agents["main"]["missing_tools"] == []
    assert on.ready is True


def test_it_lists_the_code_tools_for_discovery_only_when_enabled(settings: Any) -> None:
    settings.SAGE = {**settings.SAGE, "SAGE_CODE_TOOLS": True}
    assert [tool.name for tool in discovery_tools()] == ["python", "python_session"]
    settings.SAGE = {**settings.SAGE, "SAGE_CODE_TOOLS": False}
    assert discovery_tools() == []


async def test_it_refuses_to_run_a_discovery_tool_outside_a_worker() -> None:
    (python, _) = discovery_tools(enabled=True)
    with pytest.raises(ToolError):
        await python.handler({"code": "print(1)"}, ctx())


# --- python (stateless) ---------------------------------------------------------------------


async def test_it_runs_a_stateless_snippet_in_a_warm_interpreter(
    runtime: CodeToolsRuntime,
) -> None:
    assert await runtime.run_python({"code": "print(6*7)"}, ctx()) == "42"
    assert await runtime.run_python({"code": "x = 1"}, ctx()) == "(no output)"
    # Stateless: the previous snippet's variable is gone.
    output = await runtime.run_python({"code": "x"}, ctx())
    assert "NameError" in output
    assert runtime.pools["python"].stats().created == 1


async def test_it_returns_stderr_and_the_error_of_a_failing_snippet(
    runtime: CodeToolsRuntime,
) -> None:
    code = "import sys\nprint('before')\nsys.stderr.write('warned\\n')\nraise ValueError('boom')"
    output = await runtime.run_python({"code": code}, ctx())
    assert output.startswith("before\n[stderr]\nwarned\n[error]\n")
    assert "ValueError: boom" in output


@pytest.mark.timing
async def test_it_kills_a_snippet_past_its_timeout_and_recovers(
    runtime: CodeToolsRuntime,
) -> None:
    output = await runtime.run_python(
        {"code": "import time\ntime.sleep(30)", "timeout": 0.5}, ctx()
    )
    assert "[killed]" in output and "wall-clock limit" in output
    assert await runtime.run_python({"code": "print('still here')"}, ctx()) == "still here"


async def test_it_bounds_the_output(runtime: CodeToolsRuntime) -> None:
    output = await runtime.run_python({"code": "print('x' * 100_000)"}, ctx())
    assert len(output) < 4096 + 200
    assert "[output truncated" in output


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"code": ""},
        {"code": "   "},
        {"code": 42},
        {"code": "1", "timeout": 0},
        {"code": "1", "timeout": 11},
        {"code": "1", "timeout": "soon"},
        {"code": "1", "timeout": True},
        {"code": "1", "cwd": "/"},
    ],
)
async def test_it_refuses_bad_arguments_politely(
    runtime: CodeToolsRuntime, args: dict[str, Any]
) -> None:
    for handler in (runtime.run_python, runtime.run_python_session):
        with pytest.raises(ToolError) as info:
            await handler(dict(args), ctx())
        assert info.value.code == "tool.failed"
    assert runtime.pools["python"].stats().created == 0  # nothing was booted
    assert len(runtime.sessions) == 0


async def test_it_refuses_after_close(runtime: CodeToolsRuntime) -> None:
    await runtime.close()
    for handler in (runtime.run_python, runtime.run_python_session):
        with pytest.raises(ToolError):
            await handler({"code": "1"}, ctx())


# --- python_session (stateful) --------------------------------------------------------------


async def test_it_keeps_variables_across_calls_in_one_session(
    runtime: CodeToolsRuntime,
) -> None:
    assert await runtime.run_python_session({"code": "total = 40"}, ctx()) == "(no output)"
    assert await runtime.run_python_session({"code": "total += 2\ntotal"}, ctx()) == "42"
    live = runtime.sessions.get("s-1")
    assert live is not None and live.turns == 2 and not live.busy


async def test_it_isolates_variables_between_sessions(runtime: CodeToolsRuntime) -> None:
    await runtime.run_python_session({"code": "secret = 'a'"}, ctx("s-a"))
    output = await runtime.run_python_session({"code": "secret"}, ctx("s-b"))
    assert "NameError" in output
    assert await runtime.run_python_session({"code": "secret"}, ctx("s-a")) == "'a'"


async def test_it_takes_the_session_kind_from_the_context(runtime: CodeToolsRuntime) -> None:
    await runtime.run_python_session({"code": "1"}, ctx("s-f", session_kind="fork"))
    await runtime.run_python_session({"code": "1"}, ctx("s-m"))
    kinds = {row["key"]: row["kind"] for row in runtime.sessions.snapshot()["sessions"]}
    assert kinds == {"s-f": "fork", "s-m": "master"}


async def test_it_refuses_python_session_without_a_session(runtime: CodeToolsRuntime) -> None:
    with pytest.raises(ToolError) as info:
        await runtime.run_python_session({"code": "1"}, ctx(None))
    assert "session" in info.value.message


async def test_it_tells_the_agent_variables_were_lost_after_eviction_under_a_cgroup_limit(
    tmp_path: Path,
) -> None:
    limit_file = tmp_path / "memory.max"
    limit_file.write_text(f"{1 * MIB}\n")  # below one kernel's RSS: always over the limit
    pool = SessionPool(rss_limit=cgroup_limit(limit_file, tmp_path / "none"))
    runtime = make_runtime(session_pool=pool)
    try:
        await runtime.run_python_session({"code": "x = 41"}, ctx("s-a", session_kind="deep"))
        # Booting a kernel for another session must make room: s-a (idle) is the victim.
        await runtime.run_python_session({"code": "y = 1"}, ctx("s-b"))
        assert "s-a" not in runtime.sessions
        output = await runtime.run_python_session({"code": "x + 1"}, ctx("s-a"))
        assert output.startswith(EVICTED_NOTICE)
        assert "NameError" in output
        # The notice is given once: the fresh kernel keeps its own variables from now on.
        await runtime.run_python_session({"code": "z = 5"}, ctx("s-a"))
        assert runtime.sessions.snapshot()["evictions"] >= 1
    finally:
        await runtime.close()


async def test_it_never_evicts_a_session_while_its_snippet_runs(
    runtime: CodeToolsRuntime, tmp_path: Path
) -> None:
    flag = tmp_path / "go"
    code = f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.01)\n'done'"
    call = asyncio.create_task(runtime.run_python_session({"code": code}, ctx("s-busy")))
    await awaited_until(lambda: (s := runtime.sessions.get("s-busy")) is not None and s.busy)
    runtime.sessions.rss_limit = 1  # permanently over the limit
    assert await runtime.sessions.make_room() == 0
    assert runtime.sessions.snapshot()["sessions"][0]["running_turn"] == "r-1"
    flag.write_text("")
    assert await call == "'done'"


@pytest.mark.timing
async def test_it_tells_the_agent_when_its_kernel_was_killed_by_a_limit(
    runtime: CodeToolsRuntime,
) -> None:
    await runtime.run_python_session({"code": "kept = 1"}, ctx())
    output = await runtime.run_python_session(
        {"code": "import time\ntime.sleep(30)", "timeout": 0.5}, ctx()
    )
    assert "[killed]" in output and output.endswith(KILLED_NOTICE)
    # Told once already: the next call simply runs in a fresh kernel.
    output = await runtime.run_python_session({"code": "kept"}, ctx())
    assert "NameError" in output and "[notice]" not in output


async def test_it_restarts_a_kernel_that_died_while_parked(runtime: CodeToolsRuntime) -> None:
    await runtime.run_python_session({"code": "kept = 1"}, ctx())
    live = runtime.sessions.get("s-1")
    assert live is not None and live.pid is not None
    os.kill(live.pid, signal.SIGKILL)
    await awaited_until(lambda: not live.client.alive)
    output = await runtime.run_python_session({"code": "kept"}, ctx())
    assert output.startswith(DIED_NOTICE)
    assert "NameError" in output


# --- lifecycle and visibility ---------------------------------------------------------------


async def test_it_leaves_no_process_behind_after_close() -> None:
    before = descendants()
    runtime = make_runtime()
    await runtime.start()
    await asyncio.gather(
        runtime.run_python({"code": "print(1)"}, ctx()),
        runtime.run_python({"code": "print(2)"}, ctx()),
        runtime.run_python_session({"code": "a = 1"}, ctx("s-a")),
        runtime.run_python_session({"code": "b = 1"}, ctx("s-b", session_kind="job")),
    )
    spawned = descendants() - before
    assert len(spawned) >= 4  # interpreters, spare and kernels
    await runtime.close()
    await awaited_until(lambda: not any(alive(pid) for pid in spawned))
    assert runtime.pools["python"].stats().created == 0
    assert len(runtime.sessions) == 0


async def test_it_runs_one_janitor_for_its_pools_and_the_session_reaper() -> None:
    runtime = make_runtime(janitor_interval=0.01,
                           session_pool=SessionPool(rss_limit=0, reap_interval=0.01))
    await runtime.start()
    try:
        await runtime.run_python_session({"code": "1"}, ctx("s-job", session_kind="job"))
        # The job kind's TTL is 0: the reaper closes it once idle; the janitor runs rounds.
        await awaited_until(lambda: "s-job" not in runtime.sessions and runtime.janitor.rounds >= 2)
    finally:
        await runtime.close()


async def test_it_reports_capacity_with_pool_stats_history_and_sessions(
    runtime: CodeToolsRuntime,
) -> None:
    await runtime.run_python({"code": "1"}, ctx())
    await runtime.run_python_session({"code": "1"}, ctx())
    await runtime.janitor.run_round()
    capacity = runtime.capacity()
    assert capacity["enabled"] is True
    pool = capacity["pools"]["python"]
    assert {"created", "idle", "in_use", "waiting", "max", "resident", "grow_step",
            "shrink_step", "peak_in_use", "history", "spares"} <= set(pool)
    assert pool["created"] == 1 and pool["max"] == 2
    assert pool["history"] and all(len(sample) == 3 for sample in pool["history"])
    t, created, in_use = pool["history"][-1]
    assert isinstance(t, float) and (created, in_use) == (1, 0)
    assert capacity["sessions"]["live"] == 1
    assert capacity["sessions"]["sessions"][0]["key"] == "s-1"
