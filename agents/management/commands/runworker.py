"""``manage.py runworker``: the process that executes runs.

The worker is composed here, where both halves are visible in the imports: the scheduling
side (``scheduling.worker.Worker``: claims, leases, the dispatcher, snapshots) and the
agents side it executes runs with (``agents.executor.RunExecutor``). A run's terminal
transition writes its archive through ``agents.archives.archive_records``, registered with
the state machine at start-up by ``agents.apps``.
"""

from __future__ import annotations

import asyncio
import gc
import logging

import uvloop
from django.core.management.base import BaseCommand

from agents.executor import RunExecutor
from scheduling.worker import Worker, install_signal_handlers


class Command(BaseCommand):
    help = "Claim queued runs and execute them until SIGTERM/SIGINT."
    requires_system_checks = "__all__"

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--max-concurrent",
            type=int,
            default=None,
            help="this worker's slots (overrides SAGE_WORKER_CONCURRENT_RUNS)",
        )

    def handle(self, *args, **options) -> None:
        async def main() -> None:
            worker = Worker(executor=RunExecutor(), max_concurrent=options["max_concurrent"])
            # What start-up made lives as long as the process: out of the collector's sight,
            # a full collection no longer walks it. Such a walk pauses every run's stream
            # and the next claim (docs/PERFORMANCE.md).
            gc.freeze()
            install_signal_handlers(worker)
            logging.getLogger("sage.worker").info(
                "worker %s started: up to %d concurrent runs",
                worker.worker_id,
                worker.max_concurrent,
            )
            await worker.run()
            logging.getLogger("sage.worker").info("worker %s stopped", worker.worker_id)
            return worker.failed

        failed = asyncio.run(main(), loop_factory=uvloop.new_event_loop)
        if failed:
            # A supervisor (systemd, the container runtime, make run) restarts the worker.
            raise SystemExit(1)
