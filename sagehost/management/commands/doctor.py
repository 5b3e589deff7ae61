"""``manage.py doctor [--json]``: every health check of this host, one line each.

::

    ok    settings    valid
    ok    database    PostgreSQL 15.19 at 127.0.0.1:5432/sage (user sage)
    fail  workers     no worker heartbeat in the last 30 s
          → start a worker (manage.py runworker), or see why it stopped (its log)

``--json`` prints one document ``{"status", "checks": [{"name", "status", "detail",
"action", ...figures}]}``. The exit status is 1 when any check fails (warnings do not
count). The checks are `sagehost.health`'s; no line shows a password.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand

from sagehost import health


class Command(BaseCommand):
    help = (
        "Check this host: settings, database and migrations, Redis, live workers, the "
        "queue, runs stuck past their lease, clock skew, PostgreSQL's autovacuum and "
        "table statistics, disk space for SQLite. "
        "Exit status 1 when a check fails."
    )

    # Django's own checks read the database (a down one would end the command with a
    # traceback); the settings are one of doctor's checks.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", action="store_true", help="one JSON document")

    def handle(self, *args: Any, **options: Any) -> None:
        checks = health.doctor()
        status = health.worst(checks)
        if options["json"]:
            body = {"status": status, "checks": [c.as_dict() for c in checks]}
            self.stdout.write(json.dumps(body, indent=2, default=str))
        else:
            width = max(len(c.name) for c in checks) + 2
            for check in checks:
                self.stdout.write(f"{check.status:<6}{check.name:<{width}}{check.detail}")
                if check.action:
                    self.stdout.write(f"{'':<6}→ {check.action}")
        if status == health.FAIL:
            raise SystemExit(1)
