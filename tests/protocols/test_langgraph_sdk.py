"""The LangGraph server API under ``/lg/`` driven by the official SDK (``langgraph_sdk``)
against a real uvicorn on loopback and a real worker: every call agent-chat-ui and the
SDK's users make, as they make it, answered from our own rows."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from langgraph_sdk import get_sync_client
from langgraph_sdk.errors import ConflictError, NotFoundError, RateLimitError

from agents.models import ThreadMetadata, Visibility
from agents.services import packages
from scheduling.models import Event, Run, RunStatus, Session
from tests.conftest import demo_manifest, scripted_model, words
from tests.e2e import conftest as e2e
from tests.e2e.conftest import wait_for
from tests.protocols.conftest import token
from tests.scheduling.processes import live_web_server, worker_env

pytestmark = [pytest.mark.django_db(transaction=True)]

start_worker = e2e.start_worker  # the fixture: a real worker in a thread of this process

# The host's streams close after this many seconds (the SDK then reconnects by itself).
STREAM_SECONDS = 2
PENDING_PER_USER = 3
UI_ORIGIN = "http://ui.example:3000"


@pytest.fixture(scope="module")
def lg_url(tmp_path_factory, django_db_setup) -> Iterator[str]:
    """The ``/lg`` base URL of a live host on the test database."""
    env = worker_env(
        {
            "SAGE_LANGGRAPH_STREAM_SECONDS": str(STREAM_SECONDS),
            "SAGE_LANGGRAPH_CORS_ORIGINS": UI_ORIGIN,
            "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": str(PENDING_PER_USER),
        }
    )
    with live_web_server(tmp_path_factory.mktemp("lg") / "web.log", env) as base:
        yield f"{base}/lg"


@pytest.fixture
def demo(staff, scripted_record):
    """The demo package, published to every user (as ``seed_demo`` does)."""
    package, _ = packages.package_create(owner=staff, manifest=demo_manifest())
    packages.package_publish(package, Visibility.EVERYONE)
    return package


def sdk(url: str, user):
    return get_sync_client(url=url, api_key=token(user))


def human(text: str) -> dict:
    return {"messages": [{"type": "human", "content": [{"type": "text", "text": text}]}]}


def stream_on_a_new_thread(client, assistant: str, text: str, **options: Any) -> tuple[str, list]:
    """Create a thread and stream one run of ``assistant`` on it, asked ``text`` (``options``
    as ``runs.stream`` takes them): the thread's id and every part of the stream."""
    thread_id = client.threads.create()["thread_id"]
    return thread_id, list(client.runs.stream(thread_id, assistant, input=human(text), **options))


@pytest.mark.storage
def test_a_thread_streams_a_run_and_keeps_its_state(lg_url, alice, demo, start_worker):
    start_worker()
    client = sdk(lg_url, alice)
    created = []
    thread_id, parts = stream_on_a_new_thread(
        client,
        "demo/assistant",
        "please calculate 2+2",
        stream_mode=["values", "messages-tuple", "updates", "events"],
        stream_resumable=True,
        on_disconnect="continue",
        on_run_created=created.append,
    )
    assert parts[0].event == "metadata"
    assert parts[-1].event == "end"
    run_id = parts[0].data["run_id"]
    assert created[0]["run_id"] == run_id
    assert created[0]["thread_id"] == thread_id
    assert Run.objects.get(pk=run_id).status == RunStatus.COMPLETED
    values = [p.data for p in parts if p.event == "values"]
    final = values[-1]["messages"]
    assert [m["type"] for m in final] == ["human", "ai", "tool", "ai"]
    assert final[0]["content"] == "please calculate 2+2"
    assert final[1]["tool_calls"][0]["name"] == "calculator"
    assert final[2]["content"] == "4"
    assert final[3]["content"] == "The result is 4."
    state = client.threads.get_state(thread_id)
    assert state["values"]["messages"] == final
    assert state["next"] == []
    assert (
        state["checkpoint"]["checkpoint_id"]
        == client.threads.get_history(thread_id, limit=1)[0]["checkpoint"]["checkpoint_id"]
    )
    # The session is the thread, bound to the run's assistant by its first run.
    session = Session.objects.get(pk=thread_id)
    assert (session.owner, session.package_name, session.agent_id) == (alice, "demo", "assistant")
    # Every event has an id, none twice; the chunks of each message add up to its text.
    assert all(p.id for p in parts) and "0" not in {p.id for p in parts}
    durable = [p.id for p in parts if "-d" not in p.id]  # live chunks repeat their place
    assert len(durable) == len(set(durable))
    assert _chunk_texts(parts) == {m["id"]: m["content"] for m in final if m["type"] == "ai"}
    updates = [p.data for p in parts if p.event == "updates"]
    assert [list(u) for u in updates] == [["model"], ["tools"], ["model"]]
    events = [p.data["event"] for p in parts if p.event == "events"]
    ends = [e for e in events if e != "on_chat_model_stream"]
    assert ends == ["on_chat_model_end", "on_tool_start", "on_tool_end", "on_chat_model_end"]
    assert events.count("on_chat_model_stream") == len(
        [p for p in parts if p.event == "messages" and p.id and "-d" in p.id]
    )


def _chunk_texts(parts) -> dict[str, str]:
    """The text of the ``messages`` (messages-tuple) chunks, per message id."""
    texts: dict[str, str] = defaultdict(str)
    for part in parts:
        if part.event == "messages" and part.data[0]["type"] == "AIMessageChunk":
            texts[part.data[0]["id"]] += part.data[0]["content"]
    return dict(texts)


def test_info_and_the_assistants_a_user_may_run(lg_url, alice, bob, demo, scripted_record):
    packages.package_create(owner=alice, manifest=demo_manifest(name="mine"))
    assert httpx.get(f"{lg_url}/info").status_code == 200
    assert httpx.get(f"{lg_url}/ok").json() == {"ok": True}
    client = sdk(lg_url, alice)
    found = {a["graph_id"]: a for a in client.assistants.search(limit=100)}
    assert set(found) == {"demo/assistant", "mine/assistant"}
    demo_assistant = found["demo/assistant"]
    uuid.UUID(demo_assistant["assistant_id"])
    for name in (demo_assistant["assistant_id"], "demo/assistant", "demo"):
        assert client.assistants.get(name)["assistant_id"] == demo_assistant["assistant_id"]
    graph = client.assistants.get_graph("demo/assistant")
    assert {n["id"] for n in graph["nodes"]} == {"__start__", "model", "tools", "__end__"}
    schemas = client.assistants.get_schemas(demo_assistant["assistant_id"])
    assert schemas["graph_id"] == "demo/assistant"
    assert "messages" in schemas["input_schema"]["properties"]
    # Bob may run the published demo, not Alice's own package.
    others = sdk(lg_url, bob)
    assert [a["graph_id"] for a in others.assistants.search()] == ["demo/assistant"]
    with pytest.raises(NotFoundError):
        others.assistants.get("mine/assistant")
    assert httpx.post(f"{lg_url}/assistants/search", json={}).status_code == 401
    key = {"X-Api-Key": token(alice)}
    assert httpx.get(f"{lg_url}/assistants/search", headers=key).status_code == 405


@pytest.mark.storage
def test_a_background_run_is_joined_waited_read_and_listed(lg_url, alice, demo, start_worker):
    start_worker()
    client = sdk(lg_url, alice)
    thread_id = client.threads.create()["thread_id"]
    created = client.runs.create(thread_id, "demo/assistant", input=human("hello"))
    assert created["status"] == "pending"
    assert created["thread_id"] == thread_id
    joined = client.runs.join(thread_id, created["run_id"])
    assert [m["content"] for m in joined["messages"]] == ["hello", "You said: hello"]
    assert client.runs.get(thread_id, created["run_id"])["status"] == "success"
    waited = client.runs.wait(thread_id, "demo/assistant", input=human("calculate 3*3"))
    assert waited["messages"][-1]["content"] == "The result is 9."
    assert len(waited["messages"]) == 6
    listed = client.runs.list(thread_id)
    assert {r["run_id"] for r in listed} == set(
        map(str, Run.objects.filter(session_id=thread_id).values_list("pk", flat=True))
    )
    assert all(r["status"] == "success" for r in listed)
    assert client.runs.list(thread_id, status="error") == []
    # A run joined again after it ended answers at once.
    assert client.runs.join(thread_id, created["run_id"])["messages"] == waited["messages"]


def _slow_package(user, *, text_words: int, delay_ms: int, name: str = "slow") -> None:
    scripted_model(
        f"{name}-model",
        {"text": "", "tool_calls": [{"name": "clock", "arguments": {}}]},
        {"text": words(text_words)},
        token_delay_ms=delay_ms,
    )
    packages.package_create(owner=user, manifest=demo_manifest(name=name, model=f"{name}-model"))


@pytest.mark.storage
def test_a_run_is_cancelled_or_rolled_back(lg_url, alice, scripted_record, start_worker):
    # Long enough (about 40 s) that a loaded machine still cancels it mid-answer.
    _slow_package(alice, text_words=2000, delay_ms=20)
    start_worker()
    client = sdk(lg_url, alice)
    thread_id = client.threads.create()["thread_id"]
    first = client.runs.create(thread_id, "slow", input=human("go"))
    wait_for(lambda: Run.objects.get(pk=first["run_id"]).status == RunStatus.RUNNING)
    client.runs.cancel(thread_id, first["run_id"], wait=True)
    assert Run.objects.get(pk=first["run_id"]).status == RunStatus.CANCELLED
    assert client.runs.get(thread_id, first["run_id"])["status"] == "interrupted"
    assert Event.objects.filter(run_id=first["run_id"], type="run.cancelled").exists()

    second = client.runs.create(thread_id, "slow", input=human("again"))
    wait_for(lambda: Event.objects.filter(run_id=second["run_id"], type="run.started").exists())
    client.runs.cancel(thread_id, second["run_id"], wait=True, action="rollback")
    assert Run.objects.get(pk=second["run_id"]).status == RunStatus.INTERRUPTED
    assert not Event.objects.filter(run_id=second["run_id"]).exists()
    # The first run's history is the thread's whole state.
    messages = client.threads.get_state(thread_id)["values"]["messages"]
    assert {m["id"].split(":")[0] for m in messages} == {first["run_id"]}


@pytest.mark.storage
def test_threads_are_searched_updated_read_back_and_deleted(lg_url, alice, demo, start_worker):
    start_worker()
    client = sdk(lg_url, alice)
    used = client.threads.create(metadata={"project": "apollo"})["thread_id"]
    empty = client.threads.create()["thread_id"]
    client.runs.wait(used, "demo/assistant", input=human("hello"))
    # agent-chat-ui's search: by graph id (or assistant id), 100 at a time.
    by_graph = client.threads.search(metadata={"graph_id": "demo/assistant"}, limit=100)
    assert [t["thread_id"] for t in by_graph] == [used]
    assert by_graph[0]["values"]["messages"][0]["content"] == "hello"
    assistant_id = client.assistants.get("demo/assistant")["assistant_id"]
    by_id = client.threads.search(metadata={"assistant_id": assistant_id}, limit=100)
    assert [t["thread_id"] for t in by_id] == [used]
    assert [t["thread_id"] for t in client.threads.search(metadata={"project": "apollo"})] == [used]
    assert {t["thread_id"] for t in client.threads.search(status="idle")} == {used, empty}
    assert client.threads.count() == 2

    updated = client.threads.update(used, metadata={"project": "gemini", "stage": 2})
    assert updated["metadata"]["project"] == "gemini"
    assert updated["metadata"]["graph_id"] == "demo/assistant"
    assert ThreadMetadata.objects.get(session_id=used).metadata == {"project": "gemini", "stage": 2}
    assert [t["thread_id"] for t in client.threads.search(metadata={"stage": 2})] == [used]

    history = client.threads.get_history(used, limit=10)
    assert [[m["type"] for m in s["values"]["messages"]] for s in history] == [
        ["human", "ai"],
        ["human"],
    ]
    assert history[0]["parent_checkpoint"] == history[1]["checkpoint"]
    assert history[0]["checkpoint"] == client.threads.get_state(used)["checkpoint"]
    older = client.threads.get_history(used, limit=10, before=history[0]["checkpoint"])
    assert older == history[1:]
    assert client.threads.get_state(used, checkpoint=history[1]["checkpoint"]) == history[1]

    client.threads.delete(empty)
    with pytest.raises(NotFoundError):
        client.threads.get(empty)
    assert not Session.objects.filter(pk=empty).exists()


@pytest.mark.storage
def test_two_users_never_see_each_others_threads(lg_url, alice, bob, demo, start_worker):
    start_worker()
    client, other = sdk(lg_url, alice), sdk(lg_url, bob)
    thread_id = client.threads.create(metadata={"owner": "alice"})["thread_id"]
    run = client.runs.create(thread_id, "demo/assistant", input=human("hello"))
    client.runs.join(thread_id, run["run_id"])
    mine = other.threads.create()["thread_id"]
    calls = [
        lambda: other.threads.get(thread_id),
        lambda: other.threads.get_state(thread_id),
        lambda: other.threads.get_history(thread_id),
        lambda: other.threads.update(thread_id, metadata={"owner": "bob"}),
        lambda: other.threads.delete(thread_id),
        lambda: other.runs.list(thread_id),
        lambda: other.runs.get(thread_id, run["run_id"]),
        lambda: other.runs.join(thread_id, run["run_id"]),
        lambda: other.runs.cancel(thread_id, run["run_id"]),
        lambda: other.runs.create(thread_id, "demo/assistant", input=human("hi")),
        lambda: other.runs.wait(
            thread_id, "demo/assistant", input=human("hi"), if_not_exists="create"
        ),
        lambda: list(other.runs.stream(thread_id, "demo/assistant", input=human("hi"))),
        lambda: list(other.runs.join_stream(thread_id, run["run_id"])),
        lambda: client.threads.get(mine),
    ]
    for call in calls:
        # The SDK raises its own errors, or httpx's where it may reconnect (join, wait).
        with pytest.raises((NotFoundError, httpx.HTTPStatusError)) as refused:
            call()
        assert refused.value.response.status_code == 404
    assert [t["thread_id"] for t in other.threads.search(limit=100)] == [mine]
    assert [t["thread_id"] for t in client.threads.search(limit=100)] == [thread_id]
    assert Run.objects.filter(session_id=thread_id).count() == 1
    assert ThreadMetadata.objects.get(session_id=thread_id).metadata == {"owner": "alice"}


@pytest.mark.storage
def test_a_run_waiting_for_approval_is_resumed_with_a_command(
    lg_url, alice, scripted_record, start_worker
):
    manifest = demo_manifest(name="careful", approval=["calculator"])
    packages.package_create(owner=alice, manifest=manifest)
    start_worker()
    client = sdk(lg_url, alice)
    thread_id, parts = stream_on_a_new_thread(
        client, "careful/assistant", "please calculate 2+2", stream_mode="values"
    )
    run_id = parts[0].data["run_id"]
    assert parts[-1].event == "end"
    [interrupt] = parts[-2].data["__interrupt__"]
    request = interrupt["value"]
    assert request["action_requests"] == [
        {
            "name": "calculator",
            "args": {"expression": "2+2"},
            "description": request["action_requests"][0]["description"],
        }
    ]
    assert request["review_configs"] == [
        {"action_name": "calculator", "allowed_decisions": ["approve", "reject", "edit"]}
    ]
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUSPENDED and interrupt["id"] == run.interaction["id"]
    thread = client.threads.get(thread_id)
    assert thread["status"] == "interrupted"
    assert list(thread["interrupts"].values()) == [[interrupt]]
    state = client.threads.get_state(thread_id)
    assert state["next"] == ["tools"] and state["interrupts"] == [interrupt]
    assert state["tasks"][0]["interrupts"] == [interrupt]
    assert client.runs.get(thread_id, run_id)["status"] == "interrupted"

    # agent-chat-ui's answer to a human-in-the-loop request.
    resumed = list(
        client.runs.stream(
            thread_id,
            "careful/assistant",
            command={"resume": {"decisions": [{"type": "approve"}]}},
            stream_mode="values",
        )
    )
    assert resumed[0].data["run_id"] == run_id  # the same run, resumed
    assert resumed[-1].event == "end"
    final = resumed[-2].data["messages"]
    assert [m["content"] for m in final[2:]] == ["4", "The result is 4."]
    assert "__interrupt__" not in resumed[-2].data
    assert Run.objects.get(pk=run_id).status == RunStatus.COMPLETED
    resolved = Event.objects.get(run_id=run_id, type="interaction.resolved").payload
    assert resolved["decision"] == "approve"
    assert client.threads.get(thread_id)["status"] == "idle"


@pytest.mark.storage
def test_an_edit_from_agent_chat_ui_runs_the_edited_call(
    lg_url, alice, scripted_record, start_worker
):
    manifest = demo_manifest(name="careful", approval=["calculator"])
    packages.package_create(owner=alice, manifest=manifest)
    start_worker()
    client = sdk(lg_url, alice)
    thread_id, parts = stream_on_a_new_thread(
        client, "careful/assistant", "please calculate 2+2", stream_mode="values"
    )
    run_id = parts[0].data["run_id"]
    edited = {"name": "calculator", "args": {"expression": "6*7"}}
    resumed = list(
        client.runs.stream(
            thread_id,
            "careful/assistant",
            command={"resume": {"decisions": [{"type": "edit", "edited_action": edited}]}},
            stream_mode="values",
        )
    )
    final = resumed[-2].data["messages"]
    assert [m["content"] for m in final[2:]] == ["42", "The result is 42."]
    resolved = Event.objects.get(run_id=run_id, type="interaction.resolved").payload
    assert resolved["decision"] == "edit"
    assert list(resolved["edits"].values()) == [{"expression": "6*7"}]


@pytest.mark.storage
def test_a_stream_the_server_cuts_is_resumed_by_the_sdk(
    lg_url, alice, scripted_record, start_worker
):
    # The run lasts longer than the host keeps a stream open: the SDK reconnects by itself.
    _slow_package(alice, text_words=60, delay_ms=90, name="long")
    start_worker()
    client = sdk(lg_url, alice)
    reconnects = []
    client.http.client.event_hooks["request"].append(
        lambda r: (
            reconnects.append(r.headers["Last-Event-ID"])
            if r.method == "GET" and r.url.path.endswith("/stream")
            else None
        )
    )
    thread_id, parts = stream_on_a_new_thread(
        client,
        "long",
        "what time is it",
        stream_mode=["values", "messages-tuple"],
        stream_resumable=True,
    )
    assert reconnects, "the stream was never cut"
    run_id = parts[0].data["run_id"]
    assert [p.event for p in parts].count("metadata") == 1
    assert [p.event for p in parts].count("end") == 1 and parts[-1].event == "end"
    assert Run.objects.get(pk=run_id).status == RunStatus.COMPLETED
    # No duplicate and no missing event: one values event per durable state change, each
    # once, in order, and every message's chunks add up to its durable text exactly once.
    durable = list(Event.objects.filter(run_id=run_id).order_by("seq"))
    changes = [e for e in durable if e.type in ("message.completed", "tool.call.succeeded")]
    values = [p for p in parts if p.event == "values"]
    assert [len(p.data["messages"]) for p in values] == [1, 2, 3, 4][: len(changes)]
    assert len({p.id for p in values}) == len(values) == len(changes)
    final = values[-1].data["messages"]
    assert final == client.threads.get_state(thread_id)["values"]["messages"]
    assert _chunk_texts(parts) == {m["id"]: m["content"] for m in final if m["type"] == "ai"}
    assert final[-1]["content"] == words(60)


@pytest.mark.storage
def test_one_strategy_per_busy_thread_and_a_full_queue(lg_url, alice, demo):
    # No worker: runs stay queued.
    client = sdk(lg_url, alice)
    thread_id = client.threads.create()["thread_id"]
    client.runs.create(thread_id, "demo/assistant", input=human("one"))
    with pytest.raises(ConflictError) as busy:
        client.runs.create(thread_id, "demo/assistant", input=human("two"))
    assert busy.value.response.json()["error"]["code"] == "session.busy"
    for _ in range(PENDING_PER_USER - 1):
        client.runs.create(
            thread_id, "demo/assistant", input=human("more"), multitask_strategy="enqueue"
        )
    with pytest.raises(RateLimitError) as full:
        client.runs.create(
            thread_id, "demo/assistant", input=human("more"), multitask_strategy="enqueue"
        )
    assert full.value.response.json()["error"]["code"] == "scheduler.queue_full"
    assert full.value.response.headers["Retry-After"]
    assert Run.objects.filter(session_id=thread_id).count() == PENDING_PER_USER
    # Another assistant on a bound thread is refused.
    with pytest.raises(NotFoundError):
        client.runs.create(thread_id, "nothing/here", input=human("x"))


def test_browsers_on_allowed_origins_only(lg_url, alice):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-api-key",
    }
    allowed = httpx.options(f"{lg_url}/threads", headers={"Origin": UI_ORIGIN, **preflight})
    assert allowed.status_code == 204
    assert allowed.headers["Access-Control-Allow-Origin"] == UI_ORIGIN
    assert "POST" in allowed.headers["Access-Control-Allow-Methods"]
    assert allowed.headers["Access-Control-Allow-Headers"] == "x-api-key"
    other = httpx.options(
        f"{lg_url}/threads", headers={"Origin": "http://evil.example", **preflight}
    )
    assert "Access-Control-Allow-Origin" not in other.headers
    answer = httpx.post(
        f"{lg_url}/threads/search",
        json={},
        headers={"Origin": UI_ORIGIN, "X-Api-Key": token(alice)},
    )
    assert answer.status_code == 200
    assert answer.headers["Access-Control-Allow-Origin"] == UI_ORIGIN
    assert "Content-Location" in answer.headers["Access-Control-Expose-Headers"]
    # The rest of the host is not opened to other origins.
    assert (
        "Access-Control-Allow-Origin"
        not in httpx.get(
            lg_url.removesuffix("/lg") + "/healthz", headers={"Origin": UI_ORIGIN}
        ).headers
    )


@pytest.mark.storage
def test_a_finished_run_is_joined_again_and_regenerated_from_a_checkpoint(
    lg_url, alice, demo, start_worker
):
    start_worker()
    client = sdk(lg_url, alice)
    thread_id = client.threads.create()["thread_id"]
    client.runs.wait(thread_id, "demo/assistant", input=human("hello"))
    parts = list(client.runs.stream(thread_id, "demo/assistant", input=human("calculate 2+2")))
    run_id = parts[0].data["run_id"]
    # agent-chat-ui's rejoin replays the run from its first event; without a position
    # the stream of a finished run only ends.
    replayed = list(client.runs.join_stream(thread_id, run_id, last_event_id="-1"))
    assert [(p.event, p.data) for p in replayed] == [(p.event, p.data) for p in parts]
    assert [p.event for p in client.runs.join_stream(thread_id, run_id)] == ["end"]

    # Regenerate the last answer: from the checkpoint that holds its human message.
    history = client.threads.get_history(thread_id, limit=10)
    asked = next(s for s in history if s["metadata"]["source"] == "input")
    assert asked["values"]["messages"][-1]["content"] == "calculate 2+2"
    again = client.runs.wait(thread_id, "demo/assistant", checkpoint=asked["checkpoint"])
    assert [m["content"] for m in again["messages"]] == [
        "hello",
        "You said: hello",
        "calculate 2+2",
        "",
        "4",
        "The result is 4.",
    ]
    assert not Event.objects.filter(run_id=run_id).exists()  # the replaced turn


def test_a_client_that_leaves_cancels_its_run_when_it_asked(
    lg_url, alice, scripted_record, start_worker
):
    _slow_package(alice, text_words=300, delay_ms=30)
    start_worker()
    thread_id = sdk(lg_url, alice).threads.create()["thread_id"]
    body = {"assistant_id": "slow", "input": human("go"), "on_disconnect": "cancel"}
    url = f"{lg_url}/threads/{thread_id}/runs/stream"
    with httpx.stream("POST", url, json=body, headers={"X-Api-Key": token(alice)}) as answer:
        for line in answer.iter_lines():
            if line == "event: values":
                break  # the run has started: leave
    run = Run.objects.get(session_id=thread_id)
    wait_for(
        lambda: Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED,
        message="the run of a client that left to be cancelled",
    )
