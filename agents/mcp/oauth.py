"""OAuth 2.1 with PKCE for remote MCP servers, split for a host (Django-free).

The SDK's ``OAuthClientProvider`` runs the whole flow inline and awaits a browser
callback; a worker cannot wait on a person. So the flow is cut in two halves, each made
of the SDK's own public pieces (``mcp.client.auth``):

- `discover` (RFC 9728 protected-resource metadata, then RFC 8414 authorization-server
  metadata), `register` (RFC 7591 dynamic client registration) and `authorization` (a
  PKCE pair, a random state, the authorization URL) run in the worker when a run needs a
  server the user has not connected; the run suspends with the URL;
- `exchange` (the code and the verifier for tokens) runs in the web callback; `refresh`
  runs in the worker when the access token expired or was refused.

Every request goes through `agents.mcp.transport.http_client` (the outbound policy's one
place). Errors are `OAuthError` with a short reason; a server's body never appears in
one (it may echo a secret): the caller logs it redacted.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx2
from mcp.client.auth import OAuthFlowError, PKCEParameters
from mcp.client.auth.oauth2 import OAuthContext, check_registration_usable
from mcp.client.auth.utils import (
    build_oauth_authorization_server_metadata_discovery_urls,
    build_protected_resource_metadata_discovery_urls,
    create_client_registration_request,
    create_oauth_metadata_request,
    extract_resource_metadata_from_www_auth,
    get_client_metadata_scopes,
    handle_auth_metadata_response,
    handle_protected_resource_response,
    handle_registration_response,
    handle_token_response_scopes,
    validate_metadata_issuer,
)
from mcp.shared.auth import (
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthMetadata,
    OAuthToken,
    ProtectedResourceMetadata,
)
from mcp.shared.auth_utils import (
    calculate_token_expiry,
    check_resource_allowed,
    resource_url_from_server_url,
)

from agents.mcp.transport import http_client

# How long a user has to approve in the browser before the pending authorization expires.
PENDING_SECONDS = 600
# An access token this close to its expiry is refreshed before use (seconds).
EXPIRY_MARGIN = 30.0
HTTP_TIMEOUT = 15.0

__all__ = [
    "OAuthError",
    "Server",
    "authorization",
    "discover",
    "exchange",
    "refresh",
    "register",
]


class OAuthError(Exception):
    """A step of the OAuth flow failed (``reason``: a short text without secrets);
    ``status`` and ``body`` are the server's answer, for a redacted log line only."""

    def __init__(self, reason: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True, kw_only=True)
class Server:
    """What discovery found for one MCP server: its resource metadata (when it publishes
    it) and its authorization server's metadata. Serialisable (`to_json`/`from_json`) so
    the callback can finish what the worker began."""

    server_url: str
    issuer: str
    metadata: OAuthMetadata
    resource: ProtectedResourceMetadata | None = None
    scope: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "server_url": self.server_url,
            "issuer": self.issuer,
            "metadata": self.metadata.model_dump(mode="json", exclude_none=True),
            "resource": self.resource.model_dump(mode="json", exclude_none=True)
            if self.resource
            else None,
            "scope": self.scope,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Server:
        resource = data.get("resource")
        return cls(
            server_url=data["server_url"],
            issuer=data["issuer"],
            metadata=OAuthMetadata.model_validate(data["metadata"]),
            resource=ProtectedResourceMetadata.model_validate(resource) if resource else None,
            scope=data.get("scope"),
        )


def client_metadata(redirect_uri: str, *, scope: str | None = None) -> OAuthClientMetadata:
    """Our client's registration: a public client (PKCE, no secret) with one redirect."""
    return OAuthClientMetadata(
        client_name="Sage Host",
        redirect_uris=[redirect_uri],  # type: ignore[list-item]
        grant_types=["authorization_code", "refresh_token"],
        response_types=["code"],
        token_endpoint_auth_method="none",
        scope=scope,
    )


def _context(server: Server, client: OAuthClientInformationFull, redirect_uri: str) -> Any:
    """The SDK's flow context, filled with what we discovered: its public helpers pick
    the RFC 8707 ``resource`` and the client's token-endpoint authentication."""
    context = OAuthContext(
        server_url=server.server_url,
        client_metadata=client_metadata(redirect_uri, scope=server.scope),
        storage=None,  # type: ignore[arg-type]  (never read: no provider drives it)
        redirect_handler=None,
        callback_handler=None,
    )
    context.protected_resource_metadata = server.resource
    context.oauth_metadata = server.metadata
    context.auth_server_url = server.issuer
    context.client_info = client
    return context


async def _send(client: httpx2.AsyncClient, request: httpx2.Request) -> httpx2.Response:
    try:
        return await client.send(request)
    except httpx2.HTTPError as exc:
        raise OAuthError(
            f"{request.url.host} could not be reached ({type(exc).__name__})"
        ) from None


async def _challenge(client: httpx2.AsyncClient, server_url: str) -> str | None:
    """Where an unauthenticated request's 401 says the resource metadata is (RFC 9728
    ``WWW-Authenticate: Bearer resource_metadata=...``), if it says."""
    probe = httpx2.Request("GET", server_url, headers={"Accept": "text/event-stream"})
    response = await _send(client, probe)
    await response.aclose()
    if response.status_code != 401:
        return None
    return extract_resource_metadata_from_www_auth(response)


async def discover(server_url: str) -> Server | None:
    """The OAuth metadata of ``server_url``, or None when it publishes none (it takes
    static credentials): the resource metadata its 401 names, else the well-known URLs,
    then its authorization server's metadata. Raises `OAuthError` when the metadata is
    there but unusable."""
    async with http_client(server_url, timeout=HTTP_TIMEOUT) as client:
        hinted = await _challenge(client, server_url)
        resource = None
        for url in build_protected_resource_metadata_discovery_urls(hinted, server_url):
            resource = await handle_protected_resource_response(
                await _send(client, create_oauth_metadata_request(url))
            )
            if resource is not None:
                break
        if resource is None:
            return None
        # RFC 8707 / the SDK's rule: the metadata must describe this server (or a parent).
        expected = resource_url_from_server_url(server_url)
        if not check_resource_allowed(
            requested_resource=expected, configured_resource=str(resource.resource)
        ):
            raise OAuthError("the protected-resource metadata describes another server")
        issuer = str(resource.authorization_servers[0])
        metadata = None
        for url in build_oauth_authorization_server_metadata_discovery_urls(issuer, server_url):
            ok, metadata = await handle_auth_metadata_response(
                await _send(client, create_oauth_metadata_request(url))
            )
            if not ok or metadata is not None:
                break
        if metadata is None:
            raise OAuthError("the authorization server publishes no metadata")
        try:
            validate_metadata_issuer(metadata, issuer)
        except OAuthFlowError:
            # A root issuer may be written with or without its trailing slash.
            if str(metadata.issuer).rstrip("/") != issuer.rstrip("/"):
                raise OAuthError(
                    "the authorization server's metadata names another issuer"
                ) from None
    scope = get_client_metadata_scopes(
        None, resource, metadata, ["authorization_code", "refresh_token"]
    )
    return Server(
        server_url=server_url, issuer=issuer, metadata=metadata, resource=resource, scope=scope
    )


async def register(server: Server, redirect_uri: str) -> OAuthClientInformationFull:
    """Register our client with ``server``'s authorization server (when it offers
    dynamic registration). Raises `OAuthError`."""
    if server.metadata.registration_endpoint is None:
        raise OAuthError("the authorization server offers no dynamic client registration")
    request = create_client_registration_request(
        server.metadata, client_metadata(redirect_uri, scope=server.scope), server.issuer
    )
    async with http_client(server.server_url, timeout=HTTP_TIMEOUT) as client:
        response = await _send(client, request)
        try:
            info = await handle_registration_response(response)
            check_registration_usable(info)
        except Exception as exc:
            raise OAuthError(
                "client registration failed", status=response.status_code, body=str(exc)
            ) from None
    info.issuer = server.issuer
    return info


@dataclass(frozen=True, slots=True, kw_only=True)
class Authorization:
    """A started authorization: the URL the user opens, and what the callback needs."""

    url: str
    state: str
    verifier: str


def authorization(
    server: Server, client: OAuthClientInformationFull, redirect_uri: str
) -> Authorization:
    """A PKCE pair (the SDK's `PKCEParameters`), a random state and the authorization
    URL, with the parameters the SDK's provider sends."""
    context = _context(server, client, redirect_uri)
    pkce = PKCEParameters.generate()
    state = secrets.token_urlsafe(32)
    params = {
        "response_type": "code",
        "client_id": client.client_id,
        "redirect_uri": redirect_uri,
        "state": state,
        "code_challenge": pkce.code_challenge,
        "code_challenge_method": "S256",
    }
    if context.should_include_resource_param():
        params["resource"] = context.get_resource_url()
    if server.scope:
        params["scope"] = server.scope
    endpoint = str(server.metadata.authorization_endpoint)
    joiner = "&" if "?" in endpoint else "?"
    return Authorization(
        url=f"{endpoint}{joiner}{urlencode(params)}", state=state, verifier=pkce.code_verifier
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Tokens:
    """Tokens as stored: ``expires_at`` is a Unix time (None: no expiry given)."""

    access_token: str
    refresh_token: str | None
    expires_at: float | None
    scope: str | None

    @classmethod
    def of(cls, token: OAuthToken, *, prior: Tokens | None = None) -> Tokens:
        # RFC 6749 §6: a refresh may omit the refresh token (not rotated) and the scope.
        return cls(
            access_token=token.access_token,
            refresh_token=token.refresh_token or (prior.refresh_token if prior else None),
            expires_at=calculate_token_expiry(token.expires_in),
            scope=token.scope or (prior.scope if prior else None),
        )

    def expired(self, *, margin: float = EXPIRY_MARGIN) -> bool:
        return self.expires_at is not None and time.time() >= self.expires_at - margin


async def _token_request(
    server: Server,
    client: OAuthClientInformationFull,
    redirect_uri: str,
    data: dict[str, str],
) -> OAuthToken:
    context = _context(server, client, redirect_uri)
    data["client_id"] = client.client_id
    if context.should_include_resource_param():
        data["resource"] = context.get_resource_url()  # RFC 8707
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    data, headers = context.prepare_token_auth(data, headers)
    request = httpx2.Request(
        "POST", str(server.metadata.token_endpoint), data=data, headers=headers
    )
    async with http_client(server.server_url, timeout=HTTP_TIMEOUT) as http:
        response = await _send(http, request)
        if response.status_code not in (200, 201):
            body = (await response.aread())[:2048].decode("utf-8", "replace")
            raise OAuthError(
                f"the token endpoint answered {response.status_code}",
                status=response.status_code,
                body=body,
            )
        try:
            return await handle_token_response_scopes(response)
        except Exception:
            raise OAuthError("the token endpoint's answer is not a token") from None


async def exchange(
    server: Server,
    client: OAuthClientInformationFull,
    redirect_uri: str,
    *,
    code: str,
    verifier: str,
) -> Tokens:
    """The authorization code and its PKCE verifier for tokens. Raises `OAuthError`."""
    token = await _token_request(
        server,
        client,
        redirect_uri,
        {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": redirect_uri,
            "code_verifier": verifier,
        },
    )
    return Tokens.of(token)


async def refresh(
    server: Server, client: OAuthClientInformationFull, redirect_uri: str, tokens: Tokens
) -> Tokens:
    """New tokens for ``tokens``' refresh token. Raises `OAuthError` (refused: the user
    must authorize again)."""
    if not tokens.refresh_token:
        raise OAuthError("no refresh token")
    token = await _token_request(
        server,
        client,
        redirect_uri,
        {"grant_type": "refresh_token", "refresh_token": tokens.refresh_token},
    )
    return Tokens.of(token, prior=tokens)
