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
P99 = sorted[min(n-1, int(0.99 n))].
"""

from __future__ import annotations

import asyncio
import random
import time
from datetime import timedelta
from typing import Any

import orjson
from django.core.management.base import BaseCommand, CommandError

from scheduling.scheduler import (
    InMemoryScheduler,
    LeaseReleaseReason,
    SchedulerClaimPolicy,
    WorkItem,
)

LEASE = timedelta(hours=1)
SMALL_USERS = ("B", "C", "D", "E")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def simulate(
    *,
    order: str,
    slots: int,
    per_user: int,
    big: int,
    small: int,
    run_ms: float,
    jitter: float,
    settle: float,
    seed: int,
) -> dict[str, Any]:
    """One scenario; returns its JSON figures."""
    rng = random.Random(seed)
    scheduler = InMemoryScheduler(max_pending_items=big + small * len(SMALL_USERS) + 1)
    policy = SchedulerClaimPolicy(max_active_per_tenant=per_user, order=order)
    clock = time.perf_counter
    submitted: dict[str, float] = {}
    waits: dict[str, list[float]] = {}
    total = big + small * len(SMALL_USERS)
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
            duration = run_ms * (1 + rng.uniform(-jitter, jitter)) / 1000
            await asyncio.sleep(duration)
            await scheduler.release(lease, LeaseReleaseReason.COMPLETED)
            finished += 1
            if finished == total:
                done.set()

    await submit("A", big)
    workers = [asyncio.create_task(worker(f"slot-{i}")) for i in range(slots)]
    await asyncio.sleep(settle * run_ms / 1000)
    for user in SMALL_USERS:
        await submit(user, small)
    await done.wait()
    await scheduler.close()
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)

    figures = {}
    for user in ("A", *SMALL_USERS):
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
        "path": f"{order}_{slots}x{per_user}",
        "order": order,
        "slots": slots,
        "per_user_limit": per_user,
        "run_ms": run_ms,
        "jitter": jitter,
        "big_user_runs": big,
        "small_user_runs": small,
        "users": figures,
        "small_p99_ms": small_p99,
        "small_p99_runs": round(small_p99 / run_ms, 2),
    }


class Command(BaseCommand):
    help = "Queue waits of four small users behind one big user: fair vs oldest-first order."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--slots", type=int, default=8)
        parser.add_argument("--big", type=int, default=500)
        parser.add_argument("--small", type=int, default=5)
        parser.add_argument("--run-ms", type=float, default=20.0)
        parser.add_argument("--jitter", type=float, default=0.25)
        parser.add_argument("--settle", type=float, default=3.0)
        parser.add_argument("--seed", type=int, default=7)

    def handle(self, *args: Any, **options: Any) -> None:
        slots = options["slots"]
        if slots < 1 or options["big"] < 1 or options["small"] < 1 or options["run_ms"] <= 0:
            raise CommandError("slots, big, small and run-ms must be positive")
        if not 0 <= options["jitter"] < 1:
            raise CommandError("jitter must be in [0, 1)")
        for per_user in (slots, min(2, slots)):
            for order in ("fair", "oldest"):
                line = asyncio.run(
                    simulate(
                        order=order,
                        slots=slots,
                        per_user=per_user,
                        big=options["big"],
                        small=options["small"],
                        run_ms=options["run_ms"],
                        jitter=options["jitter"],
                        settle=options["settle"],
                        seed=options["seed"],
                    )
                )
                self.stdout.write(orjson.dumps(line).decode())
