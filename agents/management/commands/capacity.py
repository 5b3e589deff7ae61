"""``manage.py capacity [--json]``: the latest snapshot of every live worker."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from agents.management.commands._output import emit_json
from scheduling.models import WorkerSnapshot


class Command(BaseCommand):
    help = "Print the latest capacity snapshot of each running worker."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        workers = [snapshot.summary() for snapshot in WorkerSnapshot.objects.live()]
        if options["json"]:
            emit_json(self, {"workers": workers})
            return
        if not workers:
            self.stdout.write("no worker is running")
            return
        for worker in workers:
            self.stdout.write(f"worker {worker['worker_id']} (heartbeat {worker['heartbeat_at']})")
            capacity = worker["capacity"] or {}
            runs = capacity.get("runs", {})
            self.stdout.write(f"  runs: {runs.get('active', 0)}/{runs.get('max_concurrent', '?')}")
            executor = capacity.get("executor", {})
            calls = executor.get("model_calls", {})
            if calls:
                self.stdout.write(
                    f"  model calls: {calls.get('active')}/{calls.get('limit')} active, "
                    f"{calls.get('waiting')} waiting"
                )
            management = executor.get("management", {})
            if management:
                self.stdout.write(
                    f"  applications: {management.get('applications')}/{management.get('limit')}"
                    f" resident, {management.get('building')} building"
                )
                for app in management.get("resident", []):
                    safe = "safe" if app.get("safe_to_release") else "busy"
                    self.stdout.write(
                        f"    {app['package']}/{app['agent']} owner {app['owner']} "
                        f"{app['state']} idle {app['idle_seconds']}s usage {app['usage']} "
                        f"unfinished {app['unfinished_runs']} ({safe})"
                    )
