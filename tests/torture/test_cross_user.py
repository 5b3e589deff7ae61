"""The cross-user matrix: every API route, every method it allows, as another user.

The routes come from the URL configuration (every pattern under ``/api/v1/``, format
suffixes included), the methods from each view (a viewset's actions, an ``APIView``'s
handlers), so a new route is tested the day it is added — and a route whose object this
check cannot name fails it (``unmapped``) until it is taught here. Alice owns one of
everything (a model record, a package, a session, a finished run and its archive; staff
made a reclamation request); Bob, a normal user, then asks for each of them:

- a route naming Alice's object answers Bob 404 with the error envelope, for every method,
  exactly as it answers for an id that does not exist (OPTIONS included: no existence
  oracle);
- staff-only routes (``IsAdminUser``) answer Bob 403; without credentials, every route 401;
- Bob's lists hold nothing of Alice's; submitting a run into her session or opening a
  session on her package answers 404;
- nothing Bob sent changed anything of Alice's (rows compared before and after);
- no response to Bob or to nobody holds anything of Alice's (ids, names, ref, input text).

Controls, so the matrix cannot pass by testing the wrong ids: Alice (and staff) get 200
for the same URLs Bob is refused.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from tests.conftest import demo_manifest
from tests.torture.host import LiveHost, make_user

CHECK = "cross-user"
pytestmark = [pytest.mark.torture, pytest.mark.django_db(transaction=True)]

API_PREFIX = "api/v1/"
# Bodies a write sends, by the viewset action (valid, so a 400 cannot hide a lookup).
ACTION_BODIES: dict[str, Any] = {
    "update": {"name": "taken", "protocol": "scripted", "model": "scripted", "options": {}},
    "partial_update": {"name": "taken"},
    "activate": {"expected_ref": None},
    "fork": {"version": "9.9.9"},
    "validate": {},
    "cancel": {},
    "reply": {"decision": "retry"},
}
_REGEX_GROUP = re.compile(r"\(\?P<(\w+)>[^)]*\)")
_ROUTE_PARAM = re.compile(r"<(?:(\w+):)?(\w+)>")


@dataclass(frozen=True, slots=True)
class Route:
    template: str  # "/api/v1/runs/{pk}/cancel/"
    name: str  # URL name, or the view class for unnamed patterns
    kind: str | None  # "run", "session", ...: the basename of a viewset
    kwargs: tuple[str, ...]
    methods: dict[str, str]  # method -> action
    staff_only: bool


def _walk(patterns: list[Any], prefix: str = "") -> Iterator[tuple[str, URLPattern]]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern


def _template(raw: str) -> str:
    text = raw.replace("^", "").replace("$", "").replace("/?", "")
    text = _REGEX_GROUP.sub(lambda m: "{" + m.group(1) + "}", text)
    text = _ROUTE_PARAM.sub(lambda m: "{" + m.group(2) + "}", text).replace("\\.", ".")
    return "/" + text


def api_routes() -> list[Route]:
    """Every URL pattern under /api/v1/ with the methods its view allows."""
    from rest_framework.permissions import IsAdminUser

    routes = []
    for raw, pattern in _walk(get_resolver().url_patterns):
        if not raw.startswith(API_PREFIX):
            continue
        callback = pattern.callback
        cls = getattr(callback, "cls", None)
        actions = getattr(callback, "actions", None)
        if actions:
            methods = {m.upper(): a for m, a in actions.items()}
        else:
            handlers = [m for m in getattr(cls, "http_method_names", ()) if hasattr(cls, m)]
            methods = {m.upper(): m for m in handlers if m not in ("options", "head")}
        template = _template(raw)
        routes.append(
            Route(
                template=template,
                name=pattern.name or getattr(cls, "__name__", "?"),
                kind=(getattr(callback, "initkwargs", None) or {}).get("basename"),
                kwargs=tuple(re.findall(r"\{(\w+)\}", template)),
                methods=methods,
                staff_only=any(
                    isinstance(p, type) and issubclass(p, IsAdminUser)
                    for p in getattr(cls, "permission_classes", ())
                ),
            )
        )
    return routes


# Routes of each resource that names another user's object: the matrix must reach them
# all (a route walk that finds nothing would pass every check it no longer makes).
KNOWN_ROUTES = {
    "/api/v1/model-records/{pk}/",
    "/api/v1/packages/{pk}/",
    "/api/v1/sessions/{pk}/",
    "/api/v1/sessions/{pk}/events/",
    "/api/v1/runs/{pk}/",
    "/api/v1/runs/{pk}/cancel/",
    "/api/v1/runs/{pk}/reply/",
    "/api/v1/runs/{run_id}/jobs/",
    "/api/v1/archives/{run_id}/",
    "/api/v1/reclamations/{pk}/",
    "/api/v1/mcp-connections/{pk}/",
}


def test_the_route_list_holds_every_known_route() -> None:
    templates = {route.template for route in api_routes()}
    assert templates and KNOWN_ROUTES <= templates, KNOWN_ROUTES - templates


@dataclass
class World:
    ids: dict[str, str]  # object kind -> Alice's (or staff's) object id
    markers: list[str]  # strings only Alice's data contains
    package_ref: str
    session: str


def _alice_world(host: LiveHost, alice_token: str, staff_token: str, username: str) -> World:
    tag = uuid.uuid4().hex[:10]
    record_name = f"alice-model-{tag}"
    package_name = f"alice-pkg-{tag}"
    said = f"alice-says-{tag}"
    with host.client(alice_token) as api:
        record = api.post(
            "/api/v1/model-records/",
            json={"name": record_name, "protocol": "scripted", "model": "scripted"},
        )
        assert record.status_code == 201, record.text
        manifest = demo_manifest(name=package_name, model=record_name, tools=[])
        package = api.post("/api/v1/packages/", json={"manifest": manifest})
        assert package.status_code == 201, package.text
        session = api.post(
            "/api/v1/sessions/", json={"package": package_name, "agent": "assistant"}
        )
        assert session.status_code == 201, session.text
        run = api.post("/api/v1/runs/", json={"session": session.json()["id"], "input": said})
        assert run.status_code == 202, run.text
        finished = host.wait_run(api, run.json()["id"])
        assert finished["status"] == "completed", finished
        connection = api.post(
            "/api/v1/mcp-connections/",
            json={"server_url": f"https://mcp-{tag}.example.com/mcp", "bearer_token": tag},
        )
        assert connection.status_code == 201, connection.text
    with host.client(staff_token) as api:
        reclamation = api.post("/api/v1/reclamations/", json={"min_idle_seconds": 86400})
        assert reclamation.status_code == 202, reclamation.text
    ref = package.json()["ref"]
    return World(
        ids={
            "modelrecord": str(record.json()["id"]),
            "package": str(package.json()["id"]),
            "session": session.json()["id"],
            "run": run.json()["id"],
            "archive": run.json()["id"],
            "reclamation": str(reclamation.json()["id"]),
            "mcpconnection": str(connection.json()["id"]),
        },
        markers=[
            username,
            record_name,
            package_name,
            ref,
            session.json()["id"],
            run.json()["id"],
            said,
        ],
        package_ref=ref,
        session=session.json()["id"],
    )


def _url(route: Route, world: World, *, missing: bool = False) -> str | None:
    """The route's URL naming Alice's object (or one that does not exist); None when the
    route names an object this check does not know."""
    values = {}
    for name in route.kwargs:
        if name == "format":
            values[name] = "json" if ".{format}" in route.template else ".json"
            continue
        kind = "run" if name == "run_id" else route.kind
        if kind not in world.ids:
            return None
        if missing:
            real = world.ids[kind]
            values[name] = str(uuid.uuid4()) if "-" in real else str(10**9 + 7)
        else:
            values[name] = world.ids[kind]
    url = route.template.format(**values)
    return url + ("?timeout=1" if route.name.startswith("session-stream") else "")


def _body(route: Route, method: str, world: World) -> Any:
    action = route.methods.get(method, "")
    if action == "create":
        # Creations that name another user's object; other creations name none.
        return {
            "run": {"session": world.session, "input": "taken"},
            "session": {"package": world.package_ref, "agent": "assistant"},
        }.get(route.kind or "")
    if action == "activate":
        return {"expected_ref": world.package_ref}
    return ACTION_BODIES.get(action)


def _code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _snapshot(alice: Any) -> dict[str, Any]:
    from agents.models import AgentPackage, ManagedAgentRecord, McpConnection, ReclamationRequest
    from pooling.models import ModelRecord
    from scheduling.models import Event, Run, Session

    def rows(model: Any, **filters: Any) -> list[tuple]:
        return sorted(map(repr, model.objects.filter(**filters).values_list()))

    return {
        "records": rows(ModelRecord, owner=alice),
        "packages": rows(AgentPackage, owner=alice),
        "sessions": rows(Session, owner=alice),
        "runs": rows(Run, owner=alice),
        "events": rows(Event, session__owner=alice),
        "archives": rows(ManagedAgentRecord, owner=alice),
        "mcp_connections": rows(McpConnection, owner=alice),
        # Ids only: the worker answers a reclamation request (its status moves) meanwhile.
        "reclamations": sorted(ReclamationRequest.objects.values_list("id", flat=True)),
    }


def test_another_users_objects_are_not_found_on_every_route(
    live_host: LiveHost, figures: dict[str, Any]
) -> None:
    live_host.ensure_worker()
    alice, alice_token = make_user("xu-alice")
    _bob, bob_token = make_user("xu-bob")
    _staff, staff_token = make_user("xu-staff", staff=True)
    world = _alice_world(live_host, alice_token, staff_token, alice.username)
    before = _snapshot(alice)
    routes = api_routes()
    assert KNOWN_ROUTES <= {route.template for route in routes}, "the route walk lost routes"
    failures: list[str] = []
    unmapped: list[str] = []
    requests = 0

    def expect(who: str, method: str, url: str, response: httpx.Response, want: int) -> None:
        if response.status_code != want:
            failures.append(f"{who} {method} {url}: {response.status_code}, want {want}")
        elif want >= 400 and method != "HEAD" and _code(response) is None:
            # (A HEAD answer carries no body: its status is the whole answer.)
            failures.append(f"{who} {method} {url}: {want} without the error envelope")

    def leaked(who: str, method: str, url: str, response: httpx.Response) -> None:
        # What the request itself named (Bob may quote an id back to him) is no leak.
        sent = url + (response.request.content or b"").decode(errors="replace")
        found = [m for m in world.markers if m in response.text and m not in sent]
        if found:
            failures.append(f"{who} {method} {url}: Alice's data in the response {found}")

    with (
        live_host.client(bob_token) as bob,
        live_host.client() as nobody,
        live_host.client(alice_token) as owner,
        live_host.client(staff_token) as staff,
    ):
        for route in routes:
            url = _url(route, world)
            if url is None:
                unmapped.append(route.template)
                continue
            missing = _url(route, world, missing=True)
            names_object = any(k != "format" for k in route.kwargs)
            for method in route.methods:
                body = _body(route, method, world)
                if route.methods[method] == "create" and body is None and not route.staff_only:
                    continue  # a creation naming nothing of anyone's: not a cross-user case
                kwargs = {"json": body} if body is not None else {}
                answer = bob.request(method, url, **kwargs)
                anonymous = nobody.request(method, url, **kwargs)
                requests += 2
                leaked("bob", method, url, answer)
                leaked("anonymous", method, url, anonymous)
                expect("anonymous", method, url, anonymous, 401)
                if route.staff_only:
                    expect("bob", method, url, answer, 403)
                elif names_object or route.methods[method] == "create":
                    expect("bob", method, url, answer, 404)
                    if names_object:
                        other = bob.request(method, missing, **kwargs)
                        requests += 1
                        if (other.status_code, _code(other)) != (
                            answer.status_code,
                            _code(answer),
                        ):
                            failures.append(
                                f"bob {method} {url}: {answer.status_code} {_code(answer)} "
                                f"but {other.status_code} {_code(other)} for a missing id"
                            )
                else:
                    expect("bob", method, url, answer, 200)
            if names_object and not route.staff_only:
                # OPTIONS must not tell Alice's object from one that does not exist.
                mine, none = bob.options(url), bob.options(missing)
                requests += 2
                leaked("bob", "OPTIONS", url, mine)
                if (mine.status_code, mine.text) != (
                    none.status_code,
                    none.text.replace(missing.split("?")[0], url.split("?")[0]),
                ):
                    failures.append(f"bob OPTIONS {url}: differs from a missing id's answer")
            if "GET" in route.methods and names_object:
                control = staff if route.staff_only else owner
                response = control.get(url)
                requests += 1
                if response.status_code != 200:
                    failures.append(
                        f"control: {'staff' if route.staff_only else 'alice'} GET {url}: "
                        f"{response.status_code} (the matrix would test a wrong id)"
                    )
    after = _snapshot(alice)
    changed = [name for name in before if before[name] != after[name]]
    figures.update(
        routes=len(routes),
        requests=requests,
        unmapped=len(unmapped),
        failures=len(failures),
        altered=changed,
    )
    if failures:
        figures["first_failures"] = failures[:4]
    assert not unmapped, f"routes naming objects this check cannot name: {unmapped}"
    assert not changed, f"Bob's requests changed Alice's {changed}"
    assert not failures, "\n".join(failures)
