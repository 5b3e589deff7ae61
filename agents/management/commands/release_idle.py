"""``manage.py release_idle [--min-idle 300] [--limit 4] [--json] [--wait 30]``.

Records a release request for the worker (the only process holding Applications) and
waits for its answer; with no worker running it says so at the deadline.
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand
from django.utils import timezone

from agents.management.commands._output import emit_json, fail
from agents.models import ReclamationRequest, ReclamationStatus
from agents.services.reclamations import reclamation_create, wait_for_answer
from sageproject.errors import UnavailableError
from sageproject.progress import Progress


class Command(BaseCommand):
    help = "Ask the worker to release idle, safe Applications and print its answer."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--min-idle", type=int, default=300, help="seconds (default 300)")
        parser.add_argument("--limit", type=int, default=4, help="at most (default 4)")
        parser.add_argument("--json", action="store_true")
        parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait (30)")

    def handle(self, *args: Any, **options: Any) -> None:
        as_json = options["json"]
        if options["min_idle"] < 0 or options["limit"] < 1:
            from sageproject.errors import ValidationError

            fail(
                self,
                ValidationError("command.invalid", "--min-idle must be ≥ 0 and --limit ≥ 1"),
                as_json=as_json,
            )
        request = reclamation_create(
            user=None,
            scope=ReclamationRequest.Scope.IDLE,
            min_idle_seconds=options["min_idle"],
            limit=options["limit"],
        )
        answer = self._wait(request, options["wait"])
        if answer is None:
            # Nobody took it: withdraw it so a worker started later does not act on a
            # stale request (conditional: a worker that just took it still answers).
            ReclamationRequest.objects.filter(
                pk=request.pk, status=ReclamationStatus.PENDING, outcome__isnull=True
            ).update(
                status=ReclamationStatus.REFUSED,
                outcome={"released": 0, "message": "refused: no worker answered"},
                finished_at=timezone.now(),
            )
            fail(
                self,
                UnavailableError(
                    "management.no_worker",
                    f"no worker answered reclamation #{request.pk} within {options['wait']:g}s; "
                    "is a worker running (manage.py runworker)?",
                    details={"request": request.pk},
                ),
                as_json=as_json,
            )
            return
        body = {
            "id": answer.pk,
            "status": answer.status,
            "outcome": answer.outcome,
            "finished_at": answer.finished_at,
        }
        if as_json:
            emit_json(self, body)
            return
        message = (answer.outcome or {}).get("message", "")
        self.stdout.write(f"reclamation #{answer.pk} {answer.status}: {message}")

    def _wait(self, request: ReclamationRequest, seconds: float) -> ReclamationRequest | None:
        """`wait_for_answer` a second at a time, the seconds waited drawn on a terminal
        (sageproject.progress)."""
        deadline = time.monotonic() + seconds
        label = f"release_idle: waiting for a worker to answer #{request.pk}"
        with Progress(label, total=seconds, unit="s", stream=self.stderr) as bar:
            while True:
                left = max(0.0, deadline - time.monotonic())
                answer = wait_for_answer(request, timeout=min(1.0, left))
                bar.update(seconds - max(0.0, deadline - time.monotonic()))
                if answer is not None or left <= 0:
                    return answer
