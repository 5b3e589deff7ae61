"""procrastinate on PostgreSQL: ``BENCH_E2E_PROCRASTINATE_DSN`` (a libpq connection string)
with ``search_path`` set to ``BENCH_E2E_PROCRASTINATE_SCHEMA``, so its tables, types and
functions live in a schema of their own that the benchmark creates and drops. The benchmark
starts its worker as::

    python -m procrastinate --app=benchmarks.peers.procrastinate_app.app worker \\
        --queues=bench-e2e --concurrency=N
"""

from __future__ import annotations

import os

from procrastinate import App, PsycopgConnector

from benchmarks.peers import recorder

QUEUE = "bench-e2e"
SCHEMA = os.environ.get("BENCH_E2E_PROCRASTINATE_SCHEMA") or "bench_e2e_procrastinate"

app = App(
    connector=PsycopgConnector(
        conninfo=os.environ.get("BENCH_E2E_PROCRASTINATE_DSN", ""),
        kwargs={"options": f"-c search_path={SCHEMA}"},
        min_size=1,
        max_size=int(os.environ.get("BENCH_E2E_POOL_MAX") or "20"),
    )
)


@app.task(name="benchmarks.peers.record_start", queue=QUEUE)
async def record_start(key: str, i: int) -> None:
    await recorder.arecord(key, i)
