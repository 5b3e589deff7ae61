"""Runs through the model client pool, the budget and real SDKs against a loopback server."""

from __future__ import annotations

import threading
import time

import pytest

from agents.executor import RunExecutor
from agents.models import ManagedAgentRecord
from agents.services import packages
from pooling.budget import ModelConcurrencyBudget
from pooling.models import ModelRecord, Protocol
from scheduling.models import Event, Run, RunStatus
from tests.conftest import client_for, demo_manifest, scripted_model
from tests.e2e.conftest import all_terminal, wait_for
from tests.pooling.upstream import ErrorReply, Reply, upstream_fixture

upstream = upstream_fixture  # the loopback model server fixture
pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


def _package_on(user, model: str, name: str = "pkg") -> None:
    packages.package_create(owner=user, manifest=demo_manifest(name=name, model=model))


def _run(api, package: str, text: str = "hello") -> str:
    session = api.post(
        "/api/v1/sessions/", {"package": package, "agent": "assistant"}, format="json"
    ).json()["id"]
    response = api.post("/api/v1/runs/", {"session": session, "input": text}, format="json")
    assert response.status_code == 202
    return response.json()["id"]


def _openai_package(user, upstream, api_key: str) -> ModelRecord:
    """``user``'s package "pkg" on their own OpenAI record "gpt" (at the loopback server,
    with ``api_key``); returns the record."""
    record = ModelRecord(
        owner=user,
        name="gpt",
        protocol=Protocol.OPENAI,
        base_url=upstream.openai_base_url,
        model="gpt-test",
    )
    record.api_key = api_key
    record.save()
    _package_on(user, "gpt")
    return record


def _slow_record(name: str = "slow", delay_ms: int = 100, words: int = 20) -> ModelRecord:
    return scripted_model(name, {"text": " ".join(["w"] * words)}, token_delay_ms=delay_ms)


def test_it_suspends_a_run_when_the_budget_queue_is_full_and_resumes_on_retry(alice, start_worker):
    _slow_record()
    _package_on(alice, "slow")
    api = client_for(alice)
    executor = RunExecutor(budget=ModelConcurrencyBudget(1, max_waiting=0))
    start_worker(executor=executor, max_concurrent=2)
    first = _run(api, "pkg")
    wait_for(lambda: executor.budget.active == 1, message="the first call to hold the slot")
    second = _run(api, "pkg")
    wait_for(
        lambda: Run.objects.get(pk=second).status == RunStatus.SUSPENDED,
        message="the second run to be suspended",
    )
    body = api.get(f"/api/v1/runs/{second}/").json()
    assert body["interaction"]["code"] == "model.queue_full"
    assert body["interaction"]["retryable"] is True
    assert body["interaction"]["resumable"] is True
    assert body["interaction"]["allowed_decisions"] == ["retry", "cancel"]
    wait_for(lambda: all_terminal([first]), message="the first run to finish")
    reply = api.post(f"/api/v1/runs/{second}/reply/", {"decision": "retry"}, format="json")
    assert reply.status_code == 202
    assert reply.json()["status"] == "queued"
    wait_for(lambda: all_terminal([second]), message="the resumed run to finish")
    run = Run.objects.get(pk=second)
    assert run.status == RunStatus.COMPLETED
    types = list(Event.objects.filter(run_id=second).order_by("seq").values_list("type", flat=True))
    assert types[:4] == [
        "run.started",
        "message.completed",
        "run.suspended",
        "interaction.requested",
    ]
    assert "interaction.resolved" in types and types[-1] == "run.completed"
    # The user's message was stored once, and the resumed attempt did not repeat it.
    assert types.count("message.completed") == 2


def test_it_refuses_a_reply_to_a_run_that_is_not_suspended(alice, make_session):
    from agents import services

    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="x")
    response = client_for(alice).post(
        f"/api/v1/runs/{run.pk}/reply/", {"decision": "retry"}, format="json"
    )
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "run.not_suspended"


def test_it_never_runs_more_model_calls_than_the_budget(alice, start_worker):
    _slow_record(delay_ms=20, words=5)
    _package_on(alice, "slow")
    api = client_for(alice)
    executor = RunExecutor(budget=ModelConcurrencyBudget(1))
    peak = {"active": 0, "waiting": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            snapshot = executor.budget.snapshot()
            peak["active"] = max(peak["active"], snapshot["active"])
            peak["waiting"] = max(peak["waiting"], snapshot["waiting"])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    runs = [_run(api, "pkg", f"run {i}") for i in range(10)]
    start_worker(executor=executor, max_concurrent=10)
    try:
        wait_for(lambda: all_terminal(runs), message="10 runs to finish", timeout=60)
    finally:
        stop.set()
        sampler.join()
    assert Run.objects.filter(pk__in=runs, status=RunStatus.COMPLETED).count() == 10
    assert peak["active"] == 1
    assert peak["waiting"] >= 1  # the runs really did contend for the one slot


def test_it_streams_through_the_openai_sdk_with_tool_calls(alice, start_worker, upstream):
    _openai_package(alice, upstream, "sk-alice-1")
    upstream.enqueue(
        Reply(text="", tool_calls=({"name": "calculator", "arguments": {"expression": "6*7"}},)),
        Reply(text="It is 42."),
    )
    api = client_for(alice)
    run_id = _run(api, "pkg", "what is 6*7?")
    start_worker()
    wait_for(lambda: all_terminal([run_id]), message="the run to finish")
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert run.result["text"] == "It is 42."
    second_request = upstream.requests[1].json
    assert second_request["messages"][-1]["role"] == "tool"
    assert second_request["messages"][-1]["content"] == "42"
    assert upstream.requests[0].headers["authorization"] == "Bearer sk-alice-1"


def test_it_uses_a_new_client_after_a_credential_change(alice, start_worker, upstream):
    record = _openai_package(alice, upstream, "sk-old")
    gate = threading.Event()
    upstream.enqueue(Reply(text="slow old answer", gate=gate), Reply(text="new answer"))
    api = client_for(alice)
    executor = RunExecutor()
    start_worker(executor=executor, max_concurrent=2)
    old = _run(api, "pkg")
    upstream.wait_for_requests(1, timeout=10)
    record.api_key = "sk-new"
    record.save()
    new = _run(api, "pkg")
    wait_for(lambda: all_terminal([new]), message="the run on the new key to finish")
    assert Run.objects.get(pk=old).status == RunStatus.RUNNING  # still streaming, old client
    gate.set()
    wait_for(lambda: all_terminal([old]), message="the old run to finish")
    assert Run.objects.get(pk=old).result["text"] == "slow old answer"
    assert Run.objects.get(pk=new).result["text"] == "new answer"
    keys = [r.headers["authorization"] for r in upstream.requests]
    assert keys == ["Bearer sk-old", "Bearer sk-new"]
    assert executor.capacity()["model_calls"]["active"] == 0


# A 429 suspends the run instead (tests/e2e/test_upstream_faults_e2e.py).
@pytest.mark.parametrize(
    ("reply", "code", "retryable"),
    [
        (
            ErrorReply(
                status=502,
                body="<html><head><title>502 Bad Gateway</title></head>"
                "<body>nginx secret-internal-host</body></html>",
                content_type="text/html",
            ),
            "upstream.error",
            True,
        ),
        (
            ErrorReply(status=401, body='{"error": {"message": "bad key sk-leak-9"}}'),
            "upstream.auth",
            False,
        ),
    ],
)
def test_it_turns_upstream_failures_into_clear_errors(
    alice, start_worker, upstream, reply, code, retryable
):
    _openai_package(alice, upstream, "sk-leak-9")
    upstream.enqueue(reply)
    api = client_for(alice)
    run_id = _run(api, "pkg")
    start_worker()
    wait_for(lambda: all_terminal([run_id]), message="the run to fail")
    body = api.get(f"/api/v1/runs/{run_id}/").json()
    assert body["status"] == "failed"
    assert (body["error"]["code"], body["error"]["retryable"]) == (code, retryable)
    exposed = (
        str(body)
        + str(list(Event.objects.values_list("data", flat=True)))
        + str(ManagedAgentRecord.objects.get(run_id=run_id).error)
    )
    assert "secret-internal-host" not in exposed
    assert "sk-leak-9" not in exposed
    assert "<html>" not in exposed


def test_it_publishes_model_clients_and_calls_in_the_worker_snapshot(alice, staff, start_worker):
    from scheduling.models import WorkerSnapshot

    start_worker()
    wait_for(lambda: WorkerSnapshot.objects.exists(), message="a snapshot")
    body = client_for(staff).get("/api/v1/capacity").json()
    capacity = body["workers"][0]["capacity"]
    assert set(capacity["executor"]["model_clients"]) == {
        "clients",
        "closing_clients",
        "active_leases",
        "max_clients",
        "constructions",
    }
    assert capacity["executor"]["model_calls"]["limit"] == 8


def test_it_continues_a_session_with_its_earlier_turns(alice, start_worker, upstream):
    _openai_package(alice, upstream, "sk-alice")
    upstream.enqueue(Reply(text="Hello, Alice."), Reply(text="You are Alice."))
    api = client_for(alice)
    session = api.post(
        "/api/v1/sessions/", {"package": "pkg", "agent": "assistant"}, format="json"
    ).json()["id"]
    start_worker()
    for text in ("I am Alice.", "Who am I?"):
        run = api.post("/api/v1/runs/", {"session": session, "input": text}, format="json").json()[
            "id"
        ]
        wait_for(lambda run=run: all_terminal([run]), message="the run to finish")
    messages = upstream.requests[1].json["messages"]
    turns = [(m["role"], m["content"]) for m in messages if m["role"] != "system"]
    assert turns == [("user", "I am Alice."), ("assistant", "Hello, Alice."), ("user", "Who am I?")]
