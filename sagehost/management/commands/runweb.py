"""``manage.py runweb [--host H] [--port P] [--workers N]``: the web processes of a host.

N processes (default: one per CPU) serve ``sagehost.asgi`` on one port, each with a
listening socket of its own (``SO_REUSEPORT``), so the kernel spreads connections evenly
over them — ``uvicorn --workers N`` lets whichever process is idle first take them, which
leaves keep-alive clients bunched on one process (`sagehost.webserver`). A process that
exits is started again; SIGTERM or Ctrl-C stops them gracefully.
"""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from sagehost.webserver import Supervisor


class Command(BaseCommand):
    help = "Run the web processes: N uvicorn processes on one port (SO_REUSEPORT)."

    requires_system_checks: list[str] = []  # each web process checks its settings at start

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument(
            "--workers", type=int, default=os.cpu_count() or 1, help="processes (default: CPUs)"
        )
        parser.add_argument(
            "--log-level",
            default="info",
            choices=["critical", "error", "warning", "info", "debug"],
            help="uvicorn's log level",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["workers"] < 1:
            raise CommandError("--workers must be at least 1")
        supervisor = Supervisor(
            options["host"],
            options["port"],
            options["workers"],
            log=lambda line: self.stdout.write(line),
            log_level=options["log_level"],
        )
        try:
            code = supervisor.run()
        except OSError as exc:
            raise CommandError(
                f"cannot listen on {options['host']}:{options['port']}: {exc}"
            ) from None
        if code:
            raise CommandError("a web process exited at start; see the messages above")
