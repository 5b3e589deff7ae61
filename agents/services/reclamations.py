"""Operator release requests: the web process records them, the worker answers them.

The worker (``RunExecutor.process_reclamations``) takes pending rows every few seconds,
runs ``AgentManagementService.release_idle`` and writes ``done`` (released N) or
``refused`` (and why) with ``outcome`` and ``finished_at``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from agents.models import ReclamationRequest, ReclamationStatus


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
