"""The OpenAI-compatible API under ``/v1/`` (a client is given ``http://HOST:PORT/v1``).

A thin layer over the services every door calls (`agents.services`): the same ownership
rules (another user's response is 404), limits (429), idempotency (``Idempotency-Key``),
read permission and runs — no engine of its own.

- ``GET /v1/models`` (and ``/v1/models/{id}``): one model per assistant the user may use
  (`agents.protocols.common.assistants`): ``<package>`` (its entrypoint) and
  ``<package>/<agent or flow>``.
- ``POST /v1/chat/completions``: one run of the model's agent in a fresh session; the
  messages before the last user message are imported as the session's history, the last
  is the run's input. ``stream=true`` sends chunks and ends with ``data: [DONE]``.
- ``POST /v1/responses``: a run, in a fresh session (earlier input items imported as for
  chat), or with ``previous_response_id`` the next run of that response's session.
  Plain (the finished Response), ``stream=true`` (its events), ``background=true`` (at once,
  ``queued``; read it with GET).
- ``GET /v1/responses/{id}`` (``?stream=true&starting_after=N`` replays its events after
  number N, from the start without a cursor), ``POST /v1/responses/{id}/cancel``.

The agent's own instructions, tools and model record decide the answer: ``system`` /
``developer`` messages, ``instructions``, ``tools``, sampling parameters and other fields
are accepted and ignored; the agent's tool calls stay inside the host. Sessions opened here
are ``branch`` sessions. A response id is ``resp_<run id>``, a chat completion id
``chatcmpl-<run id>``: unguessable, and looked up among the caller's runs only.

Errors on this prefix are OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}`` (``code`` is our stable code), with ``Retry-After`` on a 429 and
``x-should-retry: false`` whenever repeating the request cannot help (the SDK retries
408/409/429/5xx by itself otherwise).

A plain (unstreamed) call waits for its run on the event loop (`common.DeferredResponse`).
A waiting call whose run is suspended for a retry (the host's model queue or a provider's
rate limit) cancels the run and answers 429 (a stream: ``response.failed`` with
``rate_limit_exceeded``, or an error chunk); on this prefix such a run reads as failed.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from asgiref.sync import sync_to_async
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.urls import path
from rest_framework import exceptions as drf_exceptions
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import services
from agents.models import AgentPackage
from agents.protocols import common
from agents.protocols.openai_shapes import (
    RESPONSE_STATUS,
    ChatChunks,
    ResponseEvents,
    RunText,
    chat_completion,
    error_object,
    response_body,
)
from sageproject import api
from sageproject.authentication import TokenAuthentication
from sageproject.errors import (
    ErrorCategory,
    NotFoundError,
    RateLimitedError,
    SageError,
)
from sageproject.parsers import query_bool, query_int
from scheduling import live
from scheduling.models import Event, Run, RunStatus, Session

RESPONSE_PREFIX = "resp_"
CHAT_PREFIX = "chatcmpl-"
# Retry-After of a waiting call whose run was suspended without a delay of its own.
SUSPENDED_RETRY_AFTER = 1


class BearerAuthentication(TokenAuthentication):
    """Our API token as OpenAI clients send it: ``Authorization: Bearer <token>``."""

    keyword = "Bearer"


# ------------------------------------------------------------------------------ errors


def _answer(error: dict[str, Any], status: int, retry_after: Any = None) -> JsonResponse:
    """One of our errors (the envelope's fields) in OpenAI's shape."""
    response = JsonResponse({"error": error_object(error)}, status=status)
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    if not error.get("retryable"):
        response["x-should-retry"] = "false"
    return response


def error_response(exc: SageError) -> JsonResponse:
    """``exc`` as an OpenAI error answer (Retry-After as the REST API gives it)."""
    retry_after = api.sage_error_response(exc).get("Retry-After")
    return _answer(exc.to_dict()["error"], exc.http_status, retry_after)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """The REST API's handler (the same statuses and codes), in OpenAI's shape."""
    ours = api.exception_handler(exc, context)
    if ours is None:
        return None
    error = ours.data["error"]
    response = Response({"error": error_object(error)}, status=ours.status_code)
    if "Retry-After" in ours:
        response["Retry-After"] = ours["Retry-After"]
    if ours.status_code == 401:
        response["WWW-Authenticate"] = 'Bearer realm="api"'
    if not error.get("retryable"):
        response["x-should-retry"] = "false"
    return response


def not_found(request: Any, rest: str = "") -> JsonResponse:
    """Any other path under ``/v1/``."""
    error = NotFoundError("not_found", f"no route {request.method} {request.path}")
    return error_response(error)


class OpenAIView(APIView):
    """A view of this prefix: bearer token, JSON, OpenAI's error shape, not in our schema."""

    authentication_classes = [BearerAuthentication]
    permission_classes = [IsAuthenticated]
    renderer_classes = [JSONRenderer]
    schema = None

    def get_exception_handler(self) -> Callable[..., Response | None]:
        return exception_handler


# ------------------------------------------------------------------------------ input


def _body(request: Request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise drf_exceptions.ParseError("the body must be a JSON object")
    return request.data


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise common.invalid(name, "must be a boolean")
    return value


def _text_of(content: Any, param: str) -> str:
    """Text content: a string, or a list of text parts (``text``, ``input_text``,
    ``output_text``) joined with newlines; anything else is not supported."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text") or not isinstance(
                part.get("text"), str
            ):
                raise common.invalid(f"{param}[{index}]", "only text content is supported")
            parts.append(part["text"])
        return "\n".join(parts)
    raise common.invalid(param, "must be a string or a list of text parts")


def _conversation(items: Any, param: str) -> tuple[list[tuple[str, str]], str]:
    """(earlier turns as ``(role, text)``, the last user message's text) of a list of
    messages; ``system``/``developer`` messages are left out (the agent's instructions
    stand), tool messages and other item types are refused."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise common.invalid(param, "must be a non-empty list of messages")
    turns: list[tuple[str, str]] = []
    for index, item in enumerate(items):
        where = f"{param}[{index}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise common.invalid(
                where, "only messages are supported (the agent's tools stay inside)"
            )
        role = item.get("role")
        if role in ("system", "developer"):
            continue
        if role not in ("user", "assistant") or item.get("tool_calls"):
            raise common.invalid(where, "role must be system, developer, user or assistant")
        text = _text_of(item.get("content"), f"{where}.content")
        if text:
            turns.append((role, text))
    if not turns or turns[-1][0] != "user":
        raise common.invalid(param, "the last message must be a user message with text")
    return turns[:-1], turns[-1][1]


def _assistant(user, model: Any) -> common.Assistant:
    if not isinstance(model, str) or not model:
        raise common.invalid("model", "name one of GET /v1/models")
    try:
        return common.assistant_resolve(user, model)
    except NotFoundError as exc:
        exc.details = {"fields": {"model": [exc.message]}}
        raise


# ------------------------------------------------------------------------------ runs


def _submit(
    request: Request,
    text: str,
    meta: dict[str, Any],
    *,
    assistant: common.Assistant | None = None,
    history: list[tuple[str, str]] | None = None,
    session: Session | None = None,
) -> Run:
    """Admit the run (`services.run_submit`): into ``session``, or a fresh session on
    ``assistant`` with ``history`` (removed again when the run is not admitted, or when a
    concurrent request with the same Idempotency-Key admitted it first)."""
    user = request.user
    key = common.idempotency_key(request)
    if key is not None:
        existing = (
            Run.objects.select_related("session").filter(owner=user, idempotency_key=key).first()
        )
        if existing is not None:
            services.check_read_permission(user)
            return existing
    fresh = session is None
    if fresh:
        session = services.session_import(
            owner=user,
            package=assistant.package.ref,
            agent=assistant.agent,
            history=history or (),
        )
    try:
        run, created = services.run_submit(
            owner=user,
            session_id=session.pk,
            input={"text": text, "openai": meta},
            idempotency_key=key,
        )
    except BaseException:
        if fresh:
            Session.objects.filter(pk=session.pk).delete()
        raise
    if fresh and not created:
        Session.objects.filter(pk=session.pk).delete()
    return Run.objects.select_related("session").get(pk=run.pk)


def _meta(run: Run) -> dict[str, Any]:
    value = run.input.get("openai") if isinstance(run.input, dict) else None
    return value if isinstance(value, dict) else {}


def _model_of(run: Run) -> str:
    return str(_meta(run).get("model") or f"{run.session.package_name}/{run.session.agent_id}")


def _is_flow(session: Session) -> bool:
    manifest = (
        AgentPackage.objects.filter(ref=session.package_ref).values_list("manifest", flat=True)
    ).first() or {}
    return session.agent_id in (manifest.get("flows") or {})


def _response_id(run: Run) -> str:
    return f"{RESPONSE_PREFIX}{run.pk.hex}"


def _find_response(user, response_id: Any, *, param: str | None = None) -> Run:
    """The caller's run a response id names (404 for anyone else's, as for no run)."""
    run = None
    raw = str(response_id)
    if raw.startswith(RESPONSE_PREFIX):
        try:
            pk = uuid.UUID(hex=raw.removeprefix(RESPONSE_PREFIX))
        except ValueError:
            pk = None
        if pk is not None:
            run = Run.objects.visible_to(user).select_related("session").filter(pk=pk).first()
    if run is None:
        details = {"fields": {param: ["no such response"]}} if param else {}
        raise NotFoundError(
            "response.not_found", f"no response with id {raw[:100]!r}", details=details
        )
    return run


def _suspension(run: Run) -> dict[str, Any] | None:
    """A suspended run's pending retry as an error record (``category`` RATE_LIMITED)."""
    if run.status != RunStatus.SUSPENDED:
        return None
    interaction = run.interaction or {}
    return {
        "code": interaction.get("code") or "run.suspended",
        "category": ErrorCategory.RATE_LIMITED.value,
        "message": interaction.get("message") or "the host had no room for the run",
        "retryable": True,
        "resumable": True,
        "retry_after": interaction.get("retry_after"),
    }


def _texts(run: Run, flow: bool) -> list[str]:
    rows = Event.objects.filter(session_id=run.session_id, run_id=run.pk).order_by("seq")
    return RunText(flow=flow).replay((row.type, row.payload) for row in rows)


def _usage(run: Run) -> Any:
    return run.result.get("usage") if isinstance(run.result, dict) else None


def response_now(run: Run, *, texts: list[str] | None = None) -> dict[str, Any]:
    """``run`` as a Response object now (its messages from its durable events unless
    ``texts`` are given)."""
    if texts is None:
        texts = _texts(run, _is_flow(run.session))
    meta = _meta(run)
    return response_body(
        response_id=_response_id(run),
        created_at=run.created_at.timestamp(),
        status=RESPONSE_STATUS[run.status],
        model=_model_of(run),
        texts=texts,
        error=_suspension(run) or run.error,
        usage=_usage(run),
        background=bool(meta.get("background")),
        previous_response_id=meta.get("previous_response_id"),
        completed_at=(
            run.finished_at.timestamp()
            if run.status == RunStatus.COMPLETED and run.finished_at
            else None
        ),
    )


def _reload(run_id: Any) -> Run | None:
    return Run.objects.select_related("session").filter(pk=run_id).first()


def _cancel_suspended(run_id: Any) -> Run | None:
    """Cancel the run if it is (still) suspended; returns it as it was (None when gone)."""
    run = _reload(run_id)
    if run is not None and run.status == RunStatus.SUSPENDED:
        services.run_cancel(run=run)
    return run


async def _follow(run: Run, after: int, text: RunText | None) -> AsyncIterator[tuple[str, Any]]:
    """``run`` until it ends: ``("ops", [...])`` from ``text`` (durable events, and live
    deltas when ``text`` is given), ``("keepalive", None)``, then ``("end", run)`` — the
    run as it ended, None when it is gone — or ``("suspended", run)`` after cancelling a
    run suspended for a retry (module text)."""
    items = common.follow_run(run.session_id, run.pk, after)
    async with contextlib.aclosing(items):
        async for item in items:
            if isinstance(item, live.Delta):
                if text is not None:
                    yield "ops", text.delta(item.type, item.payload)
            elif isinstance(item, live.KeepAlive):
                yield "keepalive", None
            elif isinstance(item, live.Dropped):
                continue
            elif item.type == "run.suspended":
                now = await sync_to_async(_cancel_suspended, thread_sensitive=False)(run.pk)
                if now is not None and now.status == RunStatus.SUSPENDED:
                    yield "suspended", now
                    return
            elif text is not None:
                yield "ops", text.event(item.type, item.payload, item.seq)
    yield "end", await sync_to_async(_reload, thread_sensitive=False)(run.pk)


def _suspended_error(run: Run) -> SageError:
    record = _suspension(run) or {}
    return RateLimitedError(
        str(record.get("code") or "run.suspended"),
        str(record.get("message") or "the host had no room for the run"),
        resumable=False,
        details={"retry_after": record.get("retry_after") or SUSPENDED_RETRY_AFTER},
    )


def _run_error(run: Run | None) -> SageError:
    """The SageError a run that did not complete ended with."""
    if run is None:
        return NotFoundError("response.not_found", "the run is gone")
    error = run.error or {}
    try:
        category = ErrorCategory(error.get("category"))
    except ValueError:
        category = ErrorCategory.INTERNAL
    return SageError(
        str(error.get("code") or f"run.{run.status}"),
        str(error.get("message") or f"the run ended {run.status}"),
        category=category,
        retryable=bool(error.get("retryable")),
    )


def _sse(data: Any, event: str | None = None) -> bytes:
    head = b"event: %s\n" % event.encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _event_stream(content: AsyncIterator[bytes]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(content, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _response_stream(
    run: Run, after: int, starting_after: int, live_after: int | None = None
) -> AsyncIterator[bytes]:
    """A Response's events as Server-Sent Events (``event:`` its type, ``data:`` JSON with
    ``sequence_number``), from ``run``'s durable events after seq ``after`` and its live
    deltas, until its terminal event. ``live_after``: the stream joins a run that may be
    under way (`RunText`)."""
    flow = await sync_to_async(_is_flow, thread_sensitive=False)(run.session)
    events = ResponseEvents(_response_id(run), starting_after)
    text = RunText(flow=flow, live_after=live_after)
    start = response_now(run, texts=[])
    start.update(status="queued" if run.status == RunStatus.QUEUED else "in_progress")
    start.update(error=None, completed_at=None, usage=None)
    out = events.start(start)
    for event in out:
        yield _sse(event, event["type"])
    async for kind, value in _follow(run, after, text):
        if kind == "ops":
            out = events.ops(value)
        elif kind == "keepalive":
            yield b": keep-alive\n\n"
            continue
        elif kind == "suspended" or value is not None:
            out = events.end(response_now(value, texts=text.texts))
        else:
            out = events.error(error_object(_run_error(None).to_dict()["error"]))
        for event in out:
            yield _sse(event, event["type"])


async def _chat_stream(run: Run, after: int, include_usage: bool) -> AsyncIterator[bytes]:
    """A chat completion's chunks as Server-Sent Events, ``data: [DONE]`` last; a run that
    does not complete ends the stream with an error object instead."""
    flow = await sync_to_async(_is_flow, thread_sensitive=False)(run.session)
    chunks = ChatChunks(f"{CHAT_PREFIX}{run.pk.hex}", run.created_at.timestamp(), _model_of(run))
    text = RunText(flow=flow)
    for chunk in chunks.start():
        yield _sse(chunk)
    async for kind, value in _follow(run, after, text):
        if kind == "ops":
            for chunk in chunks.ops(value):
                yield _sse(chunk)
        elif kind == "keepalive":
            yield b": keep-alive\n\n"
        elif kind == "suspended" or value is None or value.status != RunStatus.COMPLETED:
            failed = _suspended_error(value) if kind == "suspended" else _run_error(value)
            yield _sse({"error": error_object(failed.to_dict()["error"])})
            return
        else:
            for chunk in chunks.end(_usage(value), include_usage=include_usage):
                yield _sse(chunk)
            yield b"data: [DONE]\n\n"


def _waiting(
    run: Run, after: int, answer: Callable[[Run], HttpResponse]
) -> common.DeferredResponse:
    """A plain call's answer: ``answer(run)`` once the run has ended, computed on the
    event loop; 429 when it was suspended for a retry (and is cancelled)."""

    async def compute() -> HttpResponse:
        final = None
        async for kind, value in _follow(run, after, None):
            if kind == "suspended":
                return error_response(_suspended_error(value))
            if kind == "end":
                final = value
        if final is None:
            return error_response(_run_error(None))
        return await sync_to_async(answer, thread_sensitive=False)(final)

    return common.DeferredResponse(compute)


# ------------------------------------------------------------------------------ views


def _model_object(assistant: common.Assistant) -> dict[str, Any]:
    return {
        "id": assistant.id,
        "object": "model",
        "created": int(assistant.package.created_at.timestamp()),
        "owned_by": assistant.package.owner.get_username(),
    }


class Models(OpenAIView):
    def get(self, request: Request) -> Response:
        found = common.assistants(request.user)
        return Response({"object": "list", "data": [_model_object(a) for a in found]})


class ModelDetail(OpenAIView):
    def get(self, request: Request, model: str) -> Response:
        return Response(_model_object(common.assistant_resolve(request.user, model)))


class ChatCompletions(OpenAIView):
    def post(self, request: Request) -> Any:
        body = _body(request)
        assistant = _assistant(request.user, body.get("model"))
        history, text = _conversation(body.get("messages"), "messages")
        stream = _flag(body, "stream")
        if body.get("n") not in (None, 1):
            raise common.invalid("n", "only one choice is produced")
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        services.check_read_permission(request.user)
        meta = {"api": "chat", "model": assistant.id}
        run = _submit(request, text, meta, assistant=assistant, history=history)
        after = common.run_start(run)
        if stream:
            return _event_stream(_chat_stream(run, after, include_usage))
        return _waiting(run, after, _chat_answer)


def _chat_answer(run: Run) -> HttpResponse:
    if run.status != RunStatus.COMPLETED:
        return error_response(_run_error(run))
    body = chat_completion(
        completion_id=f"{CHAT_PREFIX}{run.pk.hex}",
        created=run.created_at.timestamp(),
        model=_model_of(run),
        texts=_texts(run, _is_flow(run.session)),
        usage=_usage(run),
    )
    return JsonResponse(body)


def _response_answer(run: Run) -> HttpResponse:
    return JsonResponse(response_now(run))


class Responses(OpenAIView):
    def post(self, request: Request) -> Any:
        body = _body(request)
        user = request.user
        stream = _flag(body, "stream")
        background = _flag(body, "background")
        previous = body.get("previous_response_id")
        model = body.get("model")
        if previous is not None:
            prior = _find_response(user, previous, param="previous_response_id")
            session = prior.session
            if model is not None:
                chosen = _assistant(user, model)
                if (chosen.package.name, chosen.agent) != (session.package_name, session.agent_id):
                    raise common.invalid("model", "a continued response keeps its model")
            history, text = _conversation(body.get("input"), "input")
            if history:
                raise common.invalid(
                    "input", "with previous_response_id, send the next message only"
                )
            if prior.status == RunStatus.SUSPENDED:
                services.run_cancel(run=prior)  # it reads as failed here; its turn is over
            meta = {"model": model or _model_of(prior), "previous_response_id": str(previous)}
            submit = {"session": session}
        else:
            assistant = _assistant(user, model)
            history, text = _conversation(body.get("input"), "input")
            meta = {"model": assistant.id}
            submit = {"assistant": assistant, "history": history}
        if stream or not background:
            services.check_read_permission(user)
        meta.update(api="responses", background=background)
        run = _submit(request, text, meta, **submit)
        after = common.run_start(run)
        if stream:
            return _event_stream(_response_stream(run, after, -1))
        if background:
            return Response(response_now(run))
        return _waiting(run, after, _response_answer)


class ResponseDetail(OpenAIView):
    def get(self, request: Request, response_id: str) -> Any:
        run = _find_response(request.user, response_id)
        services.check_read_permission(request.user)
        if query_bool(request, "stream"):
            # Without a cursor the stream is replayed from its first event.
            starting_after = query_int(request, "starting_after", -1, minimum=0)
            joined = Session.objects.values_list("persisted_events", flat=True).get(
                pk=run.session_id
            )
            stream = _response_stream(run, common.run_start(run), starting_after, joined)
            return _event_stream(stream)
        return Response(response_now(run))


class ResponseCancel(OpenAIView):
    def post(self, request: Request, response_id: str) -> Response:
        run = _find_response(request.user, response_id)
        services.check_read_permission(request.user)
        services.run_cancel(run=run)
        return Response(response_now(_reload(run.pk)))


urlpatterns = [
    path("models", Models.as_view(), name="openai-models"),
    path("models/<path:model>", ModelDetail.as_view(), name="openai-model"),
    path("chat/completions", ChatCompletions.as_view(), name="openai-chat-completions"),
    path("responses", Responses.as_view(), name="openai-responses"),
    path("responses/<str:response_id>", ResponseDetail.as_view(), name="openai-response"),
    path(
        "responses/<str:response_id>/cancel",
        ResponseCancel.as_view(),
        name="openai-response-cancel",
    ),
    path("", not_found),
    path("<path:rest>", not_found),
]
