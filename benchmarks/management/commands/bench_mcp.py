"""``manage.py bench_mcp``: what our MCP path adds to a tool call, and many runs calling
MCP tools at once within the session pool's limit.

One JSON line on stdout (progress on stderr), with the machine's figures (cpus, load_1m,
steal_pct, cpu_speed), measured against one MCP server on loopback built with the
official SDK's server side (`benchmarks.mcp.EchoServer`, the tool ``echo``):

- ``overhead``: ``--calls`` sequential pairs of calls after a warm-up, (a) on a bare SDK
  ``ClientSession`` with a plain httpx2 client, (b) through `McpRuntime` as the engine
  calls a tool (credential headers, the guarded outbound client, the pooled session, the
  call slot, the ``_meta`` idempotency key, the output cap); p50/p99/mean of each and
  ``added_p50_ms`` = ours - bare (target 2 ms); ``added_paired_p50_ms``: the median of
  each pair's difference (the two ran back to back, each first every other time).
- ``concurrent``: ``--runs`` runs dealt over ``--users`` users, each user with their own
  bearer-token connection, each run's scripted model calling ``echo`` ``--calls-per-run``
  times, executed by a real ``manage.py runworker`` subprocess with
  ``SAGE_MCP_MAX_SESSIONS=--max-sessions``. A run suspended because every session slot
  was in use (``mcp.session_pool_full``) is answered ``retry``, as its user would, and
  counted. The most sessions held at once: the worker's snapshot
  (``capacity.executor.mcp_sessions.entries``, sampled) and the server's own count.

Like the other database benchmarks it refuses a database holding queued or running runs
and removes what it created (users, packages, sessions, runs, connections, the model
record, the worker's snapshot), on failure and SIGTERM/Ctrl-C too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections
from django.test.utils import override_settings

from benchmarks.e2e.harness import (
    POLL_SECONDS,
    ROOT,
    check_running,
    child_env,
    database_url,
    sigterm_as_exit,
    start_child,
    wait_until,
)
from benchmarks.e2e.machine import cpu_jiffies, cpu_speed
from benchmarks.mcp import SERVER, TOOL, EchoServer, overhead
from benchmarks.shared import require_scratch_queue

WARMUP_CALLS = 50
LOOPBACK = "127.0.0.1"


def manifest(model: str, url: str) -> dict[str, Any]:
    return {
        "name": "bench-mcp",
        "version": "1.0.0",
        "entrypoint": "assistant",
        "agents": {
            "assistant": {
                "model": model,
                "instructions": "Echo through the MCP server.",
                "mcp_servers": [{"name": SERVER, "url": url}],
            }
        },
    }


def script(calls: int) -> list[dict[str, Any]]:
    """One model step per MCP call, then the answer."""
    name = f"mcp__{SERVER}__{TOOL}"
    steps: list[dict[str, Any]] = [
        {"text": "", "tool_calls": [{"name": name, "arguments": {"text": f"call {i}"}}]}
        for i in range(calls)
    ]
    return [*steps, {"text": "done"}]


class Command(BaseCommand):
    help = (
        "MCP tool calls: what our path adds to a bare SDK call (overhead), and --runs "
        "concurrent runs of --users users each making --calls-per-run MCP calls in a real "
        "worker within --max-sessions pooled sessions (concurrent). One JSON line. Use a "
        "scratch database."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--calls", type=int, default=500, help="timed sequential calls")
        parser.add_argument("--runs", type=int, default=200, help="concurrent runs")
        parser.add_argument("--users", type=int, default=20, help="owners of the runs")
        parser.add_argument("--calls-per-run", type=int, default=5, help="MCP calls per run")
        parser.add_argument(
            "--max-sessions", type=int, default=16, help="the worker's SAGE_MCP_MAX_SESSIONS"
        )
        parser.add_argument("--skip-concurrent", action="store_true")
        parser.add_argument(
            "--timeout", type=float, default=600.0, help="longest wait of any one step (s)"
        )

    def _note(self, message: str) -> None:
        self.stderr.write(f"bench_mcp: {message}")
        self.stderr.flush()

    def _emit(self, line: dict[str, Any], mark: tuple[int, int] | None) -> None:
        """The line with what the machine was doing (as bench_e2e's lines)."""
        line = {**line, "cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)}
        now = cpu_jiffies()
        if now is not None and mark is not None and now[1] > mark[1]:
            line["steal_pct"] = round(100 * (now[0] - mark[0]) / (now[1] - mark[1]), 1)
        line["cpu_speed"] = cpu_speed()
        self.stdout.write(orjson.dumps(line).decode())
        self.stdout.flush()

    def handle(self, *args: Any, **options: Any) -> None:
        for name in ("calls", "runs", "users", "calls_per_run", "max_sessions"):
            if options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be positive")
        if options["timeout"] <= 0:
            raise CommandError("--timeout must be positive")
        if not options["skip_concurrent"]:
            require_scratch_queue()
        # Per-request INFO lines of the HTTP client and the SDK would bury the results.
        for name in ("httpx", "httpx2", "mcp"):
            logging.getLogger(name).setLevel(logging.WARNING)
        mark = cpu_jiffies()
        allowed = {"SAGE_MCP_ALLOWED_HOSTS": (LOOPBACK,)}
        line: dict[str, Any] = {"path": "mcp", "database": connections["default"].vendor}
        with (
            sigterm_as_exit(),
            override_settings(SAGE={**settings.SAGE, **allowed}),
            contextlib.ExitStack() as stack,
        ):
            server = EchoServer().start()
            stack.callback(server.stop)
            self._note(f"overhead: {options['calls']} calls each way")
            line["overhead"] = overhead(server.url, options["calls"], WARMUP_CALLS)
            if not options["skip_concurrent"]:
                line["concurrent"] = self._concurrent(options, stack)
        self._emit(line, mark)

    # ------------------------------------------------------------------ concurrent

    def _concurrent(self, options: dict[str, Any], stack: contextlib.ExitStack) -> dict[str, Any]:
        from agents.services import packages
        from agents.services.mcp import mcp_connection_save
        from benchmarks.shared import bench_users
        from pooling.models import ModelRecord, Protocol

        runs, users, per_run = options["runs"], options["users"], options["calls_per_run"]
        limit, timeout = options["max_sessions"], options["timeout"]
        # Its own server: the session counts are the worker's alone.
        server = EchoServer().start()
        stack.callback(server.stop)
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-mcp-")))
        owners: list[Any] = []
        created: list[Any] = []
        stack.callback(self._delete_rows, owners, created)
        tag = uuid.uuid4().hex[:8]
        model = f"bench-mcp-{tag}"
        created.append(
            ModelRecord.objects.create(
                owner=None,
                name=model,
                protocol=Protocol.SCRIPTED,
                model=model,
                options={"script": script(per_run)},
            )
        )
        owners += bench_users(f"mcp{i}" for i in range(users)).values()
        for index, user in enumerate(owners):
            packages.package_create(owner=user, manifest=manifest(model, server.url))
            mcp_connection_save(
                user=user, server_url=server.url, bearer_token=f"bench-{tag}-{index}"
            )
        env = child_env(
            database_url(),
            runs,
            SAGE_SERVER_MAX_CONCURRENT_RUNS=str(runs),
            SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER=str(runs),
            SAGE_WORKER_CONCURRENT_RUNS=str(runs),
            SAGE_MCP_ALLOWED_HOSTS=LOOPBACK,
            SAGE_MCP_MAX_SESSIONS=str(limit),
        )
        argv = [sys.executable, str(ROOT / "manage.py"), "runworker"]
        worker = start_child("worker-mcp", argv, env, logs)
        stack.callback(self._stop_worker, worker)
        wait_until("the worker to start", lambda: self._snapshot(worker) is not None, 120, [worker])

        session_ids = self._sessions(owners, runs)
        self._note(f"concurrent: {runs} runs x {per_run} calls, {users} users, {limit} sessions")
        return self._drive(worker, server, owners, session_ids, per_run, limit, timeout)

    def _sessions(self, owners: list[Any], runs: int) -> list[tuple[Any, Any]]:
        from agents import services

        return [
            (owner, services.session_create(owner=owner, package="bench-mcp", agent="assistant").pk)
            for owner in (owners[i % len(owners)] for i in range(runs))
        ]

    def _drive(
        self,
        worker: Any,
        server: EchoServer,
        owners: list[Any],
        session_ids: list[tuple[Any, Any]],
        per_run: int,
        limit: int,
        timeout: float,
    ) -> dict[str, Any]:
        from django.db.models import Max, Min

        from agents.services import run_reply, run_submit
        from scheduling.models import Event, Run, RunStatus

        run_ids = []
        for owner, session_id in session_ids:
            run, _ = run_submit(owner=owner, session_id=session_id, input="go")
            run_ids.append(run.pk)
        mine = Run.objects.filter(pk__in=run_ids)
        largest_seen = 0
        retries = 0
        deadline = time.monotonic() + timeout
        while True:
            check_running(worker)
            snapshot = self._snapshot(worker) or {}
            held = int(snapshot.get("entries") or 0)
            largest_seen = max(largest_seen, held)
            statuses = Counter(mine.values_list("status", flat=True))
            for run in mine.filter(status=RunStatus.SUSPENDED):
                if (run.interaction or {}).get("code") == "mcp.session_pool_full":
                    run_reply(run=run, decision="retry")
                    retries += 1
                else:
                    raise CommandError(f"a run suspended: {run.interaction}")
            if not (statuses.keys() & {RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SUSPENDED}):
                break
            if time.monotonic() > deadline:
                raise CommandError(f"timed out after {timeout:.0f} s: the runs are {statuses}")
            time.sleep(POLL_SECONDS)
        span = mine.aggregate(first=Min("started_at"), last=Max("finished_at"))
        seconds = (span["last"] - span["first"]).total_seconds()
        ended = Counter(mine.values_list("status", flat=True))
        completed = ended.get(RunStatus.COMPLETED, 0)
        kinds = Counter(
            Event.objects.filter(run_id__in=run_ids, type__startswith="tool.call.").values_list(
                "type", flat=True
            )
        )
        succeeded = kinds.get("tool.call.succeeded", 0)
        # Why calls failed (the tool results the model saw), most frequent first.
        reasons = Counter(
            str(event.payload.get("error", ""))[:120]
            for event in Event.objects.filter(run_id__in=run_ids, type="tool.call.failed")
        )
        held = max(largest_seen, server.max_open)
        return {
            "runs": len(run_ids),
            "users": len(owners),
            "calls_per_run": per_run,
            "runs_completed": completed,
            "runs_ended": dict(sorted(ended.items())),
            "seconds": round(seconds, 3),
            "runs_per_s": round(completed / seconds, 1) if seconds else None,
            "calls_succeeded": succeeded,
            "calls_failed": kinds.get("tool.call.failed", 0),
            "calls_failed_because": dict(reasons.most_common(5)),
            "calls_per_s": round(succeeded / seconds, 1) if seconds else None,
            "server_calls": server.calls,
            "pool_full_retries": retries,
            "max_sessions_configured": limit,
            "max_sessions_held_snapshot": largest_seen,
            "max_sessions_open_server": server.max_open,
            "sessions_opened_server": server.sessions,
            "held_within_limit": held <= limit,
        }

    # ------------------------------------------------------------------ worker and rows

    def _snapshots(self, worker: Any) -> Any:
        from scheduling.models import WorkerSnapshot

        return WorkerSnapshot.objects.filter(pid=worker.pid, host=socket.gethostname())

    def _snapshot(self, worker: Any) -> dict[str, Any] | None:
        """The worker's published MCP session figures, or None before its first snapshot."""
        row = self._snapshots(worker).filter(stopped_at__isnull=True).first()
        if row is None:
            return None
        return ((row.capacity or {}).get("executor") or {}).get("mcp_sessions") or {}

    def _stop_worker(self, worker: Any) -> None:
        worker.stop()
        self._snapshots(worker).delete()

    def _delete_rows(self, owners: list[Any], created: list[Any]) -> None:
        from agents.models import McpConnection
        from benchmarks.shared import delete_users

        connections.close_all()
        McpConnection.objects.filter(owner__in=owners).delete()
        delete_users(owners)
        for record in created:
            record.delete()
