"""Pending counters: exact limits without a global lock, on every database.

The counters must equal the queued root runs after every transition (checked with
``pending.reconcile() == 0``: nothing to correct), a flood must admit exactly the limit,
and a drift (queued rows deleted without a transition) is corrected by a recount.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from datetime import timedelta

import httpx
import pytest
from django.db import connections
from django.utils import timezone
from rest_framework.authtoken.models import Token

from agents import services
from sageproject.errors import SageError
from scheduling import pending, runs
from scheduling.models import PendingCount, Run, RunStatus
from tests.scheduling.processes import live_web_server, worker_env

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

LEASE = timedelta(seconds=30)


@pytest.fixture
def limits(settings):
    def set_limits(host: int, per_user: int) -> None:
        settings.SAGE = {
            **settings.SAGE,
            "SAGE_SERVER_MAX_PENDING_RUNS": host,
            "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": per_user,
        }

    return set_limits


def submit(owner, session, **kw):
    return services.run_submit(owner=owner, session_id=session.pk, input="hi", **kw)[0]


def counted() -> dict[str, int]:
    """The counters, after checking they equal the queued runs (nothing to correct)."""
    assert pending.reconcile() == 0, "the counters drifted from the queued runs"
    return pending.snapshot()


def test_the_counters_follow_every_transition_into_and_out_of_the_queue(alice, bob, make_session):
    for _ in range(3):
        submit(alice, make_session(alice))
    submit(bob, make_session(bob))
    assert counted() == {"host": 4, f"user.{alice.pk}": 3, f"user.{bob.pk}": 1}

    grants, _ = runs.claim(worker_id="w", duration=LEASE, limit=2, per_tenant=8)
    assert len(grants) == 2
    assert counted()["host"] == 2

    runs.cancel(Run.objects.filter(status=RunStatus.QUEUED).first().pk)
    assert counted()["host"] == 1

    fence = runs.Fence(run_id=grants[0].row["pk"], lease_owner="w", lease_token=grants[0].token)
    assert runs.requeue(fence)
    assert counted()["host"] == 2

    # A suspended run that is resumed takes its place again; cancelling it gives it back.
    runs.claim(worker_id="w", duration=LEASE, limit=8, per_tenant=8)
    assert counted()["host"] == 0
    leased = Run.objects.filter(status=RunStatus.RUNNING).first()
    fence = runs.Fence(
        run_id=leased.pk, lease_owner=leased.lease_owner, lease_token=leased.lease_token
    )
    runs.Suspend(fence, {"id": "i1", "allowed_decisions": ["retry", "cancel"]})("default")
    assert runs.resume(leased.pk, {"interaction_id": "i1", "decision": "retry"})
    assert counted()["host"] == 1
    runs.cancel(leased.pk)
    assert counted() == {"host": 0}


def test_a_run_reaped_from_a_dead_worker_is_counted_again(alice, make_session):
    run = submit(alice, make_session(alice))
    runs.claim(worker_id="dead", duration=LEASE)
    assert counted()["host"] == 0
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - timedelta(minutes=1))

    assert runs.reap() == [str(run.pk)]
    assert counted() == {"host": 1, f"user.{alice.pk}": 1}


def test_the_last_place_of_the_host_is_found_in_whichever_stripe_has_it(
    alice, bob, make_session, limits
):
    # Fewer places than stripes: most stripes hold none, so nearly every admission falls
    # back to another stripe, and the host still admits exactly its limit.
    limits(host=5, per_user=100)
    for _ in range(5):
        submit(alice, make_session(alice))
    with pytest.raises(SageError) as refused:
        submit(bob, make_session(bob))
    assert refused.value.code == "scheduler.queue_full"
    assert refused.value.details["max_pending"] == 5
    assert counted()["host"] == 5


def test_a_user_at_the_limit_is_refused_while_others_are_admitted(alice, bob, make_session, limits):
    limits(host=100, per_user=2)
    submit(alice, make_session(alice))
    submit(alice, make_session(alice))
    with pytest.raises(SageError) as refused:
        submit(alice, make_session(alice))
    assert refused.value.details["max_pending_per_user"] == 2
    submit(bob, make_session(bob))
    assert counted() == {"host": 3, f"user.{alice.pk}": 2, f"user.{bob.pk}": 1}


def test_a_refused_admission_leaves_nothing_behind(alice, make_session, limits):
    limits(host=100, per_user=1)
    submit(alice, make_session(alice))
    session = make_session(alice)
    with pytest.raises(SageError):
        submit(alice, session)
    assert not Run.objects.filter(session=session).exists()
    assert counted() == {"host": 1, f"user.{alice.pk}": 1}


def test_a_recount_corrects_queued_runs_deleted_without_a_transition(alice, make_session, limits):
    limits(host=3, per_user=3)
    sessions = [make_session(alice) for _ in range(3)]
    for session in sessions:
        submit(alice, session)
    sessions[0].delete()  # its queued run goes with it, and no transition saw it go
    with pytest.raises(SageError):
        submit(alice, make_session(alice))

    assert pending.reconcile() == 2  # the host stripe and the user
    submit(alice, make_session(alice))
    assert counted()["host"] == 3


def test_the_counters_survive_an_emptied_table(alice, make_session):
    submit(alice, make_session(alice))
    PendingCount.objects.all().delete()
    submit(alice, make_session(alice))  # rows are created again as admissions need them
    assert pending.reconcile() > 0
    assert counted()["host"] == 2


def test_concurrent_admissions_of_many_users_admit_exactly_the_limits(
    alice, bob, carol, make_session, limits
):
    limits(host=10, per_user=4)
    users = [alice, bob, carol]
    sessions = [(user, make_session(user)) for user in users for _ in range(8)]
    results: list = [None] * len(sessions)
    barrier = threading.Barrier(len(sessions))

    def one(index: int) -> None:
        user, session = sessions[index]
        barrier.wait()
        try:
            results[index] = submit(user, session)
        except SageError as exc:
            results[index] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    admitted = [r for r in results if isinstance(r, Run)]
    refused = [r for r in results if isinstance(r, SageError)]
    assert len(admitted) + len(refused) == len(sessions), results  # nothing else went wrong
    assert len(admitted) == 10
    assert {e.code for e in refused} == {"scheduler.queue_full"}
    assert max(Counter(r.owner_id for r in admitted).values()) <= 4
    assert Run.objects.count() == 10
    assert counted()["host"] == 10


# --------------------------------------------------------------------- web processes


@pytest.fixture
def web_server(tmp_path):
    """``uvicorn sagehost.asgi:application --workers 3`` on this test's database, with a
    host limit of 12 and a per-user limit of 5; yields its base URL."""
    env = worker_env(
        {"SAGE_SERVER_MAX_PENDING_RUNS": "12", "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": "5"}
    )
    with live_web_server(tmp_path / "web.log", env, workers=3) as base:
        yield base


def test_a_flood_on_several_web_processes_admits_exactly_the_limits(
    alice, bob, carol, make_session, web_server
):
    users = [alice, bob, carol]
    tokens = {user.pk: Token.objects.get_or_create(user=user)[0].key for user in users}
    posts = [(user.pk, str(make_session(user).pk)) for user in users for _ in range(10)]

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=web_server, timeout=60) as client:

            async def post(owner: int, session: str) -> httpx.Response:
                return await client.post(
                    "/api/v1/runs/",
                    json={"session": session, "input": "hi"},
                    headers={"Authorization": f"Token {tokens[owner]}"},
                )

            return await asyncio.gather(*(post(owner, session) for owner, session in posts))

    answers = asyncio.run(flood())

    statuses = Counter(r.status_code for r in answers)
    assert statuses == {202: 12, 429: 18}, statuses
    refused = {r.json()["error"]["code"] for r in answers if r.status_code == 429}
    assert refused == {"scheduler.queue_full"}
    per_user = Counter(Run.objects.values_list("owner_id", flat=True))
    assert sum(per_user.values()) == 12
    assert max(per_user.values()) <= 5
    assert counted()["host"] == 12
