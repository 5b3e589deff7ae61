"""Throughput of a job runtime for trivial jobs (benchmarks are commands, not tests).

``measure_throughput(runtime, n)`` submits ``n`` built-in ``echo`` jobs (one short chunk
each), in waves no larger than the runtime's admission limit, waits for every one and
returns one JSON-able dict. Run it directly::

    python -m benchmarks.jobs --runtime memory --jobs 2000
    python -m benchmarks.jobs --runtime celery --jobs 500 --queue sage-jobs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from typing import Any

from agents.jobs.base import JobSpec, JobState


async def measure_throughput(runtime: Any, n: int) -> dict[str, Any]:
    """Run ``n`` trivial ``echo`` jobs through ``runtime``; returns jobs/s and counts.

    Submits concurrently in waves of at most ``max_admitted_jobs`` and waits for each wave,
    so the figure covers admission, dispatch, execution, output and terminal state.
    Raises ``ValueError`` when ``n < 1``.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    wave = max(1, min(n, runtime.limits.max_admitted_jobs))
    spec = JobSpec(owner_run_id=run_id, kind="echo", payload={"chunks": ["ok"]})
    completed = 0
    started = time.perf_counter()
    remaining = n
    while remaining:
        size = min(wave, remaining)
        handles = await asyncio.gather(*(runtime.submit(spec) for _ in range(size)))
        done = await asyncio.gather(*(runtime.wait(h.job_id) for h in handles))
        completed += sum(1 for d in done if d.state is JobState.COMPLETED)
        remaining -= size
    elapsed = time.perf_counter() - started
    purged = await runtime.purge_terminal(run_id)
    return {
        "runtime": type(runtime).__name__,
        "jobs": n,
        "completed": completed,
        "seconds": round(elapsed, 4),
        "jobs_per_second": round(n / elapsed, 1),
        "wave": wave,
        "purged": purged,
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    if args.runtime == "memory":
        from agents.jobs.memory import InMemoryJobRuntime

        runtime: Any = InMemoryJobRuntime()
    else:
        if args.redis_url:
            # The Celery app takes its broker from REDIS_URL when first imported: point it
            # at the same Redis as the runtime, or tasks would wait on another broker.
            os.environ["REDIS_URL"] = args.redis_url
        from agents.jobs.celery_runtime import CeleryJobRuntime

        runtime = CeleryJobRuntime(
            redis_url=args.redis_url, key_prefix=args.prefix, queue=args.queue
        )
    try:
        return await measure_throughput(runtime, args.jobs)
    finally:
        await runtime.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runtime", choices=["memory", "celery"], default="memory")
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--prefix", default=f"sage:bench:{uuid.uuid4().hex[:8]}")
    parser.add_argument("--queue", default=None)
    print(json.dumps(asyncio.run(_main(parser.parse_args()))))


if __name__ == "__main__":
    main()
