"""DatabaseScheduler: the shared contract on Run rows, plus database-only behaviour.

Run it once per database (``DATABASE_URL`` selects SQLite, PostgreSQL or MySQL). The work
items of the contract refer to real Run rows: ``make_work`` creates one per work id (in
the ``suspended`` state, so that ``submit`` is what queues it) for a user named after the
item's tenant.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import close_old_connections, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents.models import ManagedAgentRecord
from sageproject.db import db_call
from scheduling import runs
from scheduling.models import Event, FenceSequence, Run, RunQueue, RunStatus, Session
from scheduling.runs import Fence
from scheduling.scheduler import (
    FenceRejected,
    LeaseReleaseReason,
    SchedulerClaimPolicy,
    SchedulerQuotaGroup,
    WorkItem,
)
from scheduling.worker import REAP_SECONDS, DatabaseScheduler, lease_fence
from tests.scheduling.scheduler_contract import (
    LEASE,
    SchedulerContract,
    claim_storm,
    make_scheduler_fixture,
    within,
)

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

NAMESPACE = uuid.UUID("5b0c3a52-8d8a-4d3e-9a55-7d1f0c0de001")


class Rows:
    """Creates users, sessions and runs for work items, one run per work id."""

    def __init__(self) -> None:
        self.users: dict[str, Any] = {}
        self.sessions: dict[str, Session] = {}
        self.runs: dict[str, str] = {}
        self.base = timezone.now()
        self.count = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rows")

    def user(self, name: str) -> Any:
        if name not in self.users:
            self.users[name] = get_user_model().objects.create_user(username=name)
            self.sessions[name] = Session.objects.create(
                owner=self.users[name], package_ref="ref", package_name="pkg", agent_id="a"
            )
        return self.users[name]

    def run(self, key: str, tenant: str, **fields: Any) -> str:
        """The id of the run row for ``key`` (created on first use, in a helper thread).

        The contract calls ``make_work`` synchronously from async tests; the thread keeps
        the ORM off the event loop and gives its connection back after each call.
        """
        if key not in self.runs:
            self._pool.submit(self._create, key, tenant, fields).result()
        return self.runs[key]

    def leased(
        self, key: str, tenant: str, *, owner: str, token: int, expires_at: datetime, **fields: Any
    ) -> str:
        """The id of a running run row under ``owner``'s lease ``token`` (see `run`)."""
        return self.run(
            key,
            tenant,
            status=RunStatus.RUNNING,
            lease_owner=owner,
            lease_token=token,
            lease_expires_at=expires_at,
            **fields,
        )

    def _create(self, key: str, tenant: str, fields: dict[str, Any]) -> None:
        try:
            self._create_rows(key, tenant, fields)
        finally:
            close_old_connections()

    def _create_rows(self, key: str, tenant: str, fields: dict[str, Any]) -> None:
        if key not in self.runs:
            owner = self.user(tenant)
            self.count += 1
            run = Run.objects.create(
                id=uuid.uuid5(NAMESPACE, key),
                session=self.sessions[tenant],
                owner=owner,
                status=fields.pop("status", RunStatus.SUSPENDED),
                # Strictly increasing: submit order is creation order in these tests.
                created_at=self.base + timedelta(microseconds=self.count),
                **fields,
            )
            self.runs[key] = str(run.pk)


@pytest.fixture
def rows() -> Iterator[Rows]:
    made = Rows()
    yield made
    made._pool.shutdown()


def work_maker(rows: Rows) -> Callable[..., WorkItem]:
    def make(work_id: str, **fields: Any) -> WorkItem:
        tenant = fields.setdefault("tenant_id", "alice")
        run_key = fields.pop("run_id", f"run-{work_id}")
        fields.setdefault("idempotency_key", f"key-{work_id}")
        fields.setdefault("available_at", datetime(2000, 1, 1, tzinfo=UTC))
        run_id = rows.run(run_key, tenant)
        return WorkItem(work_id=work_id, run_id=run_id, **fields)

    return make


make_scheduler = make_scheduler_fixture(DatabaseScheduler)


ONE_ROW_PER_RUN = "a Run row is one work item: two items of one run cannot be queued"
DURABLE = "rows outlive a closed scheduler: its leases return to the queue and stay pending"


class TestDatabaseScheduler(SchedulerContract):
    capabilities = {
        "durable_across_process_restart": True,
        "supports_distributed_claims": True,
        "supports_atomic_tenant_quota": True,
    }

    @pytest.fixture
    def make_work(self, rows: Rows) -> Callable[..., WorkItem]:
        return work_maker(rows)

    @pytest.mark.skip(reason=ONE_ROW_PER_RUN)
    async def test_it_allows_one_live_lease_per_run(self):
        pass

    @pytest.mark.skip(reason=ONE_ROW_PER_RUN)
    async def test_it_skips_a_run_with_a_live_lease_without_blocking_the_tenant(self):
        pass

    @pytest.mark.skip(reason=DURABLE)
    async def test_it_returns_the_capacity_of_a_closed_member(self):
        pass

    # The contract's storms also expect the limits to be *reached* while each lease is
    # held for three loop turns; a database claim takes longer than that, so here they
    # prove the half that matters for the database: the limits are never exceeded.

    async def test_it_never_exceeds_the_tenant_limit_under_a_claim_storm(
        self, make_scheduler, make_work
    ):
        scheduler = make_scheduler()
        policy = SchedulerClaimPolicy(max_active_per_tenant=2)
        _total, peak = await claim_storm(
            [scheduler], make_work, total=30, workers=12, policy=policy, bound=30
        )
        assert max(peak.values()) <= 2

    async def test_it_never_exceeds_group_quotas_under_a_claim_storm(
        self, make_scheduler, make_work
    ):
        group = SchedulerQuotaGroup(4, 2, 1000)
        members = [make_scheduler(quota_group=group) for _ in range(2)]
        peak_total, peak = await claim_storm(members, make_work, total=60, workers=16, bound=30)
        assert peak_total <= 4 and max(peak.values()) <= 2


# ---------------------------------------------------------------------- database only


async def _claim(scheduler: DatabaseScheduler, worker: str = "w", **kw: Any):
    return await scheduler.claim(worker, lease_duration=LEASE, wait_timeout=0, **kw)


def _record_claims(monkeypatch: pytest.MonkeyPatch, keyword: str) -> list[Any]:
    """The list into which every ``runs.claim`` call, until the test ends, puts the value of
    its ``keyword`` argument (the call still claims)."""
    recorded: list[Any] = []
    claim = runs.claim

    def recording(**kwargs: Any) -> Any:
        recorded.append(kwargs[keyword])
        return claim(**kwargs)

    monkeypatch.setattr(runs, "claim", recording)
    return recorded


def test_it_is_reexported_lazily_by_the_scheduler_module():
    from scheduling import scheduler

    assert scheduler.DatabaseScheduler is DatabaseScheduler


async def test_it_claims_a_run_the_api_queued_without_a_submit(rows: Rows):
    run_id = rows.run("api", "alice", status=RunStatus.QUEUED, priority=3)
    scheduler = DatabaseScheduler()
    lease = await _claim(scheduler)
    assert lease.run_id == run_id
    assert lease.work.work_id == run_id and lease.work.priority == 3
    run = await Run.objects.aget(pk=run_id)
    assert (run.status, run.lease_owner, run.lease_token, run.attempts) == (
        RunStatus.RUNNING,
        "w",
        lease.fencing_token,
        1,
    )
    assert run.started_at is not None


async def test_it_draws_tokens_from_the_fence_sequence_row(rows: Rows):
    rows.run("a", "alice", status=RunStatus.QUEUED)
    rows.run("b", "bob", status=RunStatus.QUEUED)
    scheduler = DatabaseScheduler()
    first = await _claim(scheduler)
    second = await _claim(scheduler)
    assert second.fencing_token == first.fencing_token + 1
    assert (await FenceSequence.objects.aget(pk=1)).value == second.fencing_token


async def test_only_the_claim_after_a_run_wake_up_skips_the_look_for_work(monkeypatch):
    """Idle polls look for work before taking the claim lock (a worker frozen inside the
    claim transaction would stall every other worker's claims); a ``run`` wake-up sends the
    next claim, and only that one, straight to its transaction."""
    looked = _record_claims(monkeypatch, "look_first")
    scheduler = DatabaseScheduler()
    await scheduler.claim_many("w", lease_duration=LEASE, limit=4)
    scheduler.notify(pushed=True)
    await scheduler.claim_many("w", lease_duration=LEASE, limit=4)
    scheduler.notify()
    await scheduler.claim_many("w", lease_duration=LEASE, limit=4)
    assert looked == [True, False, True]


async def test_a_claim_after_a_run_wake_up_leaves_the_look_for_dead_leases_to_the_next(
    monkeypatch,
):
    """The run a wake-up announced does not wait for the periodic look for dead leases (nor
    the live workers' read): the claim after it takes it — unless it is a period overdue."""
    reaping = _record_claims(monkeypatch, "reap")
    scheduler = DatabaseScheduler()
    await scheduler.claim_many("w", lease_duration=LEASE, limit=4)  # the first one reaps
    scheduler._next_reap = time.monotonic() - 0.5  # due half a period ago
    scheduler.notify(pushed=True)
    await scheduler.claim_many("w", lease_duration=LEASE, limit=4)
    await scheduler.claim_many("w", lease_duration=LEASE, limit=4)
    scheduler._next_reap = time.monotonic() - 1.5 * REAP_SECONDS  # overdue
    scheduler.notify(pushed=True)
    await scheduler.claim_many("w", lease_duration=LEASE, limit=4)
    assert reaping == [True, False, True, True]


def test_a_claim_that_looks_first_takes_no_lock_when_nothing_is_queued():
    with CaptureQueriesContext(connection) as idle:
        assert runs.claim(worker_id="w", duration=LEASE, reap=False) == ([], [])
    assert len(idle) == 1  # the look, outside any transaction
    with CaptureQueriesContext(connection) as pushed:
        assert runs.claim(worker_id="w", duration=LEASE, reap=False, look_first=False) == ([], [])
    assert any(q["sql"].startswith("BEGIN") for q in pushed)  # the claim transaction ran


def test_a_claim_looks_for_work_and_for_dead_leases_in_one_statement(rows: Rows):
    queued = rows.run("q", "alice", status=RunStatus.QUEUED)
    dead = rows.leased("d", "bob", owner="gone", token=1, expires_at=timezone.now() - LEASE)
    with CaptureQueriesContext(connection) as captured:
        grants, reaped = runs.claim(worker_id="w", duration=LEASE, reap=True)
    # Work and a dead lease, found by one look before the claim's transaction (there were
    # two: any work at all, then dead leases).
    looks = []
    for query in captured:
        if query["sql"].startswith("BEGIN"):
            break
        if "scheduling_run" in query["sql"]:
            looks.append(query["sql"])
    assert len(looks) == 1, looks
    assert reaped == [dead] and [str(g.row["pk"]) for g in grants] == [queued]


async def test_it_counts_the_quota_from_running_root_runs_in_the_database(rows: Rows):
    # Another worker's running runs count: alice already has two.
    for key in ("x1", "x2"):
        rows.leased(key, "alice", owner="other", token=1, expires_at=timezone.now() + LEASE)
    rows.run("a3", "alice", status=RunStatus.QUEUED)
    rows.run("b1", "bob", status=RunStatus.QUEUED)
    scheduler = DatabaseScheduler(quota_group=SchedulerQuotaGroup(8, 2, 100))
    lease = await _claim(scheduler)
    assert lease.run_id == rows.runs["b1"]
    assert await _claim(scheduler) is None


async def test_it_does_not_count_child_runs_against_the_quota(rows: Rows):
    parent = rows.leased("p", "alice", owner="w", token=1, expires_at=timezone.now() + LEASE)
    child = rows.run("c", "alice", status=RunStatus.QUEUED, parent_id=parent)
    scheduler = DatabaseScheduler(quota_group=SchedulerQuotaGroup(1, 1, 100))
    lease = await _claim(scheduler)
    assert lease.run_id == child


async def test_it_shares_one_quota_across_the_chat_and_managed_queues(rows: Rows):
    rows.run("c1", "alice", status=RunStatus.QUEUED, queue=RunQueue.CHAT)
    rows.run("m1", "alice", status=RunStatus.QUEUED, queue=RunQueue.MANAGED)
    rows.run("m2", "bob", status=RunStatus.QUEUED, queue=RunQueue.MANAGED)
    group = SchedulerQuotaGroup(8, 1, 100)
    chat = DatabaseScheduler(queue=RunQueue.CHAT, quota_group=group)
    managed = DatabaseScheduler(queue=RunQueue.MANAGED, quota_group=group)
    assert (await _claim(chat)).run_id == rows.runs["c1"]
    assert (await _claim(managed)).run_id == rows.runs["m2"]
    assert await _claim(managed) is None


async def test_it_finds_a_tenant_behind_another_tenants_many_rows(rows: Rows):
    for i in range(300):
        rows.run(f"a{i}", "alice", status=RunStatus.QUEUED, priority=50)
    rows.run("b0", "bob", status=RunStatus.QUEUED, priority=-50)
    scheduler = DatabaseScheduler(quota_group=SchedulerQuotaGroup(8, 1, 1000))
    first = await _claim(scheduler)
    second = await _claim(scheduler)
    assert first.run_id == rows.runs["a0"]
    assert second.run_id == rows.runs["b0"]


async def test_it_ends_a_queued_run_whose_cancellation_was_requested(rows: Rows):
    # Such a row (written by an older version) was skipped by claims and stayed queued for
    # ever, counting against the pending limits; now the claim's reaping ends it.
    run_id = rows.run("a", "alice", status=RunStatus.QUEUED, cancel_requested=True)
    assert await _claim(DatabaseScheduler()) is None
    run = await Run.objects.aget(pk=run_id)
    assert (run.status, run.error["code"]) == (RunStatus.CANCELLED, "run.cancelled")
    assert [e.type async for e in Event.objects.filter(run_id=run_id)] == ["run.cancelled"]


async def test_it_fails_runs_whose_crash_budget_is_used_up_with_event_and_archive(rows: Rows):
    dead = timezone.now() - timedelta(seconds=1)
    # Many claims (suspensions, graceful restarts) but two crashes so far: the third ends it.
    rows.leased("a", "alice", owner="dead", token=1, expires_at=dead, attempts=7, crashes=2)
    # Seven claims, no crash yet: requeued.
    rows.leased("b", "bob", owner="dead", token=2, expires_at=dead, attempts=7, crashes=0)
    scheduler = DatabaseScheduler(max_attempts=3)
    assert await scheduler.reap_expired() == 2
    a = await Run.objects.aget(pk=rows.runs["a"])
    b = await Run.objects.aget(pk=rows.runs["b"])
    assert (a.status, a.error["code"], a.crashes) == (
        RunStatus.FAILED,
        "execution.worker_restarted",
        3,
    )
    events = [e async for e in Event.objects.filter(run_id=a.pk)]
    assert [e.type for e in events] == ["run.failed"]
    assert events[0].payload["error"]["code"] == "execution.worker_restarted"
    assert await ManagedAgentRecord.objects.filter(run_id=a.pk, status="failed").aexists()
    assert (b.status, b.lease_owner, b.lease_token, b.crashes) == (RunStatus.QUEUED, "", None, 1)


async def test_it_finishes_a_dead_run_whose_cancel_was_requested(rows: Rows):
    run_id = rows.leased(
        "a",
        "alice",
        owner="dead",
        token=1,
        expires_at=timezone.now() - timedelta(seconds=1),
        cancel_requested=True,
        stop_request="cancel",
    )
    assert await DatabaseScheduler().reap_expired() == 1
    run = await Run.objects.aget(pk=run_id)
    assert (run.status, run.error["code"]) == (RunStatus.CANCELLED, "run.cancelled")
    assert [e.type async for e in Event.objects.filter(run_id=run_id)] == ["run.cancelled"]
    assert await ManagedAgentRecord.objects.filter(run_id=run_id, status="cancelled").aexists()


def _write_fenced(fence: Fence, session_id: Any, run_id: str) -> None:
    with transaction.atomic():
        runs.check_fence(fence)
        Event.objects.create(session_id=session_id, seq=1, run_id=run_id, type="fenced")


async def test_it_rolls_back_a_fenced_transaction_of_a_stale_lease(rows: Rows):
    run_id = rows.run("a", "alice", status=RunStatus.QUEUED)
    lease = await _claim(DatabaseScheduler())
    # Another process took the run over.
    await Run.objects.filter(pk=run_id).aupdate(lease_owner="other", lease_token=999)
    with pytest.raises(FenceRejected):
        await db_call(_write_fenced, lease_fence(lease), rows.sessions["alice"].pk, run_id)
    assert not await Event.objects.filter(run_id=run_id).aexists()


async def test_it_rejects_a_write_past_the_lease_expiry_before_anyone_reclaims(rows: Rows):
    run_id = rows.run("a", "alice", status=RunStatus.QUEUED)
    lease = await _claim(DatabaseScheduler())
    # The lease ran out (by the database's clock); nobody has reclaimed the run yet.
    await Run.objects.filter(pk=run_id).aupdate(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    with pytest.raises(FenceRejected):
        await db_call(_write_fenced, lease_fence(lease), rows.sessions["alice"].pk, run_id)
    run = await Run.objects.aget(pk=run_id)
    assert (run.status, run.lease_token) == (RunStatus.RUNNING, lease.fencing_token)


async def test_it_commits_a_fenced_transaction_of_a_live_lease(rows: Rows):
    run_id = rows.run("a", "alice", status=RunStatus.QUEUED)
    lease = await _claim(DatabaseScheduler())
    await db_call(_write_fenced, lease_fence(lease), rows.sessions["alice"].pk, run_id)
    assert await Event.objects.filter(run_id=run_id, type="fenced").aexists()


async def test_it_grants_leases_by_the_database_clock(rows: Rows):
    rows.run("a", "alice", status=RunStatus.QUEUED)
    before = await db_call(runs.db_now)
    lease = await _claim(DatabaseScheduler())
    after = await db_call(runs.db_now)
    # Granted after any wait for the claim lock: the lease starts when it is granted.
    assert before - timedelta(seconds=1) <= lease.acquired_at <= after + timedelta(seconds=1)
    assert lease.expires_at - lease.acquired_at == LEASE


async def test_it_requeues_with_an_error_on_worker_shutdown(rows: Rows):
    run_id = rows.run("a", "alice", status=RunStatus.QUEUED)
    scheduler = DatabaseScheduler()
    lease = await _claim(scheduler)
    error = {"code": "scheduler.worker_shutdown", "resumable": True}
    await scheduler.release(lease, LeaseReleaseReason.WORKER_SHUTDOWN, requeue=True, error=error)
    run = await Run.objects.aget(pk=run_id)
    assert (run.status, run.error["code"], run.lease_owner) == (
        RunStatus.QUEUED,
        "scheduler.worker_shutdown",
        "",
    )


async def test_it_gives_each_of_many_concurrent_claimers_a_different_run(rows: Rows):
    for i in range(12):
        rows.run(f"r{i}", f"user{i % 6}", status=RunStatus.QUEUED)
    schedulers = [DatabaseScheduler() for _ in range(4)]
    policy = SchedulerClaimPolicy(max_active_per_tenant=2)
    leases = await within(
        asyncio.gather(*(_claim(schedulers[i % 4], f"w{i}", policy=policy) for i in range(16)))
    )
    taken = [lease.run_id for lease in leases if lease is not None]
    assert len(taken) == 12 == len(set(taken))
    tokens = [lease.fencing_token for lease in leases if lease is not None]
    assert len(set(tokens)) == 12
