"""Incremental event persistence on real databases.

Run against every database: the default SQLite, and PostgreSQL / MySQL through
``DATABASE_URL``. Statements are captured on the writer thread's own connection, where
the commits happen.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from agents.models import ManagedAgentRecord
from sageproject.errors import ConflictError, SageError, ValidationError
from scheduling import serialization
from scheduling.models import Event, Run, RunStatus, Session
from scheduling.runs import Finish
from scheduling.serialization import SessionEvent
from scheduling.store import (
    CommitSpec,
    EventDraft,
    Fence,
    SessionStoreCoordinator,
    append_events,
    close_default_coordinator,
    dump_events,
)
from tests.waiting import turns_until

BOUND = 20.0  # seconds: a broken store fails the test instead of hanging it

# -- helpers --------------------------------------------------------------------------

# The lease of a seeded session's running run.
LEASE_OWNER, LEASE_TOKEN = "worker-a", 7


def seeded_fence(run: Run, token: int = LEASE_TOKEN) -> Fence:
    """The fence of a seeded run's lease (or, with another ``token``, a stale one)."""
    return Fence(run_id=run.id, lease_owner=LEASE_OWNER, lease_token=token)


def _seed_session(owner: Any, events: int, *, run: bool = False) -> tuple[Session, Run | None]:
    session = Session.objects.create(
        owner=owner,
        package_ref="ref",
        package_name="demo",
        agent_id="assistant",
        persisted_events=events,
    )
    lease_run = None
    if run:
        lease_run = Run.objects.create(
            session=session,
            owner=owner,
            status=RunStatus.RUNNING,
            lease_owner=LEASE_OWNER,
            lease_token=LEASE_TOKEN,
            lease_expires_at=datetime.now(UTC) + timedelta(minutes=5),
        )
    now = datetime.now(UTC)
    Event.objects.bulk_create(
        [
            Event(session=session, seq=i, type="message", data=f'{{"i":{i}}}', created_at=now)
            for i in range(1, events + 1)
        ],
        batch_size=2000,
    )
    return session, lease_run


seed_session = sync_to_async(_seed_session)


async def seed_loaded(coordinator: SessionStoreCoordinator, owner: Any, events: int = 0) -> Session:
    """A seeded session of ``events`` events whose history ``coordinator`` has loaded."""
    session, _ = await seed_session(owner, events)
    await coordinator.history(session.id)
    return session


async def seed_leased(owner: Any, events: int = 0) -> tuple[Session, Run, Fence]:
    """A seeded session of ``events`` events with a running run, and its lease's fence."""
    session, run = await seed_session(owner, events, run=True)
    return session, run, seeded_fence(run)


@sync_to_async
def db_state(session_id: Any) -> tuple[int, list[int]]:
    persisted = Session.objects.get(pk=session_id).persisted_events
    seqs = list(
        Event.objects.filter(session_id=session_id).order_by("seq").values_list("seq", flat=True)
    )
    return persisted, seqs


@sync_to_async
def db_payloads(session_id: Any) -> list[Any]:
    return [e.payload for e in Event.objects.filter(session_id=session_id).order_by("seq")]


async def capture(
    coordinator: SessionStoreCoordinator, session_id: Any, action: Callable[[], Awaitable[Any]]
) -> tuple[Any, list[str]]:
    """Run ``action`` while capturing the SQL of ``session_id``'s writer connection."""
    context = CaptureQueriesContext(connection)
    await coordinator.call_in_writer(session_id, context.__enter__)
    try:
        result = await action()
    finally:

        def leave() -> list[str]:
            context.__exit__(None, None, None)
            return [q["sql"] for q in context.captured_queries]

        queries = await coordinator.call_in_writer(session_id, leave)
    return result, queries


def _kinds(queries: list[str]) -> list[str]:
    return [q.split(None, 1)[0].upper() for q in queries]


def _event_inserts(queries: list[str]) -> list[str]:
    return [q for q in queries if q.upper().startswith("INSERT") and "scheduling_event" in q]


class WriterGate:
    """Holds a writer busy so the test decides what is queued behind it."""

    def __init__(self, coordinator: SessionStoreCoordinator, session_id: Any) -> None:
        self.coordinator = coordinator
        self.session_id = session_id
        self.entered = threading.Event()
        self.release = threading.Event()
        self.task: asyncio.Task[Any] | None = None

    def _block(self) -> None:
        self.entered.set()
        self.release.wait(BOUND)

    async def __aenter__(self) -> WriterGate:
        self.task = asyncio.create_task(
            self.coordinator.call_in_writer(self.session_id, self._block)
        )
        await asyncio.to_thread(self.entered.wait, BOUND)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        assert self.task is not None
        await self.task

    async def wait_queued(self, n: int) -> None:
        writer = self.coordinator._writer_for(str(self.session_id))
        # Turns of the loop let the commit tasks reach the queue.
        await turns_until(
            lambda: writer.queue.qsize() >= n, message=f"{n} commits in the writer queue"
        )


@pytest.fixture(autouse=True)
async def _close_helper_thread_connections():
    """sync_to_async runs the ORM on a helper thread; close its connection after each test
    so PostgreSQL can drop the test database at the end."""
    yield
    await sync_to_async(connections.close_all)()


@pytest.fixture
async def coordinator():
    coord = SessionStoreCoordinator(writers=1)
    yield coord
    await coord.close()


async def test_it_keeps_at_most_max_open_sessions_dropping_the_least_recently_used_idle():
    """Past ``max_open_sessions`` a newly opened session drops the least recently used one
    nobody is working on; one held (locked) stays, however old."""
    coord = SessionStoreCoordinator(writers=1, max_open_sessions=2)
    ids = [str(uuid.uuid4()) for _ in range(4)]
    try:
        await coord.history(ids[0], known_empty=True)
        async with coord.locked(ids[0]):
            for session_id in ids[1:]:
                await coord.history(session_id, known_empty=True)
            assert list(coord._states) == [ids[0], ids[3]]
        await coord.history(ids[1], known_empty=True)
        assert list(coord._states) == [ids[3], ids[1]]
    finally:
        await coord.close()


# -- dump_events (no database) --------------------------------------------------------


def _history(n: int) -> list[SessionEvent]:
    now = datetime.now(UTC)
    return [
        SessionEvent(seq=i, type="m", run_id=None, created_at=now, payload={"i": i})
        for i in range(1, n + 1)
    ]


def test_it_dumps_only_the_events_after_the_offset():
    history = _history(10_000)
    before = serialization.serializer_calls.value
    rows = dump_events(history, 9_999)
    assert [e.seq for e in rows] == [10_000]
    assert serialization.serializer_calls.value - before == 1


def test_it_dumps_nothing_when_the_offset_is_the_length():
    assert dump_events(_history(5), 5) == []


def test_it_dumps_the_full_history_when_the_offset_is_past_the_end():
    assert [e.seq for e in dump_events(_history(3), 7)] == [1, 2, 3]


def test_it_reuses_an_events_encoding_instead_of_serializing_it_again():
    history = _history(4)
    dump_events(history, None)
    before = serialization.serializer_calls.value
    rows = dump_events(history, None)
    assert serialization.serializer_calls.value == before
    assert [e.data for e in rows] == ['{"i":1}', '{"i":2}', '{"i":3}', '{"i":4}']


# -- the coordinator on a real database -------------------------------------------------


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_appends_one_event_to_a_long_session_with_constant_statements(alice, coordinator):
    short, _ = await seed_session(alice, 10)
    long, _ = await seed_session(alice, 10_000)
    await coordinator.history(short.id)
    await coordinator.history(long.id)

    _, short_queries = await capture(
        coordinator,
        short.id,
        lambda: coordinator.commit(short.id, drafts=[("message", {"text": "hi"})]),
    )
    before = serialization.serializer_calls.value
    result, long_queries = await capture(
        coordinator,
        long.id,
        lambda: coordinator.commit(long.id, drafts=[("message", {"text": "hi"})]),
    )

    assert serialization.serializer_calls.value - before == 1
    assert _kinds(long_queries) == _kinds(short_queries)
    assert len(_event_inserts(long_queries)) == 1
    assert result.seqs == (10_001,)
    assert result.written == 1
    assert (await db_state(long.id))[0] == 10_001


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_issues_no_statement_when_nothing_is_new(alice, coordinator):
    session = await seed_loaded(coordinator, alice, 50)

    result, queries = await capture(coordinator, session.id, lambda: coordinator.commit(session.id))

    assert queries == []
    assert result.written == 0
    assert result.persisted_events == 50


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_replaces_the_rows_with_one_delete_and_a_full_reinsert_after_truncation(
    alice, coordinator
):
    session = await seed_loaded(coordinator, alice, 60)

    result, queries = await capture(
        coordinator, session.id, lambda: coordinator.truncate(session.id, length=20)
    )

    deletes = [q for q in queries if q.upper().startswith("DELETE")]
    assert len(deletes) == 1 and "scheduling_event" in deletes[0]
    assert len(_event_inserts(queries)) == 1
    assert result.replaced and result.written == 20
    assert await db_state(session.id) == (20, list(range(1, 21)))


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_keeps_the_persisted_counter_when_the_transaction_fails(alice, coordinator):
    session = await seed_loaded(coordinator, alice, 5)
    # A row the coordinator does not know about takes seq 6: the insert must fail.
    await sync_to_async(Event.objects.create)(session=session, seq=6, type="intruder")

    with pytest.raises(ConflictError) as raised:
        await coordinator.commit(session.id, drafts=[("message", {"n": 6})])

    assert raised.value.code == "store.session_conflict"
    assert (await db_state(session.id))[0] == 5
    assert len(await coordinator.history(session.id)) == 6  # reloaded from the database


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_restores_the_history_when_the_fence_rejects_a_commit(alice, coordinator):
    session, run = await seed_session(alice, 3, run=True)
    stale = seeded_fence(run, token=LEASE_TOKEN - 1)
    await coordinator.history(session.id)

    with pytest.raises(SageError) as raised:
        await coordinator.commit(session.id, run_id=run.id, drafts=[("m", {})], fence=stale)

    assert raised.value.code == "scheduler.fence_rejected"
    assert [e.seq for e in await coordinator.history(session.id)] == [1, 2, 3]
    assert await coordinator.persisted_events(session.id) == 3
    assert await db_state(session.id) == (3, [1, 2, 3])


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_restores_the_history_when_a_payload_cannot_be_serialized(alice, coordinator):
    session, _ = await seed_session(alice, 2)

    with pytest.raises(ValidationError) as raised:
        await coordinator.commit(session.id, drafts=[("m", {"ok": 1}), ("m", {1: object()})])

    assert raised.value.code == "store.event_not_serializable"
    assert len(await coordinator.history(session.id)) == 2


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_rejects_only_the_stale_commit_in_a_group_commit(alice, coordinator):
    seeded = [await seed_session(alice, 2, run=True) for _ in range(3)]
    for session, _ in seeded:
        await coordinator.history(session.id)
    fences = [seeded_fence(run) for _, run in seeded]
    fences[1] = seeded_fence(seeded[1][1], token=3)
    before = coordinator.snapshot()

    async with WriterGate(coordinator, seeded[0][0].id) as gate:
        tasks = [
            asyncio.create_task(
                coordinator.commit(
                    session.id, run_id=run.id, drafts=[("m", {"i": i})], fence=fences[i]
                )
            )
            for i, (session, run) in enumerate(seeded)
        ]
        await gate.wait_queued(3)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)

    after = coordinator.snapshot()
    assert after["transactions"] - before["transactions"] == 1  # one transaction for all
    assert after["largest_batch"] == 3
    assert isinstance(outcomes[1], ConflictError)
    assert outcomes[1].code == "scheduler.fence_rejected"
    assert outcomes[0].seqs == (3,) and outcomes[2].seqs == (3,)
    assert [await db_state(s.id) for s, _ in seeded] == [
        (3, [1, 2, 3]),
        (2, [1, 2]),
        (3, [1, 2, 3]),
    ]


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_a_group_commit_of_finishes_lands_whole_archived_and_hands_on_the_turn(
    alice, coordinator
):
    """Runs finishing together (PostgreSQL: the pipelined group commit, two round trips):
    each run's events, terminal status and archive row, and a session's waiting run made
    ready — and, where a fence is stale, the batch redone the general way, only the stale
    commit refused."""
    seeded = [await seed_session(alice, 1, run=True) for _ in range(3)]
    for session, _ in seeded:
        await coordinator.history(session.id)
    waiting = await sync_to_async(Run.objects.create)(
        session=seeded[1][0], owner=alice, status=RunStatus.QUEUED, ready=False
    )
    results = [{"text": "ok", "n": [i, "é"]} for i in range(3)]
    finishes = [
        Finish(seeded_fence(run), RunStatus.COMPLETED, result=results[i])
        for i, (_, run) in enumerate(seeded)
    ]
    before = coordinator.snapshot()

    async def finish_all(transitions: list[Finish]) -> list[Any]:
        async with WriterGate(coordinator, seeded[0][0].id) as gate:
            tasks = [
                asyncio.create_task(
                    coordinator.commit(
                        by_run[str(t.fence.run_id)],
                        run_id=t.fence.run_id,
                        drafts=[("run.completed", {})],
                        fence=t.fence,
                        transition=t,
                    )
                )
                for t in transitions
            ]
            await gate.wait_queued(len(tasks))
        return await asyncio.gather(*tasks, return_exceptions=True)

    by_run = {str(run.id): session.id for session, run in seeded}
    # One stale fence in the batch: the others land, the stale one alone is refused.
    stale = Finish(seeded_fence(seeded[1][1], token=3), RunStatus.COMPLETED)
    outcomes = await finish_all([finishes[0], stale, finishes[2]])
    assert [getattr(o, "code", None) for o in outcomes] == [None, "scheduler.fence_rejected", None]
    middle = coordinator.snapshot()
    (outcome,) = await finish_all([finishes[1]])
    assert getattr(outcome, "code", None) is None
    after = coordinator.snapshot()
    if connection.vendor == "postgresql":
        assert middle["redone"] - before["redone"] == 1
        assert after["pipelined"] - middle["pipelined"] == 1
        assert after["redone"] == middle["redone"]
    assert [(await db_state(s.id))[0] for s, _ in seeded] == [2, 2, 2]

    @sync_to_async
    def rows() -> tuple[dict[Any, Any], dict[Any, Any], bool]:
        runs_ = {r.pk: (r.status, r.result) for r in Run.objects.filter(session__owner=alice)}
        archived = {
            a.run_id: (a.status, a.result, a.package_name)
            for a in ManagedAgentRecord.objects.filter(owner=alice)
        }
        return runs_, archived, Run.objects.get(pk=waiting.pk).ready

    runs_, archived, ready = await rows()
    for i, (_, run) in enumerate(seeded):
        assert runs_[run.pk] == (RunStatus.COMPLETED, results[i])
        assert archived[run.pk] == (RunStatus.COMPLETED, results[i], "demo")
    assert ready is True


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_rejects_only_the_commit_whose_rows_collide_in_a_group_commit(alice, coordinator):
    sessions = [await seed_loaded(coordinator, alice, 2) for _ in range(3)]
    # Seq 3 of the middle session exists behind the coordinator's back: its insert fails,
    # the batched statements fail, and the batch is redone commit by commit.
    await sync_to_async(Event.objects.create)(session=sessions[1], seq=3, type="intruder")

    async with WriterGate(coordinator, sessions[0].id) as gate:
        tasks = [
            asyncio.create_task(coordinator.commit(s.id, drafts=[("m", {})])) for s in sessions
        ]
        await gate.wait_queued(3)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)

    assert isinstance(outcomes[1], ConflictError)
    assert outcomes[1].code == "store.session_conflict"
    assert outcomes[0].seqs == (3,) and outcomes[2].seqs == (3,)
    assert [(await db_state(s.id))[0] for s in sessions] == [3, 2, 3]


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_gives_each_commit_its_own_transaction_without_group_commit(alice):
    coordinator = SessionStoreCoordinator(writers=1, group_commit=False)
    try:
        sessions = [await seed_loaded(coordinator, alice) for _ in range(3)]
        async with WriterGate(coordinator, sessions[0].id) as gate:
            tasks = [
                asyncio.create_task(coordinator.commit(s.id, drafts=[("m", {})])) for s in sessions
            ]
            await gate.wait_queued(3)
        await asyncio.gather(*tasks)
        assert coordinator.snapshot()["largest_batch"] == 1
        assert coordinator.snapshot()["commits"] == 3
    finally:
        await coordinator.close()


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_keeps_a_sessions_sequence_contiguous_under_concurrent_commits(alice, coordinator):
    session, _ = await seed_session(alice, 0)

    results = await asyncio.wait_for(
        asyncio.gather(
            *(
                coordinator.commit(session.id, drafts=[("m", {"i": i}), ("m", {"i": i})])
                for i in range(10)
            )
        ),
        BOUND,
    )

    assert sorted(s for r in results for s in r.seqs) == list(range(1, 21))
    assert await db_state(session.id) == (20, list(range(1, 21)))


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_finishes_the_write_when_the_caller_is_cancelled(alice, coordinator):
    session = await seed_loaded(coordinator, alice, 1)

    async with WriterGate(coordinator, session.id) as gate:
        task = asyncio.create_task(coordinator.commit(session.id, drafts=[("m", {"n": 2})]))
        await gate.wait_queued(1)
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, BOUND)

    assert await db_state(session.id) == (2, [1, 2])
    assert await coordinator.persisted_events(session.id) == 2


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_deletes_a_run_and_renumbers_the_rest_of_the_session(alice, coordinator):
    session, _ = await seed_session(alice, 0)
    keep = await sync_to_async(Run.objects.create)(session=session, owner=alice)
    drop = await sync_to_async(Run.objects.create)(session=session, owner=alice)
    await coordinator.commit(session.id, run_id=keep.id, drafts=[("m", {"k": 1})])
    await coordinator.commit(session.id, run_id=drop.id, drafts=[("m", {"d": 1})])
    await coordinator.commit(session.id, run_id=keep.id, drafts=[("m", {"k": 2})])

    result = await coordinator.delete_run(session.id, drop.id)

    assert result.replaced
    assert await db_state(session.id) == (2, [1, 2])
    assert await db_payloads(session.id) == [{"k": 1}, {"k": 2}]
    assert not await sync_to_async(Run.objects.filter(pk=drop.id).exists)()


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_takes_the_locks_of_several_sessions_without_deadlock(alice, coordinator):
    a, _ = await seed_session(alice, 0)
    b, _ = await seed_session(alice, 0)

    async def hold(*ids: Any) -> None:
        for _ in range(20):
            async with coordinator.locked(*ids):
                await asyncio.sleep(0)

    await asyncio.wait_for(asyncio.gather(hold(a.id, b.id), hold(b.id, a.id)), BOUND)


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_commits_several_sessions_together(alice, coordinator):
    a, _ = await seed_session(alice, 1)
    b, _ = await seed_session(alice, 4)

    results = await coordinator.commit_many(
        [
            CommitSpec(session_id=b.id, drafts=[EventDraft(type="m", payload={})]),
            CommitSpec(session_id=a.id, drafts=[("m", {})]),
        ]
    )

    assert [r.seqs for r in results] == [(5,), (2,)]
    assert (await db_state(a.id))[0] == 2 and (await db_state(b.id))[0] == 5


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_keeps_each_session_on_the_same_writer(alice):
    coordinator = SessionStoreCoordinator(writers=4)
    try:
        sessions = [(await seed_session(alice, 0))[0] for _ in range(8)]
        first = [coordinator._writer_for(str(s.id)) for s in sessions]
        for session in sessions:
            await coordinator.commit(session.id, drafts=[("m", {})])
        assert [coordinator._writer_for(str(s.id)) for s in sessions] == first
        assert sum(w.commits for w in coordinator._writers) == 8
    finally:
        await coordinator.close()


# -- lease fencing -------------------------------------------------------------------


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_commits_with_the_runs_current_fence(alice, coordinator):
    session, run, fence = await seed_leased(alice)
    result = await coordinator.commit(session.id, run_id=run.id, drafts=[("m", {})], fence=fence)
    assert result.seqs == (1,)
    assert coordinator.snapshot()["commits"] == 1


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_applies_a_transition_in_the_commits_transaction(alice, coordinator):
    session, run, fence = await seed_leased(alice)

    def fails(using: str) -> None:
        raise RuntimeError("the transition failed")

    with pytest.raises(RuntimeError):
        await coordinator.commit(
            session.id, run_id=run.id, drafts=[("m", {})], fence=fence, transition=fails
        )
    # The events of a commit whose transition failed were not written either.
    assert await db_state(session.id) == (0, [])


# -- append_events, the executor's entry point ---------------------------------------


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_appends_through_append_events(alice):
    session, run, fence = await seed_leased(alice, 2)
    try:
        seqs = await append_events(
            session_id=session.id,
            run_id=run.id,
            events=[("a", {}), ("b", {"x": [1, 2]})],
            fence=fence,
        )
    finally:
        await close_default_coordinator()

    assert seqs == [3, 4]
    assert (await db_payloads(session.id))[2:] == [{}, {"x": [1, 2]}]


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_appends_after_rows_written_by_another_process(alice):
    session, _ = await seed_session(alice, 1)
    try:
        await append_events(session_id=session.id, run_id=None, events=[("a", {})])
        # Another process appends seq 3 behind this coordinator's back.
        await sync_to_async(Event.objects.create)(session=session, seq=3, type="other")
        await sync_to_async(Session.objects.filter(pk=session.id).update)(persisted_events=3)
        seqs = await append_events(session_id=session.id, run_id=None, events=[("b", {})])
    finally:
        await close_default_coordinator()

    assert seqs == [4]
    assert await db_state(session.id) == (4, [1, 2, 3, 4])


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_rereads_a_history_another_process_moved_on_when_asked_for_fresh(alice):
    session, _ = await seed_session(alice, 3)
    ours, theirs = SessionStoreCoordinator(writers=1), SessionStoreCoordinator(writers=1)
    try:
        assert len(await ours.history(session.id)) == 3  # cached now
        await theirs.commit(session.id, drafts=[("message", {"from": "another worker"})])
        assert len(await ours.history(session.id)) == 3  # the cache, unchecked
        fresh = await ours.history(session.id, fresh=True)
        assert [e.seq for e in fresh] == [1, 2, 3, 4]
        assert fresh[-1].payload == {"from": "another worker"}
        # And the next commit continues the sequence instead of colliding.
        result = await ours.commit(session.id, drafts=[("message", {"from": "us"})])
        assert result.seqs == (5,)
    finally:
        await ours.close()
        await theirs.close()


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_a_fresh_read_keeps_a_current_cache_and_drops_a_rewritten_one(alice, coordinator):
    session, run, fence = await seed_leased(alice)
    await coordinator.commit(session.id, run_id=run.id, drafts=[("a", {}), ("b", {})], fence=fence)
    cached = (await coordinator.history(session.id))[0]
    # Unchanged in the database: the cached events are served (no reload).
    assert (await coordinator.history(session.id, fresh=True))[0] is cached

    def rewrite() -> None:
        # Another process removed the last event and appended a different one: same length.
        Event.objects.filter(session_id=session.id, seq=2).update(type="other")

    await sync_to_async(rewrite)()
    fresh = await coordinator.history(session.id, fresh=True)
    assert [e.type for e in fresh] == ["a", "other"]
