"""A run's life through the API and a real worker: one run at a time per session, the four
multitask choices, a dead worker's run ending on the stream, resolutions recorded once."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from agents.models import ManagedAgentRecord
from agents.services import packages
from scheduling.models import TERMINAL_STATUSES, Event, Run, RunStatus
from tests.conftest import client_for, demo_manifest, scripted_model
from tests.e2e.conftest import all_terminal, wait_for

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


def _slow_session(user, *, words: int, delay_ms: int) -> tuple[APIClient, str]:
    """A client of ``user`` and a new session of theirs on a slow scripted model: ``words``
    tokens ``delay_ms`` apart per answer."""
    scripted_model("slow", {"text": " ".join(["w"] * words)}, token_delay_ms=delay_ms)
    packages.package_create(owner=user, manifest=demo_manifest(name="slowpkg", model="slow"))
    api = client_for(user)
    return api, _session(api)


def _session(api, package: str = "slowpkg") -> str:
    response = api.post(
        "/api/v1/sessions/", {"package": package, "agent": "assistant"}, format="json"
    )
    assert response.status_code == 201, response.content
    return response.json()["id"]


def _submit(api, session: str, text: str, **extra) -> tuple[int, dict]:
    response = api.post(
        "/api/v1/runs/", {"session": session, "input": text, **extra}, format="json"
    )
    return response.status_code, response.json()


def _run_blocks(session_id: str) -> list[str]:
    """The session's run ids along its seq order, consecutive duplicates merged."""
    blocks: list[str] = []
    for run_id in (
        Event.objects.filter(session_id=session_id).order_by("seq").values_list("run_id", flat=True)
    ):
        if not blocks or blocks[-1] != str(run_id):
            blocks.append(str(run_id))
    return blocks


def _run_of_a_dead_worker(
    user, make_session, *, expires_in: timedelta, **counters: int
) -> tuple[APIClient, str, str]:
    """A run on a new demo session of ``user``, marked running under the lease of a worker
    that died (the lease ends ``expires_in`` from now; ``counters``: its attempts, crashes):
    returns ``user``'s client, the session id and the run id."""
    make_session(user)
    api = client_for(user)
    session = _session(api, "demo")
    _, body = _submit(api, session, "hello")
    Run.objects.filter(pk=body["id"]).update(
        status=RunStatus.RUNNING,
        lease_owner="dead-worker",
        lease_token=1,
        lease_expires_at=timezone.now() + expires_in,
        **counters,
    )
    return api, session, body["id"]


def _status(run_id: str) -> str:
    return Run.objects.get(pk=run_id).status


def test_five_runs_of_one_session_run_one_at_a_time_in_order(alice, start_worker):
    api, session = _slow_session(alice, words=6, delay_ms=20)
    made = []
    for i in range(5):
        code, body = _submit(api, session, f"turn {i}")
        assert code == 202, body
        made.append(body["id"])
    # Up to four at once for this user, yet the session's runs never overlap.
    start_worker(max_concurrent=4, max_per_user=4)
    wait_for(lambda: all_terminal(made), message="five runs to finish")
    assert {_status(r) for r in made} == {RunStatus.COMPLETED}
    assert _run_blocks(session) == made  # no interleaving, submission order
    seqs = list(
        Event.objects.filter(session_id=session).order_by("seq").values_list("seq", flat=True)
    )
    assert seqs == list(range(1, len(seqs) + 1))
    # Each run's model saw the runs before it: its history grew by one turn each time.
    starts = list(
        Event.objects.filter(session_id=session, type="run.started")
        .order_by("seq")
        .values_list("run_id", flat=True)
    )
    assert [str(r) for r in starts] == made


def test_reject_answers_409_while_the_session_is_busy(alice, start_worker):
    api, session = _slow_session(alice, words=40, delay_ms=50)
    _, first = _submit(api, session, "one")
    code, body = _submit(api, session, "two", multitask="reject")
    assert code == 409
    assert body["error"]["code"] == "session.busy"
    assert Run.objects.filter(session_id=session).count() == 1
    start_worker()
    wait_for(lambda: all_terminal([first["id"]]), message="the first run to finish")
    code, body = _submit(api, session, "three", multitask="reject")
    assert code == 202, body


def test_enqueue_is_the_default_and_waits_its_turn(alice, start_worker):
    api, session = _slow_session(alice, words=30, delay_ms=30)
    _, first = _submit(api, session, "one")
    _, second = _submit(api, session, "two", multitask="enqueue")
    start_worker(max_per_user=2)
    wait_for(lambda: _status(first["id"]) == RunStatus.RUNNING, message="the first run to start")
    assert _status(second["id"]) == RunStatus.QUEUED
    wait_for(lambda: all_terminal([first["id"], second["id"]]), message="both runs")
    assert _run_blocks(session) == [first["id"], second["id"]]


@pytest.mark.parametrize("choice", ["interrupt", "rollback"])
def test_interrupt_and_rollback_stop_the_running_run_at_its_next_step(choice, alice, start_worker):
    api, session = _slow_session(alice, words=160, delay_ms=50)  # about 8 s if never interrupted
    _, old = _submit(api, session, "go on for a while")
    start_worker(max_per_user=2)
    wait_for(
        lambda: Event.objects.filter(run_id=old["id"], type="run.started").exists(),
        message="the old run to start",
    )
    asked = timezone.now()
    code, new = _submit(api, session, "new question", multitask=choice)
    assert code == 202, new
    wait_for(lambda: all_terminal([old["id"], new["id"]]), timeout=30, message="both runs")
    stopped = Run.objects.get(pk=old["id"])
    assert (stopped.status, stopped.error["code"]) == (RunStatus.INTERRUPTED, "run.interrupted")
    assert stopped.finished_at - asked < timedelta(seconds=5)
    assert ManagedAgentRecord.objects.get(run_id=old["id"]).status == RunStatus.INTERRUPTED
    assert _status(new["id"]) == RunStatus.COMPLETED
    if choice == "interrupt":
        assert _run_blocks(session) == [old["id"], new["id"]]
        assert Event.objects.filter(run_id=old["id"], type="run.interrupted").exists()
    else:
        assert _run_blocks(session) == [new["id"]]  # the old run's events are gone
    seqs = list(
        Event.objects.filter(session_id=session).order_by("seq").values_list("seq", flat=True)
    )
    assert seqs == list(range(1, len(seqs) + 1))


def test_a_run_reaped_after_its_workers_last_crash_ends_on_the_stream(
    alice, make_session, start_worker, settings
):
    settings.SAGE = {**settings.SAGE, "SAGE_MAX_RUN_ATTEMPTS": 3}
    # Its worker died for the third time: the lease is dead and two crashes were counted.
    api, session, run_id = _run_of_a_dead_worker(
        alice, make_session, expires_in=timedelta(seconds=-1), attempts=5, crashes=2
    )
    start_worker()
    wait_for(lambda: all_terminal([run_id]), message="the run to be failed")
    response = api.get(f"/api/v1/sessions/{session}/stream/", {"timeout": 1})

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    stream = asyncio.run(collect())
    assert b"event: run.failed\n" in stream
    assert b"execution.worker_restarted" in stream
    assert api.get(f"/api/v1/runs/{run_id}/").json()["status"] == "failed"


def test_cancel_of_a_run_whose_worker_died_ends_it(alice, make_session, start_worker):
    api, _, run_id = _run_of_a_dead_worker(
        alice, make_session, expires_in=timedelta(seconds=2), attempts=1
    )
    assert api.post(f"/api/v1/runs/{run_id}/cancel/").status_code == 202
    start_worker()
    wait_for(lambda: all_terminal([run_id]), message="the cancel to land")
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.error["code"]) == (RunStatus.CANCELLED, "run.cancelled")
    assert list(Event.objects.filter(run_id=run_id).values_list("type", flat=True)) == [
        "run.cancelled"
    ]
    # It never executed after the cancel, and no longer counts as pending.
    assert not Run.objects.filter(status__in=set(RunStatus) - TERMINAL_STATUSES).exists()
