"""Fencing across processes: a worker paused past its lease can never write again.

Two real ``manage.py runworker`` processes share the test database. Worker A claims a slow
run and is frozen with SIGSTOP mid-run. Its pause outlives its lease — the test moves the
lease deadline into the past instead of waiting out a real lease, which keeps A's own
renewer (every 20 s) out of the picture. Worker B starts, finds the run without a live
lease, requeues and claims it under a larger fencing token, and completes it. Then A is
resumed: its model stream finishes and it tries to commit the assistant message under its
old token. The database refuses (``scheduler.fence_rejected``) and nothing A wrote after
losing the lease is stored: the session holds exactly B's events, contiguous, and the run's
final state carries B's token.
"""

from __future__ import annotations

import signal

import pytest
from django.utils import timezone

from scheduling.models import Event, Run, RunStatus, WorkerSnapshot
from tests.conftest import demo_manifest, scripted_model, words
from tests.e2e.conftest import wait_for
from tests.scheduling.processes import worker_processes_fixture

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

WORDS = 30
TOKEN_DELAY_MS = 60
# Leases long enough, and renewals rare enough, that only the test ends worker A's lease.
FENCING_ENV = {"SAGE_LEASE_SECONDS": "60", "SAGE_HEARTBEAT_SECONDS": "20"}

worker_processes = worker_processes_fixture  # real runworker subprocesses


@pytest.fixture
def slow_run(alice) -> Run:
    from agents import services
    from agents.services import packages

    scripted_model("slowfence", {"text": words(WORDS, "word")}, token_delay_ms=TOKEN_DELAY_MS)
    packages.package_create(owner=alice, manifest=demo_manifest(name="slowpkg", model="slowfence"))
    session = services.session_create(owner=alice, package="slowpkg", agent="assistant")
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="talk slowly")
    return run


def _event_types(run: Run) -> list[tuple[int, str, str | None]]:
    return [
        (e.seq, e.type, e.payload.get("role"))
        for e in Event.objects.filter(session_id=run.session_id).order_by("seq")
    ]


def test_it_rejects_every_write_of_a_worker_resumed_after_losing_its_lease(
    slow_run, worker_processes
):
    a = worker_processes.start("a", **FENCING_ENV)

    def a_is_mid_run() -> bool:
        run = Run.objects.get(pk=slow_run.pk)
        return (
            run.status == RunStatus.RUNNING
            and a.owner_marker in run.lease_owner
            and Event.objects.filter(run_id=slow_run.pk).count() >= 2
        )

    wait_for(a_is_mid_run, timeout=30, message="worker A to start the run")
    a.signal(signal.SIGSTOP)
    token_a = Run.objects.get(pk=slow_run.pk).lease_token
    # A's pause outlives its lease.
    assert (
        Run.objects.filter(pk=slow_run.pk, lease_token=token_a).update(
            lease_expires_at=timezone.now() - timezone.timedelta(seconds=1)
        )
        == 1
    )

    b = worker_processes.start("b", **FENCING_ENV)
    wait_for(
        lambda: Run.objects.get(pk=slow_run.pk).status == RunStatus.COMPLETED,
        # Generous: if A froze inside a transaction, PostgreSQL ends it after 15 s first.
        timeout=60,
        message="worker B to take the run over and complete it",
    )
    events_before_resume = _event_types(slow_run)

    resumed_at = timezone.now()
    a.signal(signal.SIGCONT)

    def a_gave_the_run_up() -> bool:
        # A's own snapshot, published after it resumed, no longer lists the run: its
        # write was refused and it dropped the execution.
        snapshot = WorkerSnapshot.objects.filter(
            worker_id__contains=a.owner_marker, heartbeat_at__gt=resumed_at
        ).first()
        return snapshot is not None and str(slow_run.pk) not in snapshot.capacity["runs"]["running"]

    wait_for(a_gave_the_run_up, timeout=30, message="worker A to give the run up")
    a.terminate(20)
    b.terminate(20)

    run = Run.objects.get(pk=slow_run.pk)
    assert run.status == RunStatus.COMPLETED
    assert run.lease_token > token_a
    assert f"run {slow_run.pk} completed" in b.output()
    assert run.attempts == 2
    assert run.result["text"] == " ".join(["word"] * WORDS)
    events = _event_types(slow_run)
    assert events == events_before_resume
    assert [seq for seq, _, _ in events] == list(range(1, len(events) + 1))
    assert [(t, role) for _, t, role in events] == [
        ("run.started", None),
        ("message.completed", "user"),
        ("run.started", None),
        ("message.completed", "assistant"),
        ("run.completed", None),
    ]
    assert "lost its lease" in a.output()
