"""The Run state machine (``scheduling.runs``) on real rows, transition by transition."""

from __future__ import annotations

import contextlib
import select
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models import F
from django.utils import timezone

from agents import services
from agents.models import ManagedAgentRecord
from sageproject.db import pipelined
from sageproject.errors import ConflictError, RateLimitedError
from scheduling import runs
from scheduling.models import Event, Run, RunStatus, Session
from scheduling.runs import Fence, Finish, Outcome, Start
from scheduling.scheduler import FenceRejected
from scheduling.store import append_events, close_default_coordinator
from tests.waiting import WaitTimeout, wait_until

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

LEASE = timedelta(seconds=30)


def submit(owner, session: Session, text: str = "hi", **kw: Any) -> Run:
    run, created = runs.admit(owner=owner, session_id=session.pk, input=text, **kw)
    assert created
    return run


def claim_one(worker: str = "w", **kw: Any) -> Fence | None:
    grants, _ = runs.claim(worker_id=worker, duration=LEASE, **kw)
    if not grants:
        return None
    grant = grants[0]
    return Fence(run_id=grant.row["pk"], lease_owner=worker, lease_token=grant.token)


def finish(fence: Fence, status: str = RunStatus.COMPLETED, **kw: Any) -> None:
    runs.finish(fence, status, result={"text": "done"} if status == "completed" else None, **kw)


def types(run: Run | Any) -> list[str]:
    run_id = run.pk if isinstance(run, Run) else run
    return list(Event.objects.filter(run_id=run_id).order_by("seq").values_list("type", flat=True))


def expire(fence: Fence) -> None:
    Run.objects.filter(pk=fence.run_id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


@pytest.fixture(autouse=True)
def _limits(settings):
    settings.SAGE = {
        **settings.SAGE,
        "SAGE_SERVER_MAX_PENDING_RUNS": 100,
        "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": 100,
    }


# ------------------------------------------------------------------ one run per session


def test_a_session_runs_its_runs_one_at_a_time_in_order(alice, make_session):
    session = make_session(alice)
    first, second, third = (submit(alice, session, f"t{i}") for i in range(3))
    assert [r.ready for r in (first, second, third)] == [True, False, False]
    fence = claim_one()
    assert str(fence.run_id) == str(first.pk)
    # The session is busy: nothing else of it may start, under any per-user limit.
    assert claim_one("w2") is None
    finish(fence)
    assert Run.objects.get(pk=second.pk).ready is True
    fence = claim_one()
    assert str(fence.run_id) == str(second.pk)
    assert claim_one("w2") is None


def test_a_claim_takes_runs_of_different_sessions_in_one_transaction(alice, bob, make_session):
    sessions = [make_session(alice), make_session(alice), make_session(bob)]
    made = [submit(s.owner, s) for s in sessions for _ in range(2)]
    grants, _ = runs.claim(worker_id="w", duration=LEASE, limit=10)
    claimed = {str(g.row["pk"]) for g in grants}
    # One per session (the session's oldest), each with its own token.
    assert claimed == {str(made[0].pk), str(made[2].pk), str(made[4].pk)}
    assert len({g.token for g in grants}) == 3


PREPARED_KINDS = {
    "admission": lambda text: text.startswith("WITH c AS"),
    "claim": lambda text: "lease_owner = $" in text,
}


def _no_prepared_statements(connection: Any) -> None:
    """Start from none: the connection carries earlier tests' prepared statements, and past
    psycopg's cache size (100) the least used are deallocated and prepared anew."""
    connection.ensure_connection()
    connection.connection.execute("DEALLOCATE ALL")  # psycopg's cache forgets them too


def _prepared_runs(connection: Any, kind: str) -> dict[str, int]:
    """The connection's prepared statements of ``kind`` (`PREPARED_KINDS`): how often each
    ran."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        return {text: n for text, n in cursor.fetchall() if PREPARED_KINDS[kind](text)}


def _ran_again(before: dict[str, int], after: dict[str, int]) -> list[int]:
    """How many more times each statement ran, for those that did; a statement prepared
    anew meanwhile (not in ``before``) fails the test."""
    assert set(after) <= set(before), f"prepared anew: {set(after) - set(before)}"
    return [after[text] - before[text] for text in after if after[text] != before[text]]


def test_the_admission_and_the_claim_are_prepared_statements_on_postgresql(alice, make_session):
    """Planned once per connection, then only bound and run (planning the claim costs
    more than running it); Django turns psycopg's preparing off unless told otherwise."""
    connection = connections["default"]
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are the PostgreSQL path's")
    _no_prepared_statements(connection)
    submit(alice, make_session(alice))  # a new user's first admission runs twice
    assert claim_one(reap=False) is not None
    admissions, claims = (
        _prepared_runs(connection, "admission"),
        _prepared_runs(connection, "claim"),
    )
    for _ in range(3):
        submit(alice, make_session(alice))
    for _ in range(2):
        assert claim_one(reap=False) is not None
    assert _ran_again(admissions, _prepared_runs(connection, "admission")) == [3]
    assert _ran_again(claims, _prepared_runs(connection, "claim")) == [2]
    # Each on its generic plan from the first run: never planned again for a run's values
    # (left to choose, PostgreSQL plans at least the first five runs for their values, and
    # went on planning every claim once many runs were queued).
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, custom_plans FROM pg_prepared_statements")
        planned = {text: n for text, n in cursor.fetchall()}
    hot = [text for text in planned if any(kind(text) for kind in PREPARED_KINDS.values())]
    assert len(hot) == 2 and all(planned[text] == 0 for text in hot), planned


def test_a_refused_admission_keeps_the_connections_prepared_statements(
    alice, make_session, settings
):
    """A refusal (the user's queue is full) ends the pipelined admission with its sync, no
    ``ROLLBACK`` sent: psycopg's rollback deallocates every prepared statement of the
    connection, and the next admission, claim or token lookup would be planned again."""
    connection = connections["default"]
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are the PostgreSQL path's")
    settings.SAGE = {**settings.SAGE, "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": 1}
    _no_prepared_statements(connection)
    submit(alice, make_session(alice))
    before = _prepared_runs(connection, "admission")
    with pytest.raises(RateLimitedError):
        submit(alice, make_session(alice))
    assert connection.connection.pgconn.transaction_status == 0  # the refusal rolled back
    # The same statement, run once more (not deallocated and prepared again).
    assert _ran_again(before, _prepared_runs(connection, "admission")) == [1]


def _own_connection() -> Any:
    """A psycopg connection of the test's own to the test database, in autocommit mode
    (skips the test on other databases: pipeline mode is the PostgreSQL path's)."""
    import psycopg

    if connections["default"].vendor != "postgresql":
        pytest.skip("libpq's pipeline mode is the PostgreSQL path's")
    params = connections["default"].get_connection_params()
    for key in ("cursor_factory", "context", "server_side_binding"):
        params.pop(key, None)
    return psycopg.connect(**params, autocommit=True)


@pytest.mark.timing
def test_a_transaction_left_open_after_a_pipeline_is_ended_once_rearmed():
    """What a crash point armed before a pipelined ``COMMIT`` relies on: after a pipeline
    PostgreSQL does not reliably arm its idle-in-transaction timeout (a worker frozen there
    held the claim lock for 18 minutes), so `runs.rearm_idle_timeout` sends one plain
    statement, and the server then ends the transaction."""
    import psycopg

    with _own_connection() as raw:
        with pipelined(raw):
            raw.execute("BEGIN")
            raw.execute("SET LOCAL idle_in_transaction_session_timeout = 300")
            raw.execute("SELECT 1")
        runs.rearm_idle_timeout(raw)
        # The server ends the session: its goodbye makes the socket readable.
        readable, _, _ = select.select([raw.pgconn.socket], [], [], 30)
        assert readable, "the idle-in-transaction timeout never ended the session"
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
            raw.execute("SELECT 1")


# Admissions by path: pipelined on PostgreSQL (no key), in a transaction of its own (a key,
# or runs to stop first), and inside the caller's transaction.
CREDENTIAL_PATHS = {
    "plain": {},
    "idempotency key": {"idempotency_key": "k1"},
    "interrupt": {"multitask": "interrupt"},
}


@pytest.mark.parametrize("path", sorted(CREDENTIAL_PATHS))
@pytest.mark.parametrize("in_transaction", [False, True], ids=["own", "caller's"])
def test_an_admission_whose_credential_no_longer_holds_admits_nothing(
    alice, make_session, path, in_transaction
):
    """`runs.Credential`: checked in the admission's transaction. Holding, it is marked
    checked and the run admitted; no longer holding (the token deleted after the caller
    read it), nothing is written — no run, no pending place — and `CredentialRefused`."""
    from rest_framework.authtoken.models import Token

    from sageproject.authentication import credential_sql
    from scheduling.models import PendingCount

    session = make_session(alice)
    key = Token.objects.create(user=alice).key
    kw = CREDENTIAL_PATHS[path]

    def admit() -> runs.Credential:
        credential = runs.Credential(credential_sql(), (key, alice.pk, False, False))
        with transaction.atomic() if in_transaction else contextlib.nullcontext():
            runs.admit(owner=alice, session_id=session.pk, input="hi", credential=credential, **kw)
        return credential

    assert admit().checked
    assert Run.objects.filter(session_id=session.pk).count() == 1
    places = sorted(PendingCount.objects.values_list("scope", "pending"))
    Token.objects.filter(key=key).delete()
    with pytest.raises(runs.CredentialRefused):
        admit()
    assert Run.objects.filter(session_id=session.pk).count() == 1
    assert sorted(PendingCount.objects.values_list("scope", "pending")) == places


def test_a_suspended_run_keeps_its_sessions_turn(alice, make_session):
    session = make_session(alice)
    first, second = submit(alice, session), submit(alice, session)
    fence = claim_one()
    with transaction.atomic():
        runs.check_fence(fence)
        runs.Suspend(fence, {"id": "i1", "type": "retry", "allowed_decisions": ["retry"]})(
            "default"
        )
    assert Run.objects.get(pk=first.pk).status == RunStatus.SUSPENDED
    assert claim_one() is None  # the second waits for the first to end
    assert runs.resume(first.pk, {"interaction_id": "i1", "decision": "retry"})
    assert str(claim_one().run_id) == str(first.pk)
    assert Run.objects.get(pk=second.pk).ready is False


def _a_transaction_waits_for_a_lock() -> bool:
    """Whether a transaction waits for a lock, seen from this thread's connection: on
    PostgreSQL any on this test database, on MySQL one that waits for a lock this
    connection's transaction holds (``innodb_trx`` joined to the process list missed the
    waiting connection once other transactional tests had run). SQLite has nothing to see
    and nothing to wait for: its writers queue at ``BEGIN``, so an admission there reads
    after the finish either way."""
    vendor = connection.vendor
    with connection.cursor() as cursor:
        if vendor == "postgresql":
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # fresh within a transaction
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        elif vendor == "mysql":
            cursor.execute(
                "SELECT count(*) FROM information_schema.innodb_lock_waits w"
                " JOIN information_schema.innodb_trx t ON t.trx_id = w.blocking_trx_id"
                " WHERE t.trx_mysql_thread_id = CONNECTION_ID()"
            )
        else:
            return True
        return cursor.fetchone()[0] > 0


@pytest.mark.parametrize("key", [None, "k1"], ids=["one-statement", "keyed"])
def test_a_run_admitted_while_the_sessions_run_finishes_gets_its_turn(alice, make_session, key):
    """The admission waits for the session row the finishing commit holds; whether the
    session is busy is read after that wait, not from before it (else the new run would
    wait for a turn the finish already handed out, and never run). Both ways of admitting
    (PostgreSQL admits a run without an idempotency key in one statement)."""
    session = make_session(alice)
    submit(alice, session)
    fence = claim_one()
    locked, admitted = threading.Event(), {}

    def finishing() -> None:
        try:
            with transaction.atomic():
                # As the session store's commit: the session row is updated, then the run
                # finishes (its turn handed to a waiting run, if any) in the same transaction.
                Session.objects.filter(pk=session.pk).update(persisted_events=F("persisted_events"))
                locked.set()
                Finish(fence, RunStatus.COMPLETED, result={"text": "done"})("default")
                # The admission should be waiting for the session row by now. Where the
                # database does not show it in time (MariaDB under a loaded suite), the
                # finish commits anyway: the admission then reads after it, the same rule.
                with contextlib.suppress(WaitTimeout):
                    wait_until(
                        _a_transaction_waits_for_a_lock,
                        timeout=5,
                        message="the admission waiting for the session row",
                    )
        finally:
            connections.close_all()

    def admitting() -> None:
        try:
            locked.wait(5)
            admitted["run"] = submit(alice, session, "next", idempotency_key=key)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=finishing), threading.Thread(target=admitting)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    run = Run.objects.get(pk=admitted["run"].pk)
    assert run.ready is True
    assert str(claim_one().run_id) == str(run.pk)


# ------------------------------------------------------------------ multitask


def test_reject_refuses_a_run_while_the_session_is_busy(alice, make_session):
    session = make_session(alice)
    submit(alice, session)
    with pytest.raises(ConflictError) as info:
        submit(alice, session, multitask="reject")
    assert info.value.code == "session.busy"
    assert Run.objects.filter(session=session).count() == 1


def test_interrupt_ends_a_queued_run_now_and_asks_a_running_one_to_stop(alice, make_session):
    session = make_session(alice)
    running = submit(alice, session)
    fence = claim_one()
    waiting = submit(alice, session)
    newest = submit(alice, session, multitask="interrupt")
    waiting.refresh_from_db()
    running.refresh_from_db()
    assert (waiting.status, waiting.error["code"]) == (RunStatus.INTERRUPTED, "run.interrupted")
    assert types(waiting) == ["run.interrupted"]
    assert ManagedAgentRecord.objects.get(run=waiting).status == RunStatus.INTERRUPTED
    assert (running.status, running.cancel_requested, running.stop_request) == (
        RunStatus.RUNNING,
        True,
        "interrupt",
    )
    assert newest.ready is False
    # The worker ends the running one as interrupted; the new run is next.
    outcome = Outcome(
        status=RunStatus.INTERRUPTED,
        session_id=session.pk,
        error={"code": "run.interrupted"},
    )
    with transaction.atomic():
        runs.check_fence(fence)
        outcome.transition(fence)("default")
    assert Run.objects.get(pk=newest.pk).ready is True


def test_rollback_removes_the_interrupted_runs_events(alice, make_session):
    session = make_session(alice)
    old = submit(alice, session)
    fence = claim_one()

    async def work() -> None:
        await append_events(
            session_id=session.pk,
            run_id=old.pk,
            events=[("run.started", {}), ("message.completed", {"role": "user", "content": "x"})],
            fence=fence,
            transition=Start(fence),
        )
        await close_default_coordinator()

    import asyncio

    asyncio.run(work())
    new = submit(alice, session, multitask="rollback")
    old.refresh_from_db()
    assert (old.cancel_requested, old.stop_request) == (True, "rollback")
    finish(fence, RunStatus.INTERRUPTED)  # the worker's end of it (events kept here)
    assert Event.objects.filter(session=session).count() == 3
    runs.remove_run_events(session.pk, old.pk)
    assert Event.objects.filter(session=session).count() == 0
    assert Session.objects.get(pk=session.pk).persisted_events == 0
    assert Run.objects.get(pk=new.pk).ready is True


def test_rollback_of_a_suspended_run_removes_its_events_and_renumbers(alice, make_session):
    session = make_session(alice)
    first = submit(alice, session)
    fence = claim_one()
    finish(fence)  # run.completed at seq 1
    second = submit(alice, session)
    fence = claim_one()
    with transaction.atomic():
        runs.append_event(session.pk, second.pk, "run.started", {})
        runs.check_fence(fence)
        runs.Suspend(fence, {"id": "i", "allowed_decisions": ["retry"]})("default")
    submit(alice, session, multitask="rollback")
    assert types(second) == []
    assert list(
        Event.objects.filter(session=session).order_by("seq").values_list("seq", "run_id")
    ) == [(1, first.pk)]
    assert Run.objects.get(pk=second.pk).status == RunStatus.INTERRUPTED


# ------------------------------------------------------------------ crash budget


def test_suspensions_and_graceful_restarts_do_not_use_the_crash_budget(alice, make_session):
    session = make_session(alice)
    run = submit(alice, session)
    for _ in range(3):  # three suspend → retry cycles
        fence = claim_one()
        with transaction.atomic():
            runs.Suspend(fence, {"id": "i", "allowed_decisions": ["retry"]})("default")
        assert runs.resume(run.pk, {"decision": "retry"})
    for _ in range(2):  # two SIGTERM restarts
        fence = claim_one()
        assert runs.requeue(fence, error={"code": "scheduler.worker_shutdown"})
    fence = claim_one()
    expire(fence)  # then one crash
    assert runs.reap(max_crashes=3) == [str(run.pk)]
    run.refresh_from_db()
    assert (run.status, run.attempts, run.crashes) == (RunStatus.QUEUED, 6, 1)
    fence = claim_one()
    finish(fence)
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED


def test_the_third_crash_fails_the_run_with_its_event_and_archive(alice, make_session):
    session = make_session(alice)
    run = submit(alice, session)
    later = submit(alice, session)
    for _ in range(3):
        fence = claim_one()
        expire(fence)
        runs.reap(max_crashes=3)
    run.refresh_from_db()
    assert (run.status, run.crashes, run.error["code"]) == (
        RunStatus.FAILED,
        3,
        "execution.worker_restarted",
    )
    assert types(run) == ["run.failed"]
    assert ManagedAgentRecord.objects.get(run=run).status == RunStatus.FAILED
    assert Run.objects.get(pk=later.pk).ready is True  # the session moves on


# ------------------------------------------------------------------ cancel


def test_cancel_ends_a_queued_run_with_its_event_and_archive(alice, make_session):
    session = make_session(alice)
    run = submit(alice, session)
    after = submit(alice, session)
    cancelled = services.run_cancel(run=run)
    assert (cancelled.status, cancelled.error["code"]) == (RunStatus.CANCELLED, "run.cancelled")
    assert types(run) == ["run.cancelled"]
    assert ManagedAgentRecord.objects.get(run=run).status == RunStatus.CANCELLED
    assert Run.objects.get(pk=after.pk).ready is True
    # Idempotent.
    assert services.run_cancel(run=run).status == RunStatus.CANCELLED
    assert types(run) == ["run.cancelled"]


def test_cancel_of_a_running_run_whose_worker_died_is_finished_by_the_reaper(alice, make_session):
    session = make_session(alice)
    run = submit(alice, session)
    fence = claim_one()
    services.run_cancel(run=run)
    assert Run.objects.get(pk=run.pk).status == RunStatus.RUNNING  # its worker ends it...
    expire(fence)  # ...but the worker died
    assert runs.reap(max_crashes=3) == [str(run.pk)]
    run.refresh_from_db()
    assert (run.status, run.error["code"]) == (RunStatus.CANCELLED, "run.cancelled")
    assert types(run) == ["run.cancelled"]
    assert ManagedAgentRecord.objects.get(run=run).status == RunStatus.CANCELLED
    # It no longer counts against the pending limits.
    assert not Run.objects.filter(status=RunStatus.QUEUED).exists()


# ------------------------------------------------------------------ fences


def test_a_finish_under_a_stale_fence_writes_nothing(alice, make_session):
    session = make_session(alice)
    run = submit(alice, session)
    fence = claim_one()
    expire(fence)
    runs.reap()
    new_fence = claim_one("w2")
    with pytest.raises(FenceRejected):
        finish(fence)
    assert types(run) == []
    finish(new_fence)
    assert types(run) == ["run.completed"]
    assert Run.objects.get(pk=run.pk).lease_token is not None


def test_finish_writes_status_result_event_and_archive_in_one_transaction(alice, make_session):
    session = make_session(alice)
    run = submit(alice, session)
    fence = claim_one()

    class Boom(Exception):
        pass

    def archiver_fails(records: list[runs.ArchiveRecord], using: str) -> None:
        raise Boom

    previous = runs._archiver, runs._archive_statement
    runs.set_archiver(archiver_fails)
    try:
        with pytest.raises(Boom):
            finish(fence)
    finally:
        runs.set_archiver(*previous)
    run.refresh_from_db()
    # Nothing of the finish landed: no event, still running under the same lease.
    assert (run.status, run.result, types(run)) == (RunStatus.RUNNING, None, [])
    finish(fence)
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    event = Event.objects.get(run=run)
    assert event.payload["result"] == run.result == ManagedAgentRecord.objects.get(run=run).result


def test_start_consumes_a_resolution_so_a_later_requeue_does_not_repeat_it(alice, make_session):
    session = make_session(alice)
    run = submit(alice, session)
    fence = claim_one()
    with transaction.atomic():
        runs.Suspend(fence, {"id": "i", "allowed_decisions": ["retry"]})("default")
    runs.resume(run.pk, {"interaction_id": "i", "decision": "retry"})
    assert Run.objects.get(pk=run.pk).interaction["resolution"]["decision"] == "retry"
    fence = claim_one()
    with transaction.atomic():
        Start(fence, clear_resolution=True)("default")
    assert Run.objects.get(pk=run.pk).interaction is None


def test_a_job_event_without_the_runs_lease_is_refused_while_it_runs(alice, make_session):
    session = make_session(alice)
    run = submit(alice, session)
    claim_one("other-worker")
    with pytest.raises(FenceRejected):
        runs.append_unleased_event(session.pk, run.pk, "job.completed", {})
    assert types(run) == []


async def test_a_stale_workers_job_event_is_rejected(alice, make_session):
    from asgiref.sync import sync_to_async

    from agents.jobs.records import append_job_event
    from scheduling import dispatcher as worker

    session = await sync_to_async(make_session)(alice)
    run = await sync_to_async(submit)(alice, session)
    stale = await sync_to_async(claim_one)("this-worker")
    await sync_to_async(expire)(stale)
    await sync_to_async(runs.reap)()
    await sync_to_async(claim_one)("other-worker")
    worker._live_fences[str(run.pk)] = stale  # this worker still believes it holds it
    try:
        assert not await append_job_event(session.pk, run.pk, "job.completed", {"id": "j"})
    finally:
        worker._live_fences.pop(str(run.pk), None)
        await close_default_coordinator()
    assert not await Event.objects.filter(run_id=run.pk).aexists()


def test_finish_transition_refuses_an_expired_lease(alice, make_session):
    session = make_session(alice)
    submit(alice, session)
    fence = claim_one()
    expire(fence)
    with pytest.raises(FenceRejected), transaction.atomic():
        Finish(fence, RunStatus.COMPLETED, {"text": "x"})("default")


def test_sqlite_syncs_every_commit_so_an_answered_write_survives_power_loss():
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("SQLite only: servers have their own durability settings")
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA synchronous")
        (level,) = cursor.fetchone()
    assert level == 2  # FULL


def test_a_group_of_finishes_lands_together_each_fenced_and_hands_on_each_sessions_turn(
    alice, make_session
):
    """``Finish.apply_many`` (the session store's group commit): every run's status, result
    and error as given, JSON intact; a session's next run made ready; and one stale fence
    in the group refuses the whole statement (the store then retries commit by commit)."""
    first, second = make_session(alice), make_session(alice)
    submit(alice, first)
    submit(alice, second)
    waiting = submit(alice, first, "next")
    fences = [claim_one(), claim_one()]
    by_session = {Run.objects.get(pk=f.run_id).session_id: f for f in fences}
    done = Finish(by_session[first.pk], RunStatus.COMPLETED, result={"text": "ok", "n": [1, 2]})
    failed = Finish(by_session[second.pk], RunStatus.FAILED, error={"code": "x", "message": "é"})
    with transaction.atomic():
        Finish.apply_many([done, failed], "default")
    rows = {r.pk: r for r in Run.objects.filter(pk__in=[f.run_id for f in fences])}
    ran_first = rows[by_session[first.pk].run_id]
    ran_second = rows[by_session[second.pk].run_id]
    assert (ran_first.status, ran_first.result, ran_first.error) == (
        RunStatus.COMPLETED,
        {"text": "ok", "n": [1, 2]},
        None,
    )
    assert (ran_second.status, ran_second.result, ran_second.error) == (
        RunStatus.FAILED,
        None,
        {"code": "x", "message": "é"},
    )
    assert ran_first.lease_owner == "" and ran_first.finished_at is not None
    assert Run.objects.get(pk=waiting.pk).ready is True
    nxt = claim_one()
    stale = Fence(run_id=nxt.run_id, lease_owner=nxt.lease_owner, lease_token=nxt.lease_token + 1)
    with pytest.raises(FenceRejected), transaction.atomic():
        Finish.apply_many([Finish(stale, RunStatus.COMPLETED)], "default")
    assert Run.objects.get(pk=nxt.run_id).status == RunStatus.RUNNING


def test_a_run_is_claimable_the_moment_it_is_admitted(alice, make_session):
    # A run's ``available_at`` is this host's time to the microsecond. The claim compares it
    # with the database's clock — the ORM's (``now_expr``) and its own statements'
    # (``_now_sql``) — which must never read earlier than this host did just before: read
    # to the millisecond (SQLite's ``STRFTIME('%f')``) it hid a run from a claim made
    # within the millisecond of its admission.
    from django.db import connection
    from django.db.models import DateTimeField, Value

    run = submit(alice, make_session(alice))
    claimable = Run.objects.filter(pk=run.pk)
    for _ in range(50):
        stamp = timezone.now()
        at = Value(stamp, output_field=DateTimeField())
        assert claimable.alias(at=at).filter(at__lte=runs.now_expr()).exists()
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT %s <= {runs._now_sql(connection.vendor)}",
                [connection.ops.adapt_datetimefield_value(stamp)],
            )
            assert cursor.fetchone()[0]
    fence = claim_one()
    assert fence is not None and str(fence.run_id) == str(run.pk)
