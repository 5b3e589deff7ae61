"""Shared output helpers of the agents management commands: JSON or text, one error
envelope (DESIGN §6) for ``--json``."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from sageproject.errors import SageError


def emit_json(command: BaseCommand, value: Any) -> None:
    command.stdout.write(json.dumps(value, indent=2, sort_keys=True, default=str))


def fail(command: BaseCommand, error: SageError, *, as_json: bool) -> None:
    """Report ``error`` and exit with status 1 (the envelope on stdout under ``--json``)."""
    if as_json:
        emit_json(command, error.to_dict())
        raise SystemExit(1)
    raise CommandError(f"{error.code}: {error.message}")
