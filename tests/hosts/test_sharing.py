"""Several workers on one database, in one process: what they share and whose clock counts.

- The global limit is dealt out among the live workers (`scheduling.worker.fair_share`): two
  dispatchers that could each fill it alone execute about as many runs each, and neither
  ever holds more than its share — where, without the rule, the one whose slots free first
  takes every freed run.
- Lease and heartbeat times are the database's: a worker whose own clock is an hour ahead
  keeps a lease whose renewal failed once (it counts the lease on its monotonic clock), and
  publishes its heartbeat in the database's time.
- A Celery job whose worker stops reporting is failed (``job.worker_lost``) by any other
  process's sweep, its slot given back; the lost worker's late writes are refused, and a
  waiter is answered.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError
from django.utils import timezone

from sageproject.db import db_call
from scheduling import dispatcher as dispatcher_module
from scheduling import worker as worker_module
from scheduling.models import Run, RunStatus, WorkerSnapshot
from scheduling.runs import Fence, Outcome, db_now
from scheduling.scheduler import SchedulerQuotaGroup
from scheduling.store import append_events, close_default_coordinator
from scheduling.worker import (
    DatabaseScheduler,
    Dispatcher,
    StopSignal,
    Worker,
    fair_share,
    live_worker_slots,
)
from tests.scheduling.test_dispatcher import FakeExecutor, make_runs

BOUND = 60.0


# ------------------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("limit", "slots", "expected"),
    [
        (8, {"a": 8, "b": 8}, {"a": 4, "b": 4}),
        (64, {"a": 16, "b": 16, "c": 16, "d": 16}, {"a": 16, "b": 16, "c": 16, "d": 16}),
        (10, {"a": 16, "b": 16, "c": 16, "d": 16}, {"a": 3, "b": 3, "c": 2, "d": 2}),
        # A worker with few slots leaves the rest of its part to the others.
        (12, {"a": 2, "b": 16, "c": 16}, {"a": 2, "b": 5, "c": 5}),
        # More workers than the limit: each may still take one (the database says no).
        (2, {"a": 4, "b": 4, "c": 4}, {"a": 1, "b": 1, "c": 1}),
        (8, {"a": 8}, {"a": 8}),
    ],
)
def test_fair_share_deals_the_global_limit_out(limit, slots, expected):
    assert {w: fair_share(limit, slots, w) for w in slots} == expected


# ------------------------------------------------------------------------------ two workers

GLOBAL, RUNS_PER_USER, USERS = 2, 4, 6


class TimedExecutor(FakeExecutor):
    """Each execution holds its slot a moment, commits one fenced event and completes;
    records the most executions each dispatcher held at once."""

    def __init__(self, runs: dict[str, str], hold: float = 0.1) -> None:
        super().__init__(runs)
        self.hold = hold
        self.dispatchers: dict[str, Dispatcher] = {}
        self.peak: dict[str, int] = {}

    async def execute(self, run_id: Any, fence: Fence, stop: StopSignal, **_: Any) -> Outcome:
        owner = fence.lease_owner
        if owner in self.dispatchers:
            held = len(self.dispatchers[owner].executions)
            self.peak[owner] = max(self.peak.get(owner, 0), held)
        run_key = str(run_id)
        try:
            await asyncio.sleep(self.hold)
            await append_events(
                session_id=self.runs[run_key], run_id=run_key, events=[("note", {})], fence=fence
            )
            return Outcome(status=RunStatus.COMPLETED, session_id=self.runs[run_key])
        finally:
            self._finished_one()


def publish_snapshots(names: list[str], slots: int) -> None:
    """Live snapshots (now, by the database's clock) of ``names``; and two that must not
    count: a stopped worker and one whose heartbeat is a minute old."""
    now = db_now()
    for name in names:
        WorkerSnapshot.objects.create(
            worker_id=name,
            host="here",
            pid=1,
            started_at=now,
            heartbeat_at=now,
            capacity={"runs": {"max_concurrent": slots}},
        )
    WorkerSnapshot.objects.create(
        worker_id="stopped", host="here", pid=2, started_at=now, heartbeat_at=now,
        stopped_at=now, capacity={"runs": {"max_concurrent": slots}},
    )  # fmt: skip
    WorkerSnapshot.objects.create(
        worker_id="silent", host="here", pid=3, started_at=now,
        heartbeat_at=now - timedelta(minutes=1), capacity={"runs": {"max_concurrent": slots}},
    )  # fmt: skip


async def run_dispatchers(executor: Any, dispatchers: list[Dispatcher]) -> None:
    """Run the ``dispatchers`` (sharing ``executor``) until every run of it finished; then
    drain and close them."""
    for dispatcher in dispatchers:
        executor.dispatchers[dispatcher.worker_id] = dispatcher
    stopping = asyncio.Event()
    loops = [asyncio.create_task(d.run(stopping)) for d in dispatchers]
    try:
        await asyncio.wait_for(executor.all_done.wait(), BOUND)
    finally:
        stopping.set()
        await asyncio.wait_for(asyncio.gather(*loops), BOUND)
        for dispatcher in dispatchers:
            await dispatcher.drain(BOUND)
            await dispatcher.scheduler.close()
        await close_default_coordinator()


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_two_workers_share_a_global_limit_that_either_could_fill():
    runs = await db_call(make_runs, USERS, RUNS_PER_USER)
    names = ["worker-a", "worker-b"]
    await db_call(publish_snapshots, names, GLOBAL)
    assert await db_call(live_worker_slots) == {name: GLOBAL for name in names}
    executor = TimedExecutor(runs)
    dispatchers = [
        Dispatcher(
            DatabaseScheduler(quota_group=SchedulerQuotaGroup(GLOBAL, GLOBAL, 1024)),
            executor,
            worker_id=name,
            max_concurrent_runs=GLOBAL,
            max_concurrent_runs_per_user=GLOBAL,
            lease_seconds=30,
        )
        for name in names
    ]
    await run_dispatchers(executor, dispatchers)

    total = USERS * RUNS_PER_USER
    completed = {d.worker_id: d.completed for d in dispatchers}
    assert sum(completed.values()) == total
    # Each held at most its share (1 of the 2), so each executed about half the runs.
    assert [d.share for d in dispatchers] == [1, 1]
    assert executor.peak == {"worker-a": 1, "worker-b": 1}, executor.peak
    assert min(completed.values()) >= total // 3, completed
    statuses = await db_call(
        lambda: set(Run.objects.filter(pk__in=list(runs)).values_list("status", flat=True))
    )
    assert statuses == {RunStatus.COMPLETED}


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_a_burst_that_wakes_every_worker_is_spread_over_them():
    # Six runs, two idle workers with eight slots each and no global limit in the way:
    # whichever claims first could take all six; it takes its part (three), the other the
    # rest.
    runs = await db_call(make_runs, 6, 1)
    names = ["worker-a", "worker-b"]
    await db_call(publish_snapshots, names, 8)
    executor = TimedExecutor(runs)
    dispatchers = [
        Dispatcher(DatabaseScheduler(), executor, worker_id=name, lease_seconds=30)
        for name in names
    ]
    await run_dispatchers(executor, dispatchers)
    completed = sorted(d.completed for d in dispatchers)
    assert sum(completed) == 6
    assert completed[0] >= 2, completed


# ------------------------------------------------------------------------------ settings


def test_the_several_hosts_settings_are_checked_each_with_its_own_id():
    from sageproject import config

    defaults = config.load({})
    assert (defaults["SAGE_WORKER_CONCURRENT_RUNS"], defaults["SAGE_JOB_LOST_SECONDS"]) == (
        None,
        30,
    )
    loaded = config.load({"SAGE_WORKER_CONCURRENT_RUNS": "0", "SAGE_JOB_LOST_SECONDS": "2"})
    assert [p.check_id for p in loaded.errors] == ["sageproject.E017", "sageproject.E018"]
    # Network timeouts on every PostgreSQL connection; the URL's query overrides them.
    pg = config.parse_database_url("postgres://u@db:5432/sage?tcp_user_timeout=20000", base_dir="/")
    assert pg["OPTIONS"]["tcp_user_timeout"] == "20000"
    assert (pg["OPTIONS"]["connect_timeout"], pg["OPTIONS"]["keepalives_idle"]) == (5, 10)


@pytest.mark.django_db
def test_a_worker_has_its_own_slots_under_the_limit_of_all_workers(settings):
    settings.SAGE = {
        **settings.SAGE,
        "SAGE_SERVER_MAX_CONCURRENT_RUNS": 12,
        "SAGE_WORKER_CONCURRENT_RUNS": 4,
    }
    worker = Worker(executor=IdleExecutor())
    assert (worker.max_concurrent, worker.max_active) == (4, 12)
    assert worker.dispatcher.max_concurrent_runs == 4
    assert worker.quota.max_active == 12
    assert Worker(executor=IdleExecutor(), max_concurrent=2).max_concurrent == 2
    capacity = worker.capacity()["runs"]
    assert (capacity["max_concurrent"], capacity["max_active"], capacity["share"]) == (4, 12, 4)


# ------------------------------------------------------------------------------ clocks


class SkewedClock:
    """``django.utils.timezone`` as a host whose clock is ``skew`` ahead sees it."""

    def __init__(self, skew: timedelta) -> None:
        self.skew = skew

    def now(self):
        return timezone.now() + self.skew

    def __getattr__(self, name: str) -> Any:
        return getattr(timezone, name)


class FlakyRenewals(DatabaseScheduler):
    """The first renewal fails as a dropped connection would; the rest go through."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.renewals = 0

    async def renew(self, lease: Any, *, lease_duration: Any) -> Any:
        self.renewals += 1
        if self.renewals == 1:
            raise OperationalError("connection lost")
        return await super().renew(lease, lease_duration=lease_duration)


@pytest.mark.django_db(transaction=True)
async def test_a_worker_whose_clock_runs_ahead_keeps_a_lease_whose_renewal_failed_once(
    monkeypatch,
):
    # With the host's clock an hour ahead, comparing it with the database's lease expiry
    # would call the lease lost at the first failed renewal.
    monkeypatch.setattr(dispatcher_module, "timezone", SkewedClock(timedelta(hours=1)))
    runs = await db_call(make_runs, 1, 1)
    scheduler = FlakyRenewals()
    executor = TimedExecutor(runs, hold=2.5)  # across two renewals
    dispatcher = Dispatcher(scheduler, executor, worker_id="ahead", lease_seconds=3)
    stopping = asyncio.Event()
    loop = asyncio.create_task(dispatcher.run(stopping))
    try:
        await asyncio.wait_for(executor.all_done.wait(), BOUND)
    finally:
        stopping.set()
        await asyncio.wait_for(loop, BOUND)
        await dispatcher.drain(BOUND)  # its outcome is committed
        await scheduler.close()
        await close_default_coordinator()
    assert scheduler.renewals >= 2
    assert (dispatcher.completed, dispatcher.leases_lost) == (1, 0)
    run = await db_call(Run.objects.get, pk=next(iter(runs)))
    assert (run.status, run.attempts, run.crashes) == (RunStatus.COMPLETED, 1, 0)


class IdleExecutor(FakeExecutor):
    def __init__(self) -> None:
        super().__init__({})


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_the_heartbeat_is_the_database_time_whatever_the_host_clock(monkeypatch):
    monkeypatch.setattr(worker_module, "timezone", SkewedClock(timedelta(hours=-1)))
    worker = Worker(executor=IdleExecutor(), worker_id=f"behind-{uuid.uuid4().hex[:6]}")
    await worker._publish()
    snapshot = await db_call(WorkerSnapshot.objects.get, worker_id=worker.worker_id)
    now = await db_call(db_now)
    assert abs((now - snapshot.heartbeat_at).total_seconds()) < 30
    assert worker.worker_id in await db_call(live_worker_slots)
    await worker._publish(stopped=True)
    assert worker.worker_id not in await db_call(live_worker_slots)


# ------------------------------------------------------------------------------ lost jobs


@pytest.fixture
async def job_prefix():
    from tests.agents.conftest_jobs import delete_keys, require_redis

    require_redis()
    prefix = f"sagetest:lost:{uuid.uuid4().hex[:10]}"
    yield prefix
    delete_keys(f"{prefix}:*")


async def admitted_job(runtime: Any) -> str:
    """A ``sleep`` job admitted by ``runtime`` (its message goes to a queue no worker
    consumes: the test plays the worker)."""
    from agents.jobs import JobSpec

    handle = await runtime.submit(JobSpec(owner_run_id="run-lost", kind="sleep"))
    return handle.job_id


@pytest.mark.redis
async def test_a_job_whose_worker_stops_reporting_is_failed_and_gives_its_slot_back(job_prefix):
    from agents.jobs import JobState
    from tests.agents.conftest_jobs import celery_app, celery_runtime, delete_keys

    queue = f"nobody-{uuid.uuid4().hex[:8]}"
    runtime = celery_runtime(
        job_prefix, celery_app=celery_app(), queue=queue, kinds={"sleep"}, max_concurrent_jobs=1,
    )  # fmt: skip
    store = runtime.store
    try:
        lost, second = await admitted_job(runtime), await admitted_job(runtime)
        assert await store.start(lost, worker="gone@host-c1", lost_seconds=1) == "started"
        assert (await store.row(lost))[b"worker"] == b"gone@host-c1"
        # One slot in all: the second job waits for it.
        assert await store.start(second, worker="alive@host-c2", lost_seconds=30) == "busy"

        # The first job's worker never reports again; a waiter is answered once it is found
        # lost, and its slot is free for the second job.
        async with asyncio.timeout(20):
            done = await runtime.wait(lost)
        assert done.state is JobState.FAILED
        assert (done.error["code"], done.error["retryable"]) == ("job.worker_lost", True)
        assert await store.start(second, worker="alive@host-c2", lost_seconds=30) == "started"
        # The lost worker, back, is refused: no more output, no other end, no reports.
        assert await store.emit(lost, "stdout", b"late") == -1
        assert await store.finish(lost, JobState.COMPLETED) is False
        assert await store.beat(lost, 1) is False
        assert (await runtime.inspect(lost)).state is JobState.FAILED
        # A job whose worker keeps reporting is left running by the sweeps.
        for _ in range(3):
            assert await store.beat(second, 30) is True
            await store.sweep(runtime.limits)
        assert (await runtime.inspect(second)).state is JobState.RUNNING
        counters = await store.counters()
        assert (counters["running"], counters["admitted"]) == (1, 1)
        assert await store.finish(second, JobState.COMPLETED) is True
    finally:
        await runtime.close()
        # The queue nobody consumed, with its two messages, and kombu's bindings of it.
        for pattern in (queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"):
            delete_keys(pattern)


# ------------------------------------------------------------------------------ simulated hosts


def test_simulated_hosts_are_skipped_with_the_reason_where_namespaces_cannot_be_made(
    monkeypatch,
):
    from tests.hosts import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(netns, "CI", False)
    with pytest.raises(pytest.skip.Exception, match="network namespaces need root"):
        netns.require_namespaces()
    monkeypatch.setattr(netns, "CI", True)
    with pytest.raises(pytest.fail.Exception, match="required under CI=true"):
        netns.require_namespaces()
