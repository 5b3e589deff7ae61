"""``manage.py export_session SESSION_ID``: a session's complete history as JSON Lines."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.management.base import BaseCommand, CommandError

from sageproject.progress import Progress, is_terminal
from scheduling.models import Session
from scheduling.serialization import export_session_lines


class Command(BaseCommand):
    help = (
        "Write a session's complete history (fork-base events included) as JSON Lines: "
        "a header line, the runs, then every event."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("session_id", help="the session's UUID")
        parser.add_argument(
            "--output", "-o", default="-", help="file to write (default: standard output)"
        )
        parser.add_argument("--database", default="default", help="database alias")

    def handle(self, *args: Any, **options: Any) -> None:
        db = options["database"]
        try:
            session = Session.objects.using(db).get(pk=options["session_id"])
        except (Session.DoesNotExist, DjangoValidationError, ValueError):
            raise CommandError(f"no session {options['session_id']!r}") from None
        # Lines written, on a terminal only (sageproject.progress), and not while the lines
        # themselves go to that terminal.
        to_terminal = options["output"] == "-" and is_terminal(self.stdout)
        with Progress(
            "export_session", unit="lines", stream=self.stderr, enabled=not to_terminal
        ) as bar:
            self._write(bar.track(export_session_lines(session, using=db)), options["output"])

    def _write(self, lines: Iterator[bytes], output: str) -> None:
        if output == "-":
            # Bytes straight to the binary stream: the payloads are already JSON text.
            stream = getattr(self.stdout, "_out", sys.stdout)
            binary = getattr(stream, "buffer", None)
            if binary is not None:
                for line in lines:
                    binary.write(line)
                binary.flush()
            else:
                for line in lines:
                    self.stdout.write(line.decode(), ending="")
            return
        with open(output, "wb") as handle:
            for line in lines:
                handle.write(line)
