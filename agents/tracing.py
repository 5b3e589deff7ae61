"""OpenTelemetry spans of runs, model calls and tool calls — optional.

Installed with ``pip install -r requirements-otel.txt``; without the ``opentelemetry``
package every method here returns one shared no-op object (the cost is a function call)
and nothing else changes. Django-free: the executor builds one ``Tracing`` per worker
(``RunExecutor(tracer_provider=...)``, capture from ``SAGE_OTEL_CAPTURE_CONTENT``) and hands
it to the engine.

Spans follow the OpenTelemetry GenAI semantic conventions (development status; the names
of the spec's ``gen_ai_latest_experimental`` version):

- ``invoke_agent {agent}`` (INTERNAL) — one per execution of a run (an attempt: a resumed
  or requeued run has one per attempt), current while it runs, so the others nest in it;
- ``chat {model}`` (CLIENT) — one per model call, from the pool lease and budget slot to
  the end of the stream: provider, request and response model, input and output tokens,
  finish reasons, ``server.address``/``server.port`` (host and port of the record's
  ``base_url`` only);
- ``execute_tool {tool}`` (INTERNAL) — one per tool call of the agent loop and per tool
  node of a flow.

Every span carries ``gen_ai.conversation.id`` = the session id (and ``sage.run.id``). A span
that ended in an error has status ERROR and ``error.type``: our error code
(``SageError.code``: ``upstream.error``, ``tool.failed``, ``run.cancelled``, ...) or, for
anything else, the exception's class name. Exception messages are never recorded.
Message content — instructions, input and output messages, tool arguments and results — is
recorded only when ``capture_content`` is on (``gen_ai.system_instructions``,
``gen_ai.input.messages``, ``gen_ai.output.messages``, ``gen_ai.tool.call.arguments``,
``gen_ai.tool.call.result``, as JSON strings in the conventions' message shape). No
credential is ever an attribute: nothing here reads a record's key.

The tracer provider is the global one (configured by the operator, e.g. with
``opentelemetry-instrument``; docs/OPERATIONS.md "Tracing") unless one is passed: tests
pass their own and share no global state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from pooling.providers.base import StreamEnd, TextDelta, ToolCall
from sageproject.errors import SageError

INSTRUMENTATION_NAME = "sage.agents"

# Our protocols → ``gen_ai.provider.name`` (the conventions' well-known values; the
# keyless scripted model is ours).
PROVIDER_NAMES = {"openai": "openai", "anthropic": "anthropic", "scripted": "sage.scripted"}
# ``StreamEnd.stop_reason`` (normalized by the adapters) → the conventions' finish reasons.
FINISH_REASONS = {"end_turn": "stop", "tool_use": "tool_call", "max_tokens": "length"}
# Outcome statuses that end a run span with an error (a suspension is not one).
ERROR_STATUSES = frozenset({"failed", "cancelled", "interrupted"})
# Sampling options of a model record copied to ``gen_ai.request.*`` when they are numbers.
REQUEST_OPTIONS = ("temperature", "top_p", "frequency_penalty", "presence_penalty")


def provider_name(protocol: str) -> str:
    return PROVIDER_NAMES.get(protocol, protocol)


def error_type(exc: BaseException) -> str:
    """``error.type`` of an exception: our code, else its class name."""
    if isinstance(exc, SageError):
        return exc.code
    return type(exc).__qualname__


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _server(base_url: str) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of a base URL: host and port only (never the
    user info, path or query a URL may carry)."""
    if not base_url:
        return {}
    try:
        parts = urlsplit(base_url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return {}
    if not host:
        return {}
    if port is None:
        port = {"https": 443, "http": 80}.get(parts.scheme.lower())
    return {"server.address": host} | ({"server.port": port} if port else {})


def messages_json(messages: Sequence[Mapping[str, Any]]) -> str:
    """Normalized messages (``pooling.providers.base``) in the conventions' input shape."""
    converted = []
    for message in messages:
        role = message.get("role", "user")
        if role == "tool":
            parts = [
                {
                    "type": "tool_call_response",
                    "id": message.get("tool_call_id"),
                    "response": message.get("content", ""),
                }
            ]
        else:
            parts = (
                [{"type": "text", "content": message["content"]}] if message.get("content") else []
            )
            parts += [
                {
                    "type": "tool_call",
                    "id": call.get("id"),
                    "name": call.get("name"),
                    "arguments": call.get("arguments"),
                }
                for call in message.get("tool_calls") or ()
            ]
        converted.append({"role": role, "parts": parts})
    return _json(converted)


class _NoSpan:
    """What every method returns when tracing is off: does nothing, costs nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def model(self, protocol: str, model: str) -> None:
        pass

    def ended(self, outcome: Any) -> Any:
        return outcome

    def observe(self, item: Any) -> None:
        pass

    def failed(self, code: str) -> None:
        pass

    def succeeded(self, output: str) -> None:
        pass


NO_SPAN = _NoSpan()


class _Span(_NoSpan):
    """One open span. Entered, it ends at exit; an exception leaving it marks it failed
    (``GeneratorExit`` — a stream closed early by its reader — does not)."""

    __slots__ = (
        "_api",
        "_calls",
        "_content",
        "_current",
        "_finish",
        "_model",
        "_parts",
        "_span",
        "_token",
    )

    def __init__(
        self, api: Any, span: Any, *, current: bool, content: bool, model: str = ""
    ) -> None:
        self._api = api
        self._model = model
        self._span = span
        self._current = current
        self._token: Any = None
        # Content is built only for a span that is recorded (sampled, a provider set).
        self._content = content and span.is_recording()
        self._parts: list[str] = []
        self._calls: list[ToolCall] = []
        self._finish: str | None = None

    def __enter__(self) -> _Span:
        if self._current:
            context = self._api.trace.set_span_in_context(self._span)
            self._token = self._api.context.attach(context)
        return self

    def __exit__(self, etype: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is not None and not isinstance(exc, GeneratorExit):
                self.failed(error_type(exc))
            if self._content and (self._parts or self._calls or self._finish):
                self._output_messages()
        finally:
            if self._token is not None:
                self._api.context.detach(self._token)
            self._span.end()

    def failed(self, code: str) -> None:
        self._span.set_attribute("error.type", code)
        self._span.set_status(self._api.Status(self._api.StatusCode.ERROR, code))

    # --- invoke_agent -------------------------------------------------------------

    def model(self, protocol: str, model: str) -> None:
        """The agent's model, once its Application is known."""
        self._span.set_attributes(
            {"gen_ai.provider.name": provider_name(protocol), "gen_ai.request.model": model}
        )

    def ended(self, outcome: Any) -> Any:
        """Record how the execution ended (an ``Outcome``, or ``"lease_lost"``) and return
        it unchanged."""
        if isinstance(outcome, str):
            self.failed("scheduler.fence_rejected")
            return outcome
        self._span.set_attribute("sage.run.status", outcome.status)
        if outcome.status in ERROR_STATUSES:
            self.failed(str((outcome.error or {}).get("code") or outcome.status))
        usage = outcome.result.get("usage") if isinstance(outcome.result, Mapping) else None
        if isinstance(usage, Mapping):
            self._usage(usage)
        return outcome

    # --- chat ---------------------------------------------------------------------

    def observe(self, item: Any) -> None:
        """One item of the model stream: its end carries usage and the finish reason."""
        if isinstance(item, StreamEnd):
            self._finish = FINISH_REASONS.get(item.stop_reason, item.stop_reason)
            self._usage(item.usage)
            self._span.set_attributes(
                {
                    "gen_ai.response.finish_reasons": (self._finish,),
                    # The model that answered when the adapter reports it (a ``model`` on
                    # ``StreamEnd``), else the one requested.
                    "gen_ai.response.model": getattr(item, "model", None) or self._model,
                }
            )
        elif self._content:
            if isinstance(item, TextDelta):
                self._parts.append(item.text)
            elif isinstance(item, ToolCall):
                self._calls.append(item)

    def _usage(self, usage: Mapping[str, Any]) -> None:
        for key in ("input_tokens", "output_tokens"):
            value = usage.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                self._span.set_attribute(f"gen_ai.usage.{key}", value)

    def _output_messages(self) -> None:
        parts: list[dict[str, Any]] = []
        text = "".join(self._parts)
        if text:
            parts.append({"type": "text", "content": text})
        parts += [
            {"type": "tool_call", "id": c.id, "name": c.name, "arguments": dict(c.arguments)}
            for c in self._calls
        ]
        message = {"role": "assistant", "parts": parts, "finish_reason": self._finish or "error"}
        self._span.set_attribute("gen_ai.output.messages", _json([message]))

    # --- execute_tool -------------------------------------------------------------

    def succeeded(self, output: str) -> None:
        if self._content:
            self._span.set_attribute("gen_ai.tool.call.result", output)


class Tracing:
    """Starts the spans of one worker; ``enabled`` is false when OpenTelemetry is absent
    (or ``enabled=False`` was asked).

    ``provider``: a ``TracerProvider`` (None: the global one, which is a no-op until the
    operator configures one). ``capture_content``: record message content (off by default).
    """

    def __init__(
        self, provider: Any = None, *, capture_content: bool = False, enabled: bool = True
    ) -> None:
        self.capture_content = capture_content
        self._api = _load_api() if enabled else None
        self._tracer = (
            None
            if self._api is None
            else self._api.trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=provider)
        )

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def _start(
        self, name: str, kind: str, attributes: dict[str, Any], *, current: bool, model: str = ""
    ) -> _Span:
        api = self._api
        span = self._tracer.start_span(
            name,
            kind=getattr(api.SpanKind, kind),
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
        return _Span(api, span, current=current, content=self.capture_content, model=model)

    def run(self, *, agent: str, conversation_id: str, run_id: str) -> _NoSpan:
        """The span of one execution of a run, current while entered."""
        if self._tracer is None:
            return NO_SPAN
        return self._start(
            f"invoke_agent {agent}",
            "INTERNAL",
            {
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": agent,
                "gen_ai.conversation.id": conversation_id,
                "sage.run.id": run_id,
            },
            current=True,
        )

    def model_call(
        self,
        *,
        protocol: str,
        base_url: str,
        request: Any,
        conversation_id: str | None = None,
        run_id: str | None = None,
    ) -> _NoSpan:
        """The span of one model call (a ``ModelRequest``); feed it each stream item
        (``observe``). Not made current: it has no children, and it lives in a stream."""
        if self._tracer is None:
            return NO_SPAN
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider_name(protocol),
            "gen_ai.request.model": request.model,
            "gen_ai.request.max_tokens": request.max_tokens,
            **_server(base_url),
        }
        for option in REQUEST_OPTIONS:
            value = (request.options or {}).get(option)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attributes[f"gen_ai.request.{option}"] = float(value)
        _identify(attributes, conversation_id, run_id)
        scope = self._start(
            f"chat {request.model}", "CLIENT", attributes, current=False, model=request.model
        )
        if scope._content:
            if request.system:
                scope._span.set_attribute(
                    "gen_ai.system_instructions",
                    _json([{"type": "text", "content": request.system}]),
                )
            scope._span.set_attribute("gen_ai.input.messages", messages_json(request.messages))
        return scope

    def tool_call(
        self,
        *,
        name: str,
        call_id: str | None = None,
        arguments: Mapping[str, Any] | None = None,
        description: str | None = None,
        conversation_id: str | None = None,
        run_id: str | None = None,
        server: str | None = None,
    ) -> _NoSpan:
        """The span of one tool call, current while entered; ``failed(code)`` or
        ``succeeded(output)`` says how it went when no exception does. ``server``: the MCP
        server of an MCP tool (``sage.mcp.server``)."""
        if self._tracer is None:
            return NO_SPAN
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.type": "function",
        }
        if call_id:
            attributes["gen_ai.tool.call.id"] = call_id
        if description:
            attributes["gen_ai.tool.description"] = description
        if server:
            attributes["sage.mcp.server"] = server
        _identify(attributes, conversation_id, run_id)
        scope = self._start(f"execute_tool {name}", "INTERNAL", attributes, current=True)
        if scope._content and arguments is not None:
            scope._span.set_attribute("gen_ai.tool.call.arguments", _json(dict(arguments)))
        return scope


# Tracing that never traces: the engine's default.
DISABLED = Tracing(enabled=False)


def _identify(attributes: dict[str, Any], conversation_id: str | None, run_id: str | None) -> None:
    if conversation_id:
        attributes["gen_ai.conversation.id"] = conversation_id
    if run_id:
        attributes["sage.run.id"] = run_id


class _Api:
    """The parts of ``opentelemetry`` this module uses."""

    __slots__ = ("SpanKind", "Status", "StatusCode", "context", "trace")

    def __init__(self, trace: Any, context: Any) -> None:
        self.trace = trace
        self.context = context
        self.SpanKind = trace.SpanKind
        self.Status = trace.Status
        self.StatusCode = trace.StatusCode


def _load_api() -> _Api | None:
    """``opentelemetry``'s API when it can be imported (each ``Tracing`` asks once)."""
    try:
        from opentelemetry import context, trace
    except ImportError:
        return None
    return _Api(trace, context)
