"""``manage.py bench_persist``: fenced event commits against the configured database.

Two measurements, one JSON line each (progress on stderr):

- ``append_one``: median time to commit one new event to a session already holding N
  durable events (seeded with bulk inserts), through the coordinator and its writer;
- ``concurrent``: events/s committed by S sessions that each append one event per commit,
  all at once, with group commit on and off and with 1 and W writers. Every commit is
  durable when its caller is answered.

Every commit is fenced as the worker's are: each session has one running run, claimed
through the Run state machine (``runs.claim``, a one-hour lease on the database's clock),
and every commit carries that run's `Fence`, so the writer re-checks owner, token and an
unexpired lease inside the commit's transaction (``fenced: true`` on every line).

It creates its own throwaway user (``bench-<hex>``), sessions and runs and deletes them at
the end. Because its claims take any queued run, it refuses to start while the database
holds queued or running runs: run it against a scratch database.

Its rows (users, one run per session, the scratch-queue check, clean-up) come from
`benchmarks.shared`, as those of ``bench_single_host``, ``bench_fairness``, ``bench_e2e``
and ``bench_scale`` do.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from benchmarks.shared import PAYLOAD, bench_users, delete_users, require_scratch_queue
from sageproject.progress import note
from scheduling import runs
from scheduling.models import Event, Run, Session
from scheduling.runs import Fence
from scheduling.store import SessionStoreCoordinator

SEED_BATCH = 5000
LEASE = timedelta(hours=1)


def progress(message: str) -> None:
    note(message, prefix="bench_persist")  # a terminal only (sageproject.progress)


def claim_fences(owner: Any, session_ids: list[Any]) -> dict[Any, Fence]:
    """One running run per session, claimed through the state machine with a live lease;
    returns each session's `Fence`."""
    created = Run.objects.bulk_create(
        [Run(session_id=s, owner=owner, input="bench", ready=True) for s in session_ids]
    )
    run_session = {run.pk: run.session_id for run in created}
    worker = f"bench-persist-{uuid.uuid4().hex[:6]}"
    grants, _ = runs.claim(worker_id=worker, duration=LEASE, limit=len(run_session))
    fences = {
        run_session[grant.row["pk"]]: Fence(
            run_id=grant.row["pk"], lease_owner=worker, lease_token=grant.token
        )
        for grant in grants
        if grant.row["pk"] in run_session
    }
    if len(fences) != len(session_ids):
        raise CommandError(f"claimed {len(fences)} of {len(session_ids)} runs")
    return fences


def seed_session(owner: Any, events: int) -> Session:
    session = Session.objects.create(
        owner=owner,
        package_ref="bench",
        package_name="bench",
        agent_id="bench",
        persisted_events=events,
    )
    data = orjson.dumps(PAYLOAD).decode()
    now = datetime.now(UTC)
    for start in range(1, events + 1, SEED_BATCH):
        Event.objects.bulk_create(
            [
                Event(session=session, seq=seq, type="message", data=data, created_at=now)
                for seq in range(start, min(events, start + SEED_BATCH - 1) + 1)
            ]
        )
    return session


async def fenced_commit(
    coordinator: SessionStoreCoordinator, session_id: Any, fence: Fence
) -> None:
    """One one-event commit, fenced by the session's run as the worker's are."""
    await coordinator.commit(
        session_id, run_id=fence.run_id, drafts=[("message", PAYLOAD)], fence=fence
    )


async def append_one(
    session_ids: list[Any], fences: dict[Any, Fence], commits: int
) -> list[list[float]]:
    """Per session, the wall time of each of ``commits`` fenced one-event commits.

    The sessions take turns (one commit each per round) so that drift in the machine's
    load falls on every history length alike.
    """
    coordinator = SessionStoreCoordinator(writers=1)
    try:
        for session_id in session_ids:
            await coordinator.history(session_id)  # opening (loading N events) is not timed
            await fenced_commit(coordinator, session_id, fences[session_id])  # warm-up
        timings: list[list[float]] = [[] for _ in session_ids]
        for _ in range(commits):
            for index, session_id in enumerate(session_ids):
                started = time.perf_counter()
                await fenced_commit(coordinator, session_id, fences[session_id])
                timings[index].append(time.perf_counter() - started)
        return timings
    finally:
        await coordinator.close()


def settle_statistics() -> None:
    """Refresh the planner's statistics after the bulk seeding (not timed)."""
    vendor = connections["default"].vendor
    table = Event._meta.db_table
    with connections["default"].cursor() as cursor:
        if vendor == "postgresql":
            cursor.execute(f'VACUUM ANALYZE "{table}"')
        elif vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE `{table}`")
            cursor.fetchall()
        elif vendor == "sqlite":
            cursor.execute("ANALYZE")


async def concurrent(
    session_ids: list[Any],
    fences: dict[Any, Fence],
    *,
    commits: int,
    writers: int,
    group_commit: bool,
) -> dict[str, Any]:
    coordinator = SessionStoreCoordinator(writers=writers, group_commit=group_commit)
    try:
        for session_id in session_ids:
            await coordinator.history(session_id)

        async def one_session(session_id: Any) -> None:
            for _ in range(commits):
                await fenced_commit(coordinator, session_id, fences[session_id])

        before = coordinator.snapshot()
        started = time.perf_counter()
        await asyncio.gather(*(one_session(s) for s in session_ids))
        elapsed = time.perf_counter() - started
        after = coordinator.snapshot()
        return {
            "elapsed_ms": round(elapsed * 1000, 2),
            "events": len(session_ids) * commits,
            "events_per_s": round(len(session_ids) * commits / elapsed, 1),
            "transactions": after["transactions"] - before["transactions"],
            "largest_batch": after["largest_batch"],
        }
    finally:
        await coordinator.close()


class Command(BaseCommand):
    help = "Benchmark event commits on the configured database (append cost, group commit)."

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--events",
            default="1000,10000,100000",
            help="comma-separated history lengths for append_one",
        )
        parser.add_argument(
            "--commits", type=int, default=40, help="timed append_one commits per history length"
        )
        parser.add_argument("--sessions", type=int, default=64)
        parser.add_argument("--commits-per-session", type=int, default=30)
        parser.add_argument(
            "--writers",
            type=int,
            default=4,
            help="the multi-writer configuration to compare with 1",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            sizes = [int(x) for x in options["events"].split(",") if x.strip()]
        except ValueError:
            raise CommandError("--events takes comma-separated integers") from None
        if not sizes or min(sizes) < 1 or options["commits"] < 1 or options["sessions"] < 1:
            raise CommandError("events, commits and sessions must be positive")
        if options["commits_per_session"] < 1 or options["writers"] < 1:
            raise CommandError("commits-per-session and writers must be positive")
        require_scratch_queue()
        database = connections["default"].vendor
        owner = bench_users(["persist"])["persist"]
        try:
            self._run(owner, database, sizes, options)
        finally:
            progress("cleaning up")
            delete_users([owner])

    def _emit(self, line: dict[str, Any]) -> None:
        self.stdout.write(orjson.dumps(line).decode())
        self.stdout.flush()

    def _run(self, owner: Any, database: str, sizes: list[int], options: dict[str, Any]) -> None:
        seeded = []
        for size in sizes:
            progress(f"seeding a session with {size} events")
            seeded.append(seed_session(owner, size).id)
        sessions = [seed_session(owner, 0).id for _ in range(options["sessions"])]
        progress(
            f"claiming a run (a live lease) for each of {len(seeded) + len(sessions)} sessions"
        )
        fences = claim_fences(owner, seeded + sessions)
        settle_statistics()
        progress(f"timing {options['commits']} fenced one-event commits per history length")
        all_timings = asyncio.run(append_one(seeded, fences, options["commits"]))
        first_median = None
        for size, timings in zip(sizes, all_timings, strict=True):
            median = statistics.median(timings) * 1000
            first_median = first_median or median
            ordered = sorted(timings)
            p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1000
            self._emit(
                {
                    "path": "append_one",
                    "database": database,
                    "fenced": True,
                    "events": size,
                    "commits": options["commits"],
                    "median_ms": round(median, 3),
                    "p95_ms": round(p95, 3),
                    "ratio_vs_first": round(median / first_median, 3),
                }
            )
        results: dict[tuple[bool, int], float] = {}
        for writers in sorted({1, options["writers"]}):
            for group_commit in (False, True):
                progress(
                    f"{len(sessions)} sessions, group_commit={group_commit}, writers={writers}"
                )
                figures = asyncio.run(
                    concurrent(
                        sessions,
                        fences,
                        commits=options["commits_per_session"],
                        writers=writers,
                        group_commit=group_commit,
                    )
                )
                results[(group_commit, writers)] = figures["events_per_s"]
                self._emit(
                    {
                        "path": "concurrent",
                        "database": database,
                        "fenced": True,
                        "sessions": len(sessions),
                        "commits_per_session": options["commits_per_session"],
                        "group_commit": group_commit,
                        "writers": writers,
                        **figures,
                    }
                )
        for writers in sorted({1, options["writers"]}):
            self._emit(
                {
                    "path": "group_commit_speedup",
                    "database": database,
                    "fenced": True,
                    "writers": writers,
                    "ratio": round(results[(True, writers)] / results[(False, writers)], 2),
                }
            )
