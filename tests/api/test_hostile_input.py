"""Hostile input on the REST API: never a 500 but a clear 4xx in the envelope, the same on
every database (a NUL that PostgreSQL cannot store is refused on SQLite too), and a schema
(``GET /api/schema/``) that says what the server does."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator

import httpx
import pytest
from rest_framework.authtoken.models import Token

from agents.models import AgentPackage
from pooling.models import ModelRecord
from scheduling.models import Run
from tests.conftest import demo_manifest
from tests.scheduling.processes import live_web_server, worker_env

pytestmark = pytest.mark.django_db

LISTS = [
    "/api/v1/model-records/",
    "/api/v1/packages/",
    "/api/v1/sessions/",
    "/api/v1/runs/",
    "/api/v1/archives/",
]


def _post_raw(api, url: str, body: bytes):
    return api.generic("POST", url, body, content_type="application/json")


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.content
    return response.json()["error"]


@pytest.fixture
def alice_session(alice, make_session):
    return make_session(alice)


# --- JSON bodies ---------------------------------------------------------------------


def _record(**options) -> dict:
    return {"name": "r", "protocol": "openai", "options": options}


def _package(**manifest) -> dict:
    return {"manifest": {**demo_manifest(), **manifest}}


# Free-form JSON (options, manifests, files) has no field validator of its own: these used to
# be stored on SQLite and fail on PostgreSQL with a 500.
@pytest.mark.parametrize(
    "url, body",
    [
        ("/api/v1/model-records/", _record(key="a\x00b")),
        ("/api/v1/model-records/", _record(**{"k\x00": 1})),
        ("/api/v1/packages/", _package(files={"notes.md": "x\x00"})),
        ("/api/v1/packages/", {"manifest": demo_manifest(instructions="a\x00b")}),
    ],
)
def test_it_refuses_a_nul_character_in_any_string_or_key(alice_api, scripted_record, url, body):
    error = _error(_post_raw(alice_api, url, json.dumps(body).encode()), 400)
    assert error["code"] == "request.malformed"
    assert "NUL character" in error["message"]
    assert not ModelRecord.objects.filter(owner__username="alice").exists()
    assert not AgentPackage.objects.exists()


@pytest.mark.parametrize(
    "url, body",
    [
        ("/api/v1/model-records/", _record(key="\ud800")),
        ("/api/v1/model-records/", _record(key="\udc00x")),
        ("/api/v1/model-records/", _record(**{"\ude00\ud83d": 1})),
        ("/api/v1/packages/", _package(files={"notes.md": "\ud800"})),
    ],
)
def test_it_refuses_a_lone_surrogate(alice_api, scripted_record, url, body):
    error = _error(_post_raw(alice_api, url, json.dumps(body).encode()), 400)
    assert error["code"] == "request.malformed"
    assert not ModelRecord.objects.filter(owner__username="alice").exists()
    assert not AgentPackage.objects.exists()


def _nested_options(levels: int) -> dict:
    """A model record whose body nests ``levels`` deep (the body itself is level 1)."""
    options: dict = {}
    for _ in range(levels - 2):
        options = {"a": options}
    return {"name": f"deep-{levels}", "protocol": "openai", "options": options}


def test_it_refuses_json_nested_deeper_than_32_levels(alice_api):
    body = b'{"manifest": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    error = _error(_post_raw(alice_api, "/api/v1/packages/", body), 400)
    assert error["code"] == "request.malformed"
    assert "deeper than 32 levels" in error["message"]

    url = "/api/v1/model-records/"
    assert _error(alice_api.post(url, _nested_options(33), format="json"), 400)["code"] == (
        "request.malformed"
    )
    assert alice_api.post(url, _nested_options(32), format="json").status_code == 201


@pytest.mark.parametrize(
    "url, body, field",
    [
        ("/api/v1/runs/", {"input": 5}, "input"),
        ("/api/v1/runs/", {"input": 1.5}, "input"),
        ("/api/v1/runs/", {"session": 5}, "session"),
        ("/api/v1/runs/", {"priority": "5"}, "priority"),
        ("/api/v1/packages/", {"manifest": demo_manifest(), "activate": "yes"}, "activate"),
        ("/api/v1/packages/", {"manifest": "demo"}, "manifest"),
        ("/api/v1/model-records/", {"name": 7, "protocol": "openai"}, "name"),
    ],
)
def test_it_refuses_a_value_of_the_wrong_json_type(
    alice_api, alice_session, scripted_record, url, body, field
):
    if url == "/api/v1/runs/":
        body = {"session": str(alice_session.pk), "input": "hi", **body}
    error = _error(alice_api.post(url, body, format="json"), 400)
    assert error["code"] == "request.invalid"
    assert list(error["details"]["fields"]) == [field]
    assert not Run.objects.exists()


def test_it_measures_a_strings_length_as_sent_not_trimmed(alice_api):
    # The schema's maxLength counts what is sent; DRF would have trimmed first.
    body = {"name": " " + "a" * 100, "protocol": "openai"}
    error = _error(alice_api.post("/api/v1/model-records/", body, format="json"), 400)
    assert error["details"]["fields"] == {
        "name": ["Ensure this field has no more than 100 characters."]
    }


@pytest.mark.parametrize("action", ["validate", "activate", "fork"])
@pytest.mark.parametrize("pk", ["abc", "%C2%B2"])
def test_it_answers_404_for_a_package_id_that_is_not_a_row_id(alice_api, action, pk):
    body = {"validate": {}, "activate": {"expected_ref": None}, "fork": {"version": "2"}}
    response = alice_api.post(f"/api/v1/packages/{pk}/{action}/", body[action], format="json")
    assert _error(response, 404)["code"] == "package.not_found"


# --- query parameters ----------------------------------------------------------------


@pytest.mark.parametrize(
    "query, name",
    [
        ("session=not-a-uuid", "session"),
        ("session=%00", "session"),
        ("session=", "session"),
        ("status=%00", "status"),
        ("status=bogus", "status"),
    ],
)
def test_it_refuses_a_run_filter_value_it_does_not_know(alice_api, query, name):
    error = _error(alice_api.get(f"/api/v1/runs/?{query}"), 400)
    assert error["code"] == "request.invalid"
    assert list(error["details"]["fields"]) == [name]


def test_it_filters_runs_by_session_and_status(alice, alice_api, alice_session, make_session):
    from agents import services

    run, _ = services.run_submit(owner=alice, session_id=alice_session.pk, input="x")
    services.run_submit(owner=alice, session_id=make_session(alice).pk, input="y")
    body = alice_api.get(f"/api/v1/runs/?session={alice_session.pk}&status=queued").json()
    assert [r["id"] for r in body["results"]] == [str(run.pk)]
    assert alice_api.get("/api/v1/runs/?status=running").json()["count"] == 0
    # The filters are the list's: a run is read by its id whatever the query says.
    assert alice_api.get(f"/api/v1/runs/{run.pk}/?status=bogus").status_code == 200


@pytest.mark.parametrize("url", LISTS)
def test_every_list_takes_the_same_page_and_page_size_rules(alice_api, url):
    assert alice_api.get(url, {"page_size": 100, "page": 1}).status_code == 200
    for bad in ("null", "-1", "0", "101", "1.5", ""):
        error = _error(alice_api.get(f"{url}?page_size={bad}"), 400)
        assert error["code"] == "request.invalid"
        assert error["details"]["fields"] == {"page_size": ["must be an integer from 1 to 100"]}
    for bad in ("null", "-1", "0", "last", ""):
        error = _error(alice_api.get(f"{url}?page={bad}"), 400)
        assert list(error["details"]["fields"]) == ["page"]
    assert _error(alice_api.get(url, {"page": 2}), 404)["code"] == "not_found"


# --- the schema ----------------------------------------------------------------------


def test_the_schema_documents_errors_unknown_fields_blanks_and_pages(alice_api):
    schema = alice_api.get("/api/schema/?format=json").json()
    envelope = {"$ref": "#/components/schemas/ErrorEnvelope"}
    assert "ErrorEnvelope" in schema["components"]["schemas"]
    submit = schema["paths"]["/api/v1/runs/"]["post"]["responses"]
    for code in ("400", "401", "403", "404", "409", "413", "415", "429"):
        assert submit[code]["content"]["application/json"]["schema"] == envelope, code
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            for code in ("401", "403", "404"):
                documented = operation["responses"][code]["content"]["application/json"]
                assert documented["schema"] == envelope, (method, path, code)

    run = schema["components"]["schemas"]["RunSubmitRequest"]
    assert run["additionalProperties"] is False
    assert run["properties"]["input"]["minLength"] == 1
    session = schema["components"]["schemas"]["SessionCreateRequest"]
    assert session["additionalProperties"] is False
    assert session["properties"]["package"]["minLength"] == 1
    # Python's whitespace spelled out (ECMA's "\s" differs): "\r \u001e" is blank to both.
    blank_ok = session["properties"]["package"]["pattern"]
    assert blank_ok.startswith(r"^[\u0009-\u000d\u001c-\u0020\u0085")
    for value in ("\r \u001e", "\u3000", " \x85 "):
        assert not re.fullmatch(blank_ok, value) and not value.strip(), repr(value)
    for value in ("a b", "\ufeff", " x\n"):
        assert re.fullmatch(blank_ok, value) and value.strip(), repr(value)
    # Or "" (drf-spectacular's form): the pattern leaves "" to the other branch (oneOf).
    title, blank = session["properties"]["title"]["oneOf"]
    assert title["pattern"] == r"^[^\u0000]+$" and "minLength" not in title
    assert blank == {"type": "string", "maxLength": 0}

    pages = {
        path: {
            p["name"]: p["schema"] for p in operations["get"]["parameters"] if "page" in p["name"]
        }
        for path, operations in schema["paths"].items()
        if "get" in operations and "Paginated" in str(operations["get"]["responses"]["200"])
    }
    assert set(LISTS) <= set(pages)
    for path, parameters in pages.items():
        assert parameters == {
            "page": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
            "page_size": {"type": "integer", "minimum": 1, "maximum": 100},
        }, path


# --- bodies on a real web server -----------------------------------------------------


@pytest.fixture
def web_server(tmp_path) -> Iterator[str]:
    """``uvicorn sagehost.asgi:application`` (the production handler) on this test's
    database, with the default 1 MB request limit; yields its base URL."""
    env = worker_env({"SAGE_MAX_REQUEST_BYTES": None})
    with live_web_server(tmp_path / "web.log", env) as base:
        yield base


def _chunks(body: bytes, size: int = 65_536) -> Iterator[bytes]:
    # An iterator without a length: httpx sends it with Transfer-Encoding: chunked.
    for start in range(0, len(body), size):
        yield body[start : start + size]


@pytest.mark.django_db(transaction=True)
def test_it_reads_a_chunked_request_body(alice, make_session, web_server):
    session = make_session(alice)
    token = Token.objects.create(user=alice).key
    body = b'{"session": "%s", "input": "hello"}' % str(session.pk).encode()
    response = httpx.post(
        f"{web_server}/api/v1/runs/",
        content=_chunks(body, size=7),
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.request.headers["Transfer-Encoding"] == "chunked"
    assert response.status_code == 202, response.text
    assert Run.objects.get().input == "hello"


@pytest.mark.django_db(transaction=True)
def test_it_answers_413_to_a_chunked_body_over_the_limit(alice, web_server):
    token = Token.objects.create(user=alice).key
    response = httpx.post(
        f"{web_server}/api/v1/runs/",
        content=_chunks(b"a" * 5_000_000),
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request.too_large"
    assert response.json()["error"]["details"] == {"max_bytes": 1_048_576}


@pytest.mark.django_db(transaction=True)
def test_it_answers_413_to_a_content_length_over_the_limit_before_the_body(alice, web_server):
    token = Token.objects.create(user=alice).key
    port = int(web_server.rsplit(":", 1)[1])
    head = (
        "POST /api/v1/runs/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Token {token}\r\nContent-Type: application/json\r\n"
        "Content-Length: 5000000\r\nExpect: 100-continue\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(head.encode())
        # No body is sent: the answer must come without it (no "100 Continue" first).
        answer = b""
        while b"request.too_large" not in answer:
            chunk = client.recv(65_536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer


def test_routes_have_no_format_suffix_twins(alice, alice_api, make_session):
    # The custom actions' `.json` twins answered 500 (their views take no `format`).
    session = make_session(alice)
    run = alice_api.post(
        "/api/v1/runs/", {"session": str(session.pk), "input": "hi"}, format="json"
    ).json()
    for url in (
        f"/api/v1/runs/{run['id']}/cancel.json",
        f"/api/v1/sessions/{session.pk}/events.json",
        "/api/v1/runs.json",
    ):
        response = alice_api.post(url) if "cancel" in url else alice_api.get(url)
        assert response.status_code == 404, url
        assert response.json()["error"]["code"]


# --- the schema and the server agree (schemathesis ST108, ST201, ST202) --------------------


def _schema(api) -> dict:
    return api.get("/api/schema/?format=json").json()


def _sse_events(body: bytes) -> list[dict]:
    """The events of a text/event-stream body as the SSE format defines them (comments and
    blocks without data skipped; ``id`` carried over), the form the schema describes."""
    events, last_id = [], None
    for block in body.decode().split("\n\n"):
        fields: dict = {}
        data: list[str] = []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            elif name == "retry":
                fields["retry"] = int(value)
            elif name in ("event", "id"):
                fields[name] = value
        last_id = fields.get("id", last_id)
        if data:
            event = {"event": "message", **fields, "data": "\n".join(data)}
            if last_id is not None:
                event["id"] = last_id
            events.append(event)
    return events


@pytest.mark.django_db(transaction=True)  # the stream reads the events in another thread
def test_the_stream_is_documented_as_the_server_sent_events_it_sends(
    alice, alice_api, alice_session
):
    import asyncio

    import jsonschema

    from agents import services
    from scheduling.models import Event

    schema = _schema(alice_api)
    ok = schema["paths"]["/api/v1/sessions/{id}/stream/"]["get"]["responses"]["200"]
    assert list(ok["content"]) == ["text/event-stream"]
    assert ok["content"]["text/event-stream"]["schema"] == {
        "$ref": "#/components/schemas/StreamEvent"
    }
    event_schema = schema["components"]["schemas"]["StreamEvent"]
    assert set(event_schema["required"]) == {"event", "data"}

    run, _ = services.run_submit(owner=alice, session_id=alice_session.pk, input="x")
    for seq in (1, 2):
        Event.objects.create(
            session=alice_session, seq=seq, run=run, type="message.completed", data="{}"
        )
    response = alice_api.get(f"/api/v1/sessions/{alice_session.pk}/stream/", {"timeout": 1})
    assert response["Content-Type"] == "text/event-stream"

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    events = _sse_events(asyncio.run(collect()))
    assert [e["id"] for e in events] == ["1", "2"]
    for event in events:
        jsonschema.validate(event, event_schema)  # what schemathesis checks, event by event


def test_validate_refuses_what_its_schema_forbids(alice_api, make_session, alice):
    make_session(alice)
    package = AgentPackage.objects.get(owner=alice)
    url = f"/api/v1/packages/{package.pk}/validate/"
    operation = _schema(alice_api)["paths"]["/api/v1/packages/{id}/validate/"]["post"]
    strict = next(p for p in operation["parameters"] if p["name"] == "strict")
    assert strict["schema"] == {
        "type": "string",
        "enum": ["true", "1", "yes", "on", "false", "0", "no", "off"],
    }
    assert alice_api.post(url, {"strict": True}, format="json").status_code == 200
    assert alice_api.post(f"{url}?strict=yes", {}, format="json").status_code == 200
    for query, body in [
        ("", {"strict": True, "extra": 1}),  # additionalProperties: false
        ("", {"strict": "yes"}),  # a boolean, not a string
        ("?strict=TRUE", {}),  # not in the enum
        ("?strict=maybe", {"strict": False}),  # refused even when the body decides
    ]:
        response = alice_api.post(url + query, body, format="json")
        assert response.status_code == 400, (query, body)
        assert response.json()["error"]["code"] == "request.invalid"


def test_a_base_url_is_answered_as_its_schema_pattern_says(alice_api):
    schema = _schema(alice_api)["components"]["schemas"]["ModelRecordRequest"]
    pattern, blank = schema["properties"]["base_url"]["oneOf"]
    assert blank == {"type": "string", "maxLength": 0}
    label63 = "a" * 63
    samples = [
        "https://" + ".".join([label63] * 7) + "/v1",  # long (455 characters) but valid
        "http://ollama:11434",  # a single-label host
        "http://127.0.0.1:8080/v1?api-version=2024-01-01",
        "http://[::1]:8000/",
        "https://" + "b" * 64 + ".example.com",  # a label over 63 characters
        "ftp://example.com/",
        "http://example.com:65536/",
        "http://example.com/a b",
        " http://example.com",
        "https://example.com/\n",
    ]
    for index, url in enumerate(samples):
        # fullmatch: ECMA's "$" (the schema's) takes no trailing newline, Python's would.
        valid = len(url) <= pattern["maxLength"] and re.fullmatch(pattern["pattern"], url)
        response = alice_api.post(
            "/api/v1/model-records/",
            {"name": f"r{index}", "protocol": "openai", "base_url": url},
            format="json",
        )
        assert response.status_code == (201 if valid else 400), (url, response.content)
    assert [r.base_url for r in ModelRecord.objects.order_by("name")] == samples[:4]


def test_fork_and_manifest_versions_follow_the_schema_pattern(alice_api, make_session, alice):
    make_session(alice)
    package = AgentPackage.objects.get(owner=alice)
    schema = _schema(alice_api)["components"]["schemas"]
    version = schema["PackageForkRequest"]["properties"]["version"]
    manifest = schema["PackageCreateRequest"]["properties"]["manifest"]
    assert manifest["properties"]["version"]["pattern"] == version["pattern"]
    assert manifest["required"] == ["name", "version", "entrypoint", "agents"]
    fork = f"/api/v1/packages/{package.pk}/fork/"
    for value, accepted in [
        ("2.0.0", True),
        ("2.0.1-rc.1+build.7", True),
        ("2.0.2\n", False),  # Python's "$" took a trailing newline
        ("\u0662.0.0", False),  # a non-ASCII digit
        ("2.0", False),
        (" 2.0.3", False),
    ]:
        assert bool(re.fullmatch(version["pattern"], value)) is accepted, value
        response = alice_api.post(fork, {"version": value}, format="json")
        assert response.status_code == (201 if accepted else 400), (value, response.content)
    # The manifest's name and version follow the same rules.
    for changes in ({"name": "demo\n"}, {"version": "3.0.0\n"}, {"version": "3.0.0-" + "x" * 50}):
        response = alice_api.post("/api/v1/packages/", _package(**changes), format="json")
        assert response.status_code == 400, changes
        assert response.json()["error"]["code"] == "package.invalid"
