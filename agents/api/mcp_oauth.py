"""``GET /mcp/oauth/callback``: where an MCP server's authorization server sends the
user's browser back after they approved (see `agents.services.mcp_oauth`).

The browser carries no API token, so the request is bound by its unguessable, single-use
``state`` (the user comes from the pending authorization it names). The answer is a
small page, or JSON for ``Accept: application/json``; errors are our envelope.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.html import escape
from django.views.decorators.http import require_GET

from agents.services.mcp_oauth import mcp_oauth_callback
from sageproject.errors import SageError

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>
<body><h1>{title}</h1><p>{text}</p></body></html>
"""


def _wants_json(request: HttpRequest) -> bool:
    return "application/json" in request.headers.get("Accept", "")


@require_GET
def oauth_callback(request: HttpRequest) -> HttpResponse:
    try:
        done = mcp_oauth_callback(
            code=request.GET.get("code", ""),
            state=request.GET.get("state", ""),
            error=request.GET.get("error", ""),
            user=request.user if request.user.is_authenticated else None,
        )
    except SageError as exc:
        if _wants_json(request):
            return JsonResponse(exc.to_dict(), status=exc.http_status)
        page = _PAGE.format(title="Not connected", text=escape(exc.message))
        return HttpResponse(page, status=exc.http_status)
    body = {"connected": True, "server_url": done["server_url"], "resumed": done["resumed"]}
    if _wants_json(request):
        return JsonResponse(body)
    text = f"{escape(done['server_url'])} is connected. You can close this tab."
    return HttpResponse(_PAGE.format(title="Connected", text=text))
