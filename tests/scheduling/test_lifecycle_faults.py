"""A run's life survives its worker dying at any commit boundary.

Real ``manage.py runworker`` processes run against the test database. A worker started with
``SAGE_CRASH_AT=<point>`` SIGKILLs itself at that point (``scheduling.faults``); once it is
dead its leases are ended (`expire_leases`: nothing can renew them, so the test need not
wait them out) and a fresh worker takes over. Everything is judged from database rows and
events, and from the requests a loopback model server (``tests.pooling.upstream``) received:

- a crash at every commit boundary of claim, start, append, suspend and finish: the run
  ends exactly once (one terminal event, its result on the row, an archive row with the same
  status), the session's seqs stay contiguous, what was durable stays as it was, and the
  model is called again only when the killed worker had not committed the run's end (the
  expectations follow from what the killed worker left durable, so they hold however the
  executor batches its events);
- the reaper's endings of a dead worker's run: crash budget used up (``failed``) and a
  cancel asked meanwhile (``cancelled``), each once;
- a crash between a tool call's start and its result: the resumed run records the call as
  failed and sends the model a history where every tool call is answered;
- chaos: workers SIGKILLed at random moments (a signal, or a random crash point) while many
  short tool-calling runs execute across many sessions, the dead leases left to run out by
  the database's clock; every run completes exactly once, its tool call answered once, and
  a session's runs never interleave and execute in submission order. ``SAGE_TORTURE=1``
  runs the full size; ``SAGE_CHAOS_SEED`` replays a seed.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from itertools import groupby, pairwise
from typing import Any

import orjson
import pytest

from agents import services
from agents.engine import INTERRUPTED_TOOL_ERROR
from agents.models import ManagedAgentRecord
from agents.services import packages
from pooling.models import ModelRecord
from scheduling.models import TERMINAL_STATUSES, Event, Run, RunStatus, Session, WorkerSnapshot
from scheduling.runs import TERMINAL_EVENTS
from tests.conftest import demo_manifest, scripted_model
from tests.pooling.upstream import (
    AnyReply,
    RecordedRequest,
    Reply,
    UpstreamServer,
    upstream_fixture,
)
from tests.scheduling.processes import (
    WorkerProcess,
    WorkerProcesses,
    expire_leases,
    worker_processes_fixture,
)

upstream = upstream_fixture  # the loopback model server
worker_processes = worker_processes_fixture  # real runworker subprocesses

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

TERMINAL_EVENT_TYPES = frozenset(TERMINAL_EVENTS.values())
UPSTREAM_TEXT = "Hello from upstream."
# Generous: two cores, other suites running, a Django start-up per worker.
STARTUP_TIMEOUT = 90
RUN_TIMEOUT = 90


# ------------------------------------------------------------------------------ helpers


def _a_fresh_worker_finishes(
    worker_processes: WorkerProcesses, done: Any, *, message: str, **env: str
) -> None:
    """Start a worker named ``fresh``, wait until ``done()`` holds, and stop it cleanly."""
    fresh = worker_processes.start("fresh", **env)
    worker_processes.wait_for(
        done, timeout=STARTUP_TIMEOUT + RUN_TIMEOUT, message=message, running=(fresh,)
    )
    assert fresh.terminate() == 0, fresh.tail()


def _a_fresh_worker_ends(
    worker_processes: WorkerProcesses,
    run: Run,
    status: str = RunStatus.COMPLETED,
    *,
    message: str,
    **env: str,
) -> Run:
    """A worker named ``fresh`` ends ``run`` and stops cleanly; the run ended exactly once,
    ``status``, in a session whose events are contiguous. Returns the ended run."""
    _a_fresh_worker_finishes(worker_processes, lambda: _is_terminal(run.pk), message=message, **env)
    ended = assert_ended_once(run.pk, status)
    assert_contiguous(run.session_id)
    return ended


def _the_reaper_ends(
    worker_processes: WorkerProcesses,
    upstream: UpstreamServer,
    run: Run,
    status: str,
    events: list[str],
    *,
    message: str,
    **env: str,
) -> Run:
    """A fresh worker's reaper ends the dead worker's ``run`` (see `_a_fresh_worker_ends`)
    without executing it: no request reaches ``upstream``, and the run's events are then
    ``events``. Returns the ended run."""
    requests = len(upstream.requests)
    ended = _a_fresh_worker_ends(worker_processes, run, status, message=message, **env)
    assert len(upstream.requests) == requests
    assert_events(run.pk, events)
    return ended


def _gpt_package(user, upstream: UpstreamServer, name: str = "faults") -> None:
    """A package whose agent's model is the loopback upstream (OpenAI protocol)."""
    if not ModelRecord.objects.filter(owner=None, name="gpt").exists():
        upstream.model_record(name="gpt", api_key="sk-faults", model="gpt-test", timeout=60)
    packages.package_create(owner=user, manifest=demo_manifest(name=name, model="gpt"))


def _submit(user, text: str, package: str = "faults") -> Run:
    session = services.session_create(owner=user, package=package, agent="assistant")
    run, created = services.run_submit(owner=user, session_id=session.pk, input=text)
    assert created
    return run


def _is_terminal(run_id: Any) -> bool:
    return Run.objects.filter(pk=run_id, status__in=TERMINAL_STATUSES).exists()


def _snapshot_published(worker: WorkerProcess) -> bool:
    """The worker is up: it published its snapshot (after its start-up recovery)."""
    return WorkerSnapshot.objects.filter(pid=worker.pid, stopped_at__isnull=True).exists()


def _describe(event: Event) -> str:
    """An event as a short word: ``user``/``assistant`` for messages, ``run.started:first``
    or ``run.started:again``, else its type."""
    payload = event.payload
    if event.type == "message.completed":
        return payload.get("role", "?")
    if event.type == "run.started":
        return "run.started:" + ("first" if payload.get("first_attempt") else "again")
    return event.type


def _run_events(run_id: Any) -> list[str]:
    return [_describe(e) for e in Event.objects.filter(run_id=run_id).order_by("seq")]


def assert_events(run_id: Any, expected: list[str]) -> None:
    events = _run_events(run_id)
    assert events == expected, f"the run's events: {events}"


def assert_contiguous(session_id: Any) -> list[Event]:
    """The session's events have seqs 1..n and its durable prefix says n."""
    events = list(Event.objects.filter(session_id=session_id).order_by("seq"))
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1)), f"session seqs not contiguous: {seqs}"
    persisted = Session.objects.get(pk=session_id).persisted_events
    assert persisted == len(seqs), f"persisted_events={persisted}, {len(seqs)} events"
    return events


def assert_ended_once(run_id: Any, status: str = RunStatus.COMPLETED) -> Run:
    """The run ended exactly once: one terminal event, of ``status``; for a completed run
    its result is the event's; an archive row with the same status and result."""
    run = Run.objects.get(pk=run_id)
    assert run.status == status, (run.status, run.error)
    terminal = list(Event.objects.filter(run_id=run_id, type__in=TERMINAL_EVENT_TYPES))
    assert [e.type for e in terminal] == [TERMINAL_EVENTS[status]], _run_events(run_id)
    if status == RunStatus.COMPLETED:
        assert run.result == terminal[0].payload["result"]
    else:
        assert run.error == terminal[0].payload["error"]
    archive = ManagedAgentRecord.objects.filter(run_id=run_id).first()
    assert archive is not None, "the ended run has no archive row"
    assert (archive.status, archive.result, archive.error) == (run.status, run.result, run.error)
    assert run.lease_owner == "" and run.lease_expires_at is None
    return run


def _requests_of(upstream: UpstreamServer, user_text: str) -> list[list[dict[str, Any]]]:
    """The messages of each upstream request whose conversation carries ``user_text``."""
    found = []
    for request in upstream.requests:
        messages = (request.json or {}).get("messages") or []
        if any(m.get("role") == "user" and m.get("content") == user_text for m in messages):
            found.append(messages)
    return found


def unanswered_calls(messages: list[dict[str, Any]]) -> list[str]:
    """Ids of assistant tool calls (OpenAI chat format) not answered by a tool message
    before the next non-tool message."""
    missing: list[str] = []
    pending: set[str] = set()
    for message in messages:
        role = message.get("role")
        if role == "tool":
            pending.discard(message.get("tool_call_id"))
            continue
        missing += sorted(pending)
        pending = set()
        if role == "assistant":
            pending = {call["id"] for call in message.get("tool_calls") or []}
    return missing + sorted(pending)


# ------------------------------------------------------------------------------ 1. commits


class ToolUpstream(UpstreamServer):
    """The loopback upstream answering like a model with a calculator: a conversation with
    no tool result since the user's message gets a ``calculator`` call (a new call id per
    request), one with a tool result gets `UPSTREAM_TEXT`. So a run takes two model calls
    and, whatever the executor batches, commits at every boundary: claim, start (its first
    events), append (the tool call's start or result) and finish."""

    def reply_for(self, request: RecordedRequest) -> AnyReply:
        reply = super().reply_for(request)
        if reply is not self.default:
            return reply  # a queued reply
        messages = (request.json or {}).get("messages") or []
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        since_user = messages[users[-1] + 1 :] if users else messages
        if any(m.get("role") == "tool" for m in since_user):
            return Reply(text=UPSTREAM_TEXT)
        call = {
            "id": f"call_{len(self.requests)}",
            "name": "calculator",
            "arguments": {"expression": "6*7"},
        }
        return Reply(text="", tool_calls=(call,))


@pytest.fixture
def tool_upstream() -> Iterator[ToolUpstream]:
    with ToolUpstream() as server:
        yield server


FIRST = ["run.started:first", "user"]
COMMIT_POINTS = [
    "claim.before_commit",
    "claim.after_commit",
    "start.before_commit",
    "start.after_commit",
    "append.before_commit",
    "append.after_commit",
    "finish.before_commit",
    "finish.after_commit",
]


def restart_head(left: list[str]) -> list[str]:
    """How a new execution of a run begins, given the run's durable events: the user's
    message is recorded once, by the first execution that commits anything."""
    started = any(e.startswith("run.started") for e in left)
    return ["run.started:again"] if started else list(FIRST)


def assert_tool_calls_answered_once(run_id: Any, interrupted: set[str]) -> None:
    """Every started tool call of the run has exactly one result event; the calls in
    ``interrupted`` (their worker died before the result was durable) failed as
    interrupted — they are not run again."""
    started: list[str] = []
    results: Counter[str] = Counter()
    for event in Event.objects.filter(run_id=run_id).order_by("seq"):
        payload = event.payload
        if event.type == "tool.call.started":
            started.append(payload["id"])
        elif event.type in ("tool.call.succeeded", "tool.call.failed"):
            results[payload["id"]] += 1
            if payload["id"] in interrupted:
                assert event.type == "tool.call.failed", payload
                assert payload["error"] == INTERRUPTED_TOOL_ERROR, payload
    assert len(started) == len(set(started)), f"a tool call started twice: {started}"
    assert dict(results) == dict.fromkeys(started, 1), (started, dict(results))


@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_a_worker_killed_at_a_commit_boundary_ends_the_run_exactly_once(
    point, alice, tool_upstream, worker_processes: WorkerProcesses
):
    """What the fresh worker does follows from what the killed one made durable (the
    expectations hold however the executor batches its events): the durable events are
    kept as they are; nothing durable → the run starts over; a tool call durable without
    its result → it is answered as failed, not run again; the terminal event durable → the
    run is over and the model is not called again."""
    upstream = tool_upstream
    _gpt_package(alice, upstream)
    run = _submit(alice, "what is 6*7?")

    doomed = worker_processes.start("doomed", SAGE_CRASH_AT=point)
    doomed.wait_killed(timeout=STARTUP_TIMEOUT + RUN_TIMEOUT, unless=lambda: _is_terminal(run.pk))
    killed_calls = len(upstream.requests)
    left = _run_events(run.pk)
    row = Run.objects.get(pk=run.pk)
    ended_by_killed = any(e in TERMINAL_EVENT_TYPES for e in left)
    # What each point leaves, whatever the batching.
    if point == "claim.before_commit":
        assert (row.status, row.attempts, left, killed_calls) == (RunStatus.QUEUED, 0, [], 0)
    elif point == "finish.after_commit":
        assert (row.status, left[-1], killed_calls) == (RunStatus.COMPLETED, "run.completed", 2)
    else:
        assert row.status == RunStatus.RUNNING and doomed.owner_marker in row.lease_owner
        assert not ended_by_killed, left
        if point == "claim.after_commit":
            assert (left, killed_calls) == ([], 0)
        elif point == "start.before_commit":
            assert left == [], left
        elif point == "finish.before_commit":
            assert killed_calls == 2
        else:  # start.after_commit, append.*: the run's first commit is durable
            assert left[:2] == FIRST, left
    assert killed_calls >= left.count("assistant")
    interrupted = {
        e.payload["id"] for e in Event.objects.filter(run_id=run.pk, type="tool.call.started")
    } - {
        e.payload["id"]
        for e in Event.objects.filter(
            run_id=run.pk, type__in=["tool.call.succeeded", "tool.call.failed"]
        )
    }

    expire_leases(doomed)
    fresh = worker_processes.start("fresh")
    worker_processes.wait_for(
        lambda: _is_terminal(run.pk) and _snapshot_published(fresh),
        timeout=STARTUP_TIMEOUT + RUN_TIMEOUT,
        message=f"the fresh worker to finish the run left at {point}",
        running=(fresh,),
    )
    if ended_by_killed:
        time.sleep(2)  # the fresh worker's claim loop has had its chance to take it again
    assert fresh.terminate() == 0, fresh.tail()

    ended = assert_ended_once(run.pk)
    assert ended.result["text"] == UPSTREAM_TEXT
    assert_contiguous(run.session_id)
    final = _run_events(run.pk)
    assert final[: len(left)] == left, f"durable events changed: {left} → {final}"
    added = final[len(left) :]
    fresh_calls = len(upstream.requests) - killed_calls
    # The model is called again only when the killed worker had not ended the run: once
    # for the answer when the tool call was durable, twice when nothing of it was.
    expected_calls = 0 if ended_by_killed else (1 if "tool.call.started" in left else 2)
    assert fresh_calls == expected_calls, (point, left, added, fresh_calls)
    if ended_by_killed:
        assert added == [], added
    else:
        head = restart_head(left) + ["tool.call.failed"] * len(interrupted)
        assert added[: len(head)] == head, (left, added)
        assert added[-1] == "run.completed" and added.count("assistant") == fresh_calls, added
    assert final.count("user") == 1, final
    assert_tool_calls_answered_once(run.pk, interrupted)
    # Every request the upstream received had every tool call answered; the fresh worker's
    # first one carried the durable conversation.
    for request in upstream.requests:
        assert unanswered_calls(request.json["messages"]) == [], request.json["messages"]
    if fresh_calls:
        first = upstream.requests[killed_calls].json["messages"]
        assert sum(m["role"] == "assistant" for m in first) == left.count("assistant"), first
    # A dead lease is a crash (counted once); a claim that never committed is nothing.
    lost = point not in ("claim.before_commit", "finish.after_commit")
    assert (ended.attempts, ended.crashes) == ((2, 1) if lost else (1, 0))


# ------------------------------------------------------------------------------ reaper ends


def test_a_run_whose_workers_keep_dying_fails_once_when_its_crash_budget_is_used_up(
    alice, upstream, worker_processes: WorkerProcesses
):
    """Two workers die just before committing the run's end (``SAGE_MAX_RUN_ATTEMPTS=2``):
    the third reaps the dead lease as the last crash and ends the run ``failed`` — event,
    status and archive once — without executing it."""
    upstream.default = Reply(text=UPSTREAM_TEXT)
    _gpt_package(alice, upstream)
    run = _submit(alice, "hello")
    budget = {"SAGE_MAX_RUN_ATTEMPTS": "2"}
    left: list[str] = []
    for name in ("first", "second"):
        doomed = worker_processes.start(name, SAGE_CRASH_AT="finish.before_commit", **budget)
        doomed.wait_killed(
            timeout=STARTUP_TIMEOUT + RUN_TIMEOUT, unless=lambda: _is_terminal(run.pk)
        )
        expire_leases(doomed)
        now = _run_events(run.pk)
        assert now[: len(left)] == left, (left, now)
        if len(now) > len(left):
            assert now[len(left) :][: len(restart_head(left))] == restart_head(left), now
        left = now
    assert len(upstream.requests) == 2

    ended = _the_reaper_ends(
        worker_processes,
        upstream,
        run,
        RunStatus.FAILED,
        [*left, "run.failed"],
        message="the fresh worker to reap the run whose crash budget is used up",
        **budget,
    )
    assert ended.error["code"] == "execution.worker_restarted"
    assert (ended.attempts, ended.crashes) == (2, 2)


def test_a_run_cancelled_while_its_worker_is_dead_ends_cancelled_once(
    alice, upstream, worker_processes: WorkerProcesses
):
    """A cancel asked of a running run whose worker died is carried out by the reaper:
    ``cancelled`` once, and the run is not executed again."""
    upstream.default = Reply(text=UPSTREAM_TEXT)
    _gpt_package(alice, upstream)
    run = _submit(alice, "hello")
    doomed = worker_processes.start("doomed", SAGE_CRASH_AT="finish.before_commit")
    doomed.wait_killed(timeout=STARTUP_TIMEOUT + RUN_TIMEOUT, unless=lambda: _is_terminal(run.pk))
    left = _run_events(run.pk)
    asked = services.run_cancel(run=Run.objects.get(pk=run.pk))
    assert (asked.status, asked.cancel_requested) == (RunStatus.RUNNING, True)
    expire_leases(doomed)
    assert len(upstream.requests) == 1

    ended = _the_reaper_ends(
        worker_processes,
        upstream,
        run,
        RunStatus.CANCELLED,
        [*left, "run.cancelled"],
        message="the fresh worker to end the cancelled run of the dead worker",
    )
    assert ended.error["code"] == "run.cancelled"


# ------------------------------------------------------------------------------ suspension


@pytest.mark.parametrize("point", ["suspend.before_commit", "suspend.after_commit"])
def test_a_worker_killed_while_suspending_a_run_ends_it_exactly_once(
    point, alice, upstream, worker_processes: WorkerProcesses
):
    """Deterministic suspension: the killed worker has one model-call slot and no queue.
    Run A holds the slot (its upstream stream is held open by a gate), then run B is
    submitted: its model call is refused (``model.queue_full``, nothing reaches the
    upstream) and B suspends — where the worker dies."""
    upstream.default = Reply(text=UPSTREAM_TEXT)
    gate = threading.Event()
    upstream.enqueue(Reply(text="held open answer", gate=gate))
    _gpt_package(alice, upstream)
    first = _submit(alice, "first question")

    doomed = worker_processes.start(
        "doomed",
        SAGE_CRASH_AT=point,
        SAGE_MAX_CONCURRENT_MODEL_CALLS="1",
        SAGE_MAX_WAITING_MODEL_CALLS="0",
    )
    try:
        upstream.wait_for_requests(1, timeout=STARTUP_TIMEOUT)
    except TimeoutError:
        raise AssertionError(f"run A never reached the upstream\n{doomed.tail()}") from None
    second = _submit(alice, "second question")
    try:
        doomed.wait_killed(timeout=RUN_TIMEOUT, unless=lambda: _is_terminal(second.pk))
    finally:
        gate.set()
    left = _run_events(second.pk)
    row = Run.objects.get(pk=second.pk)
    expire_leases(doomed)
    if point == "suspend.after_commit":
        assert row.status == RunStatus.SUSPENDED
        assert row.interaction["code"] == "model.queue_full"
        assert left[-2:] == ["run.suspended", "interaction.requested"], left
        assert left.count("run.suspended") == 1, left
        services.run_reply(run=row, decision="retry")
    else:
        assert row.status == RunStatus.RUNNING
        assert "run.suspended" not in left, left

    _a_fresh_worker_finishes(
        worker_processes,
        lambda: _is_terminal(first.pk) and _is_terminal(second.pk),
        message=f"the fresh worker to finish both runs left at {point}",
    )

    for run in (first, second):
        assert_ended_once(run.pk)
        assert_contiguous(run.session_id)
    # B's refused call never reached the upstream: it was called once, by the fresh worker,
    # with the user's message once. A was called by both workers.
    b_requests = _requests_of(upstream, "second question")
    assert len(b_requests) == 1
    assert [m["role"] for m in b_requests[0]] == ["system", "user"]
    assert len(_requests_of(upstream, "first question")) == 2
    if point == "suspend.after_commit":
        resumed = ["interaction.resolved", "run.resumed", "run.started:again"]
        assert_events(second.pk, [*left, *resumed, "assistant", "run.completed"])
        assert Run.objects.get(pk=second.pk).crashes == 0
    else:
        assert_events(second.pk, [*left, *restart_head(left), "assistant", "run.completed"])
        assert Run.objects.get(pk=second.pk).crashes == 1


# ------------------------------------------------------------------------------ 2. tools


def test_a_worker_killed_between_a_tool_call_and_its_result(
    alice, upstream, worker_processes: WorkerProcesses
):
    upstream.enqueue(
        Reply(
            text="",
            tool_calls=(
                {"id": "call_calc", "name": "calculator", "arguments": {"expression": "6*7"}},
            ),
        ),
        Reply(text="It is 42."),
    )
    _gpt_package(alice, upstream)
    run = _submit(alice, "what is 6*7?")

    doomed = worker_processes.start("doomed", SAGE_CRASH_AT="tool.started")
    doomed.wait_killed(timeout=STARTUP_TIMEOUT + RUN_TIMEOUT, unless=lambda: _is_terminal(run.pk))
    assert len(upstream.requests) == 1
    assert_events(run.pk, [*FIRST, "assistant", "tool.call.started"])
    expire_leases(doomed)

    ended = _a_fresh_worker_ends(
        worker_processes,
        run,
        message="the fresh worker to finish the run whose tool call was interrupted",
    )
    assert ended.result["text"] == "It is 42."
    assert_events(
        run.pk,
        [
            *FIRST,
            "assistant",
            "tool.call.started",
            "run.started:again",
            "tool.call.failed",
            "assistant",
            "run.completed",
        ],
    )
    # The interrupted call is answered once, as failed: its effect is unknown, it is not
    # run again.
    failed = Event.objects.get(run_id=run.pk, type="tool.call.failed").payload
    assert failed == {"id": "call_calc", "name": "calculator", "error": INTERRUPTED_TOOL_ERROR}
    assert not Event.objects.filter(run_id=run.pk, type="tool.call.succeeded").exists()
    # The next model request carries a well-formed history: every tool call answered.
    assert len(upstream.requests) == 2
    messages = upstream.requests[1].json["messages"]
    assert unanswered_calls(messages) == []
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["tool_calls"][0]["id"] == "call_calc"
    assert messages[3]["tool_call_id"] == "call_calc"
    assert INTERRUPTED_TOOL_ERROR in messages[3]["content"]


# ------------------------------------------------------------------------------ 3. chaos

CHAOS_SEED = int(os.environ.get("SAGE_CHAOS_SEED", "1337"))
CRASH_POINTS = (*COMMIT_POINTS, "tool.started")
CHAOS_CALL = {"name": "calculator", "arguments": {"expression": "6*7"}}


def _chaos_size() -> tuple[int, int, int, float, int]:
    """(kills, runs, sessions, longest delay before a signal, largest crash-point count):
    the kills are spread so that about half of the work is done between them."""
    if os.environ.get("SAGE_TORTURE") == "1":
        return 20, 400, 40, 1.0, 10
    return 5, 60, 12, 0.6, 6


def test_chaos_every_run_completes_once_in_session_order_through_random_kills(
    alice, bob, carol, worker_processes: WorkerProcesses, monkeypatch, capsys, settings
):
    kills, total, n_sessions, delay_max, nth_max = _chaos_size()
    rng = random.Random(CHAOS_SEED)
    began = time.monotonic()
    monkeypatch.setitem(settings.SAGE, "SAGE_SERVER_MAX_PENDING_RUNS", total + 100)
    monkeypatch.setitem(settings.SAGE, "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER", total + 100)
    # A tool call, then the answer: a run commits at every boundary (claim, start, append,
    # finish) and takes about 150 ms, so every kill lands mid-work.
    scripted_model(
        "chaos",
        {"text": "", "tool_calls": [CHAOS_CALL]},
        {"text": "six times seven is forty-two"},
        token_delay_ms=25,
    )
    users = [alice, bob, carol]
    for user in users:
        packages.package_create(owner=user, manifest=demo_manifest(name="chaos", model="chaos"))
    sessions = [
        services.session_create(owner=users[i % len(users)], package="chaos", agent="assistant")
        for i in range(n_sessions)
    ]
    submitted: dict[str, list[str]] = {str(s.pk): [] for s in sessions}
    # Session by session: a user's oldest queued runs are then runs of one session, so a
    # scheduler that let a session run two at once (or out of order) would do it here.
    for i in range(total):
        session = sessions[i * n_sessions // total]
        run, _ = services.run_submit(owner=session.owner, session_id=session.pk, input=f"run {i}")
        submitted[str(session.pk)].append(str(run.pk))
    run_ids = [rid for ids in submitted.values() for rid in ids]
    env = {
        # The one test here that waits out real leases (by the database's clock); a lease
        # lost to a stalled worker only requeues a run, which the checks below allow.
        "SAGE_LEASE_SECONDS": "4",
        "SAGE_SERVER_MAX_CONCURRENT_RUNS": "3",
        "SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER": "3",
        # Crashes must never use up a run's budget here: every run has to complete.
        "SAGE_MAX_RUN_ATTEMPTS": "1000",
    }

    def unfinished() -> int:
        return Run.objects.filter(pk__in=run_ids).exclude(status__in=TERMINAL_STATUSES).count()

    modes: Counter[str] = Counter()
    done_kills = 0
    for k in range(kills):
        overrides = dict(env)
        mode = rng.choice(["signal", "crash_point"])
        if mode == "crash_point":
            overrides["SAGE_CRASH_AT"] = f"{rng.choice(CRASH_POINTS)}:{rng.randint(1, nth_max)}"
        delay = rng.uniform(0.0, delay_max)
        events_before = Event.objects.count()
        worker = worker_processes.start(f"chaos{k}", **overrides)
        # Kill it while it works: once it has written an event (or died at its point).
        worker_processes.wait_for(
            lambda w=worker, n=events_before: Event.objects.count() > n or not w.alive,
            timeout=STARTUP_TIMEOUT,
            message=f"chaos worker {k} to make progress",
        )
        if mode == "crash_point":
            # Its crash point usually comes first; a signal at the deadline otherwise.
            deadline = time.monotonic() + delay + 1.0
            while worker.alive and time.monotonic() < deadline:
                time.sleep(0.02)
        else:
            time.sleep(delay)
        if worker.alive:
            modes["signal" if mode == "signal" else "signal_fallback"] += 1
        else:
            modes["crash_point"] += 1
        worker.kill()
        assert worker.killed, (
            f"chaos worker {k} exited on its own ({worker.returncode}):\n{worker.tail()}"
        )
        done_kills += 1
        if unfinished() == 0:
            break

    left_for_final = unfinished()
    final = worker_processes.start("final", **env)
    worker_processes.wait_for(
        lambda: unfinished() == 0 and _snapshot_published(final),
        timeout=STARTUP_TIMEOUT + (600 if total > 100 else RUN_TIMEOUT),
        message="every chaos run to end",
        running=(final,),
    )
    assert final.terminate() == 0, final.tail()

    # --- judge the rows
    statuses = Counter(
        Run.objects.filter(pk__in=run_ids).values_list("status", flat=True).order_by()
    )
    terminal_counts = Counter(
        str(rid)
        for rid in Event.objects.filter(
            run_id__in=run_ids, type__in=TERMINAL_EVENT_TYPES
        ).values_list("run_id", flat=True)
    )
    duplicates = sum(n - 1 for n in terminal_counts.values() if n > 1)
    missing = [rid for rid in run_ids if terminal_counts[rid] == 0]
    completed_events = Event.objects.filter(run_id__in=run_ids, type="run.completed").count()
    interleaved: list[str] = []
    out_of_order: list[str] = []
    gaps: list[str] = []
    for session in sessions:
        sid = str(session.pk)
        rows = list(
            Event.objects.filter(session_id=session.pk).order_by("seq").values_list("seq", "run_id")
        )
        if [seq for seq, _ in rows] != list(range(1, len(rows) + 1)):
            gaps.append(sid)
        blocks = [str(rid) for rid, _ in groupby(rid for _, rid in rows)]
        if len(blocks) != len(set(blocks)):
            interleaved.append(sid)
        elif blocks != submitted[sid]:
            out_of_order.append(sid)
    tool_events: dict[str, Counter[str]] = {}
    interrupted = 0
    for rid, etype, data in Event.objects.filter(
        run_id__in=run_ids,
        type__in=["tool.call.started", "tool.call.succeeded", "tool.call.failed"],
    ).values_list("run_id", "type", "data"):
        payload = orjson.loads(data)
        per_run = tool_events.setdefault(str(rid), Counter())
        per_run[("started:" if etype == "tool.call.started" else "answered:") + payload["id"]] += 1
        interrupted += payload.get("error") == INTERRUPTED_TOOL_ERROR
    # Each run started its tool call once durably and answered it exactly once.
    badly_answered = [
        rid
        for rid in run_ids
        if sorted(tool_events.get(rid, Counter()).values()) != [1, 1]
        or {k.split(":", 1)[1] for k in tool_events[rid]} != {"call_0_0"}
    ]
    # One run at a time per session, from the rows: each run was first claimed no earlier
    # than the one submitted before it ended (both times by the database's clock).
    times = {
        str(pk): (started, finished)
        for pk, started, finished in Run.objects.filter(pk__in=run_ids).values_list(
            "pk", "started_at", "finished_at"
        )
    }
    overlapping = [
        sid
        for sid, ids in submitted.items()
        if any(times[b][0] < times[a][1] for a, b in pairwise(ids))
    ]
    crashes = sum(Run.objects.filter(pk__in=run_ids).values_list("crashes", flat=True))
    summary = (
        f"chaos seed={CHAOS_SEED}: kills={done_kills} ({dict(modes)}), runs={total} in "
        f"{n_sessions} sessions, completed={statuses.get(RunStatus.COMPLETED, 0)}, "
        f"duplicate terminal events={duplicates}, missing terminal events={len(missing)}, "
        f"interleaved sessions={len(interleaved)}, out-of-order sessions={len(out_of_order)}, "
        f"overlapping sessions={len(overlapping)}, seq gaps={len(gaps)}, "
        f"badly answered tool calls={len(badly_answered)}, "
        f"tool calls interrupted={interrupted}, crashes recovered={crashes}, "
        f"unfinished after the last kill={left_for_final}, "
        f"{time.monotonic() - began:.1f}s"
    )
    with capsys.disabled():
        print(f"\n{summary}")

    # Work was left after the last kill, so every kill landed while runs were executing.
    assert done_kills == kills and left_for_final > 0, f"the runs ran out first: {summary}"
    assert statuses == {RunStatus.COMPLETED: total}, summary
    assert (duplicates, missing, completed_events) == (0, [], total), summary
    assert (interleaved, out_of_order, overlapping) == ([], [], []), summary
    assert (gaps, badly_answered) == ([], []), summary
    archived = ManagedAgentRecord.objects.filter(run_id__in=run_ids, status=RunStatus.COMPLETED)
    assert archived.count() == total, summary
    assert crashes >= 1, summary
