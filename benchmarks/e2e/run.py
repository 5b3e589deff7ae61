"""This host's paths in order, after the peers: the claim path, a worker, the history,
throughput and latency (with the ratios to the peers measured before), then the HTTP
paths. Everything it creates is removed on every exit."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.db import connections

from benchmarks.e2e.harness import (
    ROOT,
    Subprocess,
    child_env,
    database_url,
    host_line,
    progress,
    ratio_key,
    start_child,
    tidy_tables,
    wait_until,
)
from benchmarks.e2e.host import (
    CLAIM_USERS,
    HostTarget,
    bench_owners,
    claim_path,
    ensure_scripted_record,
)
from benchmarks.e2e.http import http_paths, start_web
from benchmarks.e2e.method import measure_latency, measure_throughput, warm_up
from benchmarks.shared import delete_users


def host_paths(
    options: dict[str, Any],
    sizes: list[int],
    vendor: str,
    peers: dict[str, dict[str, Any]],
    *,
    emit: Callable[[dict[str, Any]], None],
) -> None:
    """Measure this host, each line given to ``emit``; ``peers``: the peers' lines that
    carry figures, for the ratios."""
    common = {"database": vendor, "host": "sage", "history": options["history"]}
    timeout = options["timeout"]
    concurrency = options["concurrency"]
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-e2e-")))
        # Registered before anything is created, so a failure half-way cleans up too.
        owners: list[tuple[Any, Any]] = []
        claim_owners: list[Any] = []
        created: list[Any] = []
        stack.callback(delete_rows, owners, claim_owners, created)
        owners += bench_owners(options["users"], "u")
        claim_owners += [user for user, _ in bench_owners(CLAIM_USERS, "claim")]
        if (record := ensure_scripted_record()) is not None:
            created.append(record)

        if not options["skip_claim"]:
            progress("claim path")
            line = asyncio.run(claim_path(claim_owners, sizes, options["claim_repeat"]))
            emit({**line, **common})
        connections.close_all()  # the claim path's threads are gone; so are theirs

        progress("starting the worker")
        env = child_env(database_url(), concurrency)
        worker = start_child(
            "worker", [sys.executable, str(ROOT / "manage.py"), "runworker"], env, logs
        )
        stack.callback(stop_worker, worker)
        host = HostTarget(owners, [worker])
        wait_until("the worker to start", lambda: worker_up(worker), 60, [worker])
        progress(f"history: {options['history']} runs")
        warm_up(host, options["history"], timeout)
        context = {**common, "concurrency": concurrency, "users": len(owners)}

        tidy_tables()
        progress(f"throughput: {options['n']} runs")
        measured = measure_throughput(host, options["n"], options["submit_threads"], timeout)
        line = host_line("throughput", context, measured)
        for peer, theirs in peers.items():
            line[ratio_key(peer)] = round(line["started_per_s"] / theirs["started_per_s"], 3)
        emit(line)

        tidy_tables()
        progress(f"latency: {options['latency_n']} runs at {options['rate']}/s")
        measured = measure_latency(host, options["latency_n"], options["rate"], timeout)
        line = host_line("latency", context, measured)
        for peer, theirs in peers.items():
            line[ratio_key(peer)] = {
                q: round(line[f"{q}_ms"] / theirs[f"latency_{q}_ms"], 3)
                for q in ("p50", "p99")
                if theirs.get(f"latency_{q}_ms")
            }
        emit(line)

        if options["skip_http"]:
            return
        web = start_web(options, env, logs, stack)
        http_paths(options, host, owners, web, worker, common, emit=emit, stack=stack)


def worker_up(worker: Subprocess) -> bool:
    from scheduling.models import WorkerSnapshot

    return WorkerSnapshot.objects.filter(
        pid=worker.pid, host=socket.gethostname(), stopped_at__isnull=True
    ).exists()


def stop_worker(worker: Subprocess) -> None:
    from scheduling.models import WorkerSnapshot

    worker.stop()
    WorkerSnapshot.objects.filter(pid=worker.pid, host=socket.gethostname()).delete()


def delete_rows(owners: list[tuple[Any, Any]], claim_owners: list[Any], created: list[Any]) -> None:
    progress("cleaning up")
    connections.close_all()
    delete_users([user for user, _ in owners] + claim_owners)
    for record in created:
        record.delete()
