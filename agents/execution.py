"""Executing one claimed run: load its session and agent, run the loop, persist, archive.

The worker (scheduling) finds this module by name (``settings.SAGE_RUN_EXECUTOR``) so
that scheduling never imports agents. Everything that touches the ORM runs in threads.
"""

from __future__ import annotations

import asyncio
import logging
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


class RunExecutor:
    """Executes runs for the worker; owns the tool registry and model access."""

    def __init__(self, *, tools: ToolRegistry | None = None) -> None:
        self.tools = tools or build_registry(settings.SAGE_TOOL_MODULES)

    async def start(self) -> None:
        """Nothing to warm up yet; the worker calls it once before claiming."""

    async def close(self) -> None:
        """Release what the executor holds; called once after the last run ended."""

    def capacity(self) -> dict[str, Any]:
        return {"tools": self.tools.names()}

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
        )

    # --- model access ---------------------------------------------------------------

    async def _stream_model(
        self, record: ModelRecordView, owner_id: int, request: ModelRequest
    ) -> AsyncIterator[Any]:
        adapter = get_adapter(record.protocol)
        client = await adapter.create_client(record)
        try:
            async for item in adapter.stream(client, request):
                yield item
        finally:
            await adapter.close_client(client)

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

        start: EventBatch = [("run.started", {"attempt_first": prepared.first_attempt})]
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


TERMINAL_EVENTS = {
    RunStatus.COMPLETED: "run.completed",
    RunStatus.FAILED: "run.failed",
    RunStatus.CANCELLED: "run.cancelled",
}


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
