"""OpenTelemetry spans of runs (``agents/tracing.py``), through the real executor.

Each test gives ``RunExecutor`` a tracer provider of its own (the SDK's, exporting to an
``InMemorySpanExporter`` through a ``SimpleSpanProcessor``), so no global provider is set
and tests share nothing. Runs are admitted, claimed and executed as in
``test_executor.py``, on the scripted model or the real OpenAI SDK against the loopback
upstream; the assertions are on the exported spans.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings as django_settings

from agents import tracing
from agents.executor import RunExecutor
from agents.services import packages, sessions
from sageproject import config
from scheduling import runs
from scheduling.models import RunStatus
from scheduling.worker import StopSignal
from tests.agents.test_executor import claim
from tests.conftest import demo_manifest, scripted_model
from tests.e2e.test_management import FLOW_MANIFEST
from tests.pooling.upstream import HTML_502, ErrorReply, Reply, upstream_fixture

upstream = upstream_fixture  # the loopback model server fixture
pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

CONTENT_KEYS = {
    "gen_ai.system_instructions",
    "gen_ai.input.messages",
    "gen_ai.output.messages",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
}
SECRET_INPUT = "my-private-words-1234"


class Spans:
    """A tracer provider of the test's own and what it exported."""

    def __init__(self) -> None:
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
                InMemorySpanExporter,
            )
        except ImportError:
            if os.environ.get("CI", "").lower() == "true":
                raise  # `make test` installs requirements-otel.txt
            pytest.skip("needs the OpenTelemetry SDK: pip install -r requirements-otel.txt")
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def all(self) -> list[Any]:
        return sorted(self.exporter.get_finished_spans(), key=lambda span: span.start_time)

    def named(self, prefix: str) -> list[Any]:
        return [span for span in self.all() if span.name.startswith(prefix)]

    def one(self, name: str) -> Any:
        (span,) = [span for span in self.all() if span.name == name]
        return span


@pytest.fixture
def spans() -> Spans:
    spans = Spans()
    yield spans
    spans.provider.shutdown()


@dataclass(frozen=True, slots=True)
class Ran:
    outcome: Any
    run_id: str
    session_id: str
    executor: RunExecutor


@sync_to_async
def admit(user, manifest: dict, text: str, agent: str) -> tuple[str, str]:
    """Admit one run of a new session on ``manifest``; (run id, session id)."""
    package, _ = packages.package_create(owner=user, manifest=manifest)
    session = sessions.session_create(owner=user, package=package.name, agent=agent)
    run, _ = runs.admit(owner=user, session_id=session.pk, input=text)
    return str(run.pk), str(session.pk)


@pytest.fixture
async def execute(alice, spans):
    """``await execute(model, text)``: one run of alice's demo agent on ``model`` (or of
    ``manifest``'s ``agent``) admitted, claimed and executed by a new ``RunExecutor``
    tracing into ``spans`` (``traced=False``: into the global provider)."""
    started: list[RunExecutor] = []

    async def execute(
        model: str = "",
        text: str = "hi",
        *,
        manifest: dict | None = None,
        agent: str = "assistant",
        traced: bool = True,
    ) -> Ran:
        manifest = manifest or demo_manifest(name=f"p-{model}", model=model)
        run_id, session_id = await admit(alice, manifest, text, agent)
        executor = RunExecutor(tracer_provider=spans.provider if traced else None)
        started.append(executor)
        await executor.start()
        fence, row = await claim()
        assert str(row["pk"]) == run_id
        outcome = await executor.execute(run_id, fence, StopSignal(), row)
        return Ran(outcome, run_id, session_id, executor)

    yield execute
    for executor in started:
        await executor.close()


def attribute_values(span: Any) -> list[str]:
    return [str(value) for value in span.attributes.values()]


def status_code(span: Any) -> str:
    return span.status.status_code.name


TOOL_SCRIPT = (
    {"tool_calls": [{"id": "call_a", "name": "calculator", "arguments": {"expression": "2+2"}}]},
    {"text": "It is four."},
)


async def test_a_run_is_one_trace_of_its_model_and_tool_calls(spans, execute):
    await sync_to_async(scripted_model)("otel-tools", *TOOL_SCRIPT)
    ran = await execute("otel-tools", f"what is 2+2 {SECRET_INPUT}")
    outcome = ran.outcome

    assert outcome.status == RunStatus.COMPLETED, outcome.error
    run = spans.one("invoke_agent assistant")
    chats = spans.named("chat ")
    tool = spans.one("execute_tool calculator")
    assert [span.name for span in chats] == ["chat otel-tools", "chat otel-tools"]
    assert len(spans.all()) == 4
    # Kinds, and one trace: the run span is the root, the calls its children.
    assert run.kind.name == "INTERNAL" and tool.kind.name == "INTERNAL"
    assert {span.kind.name for span in chats} == {"CLIENT"}
    assert run.parent is None
    for child in (*chats, tool):
        assert child.parent.span_id == run.context.span_id
        assert child.context.trace_id == run.context.trace_id
    # The tool ran between the two model calls.
    assert chats[0].end_time <= tool.start_time and tool.end_time <= chats[1].start_time

    assert dict(run.attributes) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "assistant",
        "gen_ai.conversation.id": ran.session_id,
        "sage.run.id": ran.run_id,
        "gen_ai.provider.name": "sage.scripted",
        "gen_ai.request.model": "otel-tools",
        "sage.run.status": "completed",
        "gen_ai.usage.input_tokens": outcome.result["usage"]["input_tokens"],
        "gen_ai.usage.output_tokens": outcome.result["usage"]["output_tokens"],
    }
    for chat in chats:
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.provider.name"] == "sage.scripted"
        assert chat.attributes["gen_ai.request.model"] == "otel-tools"
        assert chat.attributes["gen_ai.response.model"] == "otel-tools"
        assert chat.attributes["gen_ai.conversation.id"] == ran.session_id
        assert chat.attributes["sage.run.id"] == ran.run_id
        assert chat.attributes["gen_ai.usage.input_tokens"] > 0
        assert status_code(chat) == "UNSET"
    assert chats[0].attributes["gen_ai.response.finish_reasons"] == ("tool_call",)
    assert chats[1].attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert chats[0].attributes["gen_ai.usage.output_tokens"] == 0  # only a tool call
    assert chats[1].attributes["gen_ai.usage.output_tokens"] == 3  # "It is four."
    # The run span's usage is the sum of its model calls'.
    for key in ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"):
        assert run.attributes[key] == sum(chat.attributes[key] for chat in chats)
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert tool.attributes["gen_ai.tool.name"] == "calculator"
    assert tool.attributes["gen_ai.tool.call.id"] == "call_a"
    assert tool.attributes["gen_ai.conversation.id"] == ran.session_id
    assert status_code(tool) == "UNSET" and status_code(run) == "UNSET"
    # No message content by default: no content attribute, the user's words nowhere.
    for span in spans.all():
        assert not CONTENT_KEYS & set(span.attributes), span.name
        assert not any(SECRET_INPUT in value for value in attribute_values(span)), span.name


async def test_message_content_is_recorded_only_when_enabled(spans, execute, monkeypatch):
    monkeypatch.setitem(django_settings.SAGE, "SAGE_OTEL_CAPTURE_CONTENT", True)
    await sync_to_async(scripted_model)("otel-content", *TOOL_SCRIPT)
    outcome = (await execute("otel-content", f"what is 2+2 {SECRET_INPUT}")).outcome

    assert outcome.status == RunStatus.COMPLETED, outcome.error
    first, second = spans.named("chat ")
    tool = spans.one("execute_tool calculator")
    assert json.loads(first.attributes["gen_ai.system_instructions"]) == [
        {"type": "text", "content": "You are a test assistant."}
    ]
    assert json.loads(first.attributes["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": f"what is 2+2 {SECRET_INPUT}"}]}
    ]
    assert json.loads(first.attributes["gen_ai.output.messages"]) == [
        {
            "role": "assistant",
            "parts": [
                {
                    "type": "tool_call",
                    "id": "call_a",
                    "name": "calculator",
                    "arguments": {"expression": "2+2"},
                }
            ],
            "finish_reason": "tool_call",
        }
    ]
    # The second call's input ends with the tool's answer; its output is the final text.
    assert json.loads(second.attributes["gen_ai.input.messages"])[-1] == {
        "role": "tool",
        "parts": [{"type": "tool_call_response", "id": "call_a", "response": "4"}],
    }
    assert json.loads(second.attributes["gen_ai.output.messages"]) == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": "It is four."}],
            "finish_reason": "stop",
        }
    ]
    assert json.loads(tool.attributes["gen_ai.tool.call.arguments"]) == {"expression": "2+2"}
    assert tool.attributes["gen_ai.tool.call.result"] == "4"


async def test_a_provider_call_has_its_tokens_and_server_and_never_the_key(
    alice, spans, execute, upstream, monkeypatch
):
    monkeypatch.setitem(django_settings.SAGE, "SAGE_OTEL_CAPTURE_CONTENT", True)
    key = "sk-otel-canary-0123456789abcdef"
    await sync_to_async(upstream.model_record)(
        name="gpt-otel", api_key=key, owner=alice, model="gpt-test"
    )
    upstream.enqueue(Reply(text="Hello there", usage=(11, 7)))
    outcome = (await execute("gpt-otel", "hello")).outcome

    assert outcome.status == RunStatus.COMPLETED, outcome.error
    assert upstream.requests  # the key went to the provider ...
    chat = spans.one("chat gpt-test")
    assert chat.kind.name == "CLIENT"
    assert chat.attributes["gen_ai.provider.name"] == "openai"
    assert chat.attributes["gen_ai.request.model"] == "gpt-test"
    assert chat.attributes["gen_ai.usage.input_tokens"] == 11
    assert chat.attributes["gen_ai.usage.output_tokens"] == 7
    assert chat.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert chat.attributes["server.address"] == "127.0.0.1"
    assert chat.attributes["server.port"] == int(upstream.url.rsplit(":", 1)[1])
    assert spans.one("invoke_agent assistant").attributes["gen_ai.provider.name"] == "openai"
    # ... and into no span, content capture on or not.
    for span in spans.all():
        assert not any(key[:12] in value for value in attribute_values(span)), span.name


async def test_a_failed_model_call_marks_its_span_and_the_run_span_with_the_error_code(
    alice, spans, execute, upstream
):
    await sync_to_async(upstream.model_record)(
        name="gpt-down", api_key="sk-unused", owner=alice, model="gpt-test"
    )
    upstream.enqueue(ErrorReply(status=502, body=HTML_502, content_type="text/html"))
    outcome = (await execute("gpt-down", "hello")).outcome

    assert outcome.status == RunStatus.FAILED
    assert outcome.error["code"] == "upstream.error"
    chat = spans.one("chat gpt-test")
    run = spans.one("invoke_agent assistant")
    for span in (chat, run):
        assert status_code(span) == "ERROR"
        assert span.attributes["error.type"] == "upstream.error"
        # Never the provider's text (an exception message or an exception event).
        assert not span.events
        assert not any("Bad Gateway" in value for value in attribute_values(span))
    assert run.attributes["sage.run.status"] == "failed"
    assert "gen_ai.response.finish_reasons" not in chat.attributes


async def test_a_rate_limited_call_is_an_error_but_the_suspended_run_is_not(spans, execute):
    await sync_to_async(scripted_model)(
        "otel-429", error={"status": 429, "body": "{}", "retry_after": 7}
    )
    outcome = (await execute("otel-429", "hi")).outcome

    assert outcome.status == RunStatus.SUSPENDED
    chat = spans.one("chat otel-429")
    run = spans.one("invoke_agent assistant")
    assert chat.attributes["error.type"] == "upstream.rate_limited"
    assert status_code(chat) == "ERROR"
    assert run.attributes["sage.run.status"] == "suspended"
    assert "error.type" not in run.attributes and status_code(run) == "UNSET"


async def test_failed_tool_calls_are_error_spans_in_a_completed_run(spans, execute):
    await sync_to_async(scripted_model)(
        "otel-bad-tools",
        {
            "tool_calls": [
                {"id": "call_x", "name": "calculator", "arguments": {"expression": "2 +"}},
                {"id": "call_y", "name": "no_such_tool", "arguments": {}},
            ]
        },
        {"text": "Sorry."},
    )
    outcome = (await execute("otel-bad-tools", "go")).outcome

    assert outcome.status == RunStatus.COMPLETED, outcome.error
    calculator = spans.one("execute_tool calculator")
    unknown = spans.one("execute_tool no_such_tool")
    assert (calculator.attributes["error.type"], status_code(calculator)) == (
        "tool.failed",
        "ERROR",
    )
    assert calculator.attributes["gen_ai.tool.call.id"] == "call_x"
    assert (unknown.attributes["error.type"], status_code(unknown)) == ("tool.not_found", "ERROR")
    assert status_code(spans.one("invoke_agent assistant")) == "UNSET"


async def test_a_flow_tool_node_is_a_tool_span_of_the_run(spans, execute, scripted_record):
    # The flow "triage": agent node "ask" (the scripted echo), then tool node "time" (clock).
    ran = await execute(text="hello", manifest=FLOW_MANIFEST, agent="triage")
    outcome = ran.outcome

    assert outcome.status == RunStatus.COMPLETED, outcome.error
    run = spans.one("invoke_agent triage")
    chat = spans.one("chat scripted")
    clock = spans.one("execute_tool clock")
    assert chat.parent.span_id == run.context.span_id
    assert clock.parent.span_id == run.context.span_id
    assert clock.attributes["gen_ai.conversation.id"] == ran.session_id
    assert "gen_ai.tool.call.id" not in clock.attributes
    assert chat.end_time <= clock.start_time


async def test_without_opentelemetry_a_run_executes_and_nothing_is_traced(
    spans, execute, monkeypatch
):
    # The package cannot be imported (as when requirements-otel.txt is not installed, and
    # the API did not come with another package either).
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    await sync_to_async(scripted_model)("otel-none", *TOOL_SCRIPT)
    ran = await execute("otel-none", "what is 2+2")  # given a provider, which it cannot use
    outcome = ran.outcome

    assert ran.executor.tracing.enabled is False
    assert outcome.status == RunStatus.COMPLETED, outcome.error
    assert outcome.result["text"] == "It is four."
    assert spans.all() == []
    assert ran.executor.tracing.run(agent="a", conversation_id="s", run_id="r") is tracing.NO_SPAN


async def test_the_global_provider_is_used_when_none_is_given(execute):
    # Nothing configured by the operator: the API's no-op provider, spans not recorded.
    await sync_to_async(scripted_model)("otel-global", {"text": "fine"})
    ran = await execute("otel-global", "hi", traced=False)
    outcome = ran.outcome

    assert outcome.status == RunStatus.COMPLETED, outcome.error
    assert ran.executor.tracing.enabled is True


@pytest.mark.parametrize(
    ("raw", "value"), [(None, False), ("1", True), ("on", True), ("0", False), ("", False)]
)
def test_the_capture_setting_is_a_boolean(raw, value):
    environ = {} if raw is None else {"SAGE_OTEL_CAPTURE_CONTENT": raw}
    loaded = config.load(environ)
    assert loaded.errors == []
    assert loaded["SAGE_OTEL_CAPTURE_CONTENT"] is value


def test_a_bad_capture_setting_stops_start_up_with_its_own_check():
    loaded = config.load({"SAGE_OTEL_CAPTURE_CONTENT": "maybe"})
    assert loaded.errors == [
        config.Problem(
            "sageproject.E023",
            "SAGE_OTEL_CAPTURE_CONTENT must be 1/0, true/false, yes/no or on/off (got 'maybe')",
        )
    ]


def test_an_mcp_tool_span_names_its_server(spans):
    traced = tracing.Tracing(spans.provider)
    with traced.tool_call(name="mcp__crm__lookup", call_id="c1", server="crm") as span:
        span.succeeded("ok")
    tool = spans.one("execute_tool mcp__crm__lookup")
    assert tool.attributes["sage.mcp.server"] == "crm"
    with traced.tool_call(name="clock"):
        pass
    assert "sage.mcp.server" not in spans.one("execute_tool clock").attributes
