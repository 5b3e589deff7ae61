"""Executing one claimed run: load its session and agent, run the loop, persist, archive.

The worker (scheduling) finds this module by name (``settings.SAGE_RUN_EXECUTOR``) so
that scheduling never imports agents. Everything that touches the ORM runs in threads.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agents.engine import AgentTurn, EventBatch, history_from_events, run_turn
from agents.models import AgentPackage
from agents.services import archive_terminal
from agents.tools import ToolContext, ToolRegistry, build_registry
from pooling import providers
from pooling.budget import ModelConcurrencyBudget
from pooling.clients import ModelClientPool
from pooling.models import ModelRecord
from pooling.providers import get_adapter
from pooling.providers.base import ModelRequest
from sageproject.db import db_call
from sageproject.errors import ErrorCategory, NotFoundError, SageError, ValidationError
from scheduling.models import Event, Run, RunStatus
from scheduling.store import Fence, append_events, check_fence

logger = logging.getLogger("sage.execution")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRecordView:
    """What the model pool needs of a record, decrypted once in a thread."""

    id: int
    protocol: str
    base_url: str
    model: str
    api_key: str = field(repr=False)
    options: dict[str, Any]


@dataclass(slots=True)
class StopSignal:
    """Why the worker cancelled an execution: ``cancelled``, ``shutdown`` or ``lease_lost``."""

    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRun:
    run_id: Any
    session_id: Any
    owner_id: int
    package_ref: str
    package_name: str
    agent_id: str
    user_input: str
    history: list[dict[str, Any]]
    turn: AgentTurn
    record: ModelRecordView
    first_attempt: bool
    # The reply that resumed a suspended run, emitted as ``interaction.resolved``.
    resolution: dict[str, Any] | None = None


def _instructions(agent: dict[str, Any], files: dict[str, str]) -> str:
    instructions = agent.get("instructions", "")
    if isinstance(instructions, dict):
        return files.get(instructions.get("path", ""), "")
    return str(instructions or "")


def find_model_record(owner_id: int, name: str) -> ModelRecord:
    """The owner's record of that name, else the shared one."""
    record = (
        ModelRecord.objects.filter(Q(owner_id=owner_id) | Q(owner__isnull=True), name=name)
        .order_by("owner_id")  # the owner's own record before the shared one
        .first()
    )
    if record is None:
        raise NotFoundError("server.model_not_configured", f"no model record named {name!r}")
    return record


def error_dict(error: SageError) -> dict[str, Any]:
    return {
        "code": error.code,
        "category": str(error.category),
        "message": error.message,
        "retryable": error.retryable,
        "resumable": error.resumable,
    }


# Errors of this host's own bounded queues: the run is suspended (nothing was sent to the
# provider) and a reply with decision "retry" resumes it.
SUSPENDING_CODES = frozenset({"model.queue_full", "model.queue_timeout", "server.model_pool_full"})


class _LeasedProvider:
    """The provider a budget wraps: one adapter bound to one leased client."""

    __slots__ = ("adapter", "client")

    def __init__(self, adapter: Any, client: Any) -> None:
        self.adapter = adapter
        self.client = client

    def stream(self, request: ModelRequest) -> AsyncIterator[Any]:
        return self.adapter.stream(self.client, request)


class RunExecutor:
    """Executes runs for the worker.

    Owns the worker's one ``ModelClientPool`` and one ``ModelConcurrencyBudget`` (shared by
    every run), and the tool registry.
    """

    def __init__(
        self,
        *,
        tools: ToolRegistry | None = None,
        pool: ModelClientPool | None = None,
        budget: ModelConcurrencyBudget | None = None,
    ) -> None:
        sage = settings.SAGE
        self.tools = tools or build_registry(settings.SAGE_TOOL_MODULES)
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
        self._pool_snapshot: dict[str, Any] = {}
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Called once by the worker before it claims anything."""
        self._pool_snapshot = await self.pool.snapshot()
        self._refresher = asyncio.create_task(self._refresh_loop(), name="executor-capacity")

    async def close(self) -> None:
        """Close the model clients after the last run ended (waits for their leases)."""
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        try:
            await self.pool.close()
        except SageError as exc:
            logger.warning("closing model clients: %s (%s)", exc.message, exc.__cause__)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._pool_snapshot = await self.pool.snapshot()

    def capacity(self) -> dict[str, Any]:
        return {
            "model_clients": dict(self._pool_snapshot),
            "model_calls": self.budget.snapshot(),
            "tools": self.tools.names(),
        }

    # --- preparation --------------------------------------------------------------

    def _prepare_sync(self, run_id: Any) -> PreparedRun:
        run = Run.objects.select_related("session").get(pk=run_id)
        session = run.session
        package = AgentPackage.objects.filter(
            ref=session.package_ref, owner_id=session.owner_id
        ).first()
        if package is None:
            raise NotFoundError("package.not_found", f"package {session.package_name!r} is gone")
        agent = package.manifest.get("agents", {}).get(session.agent_id)
        if agent is None:
            raise ValidationError(
                "package.agent_not_found",
                f"package {package.name!r} has no agent {session.agent_id!r}",
            )
        record = find_model_record(run.owner_id, agent.get("model", ""))
        tools = []
        for name in agent.get("tools", []):
            tool = self.tools.get(name)
            if tool is not None:
                tools.append(tool)
        rows = (
            Event.objects.filter(session_id=session.pk).order_by("seq").values_list("type", "data")
        )
        import orjson

        history = history_from_events((etype, orjson.loads(data)) for etype, data in rows)
        user_input = run.input if isinstance(run.input, str) else str(run.input.get("text", ""))
        return PreparedRun(
            run_id=run.pk,
            session_id=session.pk,
            owner_id=run.owner_id,
            package_ref=package.ref,
            package_name=package.name,
            agent_id=session.agent_id,
            user_input=user_input,
            history=history,
            turn=AgentTurn(
                model=record.model or record.name,
                instructions=_instructions(agent, package.files or {}),
                tools=tuple(tools),
                max_steps=int(agent.get("max_steps", 8)),
                options=dict(record.options or {}),
            ),
            record=ModelRecordView(
                id=record.pk,
                protocol=record.protocol,
                base_url=record.base_url,
                model=record.model or record.name,
                api_key=record.api_key,
                options=dict(record.options or {}),
            ),
            first_attempt=not Event.objects.filter(run_id=run.pk, type="run.started").exists(),
            resolution=(run.interaction or {}).get("resolution"),
        )

    # --- model access ---------------------------------------------------------------

    async def _stream_model(
        self, record: ModelRecordView, owner_id: int, request: ModelRequest
    ) -> AsyncIterator[Any]:
        """One model call: a client leased for this user and record, one budget slot
        held for the whole stream. Pool-full and budget errors are raised before any
        request reaches the provider."""
        adapter = get_adapter(record.protocol)
        async with await self.pool.acquire(owner_id, record) as lease:
            bounded = self.budget.wrap(_LeasedProvider(adapter, lease.provider))
            async for item in bounded.stream(request):
                yield item

    # --- the run ----------------------------------------------------------------

    async def execute(self, run_id: Any, fence: Fence, stop: StopSignal) -> str:
        """Execute one claimed run to a terminal status; returns that status.

        Raises ``CancelledError`` only when the worker cancels for ``shutdown`` or
        ``lease_lost``: then nothing terminal is written and the run is requeued by
        its lease.
        """
        try:
            prepared = await db_call(self._prepare_sync, run_id)
        except SageError as exc:
            return await self._finish(run_id, fence, RunStatus.FAILED, None, error_dict(exc), None)

        async def emit(batch: EventBatch) -> None:
            await append_events(
                session_id=prepared.session_id, run_id=prepared.run_id, events=batch, fence=fence
            )

        start: EventBatch = []
        if prepared.resolution is not None:
            start.append(("interaction.resolved", prepared.resolution))
            start.append(("run.resumed", {"decision": prepared.resolution.get("decision")}))
        start.append(("run.started", {"first_attempt": prepared.first_attempt}))
        history = prepared.history
        if prepared.first_attempt:
            start.append(("message.completed", {"role": "user", "content": prepared.user_input}))
            history.append({"role": "user", "content": prepared.user_input})
        ctx = ToolContext(
            owner_id=prepared.owner_id,
            session_id=str(prepared.session_id),
            run_id=str(prepared.run_id),
        )
        try:
            await emit(start)
            outcome = await run_turn(
                prepared.turn,
                history,
                call_model=lambda request: self._stream_model(
                    prepared.record, prepared.owner_id, request
                ),
                emit=emit,
                ctx=ctx,
            )
        except asyncio.CancelledError:
            if stop.reason == "cancelled":
                error = {
                    "code": "run.cancelled",
                    "category": str(ErrorCategory.CANCELLED),
                    "message": "the run was cancelled",
                    "retryable": False,
                    "resumable": False,
                }
                return await self._finish(run_id, fence, RunStatus.CANCELLED, None, error, prepared)
            raise
        except SageError as exc:
            if exc.code == "scheduler.fence_rejected":
                logger.warning("run %s lost its lease; its writes stop here", run_id)
                return "lease_lost"
            if exc.code in SUSPENDING_CODES:
                return await self._suspend(run_id, fence, exc, prepared)
            return await self._finish(
                run_id, fence, RunStatus.FAILED, None, error_dict(exc), prepared
            )
        except Exception as exc:
            logger.exception("run %s failed with an unexpected error", run_id)
            error = {
                "code": "execution.internal",
                "category": str(ErrorCategory.INTERNAL),
                "message": f"internal error: {type(exc).__name__}",
                "retryable": False,
                "resumable": False,
            }
            return await self._finish(run_id, fence, RunStatus.FAILED, None, error, prepared)
        result = {"text": outcome.text, "steps": outcome.steps, "usage": outcome.usage}
        return await self._finish(run_id, fence, RunStatus.COMPLETED, result, None, prepared)

    async def _finish(
        self,
        run_id: Any,
        fence: Fence,
        status: str,
        result: Any,
        error: Any,
        prepared: PreparedRun | None,
    ) -> str:
        """Terminal event, then terminal status and archive, both fenced.

        Shielded: a cancellation arriving now must not leave a half-finished run.
        """
        event_type = TERMINAL_EVENTS[status]
        payload = {"result": result} if result is not None else {"error": error}
        try:
            if prepared is not None:
                await asyncio.shield(
                    append_events(
                        session_id=prepared.session_id,
                        run_id=run_id,
                        events=[(event_type, payload)],
                        fence=fence,
                    )
                )
            await asyncio.shield(
                db_call(finish_run_sync, fence=fence, status=status, result=result, error=error)
            )
        except SageError as exc:
            if exc.code == "scheduler.fence_rejected":
                logger.warning("run %s lost its lease before finishing", run_id)
                return "lease_lost"
            raise
        return status

    async def _suspend(
        self, run_id: Any, fence: Fence, error: SageError, prepared: PreparedRun
    ) -> str:
        """Park the run as ``suspended`` with an interaction a reply can resolve."""
        interaction = {
            "id": uuid.uuid4().hex,
            "type": "retry",
            "code": error.code,
            "message": error.message,
            "retryable": error.retryable,
            "resumable": error.resumable,
            "allowed_decisions": ["retry", "cancel"],
        }
        try:
            await asyncio.shield(
                append_events(
                    session_id=prepared.session_id,
                    run_id=run_id,
                    fence=fence,
                    events=[
                        ("run.suspended", {"code": error.code}),
                        ("interaction.requested", interaction),
                    ],
                )
            )
            await asyncio.shield(db_call(suspend_run_sync, fence=fence, interaction=interaction))
        except SageError as exc:
            if exc.code == "scheduler.fence_rejected":
                return "lease_lost"
            raise
        logger.info("run %s suspended: %s", run_id, error.code)
        return RunStatus.SUSPENDED


TERMINAL_EVENTS = {
    RunStatus.COMPLETED: "run.completed",
    RunStatus.FAILED: "run.failed",
    RunStatus.CANCELLED: "run.cancelled",
}


def suspend_run_sync(*, fence: Fence, interaction: dict[str, Any]) -> None:
    with transaction.atomic():
        check_fence(fence)
        Run.objects.filter(pk=fence.run_id).update(
            status=RunStatus.SUSPENDED,
            interaction=interaction,
            lease_owner="",
            lease_expires_at=None,
        )


def finish_run_sync(*, fence: Fence, status: str, result: Any, error: Any) -> None:
    """Terminal status and archive in one transaction, only while the lease holds."""
    with transaction.atomic():
        check_fence(fence)
        Run.objects.filter(pk=fence.run_id).update(
            status=status,
            result=result,
            error=error,
            finished_at=timezone.now(),
            lease_owner="",
            lease_expires_at=None,
            interaction=None,
        )
        archive_terminal(Run.objects.select_related("session").get(pk=fence.run_id))
