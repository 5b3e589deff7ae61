"""``manage.py bench_scale --workers 1,2,4``: runs per second as worker processes are added.

For each worker count N: N ``manage.py runworker`` processes on the configured database, each
with ``--concurrency`` slots (default 16: ``SAGE_WORKER_CONCURRENT_RUNS``; the global and
per-user limits are N x that, so they never bind, and so are the model-call budgets), execute
runs whose model call waits ``--model-ms`` (default 200: the keyless ``scripted`` model, a
shared record ``bench-scale-<ms>ms`` whose reply is two tokens that far apart). The runs are
I/O-bound: the claim path, not the CPU, is what has to scale — N workers need at most
N x concurrency x 1000 / model-ms runs per second (320 at 4 workers).

Method, per N (the workers started fresh, the tables vacuumed and analyzed, untimed):

1. warm-up: 2 x N x concurrency runs, so every worker has built its Applications;
2. the workers are stopped (SIGSTOP) while N x concurrency x (1000 / model-ms) x
   ``--seconds`` runs are admitted (``agents.services.run_submit``, one session each, dealt
   over ``--users`` users), then all resumed (SIGCONT) at once;
3. ``runs_per_s`` = runs / (the last ``finished_at`` - the first ``started_at``), both the
   database's clock; ``per_worker_runs``: how many of them each worker completed (its
   snapshot's count when it stopped, minus its count after the warm-up).

Output, one JSON line per N on stdout, then the summary (context on stderr)::

    {"path": "scale", "workers": N, "runs_per_s": …, "per_worker_runs": […]}
    {"path": "scale_summary", "ratio_4_over_1": …, "max_share_spread": …}

``ratio_<max>_over_<min>`` compares the largest and the smallest worker counts measured;
``max_share_spread`` = (max - min) / mean of the per-worker counts at the largest. Target
(issue 17): ratio ≥ 3.2 at 4 over 1, spread ≤ 0.25.

Like the other database benchmarks it refuses to start while the database holds queued or
running runs (use a scratch database: ``DATABASE_URL=postgres://…/bench manage.py migrate``
first) and removes what it created — its users with their packages, sessions, runs and
archives, the workers' snapshots, the model record — on failure and on SIGTERM/Ctrl-C too.
The pieces (worker processes, their environment, admission, waiting, clean-up) are
``bench_e2e``'s (`benchmarks.e2e`) and `benchmarks.shared`'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections
from django.test.utils import override_settings

from benchmarks.e2e.harness import (
    BIG_LIMIT,
    ROOT,
    child_env,
    database_url,
    sigterm_as_exit,
    start_child,
    tidy_tables,
    wait_until,
)
from benchmarks.e2e.host import HostTarget
from benchmarks.e2e.method import submit_all
from scheduling.subprocesses import Subprocess

SNAPSHOT_WAIT = 30.0


def parse_workers(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CommandError("--workers takes comma-separated integers") from None
    if not counts or counts[0] < 1:
        raise CommandError("--workers counts must be positive")
    return counts


def spread(counts: list[int]) -> float:
    """(max - min) / mean of ``counts`` (0 for one worker)."""
    mean = sum(counts) / len(counts)
    return round((max(counts) - min(counts)) / mean, 3) if mean else 0.0


def model_record(model_ms: int) -> tuple[str, Any]:
    """The shared scripted record whose reply waits ``model_ms``: (name, the record if
    created here — to delete — else None)."""
    from pooling.models import ModelRecord, Protocol

    name = f"bench-scale-{model_ms}ms"
    options = {"token_delay_ms": model_ms, "script": [{"text": "done ok"}]}
    record, created = ModelRecord.objects.get_or_create(
        owner=None,
        name=name,
        defaults={"protocol": Protocol.SCRIPTED, "model": name, "options": options},
    )
    if not created and record.options != options:
        raise CommandError(f"a model record {name!r} with other options exists; remove it")
    return name, (record if created else None)


def bench_owners(count: int, model: str) -> list[tuple[Any, Any]]:
    """Throwaway users ``bench-<hex>-scale<i>``, each with a one-agent package on ``model``
    (no tools: one model call per run)."""
    from agents.management.commands.seed_demo import DEMO_MANIFEST
    from agents.services import packages
    from benchmarks.shared import bench_users

    agent = {**DEMO_MANIFEST["agents"]["assistant"], "model": model, "tools": []}
    manifest = {**DEMO_MANIFEST, "name": "bench-scale", "agents": {"assistant": agent}}
    users = bench_users(f"scale{i}" for i in range(count))
    return [
        (user, packages.package_create(owner=user, manifest=manifest)[0]) for user in users.values()
    ]


class Command(BaseCommand):
    help = (
        "Runs per second with 1, 2, 4… worker processes on runs whose model call waits "
        "--model-ms (I/O-bound), and how evenly the workers share them. One JSON line per "
        "worker count, then a summary. Use a scratch database (PostgreSQL)."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
        parser.add_argument("--concurrency", type=int, default=16, help="slots per worker")
        parser.add_argument("--model-ms", type=int, default=200, help="the model call's wait")
        parser.add_argument(
            "--seconds",
            type=float,
            default=10.0,
            help="measured work per worker count, at the ideal rate",
        )
        parser.add_argument("--users", type=int, default=16, help="owners of the runs")
        parser.add_argument(
            "--timeout", type=float, default=600.0, help="longest wait of any one step (s)"
        )

    def _note(self, message: str) -> None:
        self.stderr.write(f"bench_scale: {message}")
        self.stderr.flush()

    def _emit(self, line: dict[str, Any]) -> None:
        self.stdout.write(orjson.dumps(line).decode())
        self.stdout.flush()

    def handle(self, *args: Any, **options: Any) -> None:
        counts = parse_workers(options["workers"])
        for name in ("concurrency", "model_ms", "users"):
            if options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be positive")
        if options["seconds"] <= 0 or options["timeout"] <= 0:
            raise CommandError("--seconds and --timeout must be positive")
        from benchmarks.shared import require_scratch_queue

        require_scratch_queue()
        vendor = connections["default"].vendor
        if vendor != "postgresql":
            self._note(f"this is {vendor}; several hosts' workers are meant for PostgreSQL")
        # Every measured run is admitted before the workers resume: no pending limit in the way.
        limits = {
            "SAGE_SERVER_MAX_PENDING_RUNS": BIG_LIMIT,
            "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": BIG_LIMIT,
        }
        with (
            sigterm_as_exit(),
            override_settings(SAGE={**settings.SAGE, **limits}),
            contextlib.ExitStack() as stack,
        ):
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-scale-")))
            owners: list[tuple[Any, Any]] = []
            created: list[Any] = []
            stack.callback(self._delete_rows, owners, created)
            name, record = model_record(options["model_ms"])
            if record is not None:
                created.append(record)
            owners += bench_owners(options["users"], name)
            measured: dict[int, dict[str, Any]] = {}
            for count in counts:
                line = self._measure(count, owners, options, logs)
                measured[count] = line
                self._emit(line)
            low, high = counts[0], counts[-1]
            self._emit(
                {
                    "path": "scale_summary",
                    f"ratio_{high}_over_{low}": round(
                        measured[high]["runs_per_s"] / measured[low]["runs_per_s"], 3
                    ),
                    "max_share_spread": spread(measured[high]["per_worker_runs"]),
                }
            )

    # ------------------------------------------------------------------ one worker count

    def _measure(
        self, count: int, owners: list[tuple[Any, Any]], options: dict[str, Any], logs: Path
    ) -> dict[str, Any]:
        concurrency, timeout = options["concurrency"], options["timeout"]
        total = count * concurrency
        env = child_env(
            database_url(),
            concurrency,
            SAGE_SERVER_MAX_CONCURRENT_RUNS=str(total),
            SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER=str(total),
            SAGE_WORKER_CONCURRENT_RUNS=str(concurrency),
        )
        with contextlib.ExitStack() as stack:
            workers: list[Subprocess] = []
            stack.callback(self._stop_workers, workers)
            for index in range(count):
                argv = [sys.executable, str(ROOT / "manage.py"), "runworker"]
                workers.append(start_child(f"worker-{count}-{index}", argv, env, logs))
            wait_until("the workers to start", lambda: self._up(workers), 120, workers)
            host = HostTarget(owners, workers)

            warm = host.prepare(2 * total, f"warm-{count}")
            submit_all(host, warm, 1)
            host.settle(warm, timeout)
            baseline = self._completed(workers, at_least=len(warm.handles))

            runs = int(total * (1000 / options["model_ms"]) * options["seconds"])
            batch = host.prepare(runs, f"measured-{count}")
            tidy_tables()
            for worker in workers:
                worker.proc.send_signal(signal.SIGSTOP)
            try:
                submit_all(host, batch, 1)
            finally:
                for worker in workers:
                    worker.proc.send_signal(signal.SIGCONT)
            ended = host.settle(batch, timeout)["runs_ended"]
            if ended != {"completed": runs}:
                raise CommandError(f"{count} worker(s): the runs ended {ended}")
            first, last = self._window(batch)
            for worker in workers:
                worker.stop()
            final = self._completed(workers, at_least=len(warm.handles) + runs, stopped=True)
        per_worker = [final[w.pid] - baseline.get(w.pid, 0) for w in workers]
        if sum(per_worker) != runs:
            raise CommandError(f"the workers' counts {per_worker} do not add up to {runs} runs")
        elapsed = (last - first).total_seconds()
        self._note(
            f"{count} worker(s) x {concurrency} slots: {runs} runs in {elapsed:.2f} s "
            f"(ideal {runs / (total * 1000 / options['model_ms']):.2f} s); "
            f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"
        )
        return {
            "path": "scale",
            "workers": count,
            "runs_per_s": round(runs / elapsed, 1),
            "per_worker_runs": sorted(per_worker, reverse=True),
        }

    def _window(self, batch: Any) -> tuple[Any, Any]:
        """The batch's first start and last finish (the database's clock)."""
        from django.db.models import Max, Min

        from scheduling.models import Run

        span = Run.objects.filter(pk__in=batch.results).aggregate(
            first=Min("started_at"), last=Max("finished_at")
        )
        return span["first"], span["last"]

    def _snapshots(self, workers: list[Subprocess]) -> Any:
        from scheduling.models import WorkerSnapshot

        return WorkerSnapshot.objects.filter(
            pid__in=[w.pid for w in workers], host=socket.gethostname()
        )

    def _up(self, workers: list[Subprocess]) -> bool:
        return self._snapshots(workers).filter(stopped_at__isnull=True).count() == len(workers)

    def _completed(
        self, workers: list[Subprocess], *, at_least: int, stopped: bool = False
    ) -> dict[int, int]:
        """Each worker's completed runs as its snapshot says, once they add up to
        ``at_least`` (snapshots are published every few seconds; ``stopped``: the last)."""
        found: dict[int, int] = {}

        def counted() -> bool:
            rows = self._snapshots(workers)
            if stopped:
                rows = rows.filter(stopped_at__isnull=False)
            found.clear()
            for pid, capacity in rows.values_list("pid", "capacity"):
                found[pid] = int(((capacity or {}).get("runs") or {}).get("completed", 0))
            return len(found) == len(workers) and sum(found.values()) >= at_least

        wait_until("the workers' snapshots to count their runs", counted, SNAPSHOT_WAIT)
        return dict(found)

    def _stop_workers(self, workers: list[Subprocess]) -> None:
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.proc.send_signal(signal.SIGCONT)
            worker.stop()
        self._snapshots(workers).delete()

    def _delete_rows(self, owners: list[tuple[Any, Any]], created: list[Any]) -> None:
        from benchmarks.shared import delete_users

        connections.close_all()
        delete_users([user for user, _ in owners])
        for record in created:
            record.delete()
