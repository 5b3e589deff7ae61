"""The OpenAI-compatible API (``/v1/``) through the official ``openai`` SDK against a live
host: every call a client makes is answered in shapes the SDK parses, on the same runs,
sessions, limits and ownership rules as the REST API."""

from __future__ import annotations

import contextlib
import io
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from agents.models import Visibility
from agents.services import packages
from scheduling.models import Event, Run, RunStatus, Session
from tests.conftest import demo_manifest, scripted_model
from tests.e2e.conftest import wait_for
from tests.protocols.conftest import PENDING_PER_USER, token

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

# The streamed answer of the `streamy` assistant: a tool call first (its arguments stream
# slowly, so a client's stream is open before any text), then these words, one per token.
WORDS = " ".join(f"w{i}" for i in range(40))


@pytest.fixture(autouse=True)
def _scripted(scripted_record):
    """The shared ``scripted`` model record every `helper` package uses."""


def sdk(live_host: str, user) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_host}/v1", api_key=token(user), max_retries=0)


def helper(user, name: str = "helper", **agent) -> None:
    """A package of ``user``'s on the scripted model (echoes, calculates)."""
    packages.package_create(owner=user, manifest=demo_manifest(name=name, **agent))


def streamy(user) -> None:
    expression = "+".join(["1"] * 40)
    scripted_model(
        "streamy",
        {
            "text": "",
            "tool_calls": [{"name": "calculator", "arguments": {"expression": expression}}],
        },
        {"text": WORDS},
        token_delay_ms=25,
    )
    helper(user, "streamy", model="streamy")


def run_of(object_id: str) -> Run:
    return Run.objects.select_related("session").get(
        pk=uuid.UUID(object_id.split("_", 1)[-1][-32:])
    )


def texts(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_models_are_the_assistants_a_user_may_use(live_host, alice, bob, staff):
    helper(alice)
    demo = packages.package_create(owner=staff, manifest=demo_manifest(name="demo"))[0]
    packages.package_publish(demo, Visibility.EVERYONE)

    mine = {m.id: m for m in sdk(live_host, alice).models.list()}
    assert set(mine) == {"helper", "helper/assistant", "demo", "demo/assistant"}
    assert (mine["helper"].object, mine["helper"].owned_by) == ("model", "alice")
    assert mine["demo/assistant"].owned_by == "staff"
    assert {m.id for m in sdk(live_host, bob).models.list()} == {"demo", "demo/assistant"}
    assert sdk(live_host, alice).models.retrieve("helper/assistant").id == "helper/assistant"

    with pytest.raises(openai.NotFoundError) as hidden:
        sdk(live_host, bob).models.retrieve("helper")  # alice's package is private
    assert hidden.value.code == "assistant.not_found"
    assert hidden.value.response.headers["x-should-retry"] == "false"

    stranger = openai.OpenAI(base_url=f"{live_host}/v1", api_key="not-a-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        stranger.models.list()
    assert refused.value.type == "authentication_error"
    # Our token scheme (Token …) is the REST API's, not this prefix's.
    answer = httpx.get(f"{live_host}/v1/models", headers={"Authorization": f"Token {token(alice)}"})
    assert answer.status_code == 401
    nowhere = httpx.get(
        f"{live_host}/v1/assistants", headers={"Authorization": f"Bearer {token(alice)}"}
    )
    assert nowhere.status_code == 404
    assert set(nowhere.json()["error"]) == {"message", "type", "param", "code"}


def test_a_chat_completion_is_one_run_with_the_earlier_turns_as_history(
    live_host, alice, start_worker
):
    helper(alice)
    start_worker()
    completion = sdk(live_host, alice).chat.completions.create(
        model="helper",
        messages=[
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"},
            {"role": "user", "content": [{"type": "text", "text": "please calculate (2+3)*4"}]},
        ],
    )
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content == "The result is 20."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.model == "helper"
    assert completion.usage.total_tokens > 0

    run = run_of(completion.id)
    assert (run.owner, run.status, run.session.kind) == (alice, RunStatus.COMPLETED, "branch")
    events = list(Event.objects.filter(session=run.session).order_by("seq"))
    history = [(e.payload["role"], e.payload["content"]) for e in events[:2]]
    assert history == [("user", "hello"), ("assistant", "hi there")]
    assert [e.run_id for e in events[:2]] == [None, None]
    # The calculator ran inside the host; the client saw only the answer.
    assert Event.objects.filter(run=run, type="tool.call.succeeded").count() == 1

    # A repeated Idempotency-Key answers the run it admitted first; no second session.
    again = [
        sdk(live_host, alice).chat.completions.create(
            model="helper",
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={"Idempotency-Key": "chat-1"},
        )
        for _ in range(2)
    ]
    assert again[0].id == again[1].id != completion.id
    assert Session.objects.filter(owner=alice).count() == 2

    with pytest.raises(openai.BadRequestError) as bad:
        sdk(live_host, alice).chat.completions.create(
            model="helper", messages=[{"role": "assistant", "content": "no question"}]
        )
    assert (bad.value.param, bad.value.type) == ("messages", "invalid_request_error")


def test_a_streamed_chat_completion_sends_the_text_in_chunks_and_ends_with_done(
    live_host, alice, start_worker
):
    streamy(alice)
    start_worker()
    chunks = list(
        sdk(live_host, alice).chat.completions.create(
            model="streamy",
            messages=[{"role": "user", "content": "go"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(content) == WORDS
    assert len(content) == len(WORDS.split())  # piece by piece, live
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert {c.id for c in chunks} == {chunks[0].id}
    assert run_of(chunks[0].id).status == RunStatus.COMPLETED

    with httpx.stream(
        "POST",
        f"{live_host}/v1/chat/completions",
        json={"model": "streamy", "messages": [{"role": "user", "content": "go"}], "stream": True},
        headers={"Authorization": f"Bearer {token(alice)}"},
        timeout=60,
    ) as raw:
        lines = [line for line in raw.iter_lines() if line.startswith("data:")]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"


def test_a_plain_and_a_streamed_response(live_host, alice, start_worker):
    helper(alice)
    streamy(alice)
    start_worker()
    client = sdk(live_host, alice)

    response = client.responses.create(model="helper", input="hello")
    assert (response.object, response.status, response.model) == ("response", "completed", "helper")
    assert response.output_text == "You said: hello"
    assert response.usage.output_tokens == 3
    assert run_of(response.id).input["text"] == "hello"

    events = list(client.responses.create(model="streamy", input="go", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert texts(events) == final.output_text == WORDS
    assert [item.type for item in final.output] == ["message"]  # the tool call stayed inside
    assert run_of(final.id).status == RunStatus.COMPLETED


def test_a_background_response_is_polled_to_completion(live_host, alice, start_worker):
    helper(alice)
    client = sdk(live_host, alice)
    response = client.responses.create(model="helper", input="hello", background=True)
    assert (response.status, response.background) == ("queued", True)
    assert response.output == []
    start_worker()
    wait_for(lambda: client.responses.retrieve(response.id).status == "completed", message="done")
    polled = client.responses.retrieve(response.id)
    assert polled.output_text == "You said: hello"
    assert polled.completed_at is not None


def test_a_stream_is_resumed_with_starting_after(live_host, alice, start_worker):
    streamy(alice)
    start_worker()
    client = sdk(live_host, alice)
    first = []
    with client.responses.create(model="streamy", input="go", stream=True) as stream:
        for event in stream:
            first.append(event)
            if sum(e.type == "response.output_text.delta" for e in first) == 5:
                break  # the client goes away mid-answer; the run goes on
    response_id = first[0].response.id
    cursor = first[-1].sequence_number

    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=cursor))
    assert [e.sequence_number for e in rest] == list(range(cursor + 1, cursor + 1 + len(rest)))
    assert rest[-1].type == "response.completed"
    assert texts(first) + texts(rest) == rest[-1].response.output_text == WORDS

    # Without a cursor the stream is replayed from its start, event for event.
    replay = list(client.responses.retrieve(response_id, stream=True))
    assert [(e.type, e.sequence_number) for e in replay] == [
        (e.type, e.sequence_number) for e in first + rest
    ]
    assert [e.delta for e in replay if e.type == "response.output_text.delta"] == [
        e.delta for e in first + rest if e.type == "response.output_text.delta"
    ]


def test_a_background_response_is_cancelled(live_host, alice, start_worker):
    scripted_model("slow", {"text": " ".join(["w"] * 400)}, token_delay_ms=50)
    helper(alice, "slow", model="slow")
    start_worker()
    client = sdk(live_host, alice)
    response = client.responses.create(model="slow", input="go", background=True)
    run = run_of(response.id)
    wait_for(
        lambda: (
            Event.objects.filter(run=run, type="run.started").exists()
            or Run.objects.get(pk=run.pk).status == RunStatus.RUNNING
        ),
        message="the run is running",
    )
    cancelled = client.responses.cancel(response.id)
    assert cancelled.id == response.id
    wait_for(lambda: client.responses.retrieve(response.id).status == "cancelled", message="cancel")
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED


def test_previous_response_id_continues_the_same_session(live_host, alice, start_worker):
    helper(alice)
    start_worker()
    client = sdk(live_host, alice)
    first = client.responses.create(model="helper", input="my name is Ada")
    second = client.responses.create(previous_response_id=first.id, input="what did I say?")
    assert second.status == "completed"
    assert second.output_text == "You said: what did I say?"
    assert (second.previous_response_id, second.model) == (first.id, "helper")

    one, two = run_of(first.id), run_of(second.id)
    assert one.session_id == two.session_id
    said = Event.objects.filter(session_id=one.session_id, type="message.completed")
    assert [e.payload["content"] for e in said.order_by("seq")] == [
        "my name is Ada",
        "You said: my name is Ada",
        "what did I say?",
        "You said: what did I say?",
    ]
    helper(alice, "other")
    with pytest.raises(openai.BadRequestError) as switched:
        client.responses.create(model="other", previous_response_id=first.id, input="hi")
    assert switched.value.param == "model"


def test_a_full_queue_is_a_rate_limit_error(live_host, alice):
    helper(alice)
    client = sdk(live_host, alice)  # no worker: admitted runs stay queued
    for _ in range(PENDING_PER_USER):
        client.responses.create(model="helper", input="hello", background=True)
    with pytest.raises(openai.RateLimitError) as full:
        client.chat.completions.create(model="helper", messages=[{"role": "user", "content": "hi"}])
    assert full.value.code == "scheduler.queue_full"
    assert int(full.value.response.headers["retry-after"]) >= 1
    assert "x-should-retry" not in full.value.response.headers  # a retry later may pass
    assert Run.objects.filter(owner=alice).count() == PENDING_PER_USER
    # The refused request's fresh session is not left behind.
    assert Session.objects.filter(owner=alice).count() == PENDING_PER_USER


def test_another_users_response_is_not_found(live_host, alice, bob):
    helper(alice)
    response = sdk(live_host, alice).responses.create(model="helper", input="hi", background=True)
    intruder = sdk(live_host, bob)
    with pytest.raises(openai.NotFoundError) as hidden:
        intruder.responses.retrieve(response.id)
    assert hidden.value.code == "response.not_found"
    with pytest.raises(openai.NotFoundError):
        intruder.responses.cancel(response.id)
    with pytest.raises(openai.NotFoundError):
        intruder.responses.create(previous_response_id=response.id, input="hi")
    with pytest.raises(openai.NotFoundError):
        intruder.responses.retrieve(f"resp_{uuid.uuid4().hex}")
    assert Run.objects.get(pk=run_of(response.id).pk).status == RunStatus.QUEUED
    assert Run.objects.filter(owner=bob).count() == 0


def test_a_run_that_fails_ends_its_streams_with_the_error(live_host, alice, start_worker):
    scripted_model("broken", error={"status": 500})
    helper(alice, "broken", model="broken")
    start_worker()
    client = sdk(live_host, alice)
    events = list(client.responses.create(model="broken", input="go", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "server_error"
    assert events[-1].response.status == "failed"
    with pytest.raises(openai.APIError) as failed:
        list(
            client.chat.completions.create(
                model="broken", messages=[{"role": "user", "content": "go"}], stream=True
            )
        )
    assert failed.value.code == "upstream.error"


def test_a_run_the_host_suspends_for_a_retry_is_cancelled_and_reported_rate_limited(
    live_host, alice, start_worker
):
    scripted_model("limited", error={"status": 429, "retry_after": 3})
    helper(alice, "limited", model="limited")
    start_worker()
    events = list(sdk(live_host, alice).responses.create(model="limited", input="go", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "rate_limit_exceeded"
    run = run_of(events[-1].response.id)
    assert run.status == RunStatus.CANCELLED  # nothing waits for a reply it cannot give
    assert Event.objects.filter(run=run, type="run.suspended").exists()


def test_a_user_whose_read_permission_is_revoked_reads_no_response(live_host, alice):
    from django.contrib.auth.models import Group

    from agents.services import READ_REVOKED_GROUP

    helper(alice)
    client = sdk(live_host, alice)
    response = client.responses.create(model="helper", input="hi", background=True)
    alice.groups.add(Group.objects.create(name=READ_REVOKED_GROUP))
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.responses.retrieve(response.id)
    assert denied.value.code == "run.read_forbidden"
    assert client.responses.create(model="helper", input="hi", background=True).status == "queued"


def test_the_readme_example_runs_against_the_seeded_demo(
    live_host, django_user_model, start_worker
):
    from django.core.management import call_command

    admin = django_user_model.objects.create_superuser("admin", "admin@localhost", "pw")
    call_command("seed_demo", owner="admin", verbosity=0, stdout=io.StringIO())
    start_worker()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = readme.split("### With the `openai` SDK", 1)[1].split("```python\n", 1)[1]
    example = example.split("```", 1)[0].replace("http://127.0.0.1:8000", live_host)
    assert len(example.strip().splitlines()) == 5
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(example, {"TOKEN": token(admin)})
    assert printed.getvalue().splitlines() == [
        "['demo', 'demo/assistant']",
        "The result is 20.",
        "You said: hello",
    ]


def test_an_idempotency_key_longer_than_a_runs_key_is_refused_before_anything_is_made(
    live_host, alice
):
    helper(alice)
    longest = Run._meta.get_field("idempotency_key").max_length
    with pytest.raises(openai.BadRequestError) as bad:
        sdk(live_host, alice).chat.completions.create(
            model="helper",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"Idempotency-Key": "k" * (longest + 1)},
        )
    assert bad.value.code == "request.invalid"
    assert f"at most {longest} characters" in bad.value.message
    assert not Run.objects.filter(owner=alice).exists()
    assert not Session.objects.filter(owner=alice).exists()
