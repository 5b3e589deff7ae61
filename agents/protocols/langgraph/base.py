"""The door of the ``/lg/`` API: our token as ``X-Api-Key``, the read permission, CORS for
the origins the operator allows, JSON answers, and how a request's body and parameters
are read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.http import HttpResponse
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.views import APIView

from agents import services
from agents.protocols import common
from sageproject.authentication import TokenAuthentication

MAX_LIMIT = 1000
# Response headers a browser page on another origin may read (the SDK reads these).
EXPOSED_HEADERS = "Content-Location, Location, Retry-After, X-Pagination-Next"
ALLOWED_HEADERS = (
    "x-api-key, authorization, content-type, last-event-id, cache-control, "
    "x-auth-scheme, idempotency-key"
)


class ApiKeyAuthentication(TokenAuthentication):
    """The LangGraph SDK's ``X-Api-Key`` header, carrying one of our API tokens."""

    def authenticate(self, request: Request) -> Any:
        key = request.headers.get("X-Api-Key")
        if not key:
            return None
        return self.authenticate_credentials(key)


def _allowed_origin(request: Any) -> str | None:
    """The ``Access-Control-Allow-Origin`` for the request's ``Origin`` (an origin
    ``SAGE_LANGGRAPH_CORS_ORIGINS`` lists, or ``*`` when it says so); None otherwise."""
    origin = request.headers.get("Origin")
    allowed = settings.SAGE.get("SAGE_LANGGRAPH_CORS_ORIGINS") or ()
    if not origin:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin.rstrip("/") in allowed else None


class JSONAnswers(DefaultContentNegotiation):
    """Errors and JSON answers in JSON whatever ``Accept`` says (a stream request asks
    for ``text/event-stream``; its errors come as JSON, as LangGraph's do)."""

    def select_renderer(self, request: Request, renderers: list, format_suffix: Any = None):
        return renderers[0], renderers[0].media_type


class LangGraphView(APIView):
    """A ``/lg/`` endpoint: our token as ``X-Api-Key``, the read permission where the
    answer carries results, CORS for the origins the operator allows (preflights are
    answered before authentication: browsers send them without credentials). Not part of
    the REST API's OpenAPI schema."""

    authentication_classes = [ApiKeyAuthentication, TokenAuthentication]
    permission_classes = [IsAuthenticated]
    content_negotiation_class = JSONAnswers
    schema = None
    # Whether the answer carries what runs produced (``check_read_permission``).
    reads_results = True

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        if self.reads_results:
            services.check_read_permission(request.user)

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        origin = _allowed_origin(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            response = HttpResponse(status=204)
            if origin is not None:
                response["Access-Control-Allow-Methods"] = "GET, POST, PATCH, DELETE, OPTIONS"
                asked = request.headers.get("Access-Control-Request-Headers")
                response["Access-Control-Allow-Headers"] = asked or ALLOWED_HEADERS
                response["Access-Control-Max-Age"] = "600"
        else:
            response = super().dispatch(request, *args, **kwargs)
        if origin is not None:
            response["Access-Control-Allow-Origin"] = origin
            response["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        response["Vary"] = "Origin"
        return response


def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object (``{}`` when empty); a 400 for any other JSON."""
    data = request.data
    if not data:
        return {}
    if not isinstance(data, dict):
        raise common.invalid("body", "must be a JSON object")
    return data


def int_param(body: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    """``body[name]`` as an integer from ``lo`` to ``hi`` (digits in text too)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise common.invalid(name, f"must be an integer from {lo} to {hi}")
    return value


def flag(value: Any) -> bool:
    """A query parameter's truth (``1``, ``true``, ``yes``, ``on``)."""
    return str(value).lower() in ("1", "true", "yes", "on")
