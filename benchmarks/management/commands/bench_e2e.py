"""``manage.py bench_e2e``: this host end to end, side by side with other task queues.

The paths, the method and the output are described in `benchmarks.e2e`; the pieces live
there too, one concern a module: `harness` (lines, database, subprocesses), `machine`
(what the machine was doing), `method` (targets, throughput, latency), `host` (this host
in process, the claim path), `http` (admission over HTTP, streaming), `peers` (the other
task queues and their driver) and `run` (this host's paths in order). This command reads
the options, runs the peers, then this host, and writes one JSON line per path.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import orjson
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections
from django.test.utils import override_settings

from benchmarks.e2e.harness import BIG_LIMIT, peer_line, sigterm_as_exit
from benchmarks.e2e.machine import cpu_jiffies, cpu_speed
from benchmarks.e2e.peers import PEERS, peer_driver, run_peer
from benchmarks.e2e.run import host_paths
from benchmarks.shared import require_scratch_queue


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CommandError("--claim-queued takes comma-separated integers") from None
    if len(sizes) < 1 or sizes[0] < 1:
        raise CommandError("--claim-queued sizes must be positive")
    return sizes


def parse_peers(text: str) -> list[str]:
    text = text.strip().lower()
    if text in ("", "none"):
        return []
    if text == "all":
        return list(PEERS)
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise CommandError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
    return names


class Command(BaseCommand):
    help = (
        "End-to-end figures of this host (claim time, runs started/s, submit→start latency, "
        "HTTP admission, model token→SSE client, durable event→SSE client) side by side "
        "with procrastinate, Celery + Redis and django-tasks-db doing trivial tasks "
        "(bench-only packages: requirements-bench.txt; "
        "each peer measured in a subprocess with "
        "DJANGO_SETTINGS_MODULE=benchmarks.peers.settings). "
        "One JSON line per path. Use a scratch database; SQLite runs without peers."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--n", type=int, default=5000, help="throughput submissions")
        parser.add_argument("--latency-n", type=int, default=500, help="latency submissions")
        parser.add_argument("--rate", type=float, default=50.0, help="latency submits per s")
        parser.add_argument(
            "--submit-threads",
            type=int,
            default=1,
            help="threads sharing the throughput submissions (peers get the same)",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=32,
            help="runs executing at once in our worker; Celery/procrastinate worker concurrency",
        )
        parser.add_argument("--users", type=int, default=8, help="owners of the runs")
        parser.add_argument(
            "--history",
            type=int,
            default=2000,
            help="runs (tasks) each target executes before its paths, kept as its history",
        )
        parser.add_argument(
            "--claim-queued", default="100,10000", help="queue sizes of the claim path"
        )
        parser.add_argument("--claim-repeat", type=int, default=15)
        parser.add_argument("--skip-claim", action="store_true")
        parser.add_argument("--http-clients", type=int, default=50)
        parser.add_argument("--http-seconds", type=float, default=10.0)
        parser.add_argument("--web-workers", type=int, default=2, help="uvicorn --workers")
        parser.add_argument(
            "--skip-http",
            action="store_true",
            help="skip http_admission, token_to_sse and event_to_sse",
        )
        parser.add_argument(
            "--sse-n", type=int, default=100, help="runs of token_to_sse and event_to_sse"
        )
        parser.add_argument("--sse-tokens", type=int, default=20, help="tokens per run")
        parser.add_argument(
            "--sse-token-gap-ms", type=float, default=10.0, help="between a run's tokens"
        )
        parser.add_argument(
            "--peers",
            default="all",
            help="none, all, or a comma-separated subset of " + ", ".join(PEERS),
        )
        parser.add_argument(
            "--redis-url",
            default="redis://127.0.0.1:6379/13",
            help="Redis for Celery's broker and the peers' start times",
        )
        parser.add_argument(
            "--db-worker-processes",
            type=int,
            default=None,
            help="django-tasks-db db_worker processes (default min(concurrency, 2 x CPUs))",
        )
        parser.add_argument("--db-worker-interval", type=float, default=0.05)
        parser.add_argument(
            "--timeout", type=float, default=600.0, help="longest wait of any one step (s)"
        )
        parser.add_argument("--peer-driver", default=None, help=argparse.SUPPRESS)

    def _write(self, line: dict[str, Any]) -> None:
        self.stdout.write(orjson.dumps(line).decode())
        self.stdout.flush()

    def _emit(self, line: dict[str, Any]) -> None:
        """Write a result line with what the machine was doing: its size and load while the
        path ran (a shared machine skews figures), the share of its CPU time the hypervisor
        gave to others since the line before, and its speed now."""
        line = {**line, "cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)}
        now, mark = cpu_jiffies(), self._cpu_mark
        # Lines written together (token_to_sse and event_to_sse) share their interval.
        if now is not None and mark is not None and now[1] > mark[1]:
            self._steal = round(100 * (now[0] - mark[0]) / (now[1] - mark[1]), 1)
            self._cpu_mark = now
        if self._steal is not None:
            line["steal_pct"] = self._steal
        line["cpu_speed"] = cpu_speed()
        self._write(line)

    def handle(self, *args: Any, **options: Any) -> None:
        self._cpu_mark, self._steal = cpu_jiffies(), None
        for name in (
            "n",
            "latency_n",
            "submit_threads",
            "concurrency",
            "users",
            "claim_repeat",
            "history",
        ):
            if options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be positive")
        if options["rate"] <= 0 or options["http_seconds"] <= 0 or options["timeout"] <= 0:
            raise CommandError("--rate, --http-seconds and --timeout must be positive")
        for name in ("http_clients", "sse_n", "sse_tokens", "web_workers"):
            if options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be positive")
        if options["sse_token_gap_ms"] < 0:
            raise CommandError("--sse-token-gap-ms must not be negative")
        if options["db_worker_processes"] is None:
            options["db_worker_processes"] = min(options["concurrency"], 2 * (os.cpu_count() or 1))
        if options["peer_driver"]:
            with sigterm_as_exit():
                # Bare: the parent writes the line again with the machine's figures.
                self._write(peer_driver(options["peer_driver"], options))
            return
        # The HTTP client's per-request INFO lines would bury the progress and the results.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        sizes = parse_sizes(options["claim_queued"])
        peers = parse_peers(options["peers"])
        vendor = connections["default"].vendor
        require_scratch_queue()
        with sigterm_as_exit():
            peer_lines: dict[str, dict[str, Any]] = {}
            for peer in peers:
                if vendor != "postgresql":
                    line = peer_line(
                        peer, skipped=f"peers run on PostgreSQL only (this is {vendor})"
                    )
                else:
                    line = run_peer(peer, options)
                peer_lines[peer] = line
                self._emit(line)
            measured = {peer: line for peer, line in peer_lines.items() if "started_per_s" in line}
            limits = {
                "SAGE_SERVER_MAX_PENDING_RUNS": BIG_LIMIT,
                "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": BIG_LIMIT,
            }
            with override_settings(SAGE={**settings.SAGE, **limits}):
                host_paths(options, sizes, vendor, measured, emit=self._emit)
