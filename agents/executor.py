"""Executing one claimed run: take its Application, run the agent loop or flow, commit
its events, and return its ``Outcome`` — the executor never writes a run's status (the
dispatcher commits the outcome through ``scheduling.runs``).

The worker receives a ``RunExecutor`` when it is composed (``agents`` management command
``runworker``). A run executes through the worker's ``AgentManagementService``
(``agents.applications``): the package is parsed, its instructions resolved and its model
records decrypted once per resident Application, not once per run. The executor also
answers operator reclamation requests and, at start-up, archives terminal runs a crash
left unarchived. Everything that touches the ORM runs in threads (``db_call``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from agents.applications import (
    AgentManagementService,
    Application,
    ModelRecordView,
    PreparedAgent,
    build_application_sync,
    fresh_records_sync,
    unfinished_runs_sync,
)
from agents.archives import archive_unarchived_sync, sweep_unarchived_sync
from agents.code_tools import CodeToolsRuntime
from agents.engine import (
    INTERRUPTED_TOOL_ERROR,
    TOOL_FAILED,
    TOOL_STARTED,
    TOOL_SUCCEEDED,
    AgentTurn,
    ApprovalReply,
    ApprovalRequired,
    EventBatch,
    history_from_events,
    run_turn,
    unanswered_tool_calls,
)
from agents.flows import run_flow
from agents.jobs.reconcile import poll_cancel_requests
from agents.jobs.records import JobEventRecorder
from agents.jobs.runtime import build_job_runtime
from agents.jobs.tools import JOB_TOOLS
from agents.mcp.runtime import NO_TOOLS, McpAuthRequired, McpRuntime, McpTools
from agents.services import reclamations
from agents.services.mcp_oauth import (
    mcp_oauth_begin,
    mcp_oauth_credentials,
    mcp_oauth_refused,
)
from agents.tools import ToolContext, ToolRegistry, ToolSuspends, build_registry
from agents.tracing import Tracing
from pooling import providers
from pooling.budget import ModelConcurrencyBudget
from pooling.clients import ModelClientPool
from pooling.providers import load_adapter
from pooling.providers.base import ModelRequest, StreamEnd, TextDelta, ToolCall, ToolCallDelta
from sageproject import logs as sage_logs
from sageproject.db import db_call, retry_transient
from sageproject.errors import ErrorCategory, NotFoundError, SageError
from scheduling import live, runs
from scheduling.figures import FIRST_TOKEN, MODEL_TOKENS, Figures
from scheduling.models import Run, RunStatus, run_cancelled_error, run_interrupted_error
from scheduling.protocol import FenceRejected
from scheduling.runs import Fence, Outcome, Start
from scheduling.store import append_events, get_default_coordinator
from scheduling.worker import StopSignal

logger = logging.getLogger("sage.execution")

# A resident Application's model records are compared with the database at most this often
# (a changed record — a rotated key — is re-read by the next run after that).
RECORD_CHECK_SECONDS = 1.0
# How often the executor looks for operator reclamation requests.
RECLAMATION_POLL_SECONDS = 2.0
# Resident Applications' unfinished-run counts (for the capacity page) are refreshed every
# this many capacity refreshes (one per second).
UNFINISHED_REFRESH_EVERY = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRun:
    """One run's own data (its package comes from the Application)."""

    run_id: Any
    session_id: Any
    owner_id: int
    package_ref: str
    package_name: str
    agent_id: str
    user_input: str
    # Filled by ``RunExecutor._prepare`` from the store coordinator.
    history: list[dict[str, Any]] = field(default_factory=list)
    first_attempt: bool = True
    session_kind: str = "master"
    # The reply that resumed a suspended run, emitted as ``interaction.resolved``.
    resolution: dict[str, Any] | None = None
    # ``tool.call.failed`` events for this run's calls a crashed attempt left unanswered.
    interrupted_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # An answered approval: the suspended step's calls and the decision (`_approval_reply`).
    approval: ApprovalReply | None = None


def _user_input(value: Any) -> str:
    return value if isinstance(value, str) else str((value or {}).get("text", ""))


def _prepared_from_claim(row: dict[str, Any]) -> PreparedRun:
    return PreparedRun(
        run_id=row["pk"],
        session_id=row["session_id"],
        owner_id=row["owner_id"],
        package_ref=row["session__package_ref"],
        package_name=row["session__package_name"],
        agent_id=row["session__agent_id"],
        user_input=_user_input(row["input"]),
        session_kind=row["session__kind"],
        resolution=(row["interaction"] or {}).get("resolution"),
        approval=_approval_reply(row["interaction"]),
    )


def _approval_reply(interaction: dict[str, Any] | None) -> ApprovalReply | None:
    """The calls of an answered approval interaction, the waiting ones rejected when the
    decision was ``reject``, with the user's arguments where it was ``edit``; None for
    anything else."""
    interaction = interaction or {}
    resolution = interaction.get("resolution")
    if interaction.get("type") != "approval" or not resolution:
        return None
    edits = resolution.get("edits") or {}
    calls = tuple(
        ToolCall(id=c["id"], name=c["name"], arguments=edits.get(c["id"], c.get("arguments") or {}))
        for c in interaction.get("tool_calls") or ()
    )
    rejected = resolution.get("decision") == "reject"
    return ApprovalReply(
        calls=calls,
        rejected=frozenset(interaction.get("waiting") or ()) if rejected else frozenset(),
    )


# Errors of this host's own bounded resources (nothing was sent to the provider) and the
# provider's own rate limit (a 429, with or without Retry-After: nothing of the step was
# kept): the run is suspended and a reply with decision "retry" resumes it.
SUSPENDING_CODES = frozenset(
    {
        "model.queue_full",
        "model.queue_timeout",
        "server.model_pool_full",
        "management.capacity",
        "management.draining",
        "upstream.rate_limited",
        # Every MCP session slot is in use (listing an agent's MCP tools).
        "mcp.session_pool_full",
    }
)


class _LeasedProvider:
    """A leased client with its protocol's adapter: the provider the budget wraps.

    ``opened`` is when its stream was asked for, after the budget gave the slot: the
    first-token figure counts from there, so a wait for the slot is not in it.
    """

    __slots__ = ("adapter", "client", "opened")

    def __init__(self, adapter: Any, client: Any) -> None:
        self.adapter = adapter
        self.client = client
        self.opened = time.monotonic()

    def stream(self, request: ModelRequest) -> AsyncIterator[Any]:
        self.opened = time.monotonic()
        return self.adapter.stream(self.client, request)


class _RunEvents:
    """The events of one execution, committed (fenced) in as few transactions as safety
    allows.

    The start of the run (``run.started``, the user's message) is not waited for: the
    model is called meanwhile, and the start goes with the execution's first commit if
    that comes within `START_COMMIT_DELAY` seconds (a one-step run then costs one commit),
    else in a commit of its own at that moment. A batch that starts tool calls or carries
    their results is committed and waited for — a tool acts on the world only after its
    call is durable, and its result is durable before the model is called again — and for
    flows every batch is. A final assistant message goes with the outcome's own commit.
    The first commit consumes a reply's resolution (``Start``; an outcome's ``Finish`` or
    ``Suspend`` replaces the interaction anyway), so a requeue does not record it again.
    """

    _FLUSHING = frozenset({TOOL_STARTED, TOOL_SUCCEEDED, TOOL_FAILED})

    def __init__(
        self, prepared: PreparedRun, fence: Fence, start: EventBatch, *, flush_every_batch: bool
    ) -> None:
        self.prepared = prepared
        self.fence = fence
        self.pending: EventBatch = list(start)
        self.flush_every_batch = flush_every_batch
        self._start: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        """Commit the start events soon, in the background (see the class text)."""
        self._timer = asyncio.get_running_loop().call_later(START_COMMIT_DELAY, self._commit_start)

    def _start_transition(self) -> Start:
        return Start(self.fence, clear_resolution=self.prepared.resolution is not None)

    def _take_start(self) -> bool:
        """Whether the start is still to be committed (then it goes with the caller's
        commit, or `_commit_start`'s): the timer is stopped."""
        if self._timer is None:
            return False
        self._timer.cancel()
        self._timer = None
        return True

    def _commit_start(self) -> None:
        if not self._take_start():
            return
        events, self.pending = self.pending, []
        self._start = asyncio.ensure_future(self._commit(events, self._start_transition()))
        # Never "exception was never retrieved": `settle` re-raises it where it matters.
        self._start.add_done_callback(lambda f: f.cancelled() or f.exception())

    def abandon(self) -> None:
        """The execution stops without an outcome (requeued): its start is not committed."""
        self._take_start()

    async def _commit(self, events: EventBatch, transition: Any = None) -> None:
        await append_events(
            session_id=self.prepared.session_id,
            run_id=self.prepared.run_id,
            events=events,
            fence=self.fence,
            transition=transition,
        )

    async def settle(self) -> None:
        """Wait for the start commit; raises what it raised (``scheduler.fence_rejected``)."""
        start, self._start = self._start, None
        if start is not None:
            await start

    async def emit(self, batch: EventBatch) -> None:
        self.pending.extend(batch)
        if self.flush_every_batch or any(etype in self._FLUSHING for etype, _ in batch):
            await self.flush()

    async def flush(self) -> None:
        transition = self._start_transition() if self._take_start() else None
        await self.settle()
        if self.pending:
            events, self.pending = self.pending, []
            await self._commit(events, transition)

    async def outcome(self, outcome: Outcome) -> Outcome | str:
        """``outcome`` preceded by the events not yet committed (one transaction), once the
        start commit landed; ``"lease_lost"`` if it was refused."""
        self._take_start()  # uncommitted, the start goes with the outcome
        try:
            await self.settle()
        except FenceRejected:
            return "lease_lost"
        if not self.pending:
            return outcome
        return dataclasses.replace(outcome, pending=tuple(self.pending))


# How long the start of an execution waits for its first commit to go with (seconds): a
# run that ends (or calls a tool) sooner commits once; a longer one makes its start
# durable at this age.
START_COMMIT_DELAY = 0.05


def live_delta(item: Any, offset: int = 0) -> dict[str, Any] | None:
    """The live stream message (type and payload) for a model stream item, if any: a text
    piece is a ``message.delta`` (with ``offset``, the characters of its model call's text
    before it, so a client that joined late knows what it missed), a piece of a tool call's
    arguments a ``tool_call.delta``."""
    if isinstance(item, TextDelta) and item.text:
        return {"type": "message.delta", "payload": {"text": item.text, "offset": offset}}
    if isinstance(item, ToolCallDelta) and item.arguments:
        return {
            "type": "tool_call.delta",
            "payload": {
                "index": item.index,
                "id": item.id,
                "name": item.name,
                "arguments": item.arguments,
            },
        }
    return None


class RunExecutor:
    """Executes runs for the worker.

    Owns the worker's one ``ModelClientPool``, one ``ModelConcurrencyBudget`` (shared by
    every run), the tool registry, the code tools runtime (started and closed with the
    executor; its tools registered when enabled) and the ``AgentManagementService``
    (``self.service``).
    """

    def __init__(
        self,
        *,
        tools: ToolRegistry | None = None,
        pool: ModelClientPool | None = None,
        budget: ModelConcurrencyBudget | None = None,
        service: AgentManagementService | None = None,
        code_tools: CodeToolsRuntime | None = None,
        jobs: Any | None = None,
        tracer_provider: Any | None = None,
        mcp: McpRuntime | None = None,
    ) -> None:
        sage = settings.SAGE
        # OpenTelemetry spans (agents/tracing.py): the global tracer provider unless one is
        # given; nothing at all without the opentelemetry package.
        self.tracing = Tracing(tracer_provider, capture_content=sage["SAGE_OTEL_CAPTURE_CONTENT"])
        self.code_tools = code_tools if code_tools is not None else CodeToolsRuntime.from_settings()
        self.tools = tools or build_registry(settings.SAGE_TOOL_MODULES, extra=JOB_TOOLS)
        # One job runtime per worker process, shared by every run; built in start(), closed
        # last (after every run and Application that could still use it).
        self.jobs: Any | None = jobs
        self._owns_jobs = jobs is None
        for tool in self.code_tools.tools():
            if tool.name not in self.tools:
                self.tools.register(tool)
        self.pool = pool or ModelClientPool(
            providers.create_client,
            providers.close_client,
            max_clients=sage["SAGE_SERVER_MAX_MODEL_CLIENTS"],
        )
        self.budget = budget or ModelConcurrencyBudget(
            sage["SAGE_MAX_CONCURRENT_MODEL_CALLS"],
            max_waiting=sage["SAGE_MAX_WAITING_MODEL_CALLS"],
            wait_timeout_seconds=sage["SAGE_MODEL_QUEUE_TIMEOUT_SECONDS"],
        )
        self.service = service or AgentManagementService(
            builder=lambda key: db_call(build_application_sync, key, self.tools),
            probe=lambda keys: db_call(unfinished_runs_sync, keys),
            archiver=lambda key, batch: db_call(archive_unarchived_sync, key, batch),
            max_applications=sage["SAGE_SERVER_MAX_MANAGED_APPLICATIONS"],
            auto_release_idle_seconds=sage["SAGE_AUTO_RELEASE_IDLE_SECONDS"],
            model_budget=self.budget,
        )
        self.worker_tag = f"{socket.gethostname()}:{os.getpid()}"
        self.swept = 0
        self._pool_snapshot: dict[str, Any] = {}
        self._mcp_snapshot: dict[str, Any] = {}
        self._job_stats: dict[str, Any] = {}
        # Time to first token and tokens per model here; the worker adds its own (/metrics).
        self.metrics = Figures()
        # Remote MCP servers' tools: sessions per (user, server, credentials), call slots.
        self.mcp = mcp or McpRuntime(
            credentials=mcp_oauth_credentials,
            refused=mcp_oauth_refused,
            max_sessions=sage["SAGE_MCP_MAX_SESSIONS"],
            max_calls_per_user=sage["SAGE_MCP_MAX_CALLS_PER_USER"],
            max_output_bytes=sage["SAGE_MCP_MAX_OUTPUT_BYTES"],
            publish=live.publish,
            metrics=self.metrics,
        )
        # When each resident Application's model records were last compared with the
        # database (see `_current_agents`).
        self._records_checked: dict[Any, float] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Called once by the worker before it claims anything: archive what a crash left
        unarchived, then start the capacity refresher and the reclamation poller."""
        try:
            self.swept = await db_call(sweep_unarchived_sync)
            if self.swept:
                logger.info("archived %d terminal run(s) left unarchived", self.swept)
        except Exception as exc:  # the sweep repeats at the next start; runs must go on
            logger.warning("start-up archive sweep failed: %s", exc)
        await self.code_tools.start()
        if self.jobs is None:
            self.jobs = build_job_runtime(on_event=JobEventRecorder())
        await self._refresh()
        self._tasks = [
            asyncio.create_task(self._refresh_loop(), name="executor-capacity"),
            asyncio.create_task(self._reclamation_loop(), name="executor-reclamations"),
            asyncio.create_task(
                poll_cancel_requests(self.jobs, asyncio.Event()), name="executor-job-upkeep"
            ),
        ]

    async def close(self) -> None:
        """Archive and release the Applications, then close the model clients (after the
        last run ended; waits for their leases)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.service.close()
        except Exception as exc:
            logger.warning("closing managed applications: %s", exc)
        try:
            await self.code_tools.close()
        except Exception as exc:
            logger.warning("closing the code tools: %s", exc)
        try:
            await self.mcp.close()
        except SageError as exc:
            logger.warning("closing MCP sessions: %s (%s)", exc.message, exc.__cause__)
        try:
            await self.pool.close()
        except SageError as exc:
            logger.warning("closing model clients: %s (%s)", exc.message, exc.__cause__)
        if self.jobs is not None and self._owns_jobs:
            try:
                await self.jobs.close()
            except Exception as exc:
                logger.warning("closing the job runtime: %s", exc)
        await self._refresh()  # the last snapshot shows what closing left

    async def _refresh(self) -> None:
        """The model client pool's and the job runtime's figures, for `capacity`."""
        self._pool_snapshot = await self.pool.snapshot()
        self._mcp_snapshot = {**await self.mcp.pool.snapshot(), **self.mcp.snapshot()}
        stats = getattr(self.jobs, "stats", None)
        if stats is not None:
            try:
                figures = stats()
                self._job_stats = dict(await figures if inspect.isawaitable(figures) else figures)
            except Exception as exc:  # Celery's are in Redis: a hiccup must not stop the loop
                logger.warning("reading the job runtime's figures: %s", exc)

    async def _refresh_loop(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(1.0)
            await self._refresh()
            rounds += 1
            if rounds % UNFINISHED_REFRESH_EVERY == 0:
                await self.service.refresh_unfinished()

    async def _reclamation_loop(self) -> None:
        while True:
            await asyncio.sleep(RECLAMATION_POLL_SECONDS)
            try:
                await self.process_reclamations()
            except Exception as exc:  # a database hiccup must not end the poller
                logger.warning("reclamation requests: %s", exc)

    async def process_reclamations(self) -> int:
        """Answer pending operator reclamation requests; returns how many were answered."""
        return await reclamations.answer_pending(self.service, self.worker_tag)

    async def _stop_jobs(self, run_id: Any) -> None:
        """A cancelled run's background jobs follow it (their pause behaviour decides)."""
        if self.jobs is None:
            return
        try:
            await self.jobs.handle_run_pause(str(run_id))
        except Exception as exc:
            logger.warning("stopping jobs of cancelled run %s: %s", run_id, exc)

    def on_wake(self, kind: str, payload: str) -> None:
        """A push wake-up for the executor: ``records`` — model records changed, so the
        next run of every Application compares them with the database again."""
        if kind == "records":
            self._records_checked.clear()

    def capacity(self) -> dict[str, Any]:
        return {
            "model_clients": dict(self._pool_snapshot),
            "model_calls": self.budget.snapshot(),
            "tools": self.tools.names(),
            "management": self.service.capacity(),
            "code_tools": self.code_tools.capacity(),
            "mcp_sessions": dict(self._mcp_snapshot),
            "jobs": {
                "runtime": type(self.jobs).__name__ if self.jobs is not None else None,
                **self._job_stats,
            },
        }

    # --- preparation --------------------------------------------------------------

    async def _prepare(self, run_id: Any, claimed: dict[str, Any] | None = None) -> PreparedRun:
        """The run, its session and its conversation. The run's fields come from what the
        claim read (``claimed``) when given; the history comes from the store coordinator,
        which the run's commits use anyway: it is read once, not twice."""
        known_empty = False
        if claimed is not None and "session__package_ref" in claimed:
            prepared = _prepared_from_claim(claimed)
            known_empty = claimed.get("session__persisted_events") == 0
        else:
            prepared = await db_call(self._prepare_sync, run_id)
        events = await get_default_coordinator().history(
            prepared.session_id, fresh=True, known_empty=known_empty
        )
        run_key = str(run_id)
        own = [(e.type, e.payload) for e in events if str(e.run_id) == run_key]
        return dataclasses.replace(
            prepared,
            history=history_from_events(
                ((event.type, event.payload) for event in events),
                open_calls=[c.id for c in prepared.approval.calls] if prepared.approval else (),
            ),
            first_attempt=not any(etype == "run.started" for etype, _ in own),
            interrupted_calls=[
                (
                    TOOL_FAILED,
                    {
                        "id": call.get("id"),
                        "name": call.get("name"),
                        "error": INTERRUPTED_TOOL_ERROR,
                    },
                )
                for call in unanswered_tool_calls(own)
            ],
        )

    def _prepare_sync(self, run_id: Any) -> PreparedRun:
        """The run's fields as a claim reads them, for a run given without them."""
        fields = ("pk", "owner_id", *runs.CLAIMED_FIELDS)
        return _prepared_from_claim(Run.objects.values(*fields).get(pk=run_id))

    async def _current_agents(self, app: Application) -> dict[str, PreparedAgent]:
        """The Application's agents with model records re-read where they changed: a
        rotated key takes effect on the next run after the change (a ``records`` wake-up
        clears the check times); without a wake-up, within ``RECORD_CHECK_SECONDS``. A
        busy Application costs one query per interval, not one per run."""
        views = {agent_id: agent.record for agent_id, agent in app.agents.items()}
        if not views:
            return {}
        now = time.monotonic()
        if now - self._records_checked.get(app.key, -RECORD_CHECK_SECONDS) >= RECORD_CHECK_SECONDS:
            self._records_checked[app.key] = now
            fresh = await retry_transient(
                db_call, fresh_records_sync, views, what="reading model records"
            )
            for agent_id, view in fresh.items():
                app.agents[agent_id] = dataclasses.replace(app.agents[agent_id], record=view)
        return dict(app.agents)

    # --- model access ---------------------------------------------------------------

    async def _stream_model(
        self,
        record: ModelRecordView,
        owner_id: int,
        request: ModelRequest,
        run: PreparedRun | None = None,
    ) -> AsyncIterator[Any]:
        """One model call: a client leased for this user and record, one budget slot
        held for the whole stream. Pool-full and budget errors are raised before any
        request reaches the provider. Traced as a ``chat`` span (agents/tracing.py)."""
        with self.tracing.model_call(
            protocol=record.protocol,
            base_url=record.base_url,
            request=request,
            conversation_id=str(run.session_id) if run is not None else None,
            run_id=str(run.run_id) if run is not None else None,
        ) as span:
            adapter = await load_adapter(record.protocol)
            ids = None if run is None else {"session": str(run.session_id), "run": str(run.run_id)}
            # The budget takes the slot at the first read, before the provider is asked: a
            # budget error means no upstream request was sent.
            async with await self.pool.acquire(owner_id, record) as lease:
                provider = _LeasedProvider(adapter, lease.provider)
                items = self.budget.wrap(provider).stream(request)
                async with contextlib.aclosing(items):
                    first = True
                    streamed = 0  # characters of this call's text already sent live
                    async for item in items:
                        if first:
                            first = False
                            # From when the slot let the request go: its wait is not counted.
                            self.metrics.observe(
                                FIRST_TOKEN, time.monotonic() - provider.opened, model=record.model
                            )
                        if isinstance(item, StreamEnd):
                            for kind in ("input", "output"):
                                tokens = int(item.usage.get(f"{kind}_tokens", 0) or 0)
                                self.metrics.count(
                                    MODEL_TOKENS, tokens, model=record.model, type=kind
                                )
                        span.observe(item)
                        if ids is not None:
                            # Live to stream clients; never persisted (the whole message is).
                            delta = live_delta(item, offset=streamed)
                            if delta is not None:
                                live.publish({**ids, **delta})
                            if isinstance(item, TextDelta):
                                streamed += len(item.text)
                        yield item

    def _turn(self, agent: PreparedAgent) -> AgentTurn:
        return AgentTurn(
            model=agent.record.model,
            instructions=agent.instructions,
            tools=agent.tools,
            max_steps=agent.max_steps,
            options=dict(agent.record.options),
        )

    # --- the run ----------------------------------------------------------------

    async def execute(
        self,
        run_id: Any,
        fence: Fence,
        stop: StopSignal,
        claimed: dict[str, Any] | None = None,
    ) -> Outcome | str:
        """Execute one claimed run and return its `Outcome` (a terminal status or
        ``suspended``) for the dispatcher to commit; ``"lease_lost"`` when a write was
        refused because another worker holds the run now. Never writes the run's status.

        Raises ``CancelledError`` only when the worker cancels for ``shutdown`` or
        ``lease_lost``: then nothing terminal is written and the run is requeued.
        """
        # Everything this run's task logs carries its ids (sageproject.logs).
        sage_logs.bind(run_id=run_id, worker_id=fence.lease_owner)
        try:
            # The database restarting while a run is prepared delays it; it never fails it.
            prepared = await retry_transient(
                self._prepare, run_id, claimed, what=f"preparing run {run_id}"
            )
        except Exception as exc:
            error = (
                exc
                if isinstance(exc, SageError)
                else SageError(
                    "run.not_found", f"the run could not be loaded: {type(exc).__name__}"
                )
            )
            return Outcome(status=RunStatus.FAILED, session_id=None, error=error.record())
        sage_logs.bind(session_id=prepared.session_id)
        async with contextlib.AsyncExitStack() as stack:
            # The run's `invoke_agent` span (agents/tracing.py): model and tool calls nest in it.
            span = stack.enter_context(
                self.tracing.run(
                    agent=prepared.agent_id,
                    conversation_id=str(prepared.session_id),
                    run_id=str(prepared.run_id),
                )
            )
            try:
                app = await stack.enter_async_context(
                    self.service.application(
                        prepared.owner_id, prepared.package_ref, prepared.agent_id
                    )
                )
            except asyncio.CancelledError:
                stopped = await self._stopped(stop, prepared)
                if stopped is not None:
                    return span.ended(stopped)
                raise
            except SageError as exc:
                # No Application: a full cache suspends the run (retry resumes it once an
                # instance is released); a missing package or model record fails it.
                if exc.code in SUSPENDING_CODES:
                    return span.ended(self._suspension(exc, prepared))
                return span.ended(
                    Outcome(
                        status=RunStatus.FAILED, session_id=prepared.session_id, error=exc.record()
                    )
                )
            entry = app.agents.get(prepared.agent_id)
            if entry is not None:
                span.model(entry.record.protocol, entry.record.model)
            return span.ended(await self._execute_with(app, prepared, fence, stop))
        raise AssertionError("unreachable")  # the block above always returns or raises

    async def _stopped(self, stop: StopSignal, prepared: PreparedRun) -> Outcome | None:
        """The outcome of a run its owner cancelled or a newer run interrupted; None for a
        shutdown or a lost lease (the run is requeued)."""
        if stop.reason not in ("cancelled", "interrupt", "rollback"):
            return None
        await self._stop_jobs(prepared.run_id)
        if stop.reason == "cancelled":
            return Outcome(
                status=RunStatus.CANCELLED,
                session_id=prepared.session_id,
                error=run_cancelled_error(),
            )
        return Outcome(
            status=RunStatus.INTERRUPTED,
            session_id=prepared.session_id,
            error=run_interrupted_error(),
            rollback=stop.reason == "rollback",
        )

    async def _execute_with(
        self, app: Application, prepared: PreparedRun, fence: Fence, stop: StopSignal
    ) -> Outcome | str:
        run_id = prepared.run_id
        start: EventBatch = []
        if prepared.resolution is not None:
            start.append(("interaction.resolved", prepared.resolution))
            start.append(("run.resumed", {"decision": prepared.resolution.get("decision")}))
        start.append(("run.started", {"first_attempt": prepared.first_attempt}))
        # Tool calls a crashed attempt left without a result are answered before the
        # model is called again: providers reject a history with an unanswered call.
        start.extend(prepared.interrupted_calls)
        history = prepared.history
        if prepared.first_attempt:
            start.append(("message.completed", {"role": "user", "content": prepared.user_input}))
            history.append({"role": "user", "content": prepared.user_input})
        ctx = ToolContext(
            owner_id=prepared.owner_id,
            session_id=str(prepared.session_id),
            run_id=str(prepared.run_id),
            # The code tools keep one kernel per session, closed by the session's kind.
            extras={"session_kind": prepared.session_kind, "jobs": self.jobs},
        )
        flow_outputs = None
        writer = _RunEvents(prepared, fence, start, flush_every_batch=app.flow is not None)
        emit = writer.emit
        try:
            agents = await self._current_agents(app)
            if app.flow is not None:
                writer.begin()
                flow = await self._run_flow(app, agents, prepared, emit, ctx)
                result = {"text": flow.output, "steps": flow.steps, "flow": flow.flow}
                flow_outputs = flow.outputs
            else:
                entry = agents[prepared.agent_id]
                mcp = await self._mcp_tools(entry, prepared)
                # Before the start can be committed: it may lose answers (`_resend`).
                resend = self._resend(prepared, mcp, writer, history)
                writer.begin()
                turn = self._turn(entry)
                # Tools whose calls wait for the user (agent sessions; flows never wait).
                outcome = await run_turn(
                    dataclasses.replace(
                        turn,
                        tools=(*turn.tools, *mcp.tools),
                        approval=entry.approval | mcp.approval,
                    ),
                    history,
                    call_model=lambda request: self._stream_model(
                        entry.record, prepared.owner_id, request, prepared
                    ),
                    emit=emit,
                    ctx=ctx,
                    tracing=self.tracing,
                    approval=prepared.approval,
                    resend=resend,
                )
                result = {"text": outcome.text, "steps": outcome.steps, "usage": outcome.usage}
        except asyncio.CancelledError:
            stopped = await self._stopped(stop, prepared)
            if stopped is not None:
                return await writer.outcome(stopped)
            writer.abandon()
            raise
        except FenceRejected:
            logger.warning("run %s lost its lease; its writes stop here", run_id)
            writer.abandon()
            return "lease_lost"
        except ApprovalRequired as exc:
            return await writer.outcome(self._approval(exc, prepared))
        except ToolSuspends as exc:
            if isinstance(exc, McpAuthRequired):
                exc.authorization_url = await self._mcp_authorization(exc, prepared)
            return await writer.outcome(self._suspension(exc, prepared))
        except SageError as exc:
            if exc.code in SUSPENDING_CODES:
                return await writer.outcome(self._suspension(exc, prepared))
            return await writer.outcome(
                Outcome(status=RunStatus.FAILED, session_id=prepared.session_id, error=exc.record())
            )
        except Exception as exc:
            logger.exception("run %s failed with an unexpected error", run_id)
            error = SageError(
                "execution.internal",
                f"internal error: {type(exc).__name__}",
                category=ErrorCategory.INTERNAL,
            ).record()
            return await writer.outcome(
                Outcome(status=RunStatus.FAILED, session_id=prepared.session_id, error=error)
            )
        return await writer.outcome(
            Outcome(
                status=RunStatus.COMPLETED,
                session_id=prepared.session_id,
                result=result,
                flow_outputs=flow_outputs,
            )
        )

    async def _mcp_authorization(self, exc: McpAuthRequired, prepared: PreparedRun) -> str | None:
        """The URL where the user authorizes a server that uses OAuth (None: it does not,
        or its authorization server failed: the run still asks for a connection)."""
        try:
            return await mcp_oauth_begin(prepared.owner_id, prepared.run_id, exc.url)
        except Exception as error:  # never lose the suspension to a failed discovery
            logger.warning("MCP OAuth for %s could not start: %s", exc.server, error)
            return None

    async def _mcp_tools(self, entry: PreparedAgent, prepared: PreparedRun) -> McpTools:
        """The agent's MCP tools for this run's user (none without ``mcp_servers``)."""
        if not entry.mcp_servers:
            return NO_TOOLS
        return await self.mcp.agent_tools(prepared.owner_id, entry.mcp_servers)

    @staticmethod
    def _resend(
        prepared: PreparedRun, mcp: McpTools, writer: _RunEvents, history: list[dict[str, Any]]
    ) -> tuple[ToolCall, ...]:
        """The calls a crashed attempt sent without recording their result, of tools the
        agent declares idempotent: sent again instead of being answered "interrupted"
        (their answer is taken out of the start events and the history)."""
        if not mcp.idempotent or not prepared.interrupted_calls:
            return ()
        interrupted = {str(p.get("id")) for _, p in prepared.interrupted_calls}
        calls = [
            ToolCall(id=str(c["id"]), name=c["name"], arguments=c.get("arguments") or {})
            for m in history
            if m.get("role") == "assistant"
            for c in m.get("tool_calls") or ()
            if str(c.get("id")) in interrupted and c.get("name") in mcp.idempotent
        ]
        again = {c.id for c in calls}
        if not again:
            return ()
        writer.pending = [
            (etype, p)
            for etype, p in writer.pending
            if not (etype == TOOL_FAILED and str(p.get("id")) in again)
        ]
        history[:] = [
            m
            for m in history
            if not (m.get("role") == "tool" and str(m.get("tool_call_id")) in again)
        ]
        return tuple(calls)

    def _approval(self, request: ApprovalRequired, prepared: PreparedRun) -> Outcome:
        """Park the run until the user approves or rejects the step's waiting calls."""
        logger.info("run %s suspends: %s", prepared.run_id, request)
        interaction = {
            "id": uuid.uuid4().hex,
            "type": "approval",
            "code": "run.approval_required",
            "message": str(request),
            "tool_calls": request.calls,
            "waiting": request.waiting,
            "allowed_decisions": ["approve", "reject", "edit"],
        }
        return Outcome(
            status=RunStatus.SUSPENDED, session_id=prepared.session_id, interaction=interaction
        )

    def _suspension(self, error: SageError, prepared: PreparedRun) -> Outcome:
        """Park the run as ``suspended`` with an interaction a reply can resolve."""
        logger.info("run %s suspends: %s", prepared.run_id, error.code)
        interaction = {
            "id": uuid.uuid4().hex,
            "type": "retry",
            **error.record(),
            "allowed_decisions": ["retry", "cancel"],
        }
        if isinstance(error, ToolSuspends):
            # What the user must do first (connect an MCP server: its name and URL).
            interaction.update(error.interaction(), type=error.interaction_type)
        retry_after = error.details.get("retry_after")
        if isinstance(retry_after, int | float) and not isinstance(retry_after, bool):
            # When a retry may succeed (an upstream 429's Retry-After, or its default).
            interaction["retry_after"] = retry_after
        return Outcome(
            status=RunStatus.SUSPENDED,
            session_id=prepared.session_id,
            interaction=interaction,
        )

    async def _run_flow(
        self,
        app: Application,
        agents: dict[str, PreparedAgent],
        prepared: PreparedRun,
        emit: Any,
        ctx: ToolContext,
    ) -> Any:
        """Run the session's flow: agent nodes through the engine (each on the node's
        input alone), tool nodes through the registry, ``flow.*`` events recorded."""

        async def run_agent(agent_id: str, text: str) -> str:
            agent = agents.get(agent_id)
            if agent is None:
                raise NotFoundError(
                    "package.agent_not_found", f"flow agent {agent_id!r} is not prepared"
                )
            outcome = await run_turn(
                self._turn(agent),
                [{"role": "user", "content": text}],
                call_model=lambda request: self._stream_model(
                    agent.record, prepared.owner_id, request, prepared
                ),
                emit=emit,
                ctx=ctx,
                tracing=self.tracing,
            )
            return outcome.text

        async def run_tool(name: str, arguments: dict[str, Any]) -> str:
            with self.tracing.tool_call(
                name=name, arguments=arguments, conversation_id=ctx.session_id, run_id=ctx.run_id
            ) as span:
                tool = self.tools.get(name)
                if tool is None:
                    raise NotFoundError("tool.not_found", f"tool {name!r} is not available")
                output = str(await tool.handler(arguments, ctx))
                span.succeeded(output)
                return output

        async def on_event(event_type: str, payload: dict[str, Any]) -> None:
            await emit([(event_type, payload)])

        return await run_flow(
            app.manifest,
            app.flow,
            prepared.user_input,
            run_agent=run_agent,
            run_tool=run_tool,
            on_event=on_event,
        )
