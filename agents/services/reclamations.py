"""Operator release requests: the web process records them, the worker answers them.

The worker's executor calls ``answer_pending`` every few seconds: it takes pending rows
(a conditional update, so two workers never both execute one), runs
``AgentManagementService.release_idle`` and writes ``done`` (released N) or ``refused``
(and why) with ``outcome`` and ``finished_at``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from django.utils import timezone

from agents.models import ReclamationRequest, ReclamationStatus
from sageproject.db import db_call
from sageproject.errors import SageError


def reclamation_create(
    *,
    user,
    scope: str = ReclamationRequest.Scope.IDLE,
    refs: Iterable[str] = (),
    min_idle_seconds: int = 300,
    limit: int = 1,
) -> ReclamationRequest:
    """Record a release request for the worker and return the row (status ``pending``)."""
    return ReclamationRequest.objects.create(
        requested_by=user,
        scope=scope,
        refs=list(refs),
        min_idle_seconds=min_idle_seconds,
        limit=limit,
    )


def wait_for_answer(
    request: ReclamationRequest, *, timeout: float, poll: float = 0.2
) -> ReclamationRequest | None:
    """Poll until the worker answered ``request``; returns the fresh row, or ``None`` at
    the deadline (no worker running)."""
    deadline = time.monotonic() + timeout
    while True:
        fresh = ReclamationRequest.objects.get(pk=request.pk)
        if fresh.status != ReclamationStatus.PENDING:
            return fresh
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll)


# --- the worker's side ---------------------------------------------------------------


def claim_reclamations_sync(worker: str, limit: int = 10) -> list[dict[str, Any]]:
    """Take pending operator requests (a conditional update, so two workers never both
    execute one); returns their parameters."""
    claimed = []
    pending = ReclamationRequest.objects.filter(
        status=ReclamationStatus.PENDING, outcome__isnull=True
    ).order_by("created_at")[:limit]
    for request in pending:
        taken = ReclamationRequest.objects.filter(
            pk=request.pk, status=ReclamationStatus.PENDING, outcome__isnull=True
        ).update(outcome={"worker": worker, "state": "executing"})
        if taken:
            claimed.append(
                {
                    "id": request.pk,
                    "scope": request.scope,
                    "refs": list(request.refs or []),
                    "min_idle_seconds": request.min_idle_seconds,
                    "limit": request.limit,
                }
            )
    return claimed


def answer_reclamation_sync(request_id: int, status: str, outcome: dict[str, Any]) -> None:
    ReclamationRequest.objects.filter(pk=request_id).update(
        status=status, outcome=outcome, finished_at=timezone.now()
    )


def reclamation_outcome(result: dict[str, Any], worker: str) -> tuple[str, dict[str, Any]]:
    """(status, outcome) of a ``release_idle`` result: done when anything was released,
    else refused with the reasons."""
    released = result["released"]
    if released:
        message = f"released {released} Application{'s' if released != 1 else ''}"
        status = ReclamationStatus.DONE
    else:
        reasons = [f"{r['application']}: {r['reason']}" for r in result["refused"]]
        reasons += [f"{r['application']}: {r['reason']}" for r in result["failed"]]
        message = "refused: " + (
            "; ".join(reasons) if reasons else "no resident Application matched"
        )
        status = ReclamationStatus.REFUSED
    return status, {**result, "message": message, "worker": worker}


async def answer_pending(service: Any, worker: str) -> int:
    """Execute pending requests with ``service`` (the worker's ``AgentManagementService``);
    returns how many were answered."""
    claimed = await db_call(claim_reclamations_sync, worker)
    for request in claimed:
        selected = request["scope"] == ReclamationRequest.Scope.SELECTED
        try:
            result = await service.release_idle(
                min_idle_seconds=request["min_idle_seconds"],
                limit=service.max_applications if selected else request["limit"],
                refs=request["refs"] if selected else None,
            )
            status, outcome = reclamation_outcome(result, worker)
        except (ValueError, SageError) as exc:
            status = ReclamationStatus.REFUSED
            outcome = {"released": 0, "message": f"refused: {exc}", "worker": worker}
        await db_call(answer_reclamation_sync, request["id"], status, outcome)
    return len(claimed)
