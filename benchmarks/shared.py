"""What the database benchmarks share: throwaway users and their rows, the scratch-queue
check, clean-up, the ``--backend`` option and the event payload they commit.

``bench_persist``, ``bench_single_host``, ``bench_fairness``, ``bench_e2e`` and
``bench_scale`` each create users named ``bench-<hex>-…`` and delete them with all they
own at the end, on failure too.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from scheduling.models import Event, Run, RunStatus, Session

# The event every fenced commit of the benchmarks carries.
PAYLOAD = {"role": "assistant", "content": "ok, done: the order ships tomorrow.", "n": 1}


def add_backend_argument(parser: Any, *, memory: str, database: str) -> None:
    """``--backend memory|database|both`` (default both) of the benchmarks with an
    in-memory and a database path; ``memory`` and ``database`` say what each runs."""
    parser.add_argument(
        "--backend",
        choices=("memory", "database", "both"),
        default="both",
        help=f"memory: {memory}; database: {database}; both (default)",
    )


def require_scratch_queue() -> None:
    """Refuse to run while the database holds queued or running runs: the benchmarks'
    claims would take (and finish) them, and their figures would include them."""
    live = Run.objects.filter(status__in=[RunStatus.QUEUED, RunStatus.RUNNING]).count()
    if live:
        raise CommandError(
            f"the database holds {live} queued or running run(s), which the benchmark's "
            "claims would take: run it against a scratch database (DATABASE_URL), or "
            "delete the users named bench-* a killed benchmark left behind"
        )


def bench_users(names: Iterable[str]) -> dict[str, Any]:
    """Throwaway users ``bench-<hex>-<name>`` (deleted by `delete_users`)."""
    User = get_user_model()
    tag = uuid.uuid4().hex[:8]
    return {
        name: User._default_manager.create(**{User.USERNAME_FIELD: f"bench-{tag}-{name}"})
        for name in names
    }


def queue_runs(owner: Any, count: int) -> list[tuple[uuid.UUID, uuid.UUID]]:
    """``count`` sessions of ``owner``, each with one queued, ready run (a run per session,
    so the one-run-per-session rule never holds one back); returns ``(run_id,
    session_id)`` pairs in submission order (``created_at`` increases with it).

    Rows are inserted directly: admission (``runs.admit``) is not what is measured, and its
    per-user pending limit would refuse a big user's flood.
    """
    sessions = Session.objects.bulk_create(
        [
            Session(owner=owner, package_ref="bench", package_name="bench", agent_id="bench")
            for _ in range(count)
        ]
    )
    rows = Run.objects.bulk_create(
        [Run(session=session, owner=owner, input="bench", ready=True) for session in sessions]
    )
    return [(run.pk, run.session_id) for run in rows]


def delete_users(users: Iterable[Any]) -> None:
    """Delete the benchmark's users with their sessions, events, runs and archives."""
    ids = [user.pk for user in users]
    Event.objects.filter(session__owner__in=ids).delete()
    get_user_model()._default_manager.filter(pk__in=ids).delete()
