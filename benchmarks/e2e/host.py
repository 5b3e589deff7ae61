"""This host in process: `HostTarget` (runs of the ``demo`` package submitted with
``agents.services.run_submit``, started by a ``runworker`` subprocess), the benchmark's
owners and model record, and the ``claim`` path (``DatabaseScheduler.claim_many`` with
small and large queues)."""

from __future__ import annotations

import statistics
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

from django.core.management.base import CommandError
from django.db import connections

from benchmarks.e2e.harness import Subprocess, pct_ms, progress, targets, tidy_tables, wait_until
from benchmarks.e2e.method import Batch, Target

LEASE = timedelta(seconds=30)
CLAIM_LIMIT = 32
CLAIM_USERS = 4
CLAIM_WARMUP = 2


class HostTarget(Target):
    """Runs of the ``demo`` package on the ``scripted`` model, one session per run,
    submitted with ``agents.services.run_submit``; start = ``Run.started_at``."""

    name = "sage"

    def __init__(self, owners: list[tuple[Any, Any]], children: list[Subprocess]) -> None:
        self.owners = owners  # (user, package)
        self.user_ids = [user.pk for user, _ in owners]
        self.children = children  # checked while waiting: a dead worker fails the wait
        self.tag = uuid.uuid4().hex[:8]

    def prepare(self, count: int, label: str, owners: list[int] | None = None) -> Batch:
        """``count`` fresh sessions dealt round-robin over the owners (or those at the
        indexes ``owners``); their title tags the batch."""
        from scheduling.models import Session

        title = f"bench-e2e-{self.tag}-{label}-{uuid.uuid4().hex[:6]}"
        dealt = [self.owners[i] for i in owners] if owners is not None else self.owners
        rows = []
        for index in range(count):
            user, package = dealt[index % len(dealt)]
            rows.append(
                Session(
                    owner=user,
                    package_ref=package.ref,
                    package_name=package.name,
                    agent_id="assistant",
                    title=title,
                )
            )
        created = Session.objects.bulk_create(rows, batch_size=2000)
        return Batch(label, title, [(s.owner, s.pk) for s in created])

    def submit(self, batch: Batch, index: int) -> None:
        from agents.services import run_submit

        owner, session_id = batch.handles[index]
        run, _ = run_submit(owner=owner, session_id=session_id, input="ping")
        batch.results[index] = run.pk

    def end_thread(self) -> None:
        connections.close_all()

    def _runs(self, batch: Batch) -> Any:
        from scheduling.models import Run

        return Run.objects.filter(session__title=batch.key)

    def _mine(self, statuses: Any) -> Any:
        """Runs of the benchmark's users in ``statuses`` (the ``(owner, status)`` index: a
        cheap poll; the paths run one after another, so these are the batch's)."""
        from scheduling.models import Run

        return Run.objects.filter(owner_id__in=self.user_ids, status__in=statuses)

    def starts(self, batch: Batch, timeout: float) -> list[float]:
        from scheduling.models import RunStatus

        queued = self._mine([RunStatus.QUEUED])
        wait_until(
            f"the runs of {batch.label} to start",
            lambda: not queued.exists(),
            timeout,
            self.children,
        )
        started = dict(self._runs(batch).values_list("pk", "started_at"))
        missing = [pk for pk in batch.results if started.get(pk) is None]
        if missing:
            raise CommandError(f"{len(missing)} run(s) of {batch.label} never started")
        return [started[pk].timestamp() for pk in batch.results]

    def settle(self, batch: Batch, timeout: float) -> dict[str, Any]:
        from scheduling.models import UNFINISHED_STATUSES

        unfinished = self._mine(UNFINISHED_STATUSES)
        wait_until(
            f"the runs of {batch.label} to finish",
            lambda: not unfinished.exists(),
            timeout,
            self.children,
        )
        ended = Counter(self._runs(batch).values_list("status", flat=True))
        return {"runs_ended": dict(sorted(ended.items()))}


def bench_owners(count: int, prefix: str) -> list[tuple[Any, Any]]:
    """Throwaway users ``bench-<hex>-<prefix><i>``, each with the ``demo`` package."""
    from agents.management.commands.seed_demo import DEMO_MANIFEST
    from agents.services import packages
    from benchmarks.shared import bench_users

    users = bench_users(f"{prefix}{i}" for i in range(count))
    return [
        (user, packages.package_create(owner=user, manifest=DEMO_MANIFEST)[0])
        for user in users.values()
    ]


def ensure_scripted_record() -> Any:
    """The shared ``scripted`` model record; returns it if created here (to delete), else None."""
    from pooling.models import ModelRecord, Protocol

    record, created = ModelRecord.objects.get_or_create(
        owner=None,
        name="scripted",
        defaults={"protocol": Protocol.SCRIPTED, "model": "scripted-echo", "options": {}},
    )
    return record if created else None


async def claim_path(owners: list[Any], sizes: list[int], repeat: int) -> dict[str, Any]:
    from benchmarks.shared import queue_runs
    from sageproject.db import db_call
    from scheduling.models import Session
    from scheduling.protocol import LeaseReleaseReason
    from scheduling.worker import DatabaseScheduler

    def seed(size: int) -> None:
        for index, owner in enumerate(owners):
            count = size // len(owners) + (1 if index < size % len(owners) else 0)
            if count:
                queue_runs(owner, count)
        tidy_tables()

    def clear() -> None:
        Session.objects.filter(owner__in=owners).delete()

    by_size: dict[str, Any] = {}
    for size in sizes:
        progress(f"claim: {size} queued runs")
        await db_call(seed, size)
        scheduler = DatabaseScheduler(max_pending_items=max(1024, size))
        worker_id = f"bench-e2e-claim-{uuid.uuid4().hex[:6]}"
        timings: list[float] = []
        try:
            for rep in range(CLAIM_WARMUP + repeat):
                started = time.perf_counter()
                leases = await scheduler.claim_many(
                    worker_id, lease_duration=LEASE, limit=CLAIM_LIMIT
                )
                elapsed = time.perf_counter() - started
                if len(leases) != min(CLAIM_LIMIT, size):
                    raise CommandError(
                        f"claimed {len(leases)} runs of {size} queued, expected "
                        f"{min(CLAIM_LIMIT, size)}"
                    )
                for lease in leases:
                    await scheduler.release(lease, LeaseReleaseReason.WORKER_SHUTDOWN)
                if rep >= CLAIM_WARMUP:
                    timings.append(elapsed)
        finally:
            await scheduler.close()
            await db_call(clear)
        ordered = sorted(timings)
        by_size[str(size)] = {
            "median_ms": round(statistics.median(ordered) * 1000, 3),
            "p90_ms": pct_ms(ordered, 0.90),
            "min_ms": round(ordered[0] * 1000, 3),
            "claimed_per_call": min(CLAIM_LIMIT, size),
        }
    small, large = by_size[str(min(sizes))], by_size[str(max(sizes))]
    return {
        "path": "claim",
        "limit": CLAIM_LIMIT,
        "users": len(owners),
        "repeat": repeat,
        "by_queued": by_size,
        "ratio": round(large["median_ms"] / small["median_ms"], 3),
        **targets("claim"),
    }
