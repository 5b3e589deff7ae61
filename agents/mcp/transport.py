"""Every HTTP client that talks to an MCP server is made here, and every server URL is
checked here first.

`check_server_url` is the syntax a manifest or a connection may hold. `http_client`
applies the operator's policy (`sageproject.outbound`, `SAGE_MCP_ALLOWED_HOSTS`): https,
or http to an allowed host; the resolved address checked at connect time; no redirects.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import urlsplit, urlunsplit

import httpx2

from sageproject import outbound
from sageproject.errors import ValidationError

_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_server_url(url: str) -> str:
    """One spelling per server: scheme and host lower-cased, the default port dropped, an
    empty path made "/". Connections are looked up by it, so "HTTPS://X:443" and
    "https://x/" are the same server. Raises ``ValidationError`` ``mcp.invalid_url``."""
    check_server_url(url)
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    netloc = host if port in (None, _DEFAULT_PORTS[scheme]) else f"{host}:{port}"
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))


def check_server_url(url: str) -> None:
    """Refuse what is not an http(s) URL with a host and without credentials or fragment.

    Raises ``ValidationError`` ``mcp.invalid_url``.
    """
    try:
        parts = urlsplit(url.strip()) if isinstance(url, str) else None
        ok = (
            parts is not None
            and parts.scheme.lower() in _DEFAULT_PORTS
            and bool(parts.hostname)
            and parts.username is None
            and parts.password is None
            and not parts.fragment
            and (parts.port or 0) >= 0
        )
    except ValueError:
        ok = False
    if not ok or len(url) > 2000:
        raise ValidationError(
            "mcp.invalid_url",
            "an MCP server URL must be http or https with a host, without credentials",
        )


ResponseHook = Callable[[httpx2.Response], Awaitable[None]]


def http_client(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    on_response: ResponseHook | None = None,
    policy: outbound.OutboundPolicy | None = None,
) -> httpx2.AsyncClient:
    """The HTTP client for one MCP session with ``url``: the guarded client of
    `sageproject.outbound` under ``policy`` (by default the MCP policy of the settings),
    no redirects followed (the SDK follows same-origin ones itself), the user's
    credential headers on every request. Raises ``outbound.url_refused`` for a URL the
    policy refuses; a refused address fails the connection with ``outbound.address_refused``."""
    check_server_url(url)
    if policy is None:
        policy = outbound.mcp_policy(read_timeout=max(timeout, 30.0))
    outbound.check_url(url, policy)
    client = outbound.async_client(policy, headers=headers)
    if on_response is not None:
        client.event_hooks = {**client.event_hooks, "response": [on_response]}
    return client
