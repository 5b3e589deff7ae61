"""``manage.py bench_single_host``: fence contention of fenced writes, global lock vs per run.

For each of ``--sessions`` runs, submit one work item and claim it (lease
1 h); then every run does ``--writes`` sequential ``execute_fenced`` calls whose operation
simulates ``--io-ms`` of storage I/O with ``asyncio.sleep``. Two paths, one JSON line each:

- ``global_baseline``: the old algorithm — one global lock held around the fence check
  *and* the write, so all runs' writes are serialized;
- ``per_run``: `InMemoryScheduler.execute_fenced` — the global state is touched only to
  check and record protection, writes of different runs overlap.

Fields: path, backend (``memory``), sessions, writes (total completed), simulated_io_ms,
elapsed_ms, ideal_ms (writes per run * io), ratio_to_ideal, peak_concurrent_writes,
median_write_ms, p95_write_ms (sorted[min(n-1, int(0.95 n))]), runs_per_s, and on
``per_run`` the speedup over the baseline. No model, no database. Asserts every write
completed and no pin is left.

Each path is measured ``--repeat`` times (default 3) and the fastest repetition is
reported (``repeats`` says how many), with the garbage collector paused while a
repetition runs — as ``timeit`` does — so a collection or a noisy neighbour does not
land on one path only.

A third line, ``db_per_run`` (``backend: database``), does the same workload the way the
worker does it on the configured database: ``--sessions`` queued runs (each in its own
session, spread over ``--users`` throwaway users) are claimed through `DatabaseScheduler`
(``claim_many`` until every slot is filled, one-hour leases on the database's clock); each
run then sleeps ``--io-ms`` (its simulated work) before each of its ``--writes`` fenced
event commits (``store.append_events`` with the lease's `Fence`, through the process's
store coordinator: the writer re-checks owner, token and lease inside each commit's
transaction), and finishes with a ``runs.Outcome`` committed as the worker's dispatcher
does: the terminal event and the ``Finish`` transition in one fenced transaction.
Its fields: elapsed_ms (first claim to last finish), claim_ms, runs_per_s, ideal_ms and
ratio_to_ideal (ideal: the sleeps alone), median/p95 write and finish latency (one
commit, answered once durable), peak_concurrent_writes, the coordinator's transactions
and largest group-commit batch, and ``ratio_to_memory``: its elapsed time over the
``per_run`` line's, measured in the same invocation (the in-memory line does no claims
and no finish). It checks every run completed with all its events, and deletes its
users, sessions, runs and events at the end; it refuses to start while the database holds
queued or running runs (its claims would take them): use a scratch database.
``--backend memory`` skips it, ``--backend database`` runs only it.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import orjson
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from benchmarks.shared import (
    PAYLOAD,
    add_backend_argument,
    bench_users,
    delete_users,
    queue_runs,
    require_scratch_queue,
)
from sageproject.db import db_call
from sageproject.progress import note
from scheduling import runs
from scheduling.models import Event, Run, RunStatus
from scheduling.scheduler import InMemoryScheduler, WorkerLease, WorkItem
from scheduling.store import append_events, close_default_coordinator, get_default_coordinator
from scheduling.worker import DatabaseScheduler, lease_fence

T = TypeVar("T")
LEASE = timedelta(hours=1)


class GlobalFenceBaseline:
    """The old fencing: the fence check and the write both run under one global lock."""

    def __init__(self, scheduler: InMemoryScheduler) -> None:
        self.scheduler = scheduler
        self._lock = asyncio.Lock()

    async def execute_fenced(self, lease: WorkerLease, operation: Callable[[], Awaitable[T]]) -> T:
        async with self._lock:
            await self.scheduler.assert_fence(lease)
            return await operation()


class Probe:
    """Counts writes in flight; the operation every fenced write runs."""

    def __init__(self, io_seconds: float) -> None:
        self.io_seconds = io_seconds
        self.current = 0
        self.peak = 0
        self.completed = 0

    async def write(self) -> None:
        self.current += 1
        if self.current > self.peak:
            self.peak = self.current
        try:
            await asyncio.sleep(self.io_seconds)
        finally:
            self.current -= 1
            self.completed += 1


async def measure(path: str, sessions: int, writes: int, io_ms: float) -> dict[str, Any]:
    """Run one path and return its JSON figures."""
    scheduler = InMemoryScheduler(max_pending_items=max(1024, sessions))
    leases = []
    for i in range(sessions):
        await scheduler.submit(WorkItem(work_id=f"run-{i}", run_id=f"run-{i}", tenant_id=None))
        lease = await scheduler.claim("bench", lease_duration=LEASE, wait_timeout=0)
        assert lease is not None
        leases.append(lease)
    fenced = GlobalFenceBaseline(scheduler) if path == "global_baseline" else scheduler
    probe = Probe(io_ms / 1000)
    latencies: list[float] = []
    clock = time.perf_counter
    execute = fenced.execute_fenced
    op = probe.write

    async def session(lease: WorkerLease) -> None:
        for _ in range(writes):
            start = clock()
            await execute(lease, op)
            latencies.append(clock() - start)

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        started = clock()
        await asyncio.gather(*(session(lease) for lease in leases))
        elapsed = clock() - started
    finally:
        if gc_was_enabled:
            gc.enable()
    assert probe.completed == sessions * writes, "not every write completed"
    assert scheduler.pinned_runs() == frozenset(), "pins left behind"
    await scheduler.close()
    latencies.sort()
    n = len(latencies)
    ideal_ms = writes * io_ms
    return {
        "path": path,
        "backend": "memory",
        "sessions": sessions,
        "writes": probe.completed,
        "simulated_io_ms": io_ms,
        "elapsed_ms": round(elapsed * 1000, 2),
        "ideal_ms": round(ideal_ms, 2),
        "ratio_to_ideal": round(elapsed * 1000 / ideal_ms, 2),
        "peak_concurrent_writes": probe.peak,
        "median_write_ms": round(statistics.median(latencies) * 1000, 2),
        "p95_write_ms": round(latencies[min(n - 1, int(0.95 * n))] * 1000, 2),
        "runs_per_s": round(sessions / elapsed, 1),
    }


def percentile_ms(ordered: list[float], q: float) -> float:
    """sorted[min(n-1, int(q n))] in ms, of an already sorted list of seconds."""
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


def _queue_spread(owners: list[Any], sessions: int) -> dict[str, Any]:
    """``sessions`` queued runs dealt round-robin over ``owners``; run id -> session id."""
    session_of: dict[str, Any] = {}
    for index, owner in enumerate(owners):
        count = sessions // len(owners) + (1 if index < sessions % len(owners) else 0)
        if count:
            session_of.update({str(run): session for run, session in queue_runs(owner, count)})
    return session_of


def _check_db_rep(session_of: dict[str, Any], writes: int) -> None:
    ids = list(session_of)
    completed = Run.objects.filter(pk__in=ids, status=RunStatus.COMPLETED).count()
    assert completed == len(ids), f"{len(ids) - completed} run(s) did not complete"
    events = Event.objects.filter(run_id__in=ids).count()
    assert events == len(ids) * (writes + 1), "events missing"


async def measure_db(owners: list[Any], sessions: int, writes: int, io_ms: float) -> dict[str, Any]:
    """One repetition of the database path (fresh rows); returns its JSON figures."""
    session_of = await db_call(_queue_spread, owners, sessions)
    scheduler = DatabaseScheduler(max_pending_items=max(1024, sessions))
    worker_id = f"bench-{uuid.uuid4().hex[:6]}"
    coordinator = get_default_coordinator()
    before = coordinator.snapshot()
    io_seconds = io_ms / 1000
    clock = time.perf_counter
    latencies: list[float] = []
    finishes: list[float] = []
    in_flight = peak = 0

    async def execute(lease: WorkerLease) -> None:
        nonlocal in_flight, peak
        fence = lease_fence(lease)
        session_id = session_of[lease.run_id]
        for n in range(writes):
            await asyncio.sleep(io_seconds)  # the run's simulated work between writes
            in_flight += 1
            peak = max(peak, in_flight)
            start = clock()
            try:
                await append_events(
                    session_id=session_id,
                    run_id=fence.run_id,
                    events=[("message", {**PAYLOAD, "n": n})],
                    fence=fence,
                )
            finally:
                in_flight -= 1
            latencies.append(clock() - start)
        outcome = runs.Outcome(
            status=RunStatus.COMPLETED, session_id=session_id, result={"ok": True}
        )
        start = clock()
        await append_events(
            session_id=session_id,
            run_id=fence.run_id,
            events=outcome.events(),
            fence=fence,
            transition=outcome.transition(fence),
        )
        finishes.append(clock() - start)
        scheduler.forget(lease)

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        started = clock()
        leases: list[WorkerLease] = []
        while len(leases) < sessions:
            claimed = await scheduler.claim_many(
                worker_id, lease_duration=LEASE, limit=sessions - len(leases)
            )
            if not claimed:
                break
            leases.extend(claimed)
        claim_elapsed = clock() - started
        if len(leases) != sessions or {lease.run_id for lease in leases} != set(session_of):
            raise CommandError(f"claimed {len(leases)} runs, expected this benchmark's {sessions}")
        await asyncio.gather(*(execute(lease) for lease in leases))
        elapsed = clock() - started
    finally:
        if gc_was_enabled:
            gc.enable()
    after = coordinator.snapshot()
    await scheduler.close()
    await db_call(_check_db_rep, session_of, writes)
    latencies.sort()
    finishes.sort()
    ideal_ms = writes * io_ms
    return {
        "path": "db_per_run",
        "backend": "database",
        "database": connections["default"].vendor,
        "sessions": sessions,
        "users": len(owners),
        "writes": len(latencies),
        "simulated_io_ms": io_ms,
        "elapsed_ms": round(elapsed * 1000, 2),
        "claim_ms": round(claim_elapsed * 1000, 2),
        "runs_per_s": round(sessions / elapsed, 1),
        "ideal_ms": round(ideal_ms, 2),
        "ratio_to_ideal": round(elapsed * 1000 / ideal_ms, 2),
        "peak_concurrent_writes": peak,
        "median_write_ms": round(statistics.median(latencies) * 1000, 2),
        "p95_write_ms": percentile_ms(latencies, 0.95),
        "median_finish_ms": round(statistics.median(finishes) * 1000, 2),
        "p95_finish_ms": percentile_ms(finishes, 0.95),
        "transactions": after["transactions"] - before["transactions"],
        "largest_batch": after["largest_batch"],
        "store_writers": after["writers"],
    }


async def best_of(
    measure_one: Callable[[], Awaitable[dict[str, Any]]], repeat: int
) -> dict[str, Any]:
    results = [await measure_one() for _ in range(repeat)]
    best = min(results, key=lambda line: line["elapsed_ms"])
    best["repeats"] = repeat
    return best


async def bench(
    sessions: int,
    writes: int,
    io_ms: float,
    repeat: int,
    *,
    backend: str = "both",
    owners: list[Any] | None = None,
) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    per_run = None
    if backend in ("memory", "both"):
        # A short warm-up so the first measured path does not pay for first-use costs.
        await measure("per_run", min(sessions, 8), 2, io_ms)
        baseline = await best_of(
            lambda: measure("global_baseline", sessions, writes, io_ms), repeat
        )
        per_run = await best_of(lambda: measure("per_run", sessions, writes, io_ms), repeat)
        per_run["speedup"] = round(baseline["elapsed_ms"] / per_run["elapsed_ms"], 2)
        lines += [baseline, per_run]
    if backend in ("database", "both"):
        assert owners, "the database path needs its users"
        try:
            # Warm-up: the store's writer thread, connections, the claim queries' plans.
            await measure_db(owners, min(sessions, 8), 2, io_ms)
            db_line = await best_of(lambda: measure_db(owners, sessions, writes, io_ms), repeat)
        finally:
            await close_default_coordinator()
        if per_run is not None:
            db_line["ratio_to_memory"] = round(db_line["elapsed_ms"] / per_run["elapsed_ms"], 2)
        lines.append(db_line)
    return lines


class Command(BaseCommand):
    help = (
        "Fenced-write contention: one global lock vs per-run pins, and the same workload on "
        "the configured database through DatabaseScheduler and fenced commits (JSON lines)."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--sessions", type=int, default=64)
        parser.add_argument("--writes", type=int, default=8)
        parser.add_argument("--io-ms", type=float, default=2.0)
        parser.add_argument("--repeat", type=int, default=3)
        parser.add_argument(
            "--users", type=int, default=8, help="owners of the database path's runs"
        )
        add_backend_argument(parser, memory="the two in-memory lines", database="db_per_run")

    def handle(self, *args: Any, **options: Any) -> None:
        sessions, writes, io_ms = options["sessions"], options["writes"], options["io_ms"]
        if sessions <= 0 or writes <= 0 or io_ms <= 0:
            raise CommandError("sessions, writes and io-ms must be positive")
        if options["repeat"] < 1 or options["users"] < 1:
            raise CommandError("repeat and users must be positive")
        backend = options["backend"]
        owners: list[Any] = []
        if backend != "memory":
            require_scratch_queue()
            count = min(options["users"], sessions)
            owners = list(bench_users(f"u{i}" for i in range(count)).values())
        what = f"{sessions} sessions x {writes} writes, {backend}"
        note(what, stream=self.stderr, prefix="bench_single_host")
        try:
            lines = asyncio.run(
                bench(sessions, writes, io_ms, options["repeat"], backend=backend, owners=owners)
            )
        finally:
            if owners:
                delete_users(owners)
        for line in lines:
            self.stdout.write(orjson.dumps(line).decode())
