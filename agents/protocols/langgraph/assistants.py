"""Assistants: an agent or flow of a package version the user may use. Its ``graph_id``
is ``<package>/<agent>`` and its ``assistant_id`` a UUID derived from that; either, or
``<package>`` alone (the entrypoint), names it. Read-only: assistants are packages, so
one is published, never created here."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from agents.protocols import common
from agents.protocols.langgraph.base import MAX_LIMIT, LangGraphView, int_param, json_body
from sageproject.errors import NotFoundError

# Assistant ids are UUIDs of this namespace and the assistant's graph id.
NAMESPACE = uuid.UUID("8a1e6c2e-3f3b-5d2c-9a57-5a6e1b0f4c21")


def graph_id(assistant: common.Assistant) -> str:
    return f"{assistant.package.name}{common.SEPARATOR}{assistant.agent}"


def assistant_uuid(graph: str) -> str:
    return str(uuid.uuid5(NAMESPACE, graph))


def _visible(user) -> list[common.Assistant]:
    """The user's assistants, each once (under ``<package>/<agent>``)."""
    return [a for a in common.assistants(user) if common.SEPARATOR in a.id]


def resolve(user, value: Any) -> common.Assistant:
    """The assistant an ``assistant_id`` names: its UUID, ``<package>/<agent>``,
    ``<package>`` (the entrypoint), or an agent id only one of the user's packages has."""
    if not isinstance(value, str) or not value:
        raise common.invalid("assistant_id", "is required")
    try:
        uuid.UUID(value)
    except ValueError:
        pass
    else:
        for assistant in _visible(user):
            if assistant_uuid(graph_id(assistant)) == value.lower():
                return assistant
        raise NotFoundError("assistant.not_found", f"no assistant {value!r}")
    try:
        found = common.assistant_resolve(user, value)
    except NotFoundError:
        named = [a for a in _visible(user) if a.agent == value]
        if len(named) != 1:
            raise
        found = named[0]
    return common.Assistant(graph_id(found), found.package, found.agent)


def assistant_json(assistant: common.Assistant) -> dict[str, Any]:
    package = assistant.package
    graph = graph_id(assistant)
    return {
        "assistant_id": assistant_uuid(graph),
        "graph_id": graph,
        "name": graph,
        "description": f"{'flow' if assistant.flow else 'agent'} {assistant.agent} of "
        f"{package.name} {package.version}",
        "config": {},
        "context": {},
        "metadata": {
            "package": package.name,
            "version": package.version,
            "ref": package.ref,
            "agent": assistant.agent,
            "kind": "flow" if assistant.flow else "agent",
        },
        "version": 1,
        "created_at": package.created_at.isoformat(),
        "updated_at": package.created_at.isoformat(),
    }


def _graph(assistant: common.Assistant) -> dict[str, Any]:
    """The assistant as a graph: an agent is ``model`` ⇄ ``tools``; a flow, its nodes."""
    manifest = assistant.package.manifest
    nodes = [{"id": "__start__", "type": "schema", "data": "__start__"}]
    edges: list[dict[str, Any]] = []
    if assistant.flow:
        flow = (manifest.get("flows") or {})[assistant.agent]
        for node_id, node in (flow.get("nodes") or {}).items():
            nodes.append({"id": node_id, "type": "runnable", "data": {"name": node_id, **node}})
            if node.get("type") == "end":
                edges.append({"source": node_id, "target": "__end__", "conditional": False})
        edges.append({"source": "__start__", "target": flow.get("start"), "conditional": False})
        for edge in flow.get("edges") or ():
            conditional = bool(edge.get("when"))
            edges.append({"source": edge["from"], "target": edge["to"], "conditional": conditional})
    else:
        agent = (manifest.get("agents") or {}).get(assistant.agent) or {}
        nodes.append({"id": "model", "type": "runnable", "data": {"name": "model"}})
        edges.append({"source": "__start__", "target": "model", "conditional": False})
        edges.append({"source": "model", "target": "__end__", "conditional": True})
        if agent.get("tools"):
            nodes.append({"id": "tools", "type": "runnable", "data": {"name": "tools"}})
            edges.append({"source": "model", "target": "tools", "conditional": True})
            edges.append({"source": "tools", "target": "model", "conditional": False})
    nodes.append({"id": "__end__", "type": "schema", "data": "__end__"})
    return {"nodes": nodes, "edges": edges}


MESSAGES_SCHEMA = {
    "type": "object",
    "properties": {
        "messages": {
            "type": "array",
            "items": {"type": "object"},
            "description": "LangChain messages (human / ai / tool).",
        }
    },
    "required": ["messages"],
}


def _schemas(assistant: common.Assistant) -> dict[str, Any]:
    return {
        "graph_id": graph_id(assistant),
        "input_schema": {**MESSAGES_SCHEMA, "title": "Input"},
        "output_schema": {**MESSAGES_SCHEMA, "title": "Output"},
        "state_schema": {**MESSAGES_SCHEMA, "title": "State"},
        "config_schema": {"type": "object", "properties": {}, "title": "Config"},
        "context_schema": None,
    }


def _search_assistants(user, body: Mapping[str, Any]) -> list[common.Assistant]:
    found = _visible(user)
    if body.get("graph_id"):
        found = [a for a in found if graph_id(a) == body["graph_id"]]
    if body.get("name"):
        found = [a for a in found if str(body["name"]).lower() in graph_id(a).lower()]
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise common.invalid("metadata", "must be an object")
    if metadata:
        found = [
            a
            for a in found
            if all(assistant_json(a)["metadata"].get(k) == v for k, v in metadata.items())
        ]
    return found


class Info(LangGraphView):
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []
    reads_results = False

    def get(self, request: Request) -> Response:
        return Response(
            {
                "version": "sage-host",
                "flags": {"assistants": True, "crons": False, "langsmith": False},
                "host": {"kind": "sage-host", "project_id": None, "revision_id": None},
            }
        )


class Ok(Info):
    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class AssistantSearch(LangGraphView):
    reads_results = False

    def post(self, request: Request) -> Response:
        body = json_body(request)
        found = _search_assistants(request.user, body)
        offset = int_param(body, "offset", 0, 0, 10**9)
        limit = int_param(body, "limit", 10, 1, MAX_LIMIT)
        page = [assistant_json(a) for a in found[offset : offset + limit]]
        sort_by = body.get("sort_by")
        if sort_by in ("assistant_id", "graph_id", "name", "created_at", "updated_at"):
            page.sort(key=lambda a: a[sort_by], reverse=body.get("sort_order") == "desc")
        response = Response(page)
        if offset + limit < len(found):
            response["X-Pagination-Next"] = str(offset + limit)
        return response


class AssistantCount(LangGraphView):
    reads_results = False

    def post(self, request: Request) -> Response:
        return Response(len(_search_assistants(request.user, json_body(request))))


class AssistantDetail(LangGraphView):
    reads_results = False

    def get(self, request: Request, assistant_id: str, part: str = "") -> Response:
        assistant = resolve(request.user, assistant_id)
        if part == "graph":
            return Response(_graph(assistant))
        if part == "schemas":
            return Response(_schemas(assistant))
        if part == "subgraphs":
            return Response({})
        return Response(assistant_json(assistant))
