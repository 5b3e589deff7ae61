"""The credential canary: a model key shows up nowhere but in its encrypted column.

Alice registers a model record through the API with a unique key (``openai`` protocol,
``base_url`` on `tests.pooling.upstream.EchoUpstream`, which puts the key it receives
into every error body it answers: 401, 400, 500, a 502 HTML page, 429, an error event
inside a 200 stream) and runs one run per error (and one that succeeds). Then
the key is looked for — whole, and as any 12 consecutive characters of its random part —
in:

- every API response: each GET route of the URL configuration (`test_cross_user.api_routes`)
  for each of Alice's objects, as Alice and as staff;
- the admin, through a real session on the live web process (staff login): the index, every
  registered model's list, add, change, history and delete pages for its objects, and the
  site's own pages (capacity, release idle);
- the host's log files (web and worker);
- the database: every column of every row of every table.

The same search looks for a second secret: a bearer token Alice saves through the API
as MCP connections to `tests.torture.mcp_echo.EchoMcpServer` (on loopback; the host allows
it), which echoes it in its 401 and 500 bodies and in a failing initialise. Her agents
call its tools through scripted models: an answer and an ``isError`` result, a 500, a 401
after the listing (the run asks to connect again), a server whose initialise fails. The
search is one walk for both (the admin and API walk is the check's cost).

Controls: the upstream received the key and echoed it; the record's encrypted column
decrypts to it; the admin login worked and its pages answered 200; the scanner finds the
key in the upstream's recorded requests; the MCP server received the token and echoed it
at least three times; the connections' encrypted column decrypts to it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from django.urls import NoReverseMatch, reverse

from tests.conftest import demo_manifest
from tests.pooling.upstream import ECHO_CASES, EchoUpstream
from tests.torture.host import TERMINAL, LiveHost, make_user
from tests.torture.mcp_echo import EchoMcpServer
from tests.torture.test_cross_user import api_routes

CHECK = "credential-canary"
pytestmark = [pytest.mark.torture, pytest.mark.django_db(transaction=True)]

ADMIN_OBJECTS_PER_MODEL = 25
WINDOW = 12
OK = frozenset({200})
MAY_REFUSE = frozenset({200, 403})


class Scanner:
    """Finds the key, or any ``WINDOW`` consecutive characters of its random part."""

    def __init__(self, key: str, random_part: str) -> None:
        self.key = key
        self.windows = {random_part[i : i + WINDOW] for i in range(len(random_part) - WINDOW + 1)}
        self.hits: dict[str, list[str]] = {}
        self.scanned: dict[str, int] = {}

    def found(self, text: str) -> bool:
        return self.key in text or any(w in text for w in self.windows)

    def scan(self, place: str, where: str, text: str) -> None:
        self.scanned[place] = self.scanned.get(place, 0) + 1
        if self.found(text):
            self.hits.setdefault(place, []).append(where)


def _database_cells() -> Iterable[tuple[str, str]]:
    """(table.column, text) of every non-null value of every table."""
    from django.db import connection

    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            columns = [c[0] for c in cursor.description]
            for row in cursor.fetchall():
                for column, value in zip(columns, row, strict=True):
                    if value is None:
                        continue
                    if isinstance(value, memoryview | bytes | bytearray):
                        value = bytes(value).decode("latin-1")
                    yield f"{table}.{column}", str(value)


def _admin_urls() -> list[tuple[str, frozenset[int]]]:
    """(URL, the statuses it may answer): 403 is fine for add and delete pages (models
    that allow neither), never for a list or an object's page."""
    from django.apps import apps
    from django.contrib import admin

    urls = [reverse("admin:index")]
    for name in ("admin:capacity", "admin:mcp", "admin:agents_reclamationrequest_release_idle"):
        try:
            urls.append(reverse(name))
        except NoReverseMatch:
            pass
    for config in apps.get_app_configs():
        try:
            urls.append(reverse("admin:app_list", args=[config.label]))
        except NoReverseMatch:
            continue
    for model in admin.site._registry:
        opts = model._meta
        base = f"admin:{opts.app_label}_{opts.model_name}"
        urls.append(reverse(f"{base}_changelist"))
        try:
            urls.append(reverse(f"{base}_add"))
        except NoReverseMatch:
            pass
        # Instances, not values_list: a proxy may define its own pk (DRF's TokenProxy).
        for obj in model._default_manager.all()[:ADMIN_OBJECTS_PER_MODEL]:
            for page in ("change", "history", "delete"):
                urls.append(reverse(f"{base}_{page}", args=[obj.pk]))
    return [(url, MAY_REFUSE if url.endswith(("/add/", "/delete/")) else OK) for url in urls]


def _admin_session(base_url: str, username: str, password: str) -> httpx.Client:
    client = httpx.Client(base_url=base_url, timeout=30)
    form = client.get("/admin/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
    assert token, f"no login form: {form.status_code}"
    answer = client.post(
        "/admin/login/?next=/admin/",
        data={
            "csrfmiddlewaretoken": token.group(1),
            "username": username,
            "password": password,
            "next": "/admin/",
        },
    )
    assert answer.status_code == 302 and "sessionid" in client.cookies, "staff login failed"
    return client


def _api_urls(ids: dict[str, list[str]]) -> list[str]:
    """Every GET route, once per object of the kind it names (Alice's objects)."""
    urls = []
    for route in api_routes():
        if "GET" not in route.methods or "{format}" in route.template:
            continue
        named = [k for k in route.kwargs if k != "format"]
        if not named:
            urls.append(route.template)
            continue
        kind = "run" if named[0] == "run_id" else route.kind
        values = ids.get(kind or "", [])
        if route.name == "session-stream":
            # One stream is enough: each stays open for its whole timeout (1 s).
            values = [f"{value}?timeout=1" for value in values[:1]]
        for value in values:
            urls.append(route.template.format(**{named[0]: value}))
    return urls


def _scan_host(
    live_host: LiveHost,
    scanners: list[Scanner],
    ids: dict[str, list[str]],
    alice_token: str,
    staff_token: str,
    staff: Any,
    password: str,
) -> list[str]:
    """Scan, with each of ``scanners``, every API response (as Alice and as staff),
    admin page, host log line and database value; returns the admin pages that answered
    an unexpected status."""

    def scan(place: str, where: str, text: str) -> None:
        for scanner in scanners:
            scanner.scan(place, where, text)

    api_urls = _api_urls(ids)
    for who, token in (("alice", alice_token), ("staff", staff_token)):
        with live_host.client(token) as client:
            for url in api_urls:
                response = client.get(url)
                scan("api", f"{who} GET {url} ({response.status_code})", response.text)

    admin_failures = []
    admin = _admin_session(live_host.base_url, staff.username, password)
    try:
        for url, allowed in _admin_urls():
            response = admin.get(url)
            if response.status_code not in allowed:
                admin_failures.append(f"{url}: {response.status_code}")
            scan("admin", url, response.text)
    finally:
        admin.close()
    for name, text in live_host.logs().items():
        for number, line in enumerate(text.splitlines(), 1):
            scan("logs", f"{name}:{number}", line)
    for where, text in _database_cells():
        scan("database", where, text)
    return admin_failures


def _scanned(scanner: Scanner) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "api_responses": scanner.scanned.get("api", 0),
        "admin_pages": scanner.scanned.get("admin", 0),
        "log_lines": scanner.scanned.get("logs", 0),
        "db_cells": scanner.scanned.get("database", 0),
        "hits": {place: len(where) for place, where in scanner.hits.items()},
    }
    if scanner.hits:
        figures["first_hits"] = {place: where[:3] for place, where in scanner.hits.items()}
    return figures


# The MCP canary's runs: each its own agent and scripted model (step 1 calls the tools,
# step 2 answers), and the statuses it may end in.
LOOKUP = {"name": "mcp__crm__lookup", "arguments": {"key": "k"}}
MCP_CASES: dict[str, tuple[list[dict[str, Any]], frozenset[str]]] = {
    # An answer and an isError result (whose text the model sees: it does not echo).
    "tools": ([LOOKUP, {"name": "mcp__crm__fail", "arguments": {}}], frozenset({"completed"})),
    # 500 echoing the token. It may share a session with "expire", whose 401 tells the
    # session the token is refused: then this run asks to connect again too.
    "boom": (
        [{"name": "mcp__crm__boom", "arguments": {}}],
        frozenset({"completed", "failed", "suspended"}),
    ),
    # 401 echoing it, after the listing succeeded: the run asks to connect again.
    "expire": ([{"name": "mcp__crm__expire", "arguments": {}}, LOOKUP], frozenset({"suspended"})),
    # The initialise answered 500 echoing it.
    "broken": ([LOOKUP], frozenset({"failed"})),
}


def _mcp_manifest(name: str, server: EchoMcpServer) -> dict[str, Any]:
    agents = {
        case: {
            "model": f"{name}-{case}",
            "instructions": "Use the CRM.",
            "mcp_servers": [
                {
                    "name": "crm",
                    "url": server.broken_url if case == "broken" else server.url,
                    "timeout_seconds": 10,
                }
            ],
        }
        for case in MCP_CASES
    }
    return {"name": name, "version": "1.0.0", "entrypoint": "tools", "agents": agents}


@dataclass
class McpCanary:
    """The MCP half of the canary: Alice's connections, models, package and runs."""

    token: str
    scanner: Scanner
    connections: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    package: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)
    codes: dict[str, str] = field(default_factory=dict)
    received: list[str] = field(default_factory=list)
    echoed: int = 0


def _mcp_submit(api: httpx.Client, server: EchoMcpServer, canary: McpCanary) -> None:
    """Save the token as Alice's connections (as a user would), and start one run per
    `MCP_CASES` entry."""
    name = f"mcp-canary-{uuid.uuid4().hex[:6]}"
    for url in (server.url, server.broken_url):
        answer = api.post(
            "/api/v1/mcp-connections/", json={"server_url": url, "bearer_token": canary.token}
        )
        assert answer.status_code == 201, answer.text
        canary.connections.append(answer.json())
    for case, (calls, _ends) in MCP_CASES.items():
        record = api.post(
            "/api/v1/model-records/",
            json={
                "name": f"{name}-{case}",
                "protocol": "scripted",
                "model": f"{name}-{case}",
                "options": {"script": [{"text": "", "tool_calls": calls}, {"text": "ok"}]},
            },
        )
        assert record.status_code == 201, record.text
        canary.records.append(record.json())
    package = api.post("/api/v1/packages/", json={"manifest": _mcp_manifest(name, server)})
    assert package.status_code == 201, package.text
    canary.package = package.json()
    for case in MCP_CASES:
        session = api.post("/api/v1/sessions/", json={"package": name, "agent": case})
        assert session.status_code == 201, session.text
        run = api.post("/api/v1/runs/", json={"session": session.json()["id"], "input": case})
        assert run.status_code == 202, run.text
        canary.runs.append(run.json())


def _mcp_wait(
    live_host: LiveHost, api: httpx.Client, server: EchoMcpServer, canary: McpCanary
) -> None:
    for case, run in zip(MCP_CASES, canary.runs, strict=True):
        done = live_host.wait_run(api, run["id"], until=TERMINAL | {"suspended"})
        canary.statuses[case] = done["status"]
        found = done.get("error") or done.get("interaction") or {}
        canary.codes[case] = found.get("code") or ""
        if done["status"] == "suspended":
            api.post(f"/api/v1/runs/{run['id']}/cancel/")
    canary.received = list(server.authorizations)
    canary.echoed = server.echoed


def _mcp_manifest(name: str, server: EchoMcpServer) -> dict[str, Any]:
    agents = {
        case: {
            "model": f"{name}-{case}",
            "instructions": "Use the CRM.",
            "mcp_servers": [
                {
                    "name": "crm",
                    "url": server.broken_url if case == "broken" else server.url,
                    "timeout_seconds": 10,
                }
            ],
        }
        for case in MCP_CASES
    }
    return {"name": name, "version": "1.0.0", "entrypoint": "tools", "agents": agents}


def _canary(prefix: str) -> Scanner:
    random_part = uuid.uuid4().hex + uuid.uuid4().hex[:8]
    return Scanner(f"{prefix}-{random_part}", random_part)


def test_a_model_key_and_an_mcp_token_appear_nowhere_but_in_their_encrypted_columns(
    live_host: LiveHost, figures: dict[str, Any]
) -> None:
    """One search (the admin and API walk is the check's cost) for two secrets: the
    model key, and a bearer token saved as MCP connections to a server that echoes it in
    its 401 and 500 bodies and its failing initialise."""
    from agents.models import McpConnection
    from pooling.models import ModelRecord

    live_host.ensure_worker()
    scanner = _canary("canary")
    key = scanner.key
    mcp = McpCanary(token=(mcp_scanner := _canary("mcp-canary")).key, scanner=mcp_scanner)
    password = f"pw-{uuid.uuid4().hex}"
    _alice, alice_token = make_user("canary-alice")
    staff, staff_token = make_user("canary-staff", staff=True, password=password)
    statuses: dict[str, str] = {}
    runs: list[dict[str, Any]] = []
    with (
        EchoUpstream() as upstream,
        EchoMcpServer() as server,
        live_host.client(alice_token) as api,
    ):
        _mcp_submit(api, server, mcp)
        record = api.post(
            "/api/v1/model-records/",
            json={
                "name": "canary",
                "protocol": "openai",
                "model": "canary",
                "api_key": key,
                "base_url": upstream.openai_base_url,
                "options": {"timeout": 15},
            },
        )
        assert record.status_code == 201, record.text
        package = api.post(
            "/api/v1/packages/",
            json={"manifest": demo_manifest(name="canary", model="canary", tools=[])},
        )
        assert package.status_code == 201, package.text
        for case in ECHO_CASES:
            session = api.post(
                "/api/v1/sessions/", json={"package": "canary", "agent": "assistant"}
            )
            assert session.status_code == 201, session.text
            run = api.post(
                "/api/v1/runs/", json={"session": session.json()["id"], "input": f"canary:{case}"}
            )
            assert run.status_code == 202, run.text
            runs.append(run.json())
        for case, run in zip(ECHO_CASES, runs, strict=True):
            done = live_host.wait_run(api, run["id"], until=TERMINAL | {"suspended"})
            statuses[case] = done["status"]
            if done["status"] == "suspended":
                api.post(f"/api/v1/runs/{run['id']}/cancel/")  # one more API path
        _mcp_wait(live_host, api, server, mcp)
        requests = upstream.requests
    sent_key = sum(1 for r in requests if r.headers.get("authorization") == f"Bearer {key}")
    sent_token = sum(1 for auth in mcp.received if auth == f"Bearer {mcp.token}")

    all_runs = runs + mcp.runs
    ids = {
        "mcpconnection": [str(c["id"]) for c in mcp.connections],
        "modelrecord": [str(record.json()["id"])] + [str(r["id"]) for r in mcp.records],
        "package": [str(package.json()["id"]), str(mcp.package["id"])],
        "session": sorted({r["session"] for r in all_runs}),
        "run": [r["id"] for r in all_runs],
        "archive": [r["id"] for r in all_runs],
    }
    admin_failures = _scan_host(
        live_host, [scanner, mcp.scanner], ids, alice_token, staff_token, staff, password
    )

    stored = ModelRecord.objects.get(pk=record.json()["id"])
    connections = [McpConnection.objects.get(pk=c["id"]) for c in mcp.connections]
    control = Scanner(key, key.removeprefix("canary-"))
    for request in requests:
        control.scan("upstream", request.path, repr(request))
    figures.update(runs=statuses, key_sent=sent_key, **_scanned(scanner))
    figures["mcp"] = {
        "runs": mcp.statuses,
        "codes": mcp.codes,
        "token_sent": sent_token,
        "echoed": mcp.echoed,
        **_scanned(mcp.scanner),
    }

    # Controls: the leak was possible, and each place was really looked at.
    assert sent_key >= len(ECHO_CASES), "the upstream never received the key"
    assert control.hits.get("upstream"), "the scanner cannot find the key where it is"
    assert stored.api_key == key and key not in stored.encrypted_credentials
    assert sent_token >= len(MCP_CASES), "the MCP server never received the token"
    assert mcp.echoed >= 3, "the MCP server did not echo the token (401, 500, initialise)"
    assert all(c.secret == {"token": mcp.token} for c in connections)
    assert all(mcp.token not in c.encrypted_secret for c in connections)
    assert not admin_failures, f"admin pages that answered otherwise: {admin_failures}"
    assert all(scanner.scanned.get(p) for p in ("api", "admin", "logs", "database"))
    assert set(statuses.values()) <= TERMINAL | {"suspended"}
    for case, (_calls, ends) in MCP_CASES.items():
        assert mcp.statuses[case] in ends, f"{case}: {mcp.statuses[case]} {mcp.codes[case]}"
    assert mcp.codes["expire"] == "mcp.auth_required"
    assert mcp.codes["broken"].startswith("mcp.")
    assert not scanner.hits, f"the key leaked: {scanner.hits}"
    assert not mcp.scanner.hits, f"the MCP token leaked: {mcp.scanner.hits}"
