"""The fair claim rule, written twice, chooses the same runs both ways.

PostgreSQL claims in one statement (`scheduling.runs.statements.claim`); every other
claim reads each user's heads and picks them one at a time in Python (`claims._heads`,
`claims._pick`). A claim inside a caller's transaction takes the Python way on PostgreSQL
too, which is how this test drives both on the same rows: the Python way in a transaction
rolled back afterwards, then the one-statement way, whose leases are kept. Queues are
random from a fixed seed: several users, priorities and queues, sessions with several
runs, child runs, runs not yet available, per-user and host limits, shared claims.
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections, transaction
from django.utils import timezone

from scheduling import runs
from scheduling.models import Run, RunQueue, RunStatus, Session
from scheduling.protocol import ClaimOrder
from scheduling.runs import Fence

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

SEED = 33
ROUNDS = 60
LEASE = timedelta(minutes=5)


class _RolledBack(Exception):
    """Ends the transaction of the Python way's claim: nothing of it stays."""


def python_pick(**claim: Any) -> list[str]:
    """The runs the Python way would lease now, leaving the rows as they were."""
    picked: list[str] = []
    try:
        with transaction.atomic():
            grants, _ = runs.claim(**claim)
            picked = [str(g.row["pk"]) for g in grants]
            raise _RolledBack
    except _RolledBack:
        pass
    return picked


def sql_claim(**claim: Any) -> list[runs.Grant]:
    """The one-statement way (PostgreSQL, outside any transaction): leases kept."""
    assert not connections["default"].in_atomic_block
    grants, _ = runs.claim(**claim)
    return grants


class Queues:
    """Random runs of a few users, added round by round."""

    def __init__(self, rng: random.Random, users: list[Any], make_session: Any) -> None:
        self.rng = rng
        self.users = users
        self.sessions = {u.pk: [make_session(u) for _ in range(3)] for u in users}
        self.now = timezone.now()

    def add(self, count: int) -> None:
        rng = self.rng
        for _ in range(count):
            user = rng.choice(self.users)
            session: Session = rng.choice(self.sessions[user.pk])
            busy = Run.objects.filter(
                session=session,
                status__in=[RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SUSPENDED],
            ).exists()
            parent = None
            roots = list(
                Run.objects.filter(owner=user, parent__isnull=True).order_by("created_at", "id")
            )
            if roots and rng.random() < 0.2:
                parent = rng.choice(roots)
            # Equal times sometimes: the id then breaks the tie, both ways alike.
            created = self.now + timedelta(microseconds=rng.randrange(0, 50) * 1000)
            self.now += timedelta(microseconds=rng.choice([0, 1000]))
            later = rng.random() < 0.1
            Run.objects.create(
                session=session if parent is None else rng.choice(self.sessions[user.pk]),
                owner=user,
                parent=parent,
                input="x",
                priority=rng.choice([0, 0, 0, 1, 5, -3]),
                queue=rng.choice([RunQueue.CHAT, RunQueue.CHAT, RunQueue.MANAGED]),
                # A session's oldest unfinished run is its turn; a child run always is.
                ready=parent is not None or not busy,
                available_at=timezone.now() + timedelta(hours=1) if later else timezone.now(),
                admission_slot=rng.randrange(16),
                created_at=created,
            )


def test_the_sql_claim_and_the_python_claim_choose_the_same_runs(
    alice, bob, carol, staff, make_session
):
    if connections["default"].vendor != "postgresql":
        pytest.skip("the one-statement claim is PostgreSQL's; elsewhere only Python picks")
    rng = random.Random(SEED)
    queues = Queues(rng, [alice, bob, carol, staff], make_session)
    queues.add(30)
    held: list[Fence] = []
    compared = taken = 0
    for round_ in range(ROUNDS):
        queues.add(rng.randrange(0, 6))
        # Some leases end: running counts fall, sessions hand their turn on.
        rng.shuffle(held)
        ends = rng.randrange(0, 4)
        ending, held = held[:ends], held[ends:]
        for fence in ending:
            runs.finish(fence, RunStatus.COMPLETED, result={"text": "done"})
        claim = {
            "worker_id": f"w{round_}",
            "duration": LEASE,
            "order": rng.choice([ClaimOrder.FAIR, ClaimOrder.FAIR, ClaimOrder.OLDEST]),
            "max_active": rng.choice([None, 4, 8, 12, 30]),
            "per_tenant": rng.choice([None, 1, 2, 3, 5]),
            "queue": rng.choice([None, None, RunQueue.CHAT]),
            "limit": rng.choice([1, 2, 3, 5, 8]),
            "share_with": rng.choice([1, 1, 2, 3]),
            "reap": False,
        }
        expected = python_pick(**claim)
        grants = sql_claim(**claim)
        chosen = [str(g.row["pk"]) for g in grants]
        assert chosen == expected, f"round {round_}, claim {claim}"
        compared += 1
        taken += len(chosen)
        held += [
            Fence(run_id=g.row["pk"], lease_owner=claim["worker_id"], lease_token=g.token)
            for g in grants
        ]
    # The rounds exercised the rule, not only empty queues.
    assert compared == ROUNDS
    assert taken >= ROUNDS
