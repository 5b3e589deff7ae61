"""The side-effect journal across a worker's death: a real ``runworker`` SIGKILLed at the
crash point ``mcp.call.sent`` (the MCP server acted; its answer is not durable yet), then a
fresh worker finishes the run (see tests/scheduling/test_lifecycle_faults.py for the
harness)."""

from __future__ import annotations

from typing import Any

import pytest

from agents import services
from agents.engine import INTERRUPTED_TOOL_ERROR
from agents.services import packages
from agents.services.mcp import mcp_connection_save
from scheduling.models import Event, Run, RunStatus
from tests.agents.mcp_fixtures import mcp_server_fixture  # noqa: F401  (registers "mcp_server")
from tests.conftest import scripted_model
from tests.scheduling.processes import (
    WorkerProcesses,
    expire_leases,
    worker_processes_fixture,
)

worker_processes = worker_processes_fixture  # real runworker subprocesses

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

# Generous: two cores, other suites running, a Django start-up per worker.
TIMEOUT = 180


def _run(user, url: str, **server: Any) -> Run:
    scripted_model(
        "journal",
        {"text": "", "tool_calls": [{"id": "call_bump", "name": "mcp__crm__bump"}]},
        {"text": "Carried on."},
    )
    manifest = {
        "name": "journal",
        "version": "1.0.0",
        "entrypoint": "assistant",
        "agents": {
            "assistant": {
                "model": "journal",
                "mcp_servers": [{"name": "crm", "url": url, **server}],
            }
        },
    }
    packages.package_create(owner=user, manifest=manifest)
    mcp_connection_save(user=user, server_url=url, bearer_token="alice-token")
    session = services.session_create(owner=user, package="journal", agent="assistant")
    run, _ = services.run_submit(owner=user, session_id=session.pk, input="bump it")
    return run


def _ended(run: Run) -> bool:
    return Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED


def _killed_after_the_call(worker_processes: WorkerProcesses, run: Run, mcp_server) -> None:
    doomed = worker_processes.start("doomed", SAGE_CRASH_AT="mcp.call.sent")
    doomed.wait_killed(timeout=TIMEOUT, unless=lambda: _ended(run))
    assert mcp_server.bumps == 1
    assert not Event.objects.filter(run_id=run.pk, type="tool.call.succeeded").exists()
    expire_leases(doomed)
    fresh = worker_processes.start("fresh")
    worker_processes.wait_for(
        lambda: _ended(run),
        timeout=TIMEOUT,
        message="the fresh worker to end the run",
        running=(fresh,),
    )
    assert fresh.terminate() == 0, fresh.tail()


def test_a_call_sent_but_not_recorded_is_not_sent_again(
    alice, mcp_server, worker_processes: WorkerProcesses
):
    run = _run(alice, mcp_server.url)
    _killed_after_the_call(worker_processes, run, mcp_server)
    # One call reached the server; the run went on, told the outcome is unknown.
    assert mcp_server.bumps == 1
    failed = Event.objects.get(run_id=run.pk, type="tool.call.failed").payload
    assert failed == {"id": "call_bump", "name": "mcp__crm__bump", "error": INTERRUPTED_TOOL_ERROR}
    assert Run.objects.get(pk=run.pk).result["text"] == "Carried on."


def test_an_idempotent_tool_is_sent_again_with_the_same_key(
    alice, mcp_server, worker_processes: WorkerProcesses
):
    run = _run(alice, mcp_server.url, idempotent=["bump"])
    _killed_after_the_call(worker_processes, run, mcp_server)
    sent = mcp_server.called("bump")
    assert [c.key for c in sent] == [f"{run.pk}:call_bump"] * 2
    [done] = Event.objects.filter(run_id=run.pk, type="tool.call.succeeded")
    assert done.payload["output"] == "counter is 2"
    assert not Event.objects.filter(run_id=run.pk, type="tool.call.failed").exists()
