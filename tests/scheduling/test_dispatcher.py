"""The dispatcher path: DatabaseScheduler → Dispatcher → fenced commits → coordinator.

Executions here are a small fake executor that commits events fenced by its lease and
returns a completed `Outcome`, which the dispatcher commits (terminal event, status,
archive), so the scheduler, the quotas, the renewer, cancellation and shutdown are
exercised without a model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from sageproject.db import db_call, transient_database_error
from scheduling.models import Event, Run, RunStatus, Session, WorkerSnapshot
from scheduling.runs import Fence, Outcome
from scheduling.scheduler import SchedulerQuotaGroup
from scheduling.store import append_events, close_default_coordinator
from scheduling.worker import DatabaseScheduler, Dispatcher, StopSignal, is_transient
from tests.waiting import awaited_until

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

BOUND = 60.0


def make_runs(users: int, per_user: int) -> dict[str, str]:
    """Queued runs, one session each; returns run id → session id."""
    made: dict[str, str] = {}
    base = timezone.now()
    n = 0
    for u in range(users):
        owner = get_user_model().objects.create_user(username=f"user{u}")
        for _ in range(per_user):
            session = Session.objects.create(
                owner=owner, package_ref="ref", package_name="pkg", agent_id="a"
            )
            n += 1
            run = Run.objects.create(
                session=session,
                owner=owner,
                created_at=base + timezone.timedelta(microseconds=n),
            )
            made[str(run.pk)] = str(session.pk)
    return made


class FakeExecutor:
    """An executor of ``runs`` (run id → session id) without a model: nothing to start,
    close or report; ``all_done`` is set once each of them finished (`_finished_one`)."""

    def __init__(self, runs: dict[str, str]) -> None:
        self.runs = runs
        self.finished = 0
        self.all_done = asyncio.Event()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def capacity(self) -> dict[str, Any]:
        return {}

    def _finished_one(self) -> None:
        self.finished += 1
        if self.finished == len(self.runs):
            self.all_done.set()


class StoreExecutor(FakeExecutor):
    """Commits ``writes`` events per run fenced by its lease, then completes it.

    The first ``hold`` executions wait until that many are active at once, which proves
    the dispatcher filled every slot; ``peak``/``peak_per_user`` record the most seen.
    """

    def __init__(self, runs: dict[str, str], *, writes: int = 3, hold: int = 0) -> None:
        super().__init__(runs)
        self.writes = writes
        self.hold = hold
        self.dispatcher: Dispatcher | None = None
        self.active: dict[str, int] = {}
        self.peak = 0
        self.peak_per_user: dict[str, int] = {}
        self.full = asyncio.Event()
        self.commits_in_flight = 0
        self.peak_commits = 0

    async def execute(self, run_id: Any, fence: Fence, stop: StopSignal, **_: Any) -> Outcome:
        assert self.dispatcher is not None
        run_key = str(run_id)
        user = self.dispatcher.executions[run_key].tenant or ""
        self.active[user] = self.active.get(user, 0) + 1
        self.peak_per_user[user] = max(self.peak_per_user.get(user, 0), self.active[user])
        self.peak = max(self.peak, sum(self.active.values()))
        try:
            if self.hold and not self.full.is_set():
                if sum(self.active.values()) >= self.hold:
                    self.full.set()
                await asyncio.wait_for(self.full.wait(), BOUND)
            for i in range(self.writes):
                self.commits_in_flight += 1
                self.peak_commits = max(self.peak_commits, self.commits_in_flight)
                try:
                    await append_events(
                        session_id=self.runs[run_key],
                        run_id=run_key,
                        events=[("note", {"i": i})],
                        fence=fence,
                    )
                finally:
                    self.commits_in_flight -= 1
            return Outcome(
                status=RunStatus.COMPLETED, session_id=self.runs[run_key], result={"text": "ok"}
            )
        finally:
            self.active[user] -= 1
            self._finished_one()


def seqs_by_session(session_ids: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {s: [] for s in session_ids}
    for session_id, seq in (
        Event.objects.filter(session_id__in=session_ids)
        .order_by("session_id", "seq")
        .values_list("session_id", "seq")
    ):
        out[str(session_id)].append(seq)
    return out


@pytest.fixture
def runs_8x8(db) -> dict[str, str]:
    return make_runs(8, 8)


@contextlib.asynccontextmanager
async def running(dispatcher: Dispatcher) -> AsyncIterator[asyncio.Task[None]]:
    """The dispatcher's loop runs in a task (yielded) for the block; then it is asked to
    stop and waited for."""
    stopping = asyncio.Event()
    loop_task = asyncio.create_task(dispatcher.run(stopping))
    try:
        yield loop_task
    finally:
        stopping.set()
        await asyncio.wait_for(loop_task, BOUND)


async def _dispatch(dispatcher: Dispatcher, executor: StoreExecutor) -> None:
    try:
        async with running(dispatcher):
            await asyncio.wait_for(executor.all_done.wait(), BOUND)
    finally:
        await dispatcher.drain(5.0)
        await dispatcher.scheduler.close()
        await close_default_coordinator()


async def test_it_runs_64_runs_of_8_users_in_16_slots_two_per_user(runs_8x8):
    scheduler = DatabaseScheduler(quota_group=SchedulerQuotaGroup(16, 2, 1024))
    executor = StoreExecutor(runs_8x8, hold=16)
    dispatcher = Dispatcher(
        scheduler,
        executor,
        worker_id="dispatch-test",
        max_concurrent_runs=16,
        max_concurrent_runs_per_user=2,
        lease_seconds=30,
    )
    executor.dispatcher = dispatcher
    await _dispatch(dispatcher, executor)
    assert executor.peak == 16
    assert executor.peak_commits == 16  # storage commits of 16 runs in flight at once
    assert max(executor.peak_per_user.values()) == 2
    assert dispatcher.completed == 64
    statuses = await db_call(
        lambda: set(Run.objects.filter(pk__in=list(runs_8x8)).values_list("status", flat=True))
    )
    assert statuses == {RunStatus.COMPLETED}
    seqs = await db_call(seqs_by_session, list(runs_8x8.values()))
    assert all(s == [1, 2, 3, 4] for s in seqs.values())  # three notes and run.completed
    assert scheduler.leases() == ()
    assert dispatcher.executions == {}


class BlockingExecutor(StoreExecutor):
    """Starts, signals ``started``, then waits until cancelled."""

    def __init__(self, runs: dict[str, str]) -> None:
        super().__init__(runs)
        self.started = asyncio.Event()
        self.reasons: list[str | None] = []

    async def execute(self, run_id: Any, fence: Fence, stop: StopSignal, **_: Any) -> Outcome:
        self.started.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.reasons.append(stop.reason)
        return "unreachable"


@pytest.fixture
def one_run(db) -> dict[str, str]:
    return make_runs(1, 1)


def _dispatcher(
    executor: StoreExecutor, scheduler: DatabaseScheduler | None = None, **kw: Any
) -> Dispatcher:
    """A dispatcher (worker ``w``, 30 s leases unless ``kw`` says otherwise) of
    ``scheduler`` (default: a new `DatabaseScheduler`), wired to ``executor``."""
    kw.setdefault("lease_seconds", 30)
    dispatcher = Dispatcher(scheduler or DatabaseScheduler(), executor, worker_id="w", **kw)
    executor.dispatcher = dispatcher
    return dispatcher


async def _stopped_mid_run(
    runs: dict[str, str], change: dict[str, Any], **kw: Any
) -> tuple[BlockingExecutor, Run]:
    """Start the one run of ``runs`` on a blocked execution, apply ``change`` to its row,
    and wait until the execution's supervisor ended it; the executor and the run after."""
    executor = BlockingExecutor(runs)
    dispatcher = _dispatcher(executor, **kw)
    run_id = next(iter(runs))
    async with running(dispatcher):
        await asyncio.wait_for(executor.started.wait(), BOUND)
        await Run.objects.filter(pk=run_id).aupdate(**change)
        supervisor = dispatcher.executions[run_id].supervisor
        await asyncio.wait_for(asyncio.shield(supervisor), BOUND)
    return executor, await Run.objects.aget(pk=run_id)


async def test_it_requeues_unfinished_runs_with_worker_shutdown_after_the_grace(one_run):
    executor = BlockingExecutor(one_run)
    dispatcher = _dispatcher(executor)
    async with running(dispatcher):
        await asyncio.wait_for(executor.started.wait(), BOUND)
    await asyncio.wait_for(dispatcher.drain(0.05), BOUND)
    run = await Run.objects.aget(pk=next(iter(one_run)))
    assert executor.reasons == ["shutdown"]
    assert (run.status, run.lease_owner, run.error["code"]) == (
        RunStatus.QUEUED,
        "",
        "scheduler.worker_shutdown",
    )
    assert run.error["resumable"] is True


@pytest.mark.timing
async def test_it_cancels_an_execution_whose_run_cancellation_was_requested(one_run):
    executor, run = await _stopped_mid_run(
        one_run, {"cancel_requested": True}, cancel_poll_seconds=0.05
    )
    assert executor.reasons == ["cancelled"]
    assert (run.status, run.error["code"]) == (RunStatus.CANCELLED, "run.cancelled")


@pytest.mark.timing
async def test_it_cancels_an_execution_whose_lease_was_taken_over(one_run):
    # Another worker took the run over: the renewer's conditional update matches nothing.
    taken_over = {"lease_owner": "other", "lease_token": 10**9}
    executor, run = await _stopped_mid_run(one_run, taken_over, lease_seconds=0.3)
    assert executor.reasons == ["lease_lost"]
    assert (run.status, run.lease_owner) == (RunStatus.RUNNING, "other")


class FlakyScheduler(DatabaseScheduler):
    """Fails its first claims with a given error."""

    def __init__(self, error: BaseException, failures: int) -> None:
        super().__init__()
        self.error = error
        self.failures = failures
        self.claimed = asyncio.Event()
        self.raised = asyncio.Event()

    async def claim_many(self, *args: Any, **kwargs: Any):
        if self.failures:
            self.failures -= 1
            self.raised.set()  # the dispatcher handles the error before a waiter resumes
            raise self.error
        leases = await super().claim_many(*args, **kwargs)
        if leases:
            self.claimed.set()
        return leases


async def test_it_keeps_claiming_after_transient_errors(one_run):
    from django.db import OperationalError

    executor = BlockingExecutor(one_run)
    scheduler = FlakyScheduler(OperationalError("server closed the connection"), failures=2)
    dispatcher = _dispatcher(executor, scheduler)
    async with running(dispatcher):
        await asyncio.wait_for(executor.started.wait(), BOUND)
        assert dispatcher.claim_errors == 2 and dispatcher.permanent_error is None
    await dispatcher.drain(0)


async def test_it_stops_claiming_and_reports_a_permanent_error(one_run):
    executor = BlockingExecutor(one_run)
    scheduler = FlakyScheduler(RuntimeError("schema is broken"), failures=1)
    dispatcher = _dispatcher(executor, scheduler)
    async with running(dispatcher) as loop_task:
        await asyncio.wait_for(scheduler.raised.wait(), BOUND)
        assert dispatcher.permanent_error == "RuntimeError: schema is broken"
        assert not loop_task.done()  # the worker lives on and keeps reporting
    assert not scheduler.claimed.is_set()


def test_it_classifies_claim_errors():
    from django.db import InternalError, OperationalError, ProgrammingError

    from sageproject.errors import RateLimitedError

    assert is_transient(OperationalError("gone"))
    # PostgreSQL ending a session idle in its transaction (a frozen worker) is class 25.
    assert is_transient(InternalError("terminating connection due to idle-in-transaction"))
    assert is_transient(ConnectionResetError())
    assert is_transient(RateLimitedError("scheduler.queue_full", "full"))
    assert not is_transient(ProgrammingError("no such table"))
    assert not is_transient(ValueError("bug"))


def test_the_drivers_own_connection_errors_are_transient_everywhere():
    """A statement on the raw psycopg connection (outside Django's error wrapper) fails with
    the driver's classes: the claim retries them, and the store's writes say retryable."""
    psycopg = pytest.importorskip("psycopg")
    from django.db import ProgrammingError

    from scheduling.store_writer import _translate

    lost = psycopg.OperationalError("server closed the connection unexpectedly")
    for exc in (
        lost,
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.InterfaceError("the connection is closed"),
    ):
        assert transient_database_error(exc)
        assert is_transient(exc)
    error = _translate(lost, "s1")
    assert (error.code, error.retryable, error.__cause__) == ("store.write_failed", True, lost)
    refused = _translate(ProgrammingError("no such table"), "s1")
    assert (refused.code, refused.retryable) == ("store.write_failed", False)
    assert not transient_database_error(psycopg.ProgrammingError("syntax error"))
    assert _translate(ValueError("bug"), "s1").__class__ is ValueError


def test_it_rejects_invalid_limits():
    with pytest.raises(ValueError):
        Dispatcher(DatabaseScheduler(), object(), worker_id="w", max_concurrent_runs=0)
    with pytest.raises(ValueError):
        Dispatcher(DatabaseScheduler(), object(), worker_id="w", lease_seconds=0)


async def test_it_recovers_a_dead_workers_run_at_start_up(one_run, settings):
    from scheduling.worker import Worker

    run_id = next(iter(one_run))
    await Run.objects.filter(pk=run_id).aupdate(
        status=RunStatus.RUNNING,
        lease_owner="dead",
        lease_token=1,
        attempts=1,
        lease_expires_at=timezone.now() - timezone.timedelta(seconds=1),
    )
    executor = BlockingExecutor(one_run)
    worker = Worker(executor=executor, worker_id="fresh", grace_seconds=0)
    executor.dispatcher = worker.dispatcher
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(executor.started.wait(), BOUND)
    run = await Run.objects.aget(pk=run_id)
    assert (run.status, run.lease_owner, run.attempts) == (RunStatus.RUNNING, "fresh", 2)
    assert worker.recovered == 1
    capacity = worker.capacity()
    assert capacity["runs"]["active"] == 1
    assert set(capacity["runs"]) >= {"per_user", "per_queue", "max_per_user"}
    assert capacity["scheduler"]["backend"] == "database"
    worker.request_stop()
    await asyncio.wait_for(task, BOUND)


async def test_an_idle_worker_claims_a_run_when_its_wake_up_arrives(db, monkeypatch):
    """An idle worker's claim loop waits for a wake-up: with its fallback poll an hour away,
    a run admitted with a wake-up starts at once — the listener's message reaches the
    dispatcher through the worker."""
    from django.db import transaction

    from scheduling import dispatcher as dispatcher_module
    from scheduling import wakeups
    from scheduling import worker as worker_module

    monkeypatch.setattr(dispatcher_module, "IDLE_START", 3600.0)
    monkeypatch.setattr(worker_module, "PUSH_IDLE_MAX", 3600.0)
    known: dict[str, str] = {}
    executor = BlockingExecutor(known)
    worker = worker_module.Worker(executor=executor, worker_id="pushed", grace_seconds=0)
    executor.dispatcher = worker.dispatcher
    task = asyncio.create_task(worker.run())
    try:
        # Idle: its first claim found nothing and the claim loop waits (the poll is far off).
        await awaited_until(
            lambda: worker.scheduler._ledger.waiters, within=BOUND, message="the worker idle"
        )

        def admit() -> dict[str, str]:
            with transaction.atomic():
                made = make_runs(1, 1)
                wakeups.notify("run")
            return made

        known.update(await db_call(admit))
        await asyncio.wait_for(executor.started.wait(), BOUND)
        assert worker.wakeups.snapshot()["received"] >= 1
        run = await Run.objects.aget(pk=next(iter(known)))
        assert (run.status, run.lease_owner) == (RunStatus.RUNNING, "pushed")
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, BOUND)


async def test_it_fails_a_run_out_of_attempts_at_start_up(db, alice, make_session):
    from agents.models import ManagedAgentRecord
    from scheduling.worker import Worker

    session = await db_call(make_session, alice)
    run = await Run.objects.acreate(
        session=session,
        owner=alice,
        status=RunStatus.RUNNING,
        lease_owner="dead",
        lease_token=1,
        attempts=9,
        crashes=2,
        lease_expires_at=timezone.now() - timezone.timedelta(seconds=1),
    )
    executor = BlockingExecutor({})
    worker = Worker(executor=executor, worker_id="fresh", grace_seconds=0)
    executor.dispatcher = worker.dispatcher
    worker.request_stop()  # recovery still runs first; then the worker stops at once
    await asyncio.wait_for(worker.run(), BOUND)
    assert worker.recovered == 1
    run = await Run.objects.aget(pk=run.pk)
    assert (run.status, run.error["code"]) == (RunStatus.FAILED, "execution.worker_restarted")
    record = await ManagedAgentRecord.objects.aget(run_id=run.pk)
    assert record.status == RunStatus.FAILED
    # Its end is an event too, so a stream client learns it.
    event = await Event.objects.aget(run_id=run.pk)
    assert (event.type, event.payload["error"]["code"]) == (
        "run.failed",
        "execution.worker_restarted",
    )


async def test_a_worker_whose_claiming_failed_permanently_stops_and_says_so(one_run):
    from scheduling.worker import Worker

    executor = BlockingExecutor(one_run)
    worker = Worker(executor=executor, worker_id="broken", grace_seconds=0)
    executor.dispatcher = worker.dispatcher
    scheduler = FlakyScheduler(RuntimeError("schema is broken"), failures=1)
    worker.scheduler = worker.dispatcher.scheduler = scheduler
    # It exits on its own (a supervisor restarts it) instead of idling as a silent worker.
    await asyncio.wait_for(worker.run(), BOUND)
    assert worker.failed == "RuntimeError: schema is broken"
    snapshot = await WorkerSnapshot.objects.aget(worker_id="broken")
    assert snapshot.stopped_at is not None
    assert snapshot.capacity["scheduler"]["permanent_error"] == worker.failed
