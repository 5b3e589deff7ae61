"""Real runs through the worker whose scripted model calls the code tools.

These need ``RunExecutor(code_tools=...)`` (the executor registers the runtime's tools,
starts and closes it with itself, passes the session kind to the tools and publishes
``capacity()["code_tools"]``); they are skipped until that keyword exists.
"""

from __future__ import annotations

import inspect

import psutil
import pytest

from agents import services
from agents.code_tools import CodeToolsRuntime
from agents.executor import RunExecutor
from agents.services import packages
from pooling.interpreters import InterpreterLimits
from pooling.sessions import SessionPool
from scheduling.models import Event, Run, RunStatus
from tests.conftest import demo_manifest, scripted_model
from tests.e2e.conftest import all_terminal, wait_for

pytestmark = [
    pytest.mark.storage,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        "code_tools" not in inspect.signature(RunExecutor).parameters,
        reason="RunExecutor does not take code_tools yet",
    ),
]

LIMITS = InterpreterLimits(
    cpu_seconds=5, memory_bytes=256 * 1024 * 1024, wall_seconds=10.0, output_bytes=4096
)


def _runtime() -> CodeToolsRuntime:
    return CodeToolsRuntime(
        enabled=True,
        max_interpreters=2,
        limits=LIMITS,
        session_pool=SessionPool(rss_limit=0, max_live=4),
    )


def _coder(user, *, tool: str, code: str, kind: str = "master"):
    """A scripted model that calls ``tool`` once, then says "done"; a session on it."""
    scripted_model(
        "coder",
        {"text": "", "tool_calls": [{"name": tool, "arguments": {"code": code}}]},
        {"text": "done"},
    )
    packages.package_create(
        owner=user, manifest=demo_manifest(name="coding", model="coder", tools=[tool])
    )
    return services.session_create(owner=user, package="coding", agent="assistant", kind=kind)


def _submit(user, session, text: str = "go") -> str:
    run, _ = services.run_submit(owner=user, session_id=session.pk, input=text)
    return str(run.pk)


def _tool_outputs(run_id: str) -> list[dict]:
    return list(
        Event.objects.filter(run_id=run_id, type__startswith="tool.call.")
        .exclude(type="tool.call.started")
        .order_by("seq")
        .values_list("data", flat=True)
    )


def _decoded(rows: list) -> list[dict]:
    import orjson

    return [row if isinstance(row, dict) else orjson.loads(row) for row in rows]


def test_it_runs_the_python_tool_in_a_real_run(alice, start_worker):
    session = _coder(alice, tool="python", code="print(6*7)")
    runtime = _runtime()
    worker = start_worker(executor=RunExecutor(code_tools=runtime))
    run_id = _submit(alice, session)
    wait_for(lambda: all_terminal([run_id]), message="the run to finish")
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert run.result["text"] == "done"
    types = list(Event.objects.filter(run_id=run_id).values_list("type", flat=True))
    assert "tool.call.succeeded" in types
    (output,) = _decoded(_tool_outputs(run_id))
    assert (output["name"], output["output"]) == ("python", "42")
    spawned = {pid for pid in (p.pid for p in psutil.Process().children(recursive=True))}
    worker.stop()
    # The executor closed the runtime with itself: no interpreter is left running.
    assert runtime.capacity()["pools"]["python"]["created"] == 0
    leftovers = [p for p in psutil.Process().children(recursive=True) if p.pid in spawned
                 and p.status() != psutil.STATUS_ZOMBIE]
    assert leftovers == []


def test_it_keeps_python_session_variables_across_runs_of_one_session(alice, start_worker):
    code = "n = globals().get('n', 0) + 1\nprint(n)"
    session = _coder(alice, tool="python_session", code=code, kind="branch")
    runtime = _runtime()
    start_worker(executor=RunExecutor(code_tools=runtime))
    first = _submit(alice, session, "once")
    wait_for(lambda: all_terminal([first]), message="the first run to finish")
    second = _submit(alice, session, "twice")
    wait_for(lambda: all_terminal([second]), message="the second run to finish")
    outputs = [_decoded(_tool_outputs(run))[0]["output"] for run in (first, second)]
    assert outputs == ["1", "2"]
    # The executor passed the session's kind to the tool.
    rows = runtime.capacity()["sessions"]["sessions"]
    assert [(row["key"], row["kind"]) for row in rows] == [(str(session.pk), "branch")]


def test_it_publishes_the_code_tools_capacity_in_the_worker_snapshot(alice, staff, start_worker):
    from scheduling.models import WorkerSnapshot
    from tests.conftest import client_for

    session = _coder(alice, tool="python", code="print(1)")
    start_worker(executor=RunExecutor(code_tools=_runtime()))
    run_id = _submit(alice, session)
    wait_for(lambda: all_terminal([run_id]), message="the run to finish")
    wait_for(lambda: WorkerSnapshot.objects.exists(), message="a snapshot")

    def published() -> dict | None:
        body = client_for(staff).get("/api/v1/capacity").json()
        for worker in body["workers"]:
            code_tools = worker["capacity"]["executor"].get("code_tools")
            if code_tools and code_tools["pools"]["python"]["history"]:
                return code_tools
        return None

    wait_for(lambda: published() is not None, message="code tools in the snapshot")
    code_tools = published()
    assert code_tools["enabled"] is True
    assert code_tools["pools"]["python"]["max"] == 2
    assert all(len(sample) == 3 for sample in code_tools["pools"]["python"]["history"])
    assert "sessions" in code_tools
