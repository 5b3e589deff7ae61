"""``manage.py import_session FILE``: restore an ``export_session`` file into this database."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import orjson
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from sageproject.errors import SageError
from sageproject.progress import Progress
from scheduling.serialization import import_session_lines


class Command(BaseCommand):
    help = (
        "Restore a session exported by export_session (JSON Lines) into the configured "
        "database, so that exporting it again gives the same file."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("file", help="the export file, or - for standard input")
        parser.add_argument(
            "--owner",
            default=None,
            help="username to own the imported sessions (default: as exported)",
        )
        parser.add_argument(
            "--create-owner",
            action="store_true",
            help="create the exported owner when no such user exists",
        )
        parser.add_argument("--database", default="default", help="database alias")
        parser.add_argument(
            "--json", action="store_true", help="print the result, or the error envelope, as JSON"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        db = options["database"]
        owner = None
        if options["owner"]:
            User = get_user_model()
            try:
                owner = User._default_manager.db_manager(db).get_by_natural_key(options["owner"])
            except User.DoesNotExist:
                raise CommandError(f"no user {options['owner']!r}") from None
        try:
            with contextlib.ExitStack() as stack:
                if options["file"] == "-":
                    source, size = sys.stdin.buffer, None
                else:
                    source = stack.enter_context(open(options["file"], "rb"))
                    size = os.fstat(source.fileno()).st_size
                # Bytes read, on a terminal only (sageproject.progress).
                bar = stack.enter_context(
                    Progress("import_session", total=size, unit="B", stream=self.stderr)
                )
                session = import_session_lines(
                    bar.track(source, len),
                    using=db,
                    owner=owner,
                    create_owner=options["create_owner"],
                )
        except OSError as exc:
            raise CommandError(f"cannot read {options['file']}: {exc}") from exc
        except SageError as exc:
            if options["json"]:
                self.stdout.write(orjson.dumps(exc.to_dict()).decode())
                raise SystemExit(1) from exc
            raise CommandError(f"{exc.code}: {exc.message}") from exc
        if options["json"]:
            self.stdout.write(
                orjson.dumps(
                    {"session": str(session.id), "events": session.persisted_events}
                ).decode()
            )
        else:
            self.stdout.write(f"imported session {session.id} ({session.persisted_events} events)")
