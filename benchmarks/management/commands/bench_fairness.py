"""``manage.py bench_fairness``: queue waits of small users behind one big user.

A simulation on `InMemoryScheduler` (no model, no database): ``--slots`` workers each claim
a run, "execute" it for a simulated duration (``--run-ms``, each run's length drawn with
±``--jitter`` around it from a seeded generator, so slots free up at staggered times as
they do in production), release it and claim again. User A submits ``--big`` runs at
once; after ``--settle`` run durations (the slots are all busy with A by then) users B-E
submit ``--small`` runs each. The queue wait of a run is claim time minus submit time.

Four JSON lines: claim order ``fair`` (fewest running runs per user first, then priority,
then oldest — the rule the database scheduler uses too) and ``oldest`` (plain priority
then oldest), each with a per-user limit equal to the slots (so the limit alone protects
nobody) and with the default 8/2. Each line has every user's p50/p99 wait in ms and in run
durations, and ``small_p99_runs``: the worst p99 of B-E divided by one run duration.
P99 = sorted[min(n-1, int(0.99 n))]. These lines carry ``backend: memory``.

The same four scenarios then run on the configured database (``backend: database``, paths
``db_fair_8x8`` ...; the same keys, plus ``database``, ``claims`` — claim transactions
that took runs —, ``median_claim_ms`` and ``median_release_ms``): five throwaway users;
every run a queued ``Run`` row in its own session (so the one-run-per-session rule holds
none back), A's inserted at the start, B-E's in one transaction after the settle time
(a run's queue wait counts from the commit of its insert; the claim loop is woken as an
in-process submit wakes it). One claim loop runs as the worker's dispatcher does:
`DatabaseScheduler.claim_many` fills the free slots in one transaction (the scenario's
order and per-user limit, counted in the database); when nothing is claimable it waits
for a release here (or the idle poll, 0.05 s doubling to 0.5 s). Each claimed run
"executes" the same seeded sleep and ends through the state machine with
``DatabaseScheduler.release(lease, "completed")`` (``runs.finish``: fence check,
terminal event, status and archive in one transaction), which frees its slot.

A claim and a finish cost milliseconds of database and ORM work each, so the database
scenarios use their own ``--db-run-ms`` (default 250) and ``--db-big`` (default 60): at
the in-memory 20 ms runs on 8 slots the database, not the claim order, would set the waits.
Compare the orders within one backend, and the backends in run durations (``*_runs``).
``--backend`` picks memory, database or both (default). The database path deletes its
users and rows at the end and refuses to start while the database holds queued or running
runs (its claims would take them): use a scratch database.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import orjson
from django.core.management.base import BaseCommand, CommandError
from django.db import connections, transaction

from benchmarks.shared import (
    add_backend_argument,
    bench_users,
    delete_users,
    queue_runs,
    require_scratch_queue,
)
from sageproject.db import db_call
from sageproject.progress import note
from scheduling.models import Run, RunStatus
from scheduling.scheduler import (
    InMemoryScheduler,
    LeaseReleaseReason,
    SchedulerClaimPolicy,
    WorkerLease,
    WorkItem,
)
from scheduling.worker import DatabaseScheduler

LEASE = timedelta(hours=1)
SMALL_USERS = ("B", "C", "D", "E")
USERS = ("A", *SMALL_USERS)
# The dispatcher's idle wait between empty claims (scheduling.worker).
IDLE_START, IDLE_MAX = 0.05, 0.5


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One scenario: claim ``order`` over ``slots`` workers with a ``per_user`` limit; A's
    ``big`` runs, then ``settle`` run durations later B-E's ``small`` runs each; each run
    lasts ``run_ms`` ± ``jitter`` (drawn from a generator seeded with ``seed``)."""

    order: str
    slots: int
    per_user: int
    big: int
    small: int
    run_ms: float
    jitter: float
    settle: float
    seed: int

    @property
    def total(self) -> int:
        return self.big + self.small * len(SMALL_USERS)

    def policy(self) -> SchedulerClaimPolicy:
        return SchedulerClaimPolicy(max_active_per_tenant=self.per_user, order=self.order)

    def run_seconds(self, rng: random.Random) -> float:
        """One run's simulated duration."""
        return self.run_ms * (1 + rng.uniform(-self.jitter, self.jitter)) / 1000

    def settle_seconds(self) -> float:
        return self.settle * self.run_ms / 1000


async def simulate(scenario: Scenario) -> dict[str, Any]:
    """One scenario; returns its JSON figures."""
    rng = random.Random(scenario.seed)
    scheduler = InMemoryScheduler(max_pending_items=scenario.total + 1)
    policy = scenario.policy()
    clock = time.perf_counter
    submitted: dict[str, float] = {}
    waits: dict[str, list[float]] = {}
    total = scenario.total
    done = asyncio.Event()
    finished = 0

    async def submit(user: str, count: int) -> None:
        for i in range(count):
            work_id = f"{user}-{i}"
            submitted[work_id] = clock()
            await scheduler.submit(WorkItem(work_id=work_id, run_id=work_id, tenant_id=user))

    async def worker(name: str) -> None:
        nonlocal finished
        while finished < total:
            lease = await scheduler.claim(name, lease_duration=LEASE, policy=policy)
            if lease is None:
                continue
            user = lease.work.tenant_id or ""
            waits.setdefault(user, []).append(clock() - submitted[lease.work.work_id])
            await asyncio.sleep(scenario.run_seconds(rng))
            await scheduler.release(lease, LeaseReleaseReason.COMPLETED)
            finished += 1
            if finished == total:
                done.set()

    await submit("A", scenario.big)
    workers = [asyncio.create_task(worker(f"slot-{i}")) for i in range(scenario.slots)]
    await asyncio.sleep(scenario.settle_seconds())
    for user in SMALL_USERS:
        await submit(user, scenario.small)
    await done.wait()
    await scheduler.close()
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)

    return summarize(scenario, path="", backend="memory", waits=waits)


def summarize(
    scenario: Scenario, *, path: str, backend: str, waits: dict[str, list[float]]
) -> dict[str, Any]:
    """A scenario's JSON line from every user's queue waits (seconds); its path is
    ``path`` (a prefix) then ``<order>_<slots>x<per_user>``."""
    run_ms = scenario.run_ms
    figures = {}
    for user in USERS:
        values = waits[user]
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        figures[user] = {
            "runs": len(values),
            "p50_ms": round(p50 * 1000, 2),
            "p99_ms": round(p99 * 1000, 2),
            "p50_runs": round(p50 * 1000 / run_ms, 2),
            "p99_runs": round(p99 * 1000 / run_ms, 2),
        }
    small_p99 = max(figures[u]["p99_ms"] for u in SMALL_USERS)
    return {
        "path": f"{path}{scenario.order}_{scenario.slots}x{scenario.per_user}",
        "backend": backend,
        "order": scenario.order,
        "slots": scenario.slots,
        "per_user_limit": scenario.per_user,
        "run_ms": run_ms,
        "jitter": scenario.jitter,
        "big_user_runs": scenario.big,
        "small_user_runs": scenario.small,
        "users": figures,
        "small_p99_ms": small_p99,
        "small_p99_runs": round(small_p99 / run_ms, 2),
    }


async def simulate_db(scenario: Scenario, owners: dict[str, Any]) -> dict[str, Any]:
    """One scenario on the configured database; returns its JSON figures."""
    rng = random.Random(scenario.seed)
    scheduler = DatabaseScheduler(max_pending_items=scenario.total + 1)
    policy = scenario.policy()
    slots = scenario.slots
    worker_id = f"bench-fairness-{uuid.uuid4().hex[:6]}"
    clock = time.perf_counter
    user_of = {str(owner.pk): name for name, owner in owners.items()}
    submitted: dict[str, float] = {}
    waits: dict[str, list[float]] = {}
    claim_times: list[float] = []
    release_times: list[float] = []
    total = scenario.total
    active: dict[str, asyncio.Task[None]] = {}
    slot_freed = asyncio.Event()
    stamped = asyncio.Event()
    finished = 0

    def insert(batch: list[tuple[str, int]]) -> tuple[list[str], float]:
        with transaction.atomic():
            run_ids = [
                str(run) for user, count in batch for run, _ in queue_runs(owners[user], count)
            ]
        # Queued (visible to claims) from the insert's commit on.
        return run_ids, clock()

    async def submit(batch: list[tuple[str, int]]) -> None:
        stamped.clear()
        run_ids, now = await db_call(insert, batch)
        submitted.update(dict.fromkeys(run_ids, now))
        stamped.set()
        scheduler.notify()  # as an in-process submit wakes the claim loop

    async def execute(lease: WorkerLease) -> None:
        nonlocal finished
        try:
            await asyncio.sleep(scenario.run_seconds(rng))
            started = clock()
            await scheduler.release(lease, LeaseReleaseReason.COMPLETED)
            release_times.append(clock() - started)
            finished += 1
        finally:
            active.pop(lease.run_id, None)
            slot_freed.set()

    async def claim_loop() -> None:
        """The dispatcher's loop: fill free slots; when nothing is claimable, wait for a
        release or submit here (or the idle poll interval)."""
        idle = IDLE_START
        while finished < total:
            for task in [t for t in active.values() if t.done() and t.exception()]:
                raise task.exception()  # type: ignore[misc]
            free = slots - len(active)
            if free == 0:
                slot_freed.clear()
                await slot_freed.wait()
                continue
            started = clock()
            leases = await scheduler.claim_many(
                worker_id, lease_duration=LEASE, limit=free, policy=policy
            )
            if not leases:
                await scheduler.wait_for_change(idle)
                idle = min(idle * 2, IDLE_MAX)
                continue
            claimed = clock()
            claim_times.append(claimed - started)
            idle = IDLE_START
            for lease in leases:
                while lease.run_id not in submitted:  # claimed before submit() resumed
                    await stamped.wait()
                user = user_of[lease.work.tenant_id or ""]
                waits.setdefault(user, []).append(claimed - submitted[lease.run_id])
                active[lease.run_id] = asyncio.create_task(execute(lease))

    await submit([("A", scenario.big)])
    loop_task = asyncio.create_task(claim_loop())
    try:
        await asyncio.sleep(scenario.settle_seconds())
        await submit([(user, scenario.small) for user in SMALL_USERS])
        await loop_task
        await asyncio.gather(*active.values())
    finally:
        loop_task.cancel()
        for task in active.values():
            task.cancel()
        await asyncio.gather(loop_task, *active.values(), return_exceptions=True)
        await scheduler.close()
    completed = await db_call(
        lambda: Run.objects.filter(pk__in=list(submitted), status=RunStatus.COMPLETED).count()
    )
    assert completed == total, f"{total - completed} run(s) did not complete"
    line = summarize(scenario, path="db_", backend="database", waits=waits)
    line["database"] = connections["default"].vendor
    line["claims"] = len(claim_times)
    line["median_claim_ms"] = round(statistics.median(claim_times) * 1000, 2)
    line["median_release_ms"] = round(statistics.median(release_times) * 1000, 2)
    return line


def scenarios(options: dict[str, Any], *, big: int, run_ms: float) -> list[Scenario]:
    """The four scenarios of one backend: orders fair and oldest, each with a per-user
    limit of the slots and of min(2, slots)."""
    slots = options["slots"]
    shared = {key: options[key] for key in ("slots", "small", "jitter", "settle", "seed")}
    return [
        Scenario(order=order, per_user=per_user, big=big, run_ms=run_ms, **shared)
        for per_user in (slots, min(2, slots))
        for order in ("fair", "oldest")
    ]


def announce(backend: str, scenario: Scenario, stream: Any) -> None:
    """The scenario about to run, on a terminal only (sageproject.progress)."""
    what = f"{backend}: {scenario.order} order, per user {scenario.per_user}"
    note(what, stream=stream, prefix="bench_fairness")


class Command(BaseCommand):
    help = (
        "Queue waits of four small users behind one big user: fair vs oldest-first order, "
        "in memory and on the configured database."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--slots", type=int, default=8)
        parser.add_argument("--big", type=int, default=500)
        parser.add_argument(
            "--db-big", type=int, default=60, help="the big user's runs on the database"
        )
        parser.add_argument(
            "--db-run-ms",
            type=float,
            default=250.0,
            help="a run's duration on the database (long enough that claims and finishes "
            "keep up with the slots)",
        )
        parser.add_argument("--small", type=int, default=5)
        parser.add_argument("--run-ms", type=float, default=20.0)
        parser.add_argument("--jitter", type=float, default=0.25)
        parser.add_argument("--settle", type=float, default=3.0)
        parser.add_argument("--seed", type=int, default=7)
        add_backend_argument(parser, memory="InMemoryScheduler", database="DatabaseScheduler")

    def handle(self, *args: Any, **options: Any) -> None:
        slots = options["slots"]
        if (
            slots < 1
            or options["big"] < 1
            or options["db_big"] < 1
            or options["small"] < 1
            or options["run_ms"] <= 0
            or options["db_run_ms"] <= 0
        ):
            raise CommandError("slots, big, db-big, small, run-ms and db-run-ms must be positive")
        if not 0 <= options["jitter"] < 1:
            raise CommandError("jitter must be in [0, 1)")
        backend = options["backend"]
        if backend in ("memory", "both"):
            for scenario in scenarios(options, big=options["big"], run_ms=options["run_ms"]):
                announce("memory", scenario, self.stderr)
                self._emit(asyncio.run(simulate(scenario)))
        if backend in ("database", "both"):
            require_scratch_queue()
            owners = bench_users(USERS)
            try:
                for scenario in scenarios(
                    options, big=options["db_big"], run_ms=options["db_run_ms"]
                ):
                    announce("database", scenario, self.stderr)
                    self._emit(asyncio.run(simulate_db(scenario, owners)))
            finally:
                delete_users(owners.values())

    def _emit(self, line: dict[str, Any]) -> None:
        self.stdout.write(orjson.dumps(line).decode())
        self.stdout.flush()
