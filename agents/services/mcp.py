"""Users' connections to remote MCP servers: save, revoke, list, and the worker's read.

A connection is one user's credentials for one server URL (normalised, so two spellings
of a server are one connection). Saving replaces the live connection's secret; revoking
wipes it and keeps the row (who connected what, and when, stays visible to operators).
The secret never leaves this module except as the request headers the worker sends.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from agents.mcp.transport import normalize_server_url
from agents.models import McpConnection, McpConnectionKind
from sageproject.errors import NotFoundError, ValidationError

MAX_HEADERS = 20
MAX_SECRET_CHARS = 8192
# RFC 9110 token characters: what a header name may be.
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}$")
# Headers the MCP transport owns: a user's value would break or hijack the session.
_RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "accept",
        "connection",
        "transfer-encoding",
        "mcp-session-id",
        "mcp-protocol-version",
        "last-event-id",
    }
)
# ``last_used_at`` is written at most this often per connection: not one write per call.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def server_key(server_url: str) -> str:
    return hashlib.sha256(server_url.encode("utf-8")).hexdigest()


def _invalid(field: str, message: str) -> ValidationError:
    return ValidationError(
        "mcp.connection_invalid", message, details={"fields": {field: [message]}}
    )


def _check_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    if not headers or len(headers) > MAX_HEADERS:
        raise _invalid("headers", f"give 1 to {MAX_HEADERS} headers")
    out: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not _HEADER_NAME.match(name):
            raise _invalid("headers", f"not a header name: {str(name)[:100]!r}")
        if name.lower() in _RESERVED_HEADERS:
            raise _invalid("headers", f"{name} is set by the MCP transport itself")
        if not isinstance(value, str) or not value or any(c in value for c in "\r\n\x00"):
            # The value is a secret: never echoed back, not even in an error.
            raise _invalid("headers", f"the value of {name} must be one line of text")
        out[name] = value
    return out


def mcp_connection_save(
    *,
    user: Any,
    server_url: str,
    bearer_token: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> McpConnection:
    """Save ``user``'s credentials for ``server_url`` (exactly one of ``bearer_token`` and
    ``headers``) and return the live connection: the existing one updated, or a new one.

    Raises ``ValidationError`` ``mcp.invalid_url`` or ``mcp.connection_invalid``.
    """
    url = normalize_server_url(server_url)
    if (bearer_token is None) == (headers is None):
        raise _invalid("bearer_token", "give either bearer_token or headers")
    if bearer_token is not None:
        if (
            not bearer_token
            or len(bearer_token) > MAX_SECRET_CHARS
            or any(c in bearer_token for c in "\r\n\x00 ")
        ):
            raise _invalid("bearer_token", "the token must be one word of text")
        kind, secret = McpConnectionKind.BEARER, {"token": bearer_token}
    else:
        kind, secret = McpConnectionKind.HEADERS, {"headers": _check_headers(headers or {})}
    key = server_key(url)
    for _ in range(2):  # a concurrent first save of the same server: update theirs
        try:
            with transaction.atomic():
                row = (
                    McpConnection.objects.select_for_update()
                    .filter(owner=user, server_key=key, active=True)
                    .first()
                )
                if row is None:
                    row = McpConnection(owner=user, server_url=url, server_key=key)
                row.kind = kind
                row.secret = secret
                row.save()
                return row
        except IntegrityError:
            continue
    raise _invalid("server_url", "the connection changed while it was saved; try again")


def mcp_connection_revoke(
    *, user: Any, connection_id: int, operator: bool = False
) -> McpConnection:
    """Revoke a live connection of ``user`` (any user's when ``operator``): its secret is
    wiped and runs that need the server ask to connect again. Revoking a revoked one does
    nothing. Raises ``NotFoundError`` ``mcp.connection_not_found`` (also for another
    user's)."""
    rows = McpConnection.objects.all() if operator else McpConnection.objects.filter(owner=user)
    with transaction.atomic():
        row = rows.select_for_update().filter(pk=connection_id).first()
        if row is None:
            raise NotFoundError("mcp.connection_not_found", "no such MCP connection")
        if row.active:
            row.active = None
            row.revoked_at = timezone.now()
            row.secret = {}
            row.save(update_fields=["active", "revoked_at", "encrypted_secret", "updated_at"])
    return row


def mcp_connection_list(*, user: Any) -> Any:
    """``user``'s live connections, newest first (a queryset; no secrets in any field the
    API or admin shows)."""
    return McpConnection.objects.live().filter(owner=user)


def mcp_credentials_sync(owner_id: int, server_url: str) -> dict[str, str] | None:
    """The request headers of ``owner_id``'s live connection to ``server_url``, or None
    when the user has not connected it (the worker's read, in a thread). Notes the use."""
    url = normalize_server_url(server_url)
    row = McpConnection.objects.live().filter(owner_id=owner_id, server_key=server_key(url)).first()
    if row is None:
        return None
    now = timezone.now()
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
        McpConnection.objects.filter(pk=row.pk).update(last_used_at=now)
    return row.request_headers()
