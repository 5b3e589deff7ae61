"""``manage.py bench_pooling``: measure the model budget and the model client pool.

One JSON line per measured path:

* ``budget_uncontended``: ``async with budget.lease()`` with a free slot vs
  ``async with asyncio.Semaphore`` (µs per lease+release, and the ratio; target ≤ 3);
* ``budget_contended``: 1000 tasks x 50 operations through a limit of 50, each holding the
  slot across one loop turn, vs ``asyncio.Semaphore`` (operations/s, ratio; target ≥ 0.5);
* ``pool_warm_lease``: ``await pool.acquire(...)`` + ``await lease.close()`` on a warm key
  (µs; target ≤ 20);
* ``pool_cold_coalescing``: 50 concurrent first acquires of one key (constructions; must be
  1).

Each timing is the best of a few repeats in a fresh event loop, so a stray pause of the
machine does not decide the figure. The whole command takes a few seconds. The logic lives
in :func:`run_benchmarks`, callable without Django.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pooling.budget import ModelConcurrencyBudget
from pooling.clients import ModelClientPool
from sageproject.progress import note

try:  # The command wrapper needs Django; run_benchmarks does not.
    from django.core.management.base import BaseCommand
except ImportError:  # pragma: no cover - exercised only without Django installed
    BaseCommand = object  # type: ignore[assignment,misc]

UNCONTENDED_ITERATIONS = 200_000
CONTENDED_TASKS = 1000
CONTENDED_OPERATIONS = 50
CONTENDED_LIMIT = 50
WARM_ITERATIONS = 50_000
COLD_WAITERS = 50
REPEATS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRecord:
    """A model record as the pool sees it (the benchmark never contacts a model)."""

    id: int
    protocol: str
    base_url: str
    model: str
    api_key: str


RECORD = BenchRecord(
    id=1, protocol="openai", base_url="http://127.0.0.1:9/v1", model="bench", api_key="sk-bench"
)


def _best(measure: Callable[[], float], repeats: int) -> float:
    # Collect garbage between repeats so one repeat does not pay for another's garbage.
    results = []
    for _ in range(repeats):
        gc.collect()
        results.append(measure())
    return min(results)


async def _uncontended(cm: Any, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        async with cm:
            pass
    return time.perf_counter() - start


async def _uncontended_budget(iterations: int) -> float:
    budget = ModelConcurrencyBudget(1)
    start = time.perf_counter()
    for _ in range(iterations):
        async with budget.lease():
            pass
    return time.perf_counter() - start


async def _contended(make: Callable[[], Callable[[], Any]]) -> float:
    # ``make`` returns the per-operation entry call (``budget.lease`` or ``lambda: sem``),
    # so both sides pay one call per operation, as real callers do.
    enter = make()

    async def worker() -> None:
        for _ in range(CONTENDED_OPERATIONS):
            async with enter():
                await asyncio.sleep(0)

    tasks = [asyncio.create_task(worker()) for _ in range(CONTENDED_TASKS)]
    start = time.perf_counter()
    await asyncio.gather(*tasks)
    return time.perf_counter() - start


def _semaphore_entry() -> Callable[[], asyncio.Semaphore]:
    semaphore = asyncio.Semaphore(CONTENDED_LIMIT)
    return lambda: semaphore


async def _noop_factory(record: Any) -> object:
    return object()


async def _noop_closer(client: Any) -> None:
    return None


async def _warm_pool(iterations: int) -> float:
    pool = ModelClientPool(_noop_factory, _noop_closer, max_clients=4)
    lease = await pool.acquire("alice", RECORD)
    await lease.close()
    start = time.perf_counter()
    for _ in range(iterations):
        lease = await pool.acquire("alice", RECORD)
        await lease.close()
    elapsed = time.perf_counter() - start
    await pool.close()
    return elapsed


async def _cold_coalescing() -> dict[str, Any]:
    async def slow_factory(record: Any) -> object:
        # A few loop turns, like a real SDK client doing setup work.
        for _ in range(5):
            await asyncio.sleep(0)
        return object()

    pool = ModelClientPool(slow_factory, _noop_closer, max_clients=4)
    leases = await asyncio.gather(*(pool.acquire("alice", RECORD) for _ in range(COLD_WAITERS)))
    distinct = len({id(lease.provider) for lease in leases})
    for lease in leases:
        await lease.close()
    snapshot = await pool.snapshot()
    await pool.close()
    return {"constructions": snapshot["constructions"], "distinct_clients": distinct}


def run_benchmarks(
    *, emit: Callable[[dict[str, Any]], None] | None = None, repeats: int = REPEATS
) -> list[dict[str, Any]]:
    """Run every benchmark and return one dict per measured path (also passed to ``emit``
    as soon as it is measured). Raises nothing of its own; never asserts speed."""
    lines: list[dict[str, Any]] = []

    def out(line: dict[str, Any]) -> None:
        lines.append(line)
        if emit is not None:
            emit(line)

    n = UNCONTENDED_ITERATIONS
    sem_s = _best(lambda: asyncio.run(_uncontended(asyncio.Semaphore(1), n)), repeats)
    budget_s = _best(lambda: asyncio.run(_uncontended_budget(n)), repeats)
    ratio = budget_s / sem_s
    out(
        {
            "path": "budget_uncontended",
            "iterations": n,
            "budget_us": round(budget_s / n * 1e6, 3),
            "semaphore_us": round(sem_s / n * 1e6, 3),
            "ratio": round(ratio, 2),
            "target_max_ratio": 3.0,
            "ok": ratio <= 3.0,
        }
    )

    operations = CONTENDED_TASKS * CONTENDED_OPERATIONS
    contended_repeats = max(1, repeats - 2)
    sem_s = _best(
        lambda: asyncio.run(_contended(_semaphore_entry)),
        contended_repeats,
    )
    budget_s = _best(
        lambda: asyncio.run(
            _contended(
                lambda: ModelConcurrencyBudget(CONTENDED_LIMIT, max_waiting=CONTENDED_TASKS).lease
            )
        ),
        contended_repeats,
    )
    ratio = sem_s / budget_s  # throughput ratio, budget / semaphore
    out(
        {
            "path": "budget_contended",
            "tasks": CONTENDED_TASKS,
            "operations_per_task": CONTENDED_OPERATIONS,
            "limit": CONTENDED_LIMIT,
            "budget_ops_per_s": round(operations / budget_s),
            "semaphore_ops_per_s": round(operations / sem_s),
            "ratio": round(ratio, 2),
            "target_min_ratio": 0.5,
            "ok": ratio >= 0.5,
        }
    )

    n = WARM_ITERATIONS
    warm_s = _best(lambda: asyncio.run(_warm_pool(n)), repeats)
    warm_us = warm_s / n * 1e6
    out(
        {
            "path": "pool_warm_lease",
            "iterations": n,
            "acquire_close_us": round(warm_us, 3),
            "target_max_us": 20.0,
            "ok": warm_us <= 20.0,
        }
    )

    cold = asyncio.run(_cold_coalescing())
    out(
        {
            "path": "pool_cold_coalescing",
            "waiters": COLD_WAITERS,
            **cold,
            "ok": cold["constructions"] == 1 and cold["distinct_clients"] == 1,
        }
    )
    return lines


class Command(BaseCommand):
    help = "Benchmark the model concurrency budget and the model client pool (JSON lines)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--repeats",
            type=int,
            default=REPEATS,
            help="repeats per timing; the best is reported (default %(default)s)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        repeats = max(1, int(options["repeats"]))
        note(f"timing each path, best of {repeats}", stream=self.stderr, prefix="bench_pooling")
        run_benchmarks(emit=lambda line: self.stdout.write(json.dumps(line)), repeats=repeats)
