"""Quotas hold while many runs execute: sampled from the database, across two dispatchers.

200 runs of 10 users go through two dispatchers (two "workers", 8 slots each) that share
only the database: the global limit of 8 and the per-user limit of 2 are counted there, so
they must hold across both. A sampler queries the running root runs over and over; the
first executions wait until the sampler has seen the limit reached, so the test proves the
limits are both reached and never exceeded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.db.models import Count

from sageproject.db import db_call
from scheduling.models import Run, RunStatus
from scheduling.runs import Fence, Outcome
from scheduling.scheduler import SchedulerQuotaGroup
from scheduling.store import append_events, close_default_coordinator
from scheduling.worker import DatabaseScheduler, Dispatcher, StopSignal
from tests.hosts.test_sharing import publish_snapshots
from tests.scheduling.test_dispatcher import FakeExecutor, make_runs, seqs_by_session

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

BOUND = 120.0
GLOBAL, PER_USER = 8, 2


def running_per_user() -> dict[int, int]:
    return dict(
        Run.objects.filter(status=RunStatus.RUNNING, parent__isnull=True)
        .values_list("owner_id")
        .annotate(n=Count("pk"))
        .order_by()
    )


class SharedExecutor(FakeExecutor):
    """Executes for several dispatchers (found by the fence's lease owner)."""

    def __init__(self, runs: dict[str, str], seen_full: asyncio.Event) -> None:
        super().__init__(runs)
        self.seen_full = seen_full
        self.dispatchers: dict[str, Dispatcher] = {}

    async def execute(self, run_id: Any, fence: Fence, stop: StopSignal, **_: Any) -> Outcome:
        run_key = str(run_id)
        session_id = self.runs[run_key]
        try:
            # Hold the first wave until the sampler saw the limit reached.
            await asyncio.wait_for(self.seen_full.wait(), BOUND)
            for i in range(2):
                await append_events(
                    session_id=session_id, run_id=run_key, events=[("note", {"i": i})], fence=fence
                )
            return Outcome(status=RunStatus.COMPLETED, session_id=session_id, result={"n": 2})
        finally:
            self._finished_one()


@pytest.fixture
def runs_10x20(db) -> dict[str, str]:
    return make_runs(10, 20)


WORKERS = ("worker-a", "worker-b")


async def test_it_never_exceeds_the_limits_while_200_runs_of_10_users_execute(runs_10x20):
    seen_full = asyncio.Event()
    executor = SharedExecutor(runs_10x20, seen_full)
    dispatchers = []
    # Both workers' heartbeats, as running workers publish them: each then claims its
    # share of the global limit (`fair_share`), so neither can take every freed slot.
    await db_call(publish_snapshots, list(WORKERS), GLOBAL)
    for name in WORKERS:
        scheduler = DatabaseScheduler(quota_group=SchedulerQuotaGroup(GLOBAL, PER_USER, 1024))
        dispatcher = Dispatcher(
            scheduler,
            executor,
            worker_id=name,
            max_concurrent_runs=GLOBAL,
            max_concurrent_runs_per_user=PER_USER,
            lease_seconds=30,
        )
        executor.dispatchers[name] = dispatcher
        dispatchers.append(dispatcher)
    samples: list[dict[int, int]] = []

    async def sample() -> None:
        while not executor.all_done.is_set():
            counts = await db_call(running_per_user)
            samples.append(counts)
            if sum(counts.values()) == GLOBAL:
                seen_full.set()

    stopping = asyncio.Event()
    sampler = asyncio.create_task(sample())
    loops = [asyncio.create_task(d.run(stopping)) for d in dispatchers]
    try:
        await asyncio.wait_for(executor.all_done.wait(), BOUND)
    finally:
        stopping.set()
        await asyncio.wait_for(asyncio.gather(*loops, sampler), BOUND)
        for dispatcher in dispatchers:
            await dispatcher.drain(5.0)
            await dispatcher.scheduler.close()
        await close_default_coordinator()

    assert seen_full.is_set()
    assert max(sum(s.values()) for s in samples) == GLOBAL
    assert max(max(s.values(), default=0) for s in samples) == PER_USER
    assert sum(d.completed for d in dispatchers) == 200
    assert all(d.completed > 0 for d in dispatchers)
    statuses = await db_call(
        lambda: set(Run.objects.filter(pk__in=list(runs_10x20)).values_list("status", flat=True))
    )
    assert statuses == {RunStatus.COMPLETED}
    seqs = await db_call(seqs_by_session, list(runs_10x20.values()))
    assert all(s == [1, 2, 3] for s in seqs.values())  # two notes and run.completed
