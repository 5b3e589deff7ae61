"""Runs: a run is a Run whose input is the text of ``input.messages``' human messages.
Created through ``run_submit``, resumed through ``run_reply`` (``command.resume``),
cancelled through ``run_cancel``; an earlier ``checkpoint`` rolls the later turns back
(``session_rollback``) first. Each view validates, calls a service, and answers."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from django.http import HttpResponse
from rest_framework.request import Request
from rest_framework.response import Response

from agents import services
from agents.protocols import common
from agents.protocols.langgraph.assistants import assistant_uuid, resolve
from agents.protocols.langgraph.base import MAX_LIMIT, LangGraphView, flag, int_param, json_body
from agents.protocols.langgraph.state import bound_graph, build_thread, own_thread, persisted
from agents.protocols.langgraph.streams import (
    ended,
    finished,
    last_seq,
    locations,
    stream_response,
    until_finished,
    wait_response,
)
from agents.protocols.messages import checkpoint_seq, decision, edits, parse_event_id
from sageproject.errors import ConflictError, NotFoundError
from scheduling.models import Multitask, Run, RunStatus, Session

# Run status → LangGraph's (a run waiting for its interaction reads "interrupted").
RUN_STATUS = {
    RunStatus.QUEUED: "pending",
    RunStatus.RUNNING: "running",
    RunStatus.SUSPENDED: "interrupted",
    RunStatus.COMPLETED: "success",
    RunStatus.FAILED: "error",
    RunStatus.CANCELLED: "interrupted",
    RunStatus.INTERRUPTED: "interrupted",
}
STATUS_FILTER = {
    "pending": [RunStatus.QUEUED],
    "running": [RunStatus.RUNNING],
    "success": [RunStatus.COMPLETED],
    "error": [RunStatus.FAILED],
    "interrupted": [RunStatus.SUSPENDED, RunStatus.CANCELLED, RunStatus.INTERRUPTED],
    "timeout": [],
}
# The stream modes LangGraph defines (the SDK's ``StreamMode``).
KNOWN_MODES = frozenset(
    {
        "values",
        "messages",
        "updates",
        "events",
        "tasks",
        "checkpoints",
        "debug",
        "custom",
        "messages-tuple",
        "tools",
        "lifecycle",
    }
)


def run_json(run: Run, session: Session, multitask: str | None = None) -> dict[str, Any]:
    graph = bound_graph(session)
    return {
        "run_id": str(run.pk),
        "thread_id": str(run.session_id),
        "assistant_id": assistant_uuid(graph) if graph else None,
        "created_at": run.created_at.isoformat(),
        "updated_at": run.updated_at.isoformat(),
        "status": RUN_STATUS[run.status],
        "metadata": {},
        "multitask_strategy": multitask,
        "kwargs": {"input": {"messages": [{"type": "human", "content": run.input}]}},
    }


def input_text(value: Any) -> str:
    """The run's input from LangGraph ``input``: the human messages of ``messages``
    (``{"role": "user" | "human"}`` or ``{"type": "human"}``, content text or text
    parts; a bare string is one), joined by blank lines."""
    if isinstance(value, dict):
        messages = value.get("messages")
    else:
        messages = value
    if isinstance(messages, str | dict):
        messages = [messages]
    if not isinstance(messages, list):
        raise common.invalid("input", 'must be {"messages": [...]} with a human message')
    texts = []
    for message in messages:
        if isinstance(message, str):
            texts.append(message)
            continue
        if not isinstance(message, dict):
            raise common.invalid("input", "every message must be an object or a string")
        kind = message.get("type") or message.get("role")
        if kind not in ("human", "user"):
            continue
        texts.append(common_text(message.get("content")))
    text = "\n\n".join(t for t in texts if t)
    if not text.strip():
        raise common.invalid("input", "needs a human message with text")
    return text


def common_text(content: Any) -> str:
    """A message's content as text: a string, or the text of its ``text`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") in ("text", "input_text")
        )
    raise common.invalid("input", "message content must be text or a list of text parts")


def _modes(value: Any) -> list[str]:
    if value is None:
        return ["values"]
    modes = [value] if isinstance(value, str) else value
    if not isinstance(modes, list) or any(m not in KNOWN_MODES for m in modes):
        raise common.invalid(
            "stream_mode", f"every mode must be one of {', '.join(sorted(KNOWN_MODES))}"
        )
    return modes or ["values"]


def _regenerate(session: Session, checkpoint: Any, text: str | None) -> str | None:
    """Run from an earlier checkpoint: roll back the (finished) runs after it; returns the
    input to run — ``text``, or the human message of the turn being replaced."""
    seq = checkpoint_seq(checkpoint)
    if seq is None:
        raise common.invalid("checkpoint", "must be a checkpoint of this thread")
    thread = build_thread(session)
    if thread.index_of(seq) is None:
        raise NotFoundError("checkpoint.not_found", "no such checkpoint in this thread")
    if seq == thread.checkpoints[-1].seq:
        return text
    services.check_rollback(session=session, after_seq=seq)
    if text is None:
        human = [
            m
            for m in thread.messages[: thread.checkpoints[thread.index_of(seq)].count]
            if m["type"] == "human"
        ]
        if not human:
            raise common.invalid("input", "needs a human message with text")
        text = str(human[-1]["content"])
    services.session_rollback(session=session, after_seq=seq)
    return text


def _resume(session: Session, command: Mapping[str, Any]) -> tuple[Run, int]:
    """Answer the thread's suspended run with ``command["resume"]``: (the run, the seq
    its new events follow)."""
    run = (
        Run.objects.filter(session=session, status=RunStatus.SUSPENDED)
        .order_by("-created_at")
        .first()
    )
    if run is None:
        raise ConflictError("run.not_suspended", "the thread has no interrupt to resume")
    interaction = run.interaction or {}
    choice = decision(command.get("resume"), interaction)
    if not isinstance(choice, str):
        allowed = interaction.get("allowed_decisions") or []
        raise common.invalid("command.resume", f"must choose one of {', '.join(allowed)}")
    after = persisted(session)
    run = services.run_reply(
        run=run,
        decision=choice,
        interaction_id=interaction.get("id"),
        edits=edits(command.get("resume"), interaction) if choice == "edit" else None,
    )
    return run, after


def create_run(
    request: Request, thread_id: Any, body: Mapping[str, Any]
) -> tuple[Session, Run, int, str | None]:
    """Create (or, with ``command.resume``, resume) a run: (the session, the run, the seq
    its events follow, the multitask strategy used)."""
    user = request.user
    assistant = resolve(user, body.get("assistant_id"))
    if thread_id is None:
        session = services.thread_create(owner=user)
    else:
        session = Session.objects.filter(pk=thread_id, owner=user).first()
        if session is None:
            if body.get("if_not_exists") != "create":
                raise NotFoundError("thread.not_found", f"thread {thread_id} not found")
            try:
                session = services.thread_create(owner=user, thread_id=thread_id)
            except ConflictError:  # another user's thread has that id
                raise NotFoundError("thread.not_found", f"thread {thread_id} not found") from None
    services.thread_bind(session=session, package=assistant.package, agent=assistant.agent)
    command = body.get("command")
    if command is not None:
        if not isinstance(command, dict) or "resume" not in command:
            raise common.invalid("command", "only a command with resume is supported")
        run, after = _resume(session, command)
        return session, run, after, None
    raw_input = body.get("input")
    text = input_text(raw_input) if raw_input is not None else None
    checkpoint = body.get("checkpoint") or (
        {"checkpoint_id": body["checkpoint_id"]} if body.get("checkpoint_id") else None
    )
    if checkpoint:
        text = _regenerate(session, checkpoint, text)
    if text is None:
        raise common.invalid("input", "needs a human message with text")
    multitask = body.get("multitask_strategy") or Multitask.REJECT
    if multitask not in Multitask.values:
        raise common.invalid("multitask_strategy", f"must be one of {', '.join(Multitask.values)}")
    key = common.idempotency_key(request)
    run, _ = services.run_submit(
        owner=user, session_id=session.pk, input=text, multitask=multitask, idempotency_key=key
    )
    return session, run, common.run_start(run), multitask


def _own_run(user, thread_id: Any, run_id: Any) -> tuple[Session, Run]:
    session = own_thread(user, thread_id)
    run = Run.objects.filter(pk=run_id, session=session, owner=user).first()
    if run is None:
        raise NotFoundError("run.not_found", f"run {run_id} not found")
    return session, run


class RunCreate(LangGraphView):
    """``POST /threads/{id}/runs`` (a background run), and ``POST /runs`` (in a new thread)."""

    def post(self, request: Request, thread_id: uuid.UUID | None = None) -> Response:
        session, run, _, multitask = create_run(request, thread_id, json_body(request))
        response = Response(run_json(run, session, multitask))
        return locations(response, run, "join")


class ThreadRuns(RunCreate):
    def get(self, request: Request, thread_id: uuid.UUID) -> Response:
        session = own_thread(request.user, thread_id)
        params = request.query_params
        limit = int_param(params, "limit", 10, 1, MAX_LIMIT)
        offset = int_param(params, "offset", 0, 0, 10**9)
        query = Run.objects.filter(session=session, owner=request.user).order_by("-created_at")
        status = params.get("status")
        if status:
            if status not in STATUS_FILTER:
                raise common.invalid("status", f"must be one of {', '.join(STATUS_FILTER)}")
            query = query.filter(status__in=STATUS_FILTER[status])
        return Response([run_json(r, session) for r in query[offset : offset + limit]])


class RunStreamView(LangGraphView):
    def post(self, request: Request, thread_id: uuid.UUID | None = None) -> Any:
        body = json_body(request)
        modes = _modes(body.get("stream_mode"))
        session, run, after, _ = create_run(request, thread_id, body)
        return stream_response(
            session,
            run,
            after,
            modes,
            cancel_on_disconnect=body.get("on_disconnect") == "cancel",
        )


class RunWait(LangGraphView):
    def post(self, request: Request, thread_id: uuid.UUID | None = None) -> Any:
        _, run, _, _ = create_run(request, thread_id, json_body(request))
        return wait_response(run, "join")


class RunDetail(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID, run_id: uuid.UUID) -> Response:
        session, run = _own_run(request.user, thread_id, run_id)
        return Response(run_json(run, session))


class RunJoin(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID, run_id: uuid.UUID) -> Any:
        _, run = _own_run(request.user, thread_id, run_id)
        return wait_response(run, "join")


class RunJoinStream(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID, run_id: uuid.UUID) -> Any:
        session, run = _own_run(request.user, thread_id, run_id)
        modes = [m for m in request.query_params.getlist("stream_mode") if m]
        last = request.headers.get("Last-Event-ID")
        if last == "-1":
            # From the run's first event (agent-chat-ui's rejoin).
            after, last = common.run_start(run), None
        elif parse_event_id(last) is None:
            # Without a position: what happens from now on.
            after, last = persisted(session), None
            if finished(run) and after >= last_seq(run):
                return ended(run)
        else:
            after = 0
        return stream_response(
            session,
            run,
            after,
            _modes(modes or None),
            last_event_id=last,
            live_start=run.status == RunStatus.QUEUED,
            cancel_on_disconnect=flag(request.query_params.get("cancel_on_disconnect")),
        )


class RunCancel(LangGraphView):
    def post(self, request: Request, thread_id: uuid.UUID, run_id: uuid.UUID) -> Any:
        _, run = _own_run(request.user, thread_id, run_id)
        action = request.query_params.get("action") or "interrupt"
        if action not in ("interrupt", "rollback"):
            raise common.invalid("action", "must be interrupt or rollback")
        run = services.run_cancel(run=run, rollback=action == "rollback")
        if not flag(request.query_params.get("wait")):
            return Response(status=202)

        async def compute() -> HttpResponse:
            await until_finished(run)
            return HttpResponse(status=204)

        return common.DeferredResponse(compute)
