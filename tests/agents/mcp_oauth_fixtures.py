"""An OAuth-protected MCP server on loopback, built with the official SDK's server auth.

`OAuthTestServer` is one uvicorn app (in a thread, on a free port) that is both the
authorization server (the SDK's ``create_auth_routes``: metadata, dynamic registration,
``/authorize``, ``/token``) and the protected resource (the SDK's bearer middleware, its
protected-resource metadata, and a ``whoami`` tool). Its `Provider` auto-approves: the
``/authorize`` redirect carries a code for whoever `Provider.subject` names. Every grant
is recorded, so tests can see a refresh happen; `expire`, `revoke` and `refuse_refresh`
play the authorization server's side of expiry and revocation.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    RefreshToken,
    construct_redirect_uri,
)
from mcp.server.auth.settings import AuthSettings, ClientRegistrationOptions
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken


class Provider:
    """An in-memory ``OAuthAuthorizationServerProvider`` that approves every request."""

    def __init__(self, *, ttl: int = 3600) -> None:
        self.ttl = ttl
        self.subject = "nobody"
        self.refuse_refresh = False
        self.clients: dict[str, OAuthClientInformationFull] = {}
        self.codes: dict[str, AuthorizationCode] = {}
        self.access: dict[str, AccessToken] = {}
        self.refresh: dict[str, RefreshToken] = {}
        # Grants the token endpoint answered: "authorization_code" or "refresh_token".
        self.grants: list[str] = []
        self.authorizations: list[AuthorizationParams] = []

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        return self.clients.get(client_id)

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        self.clients[client_info.client_id or ""] = client_info

    async def authorize(
        self, client: OAuthClientInformationFull, params: AuthorizationParams
    ) -> str:
        self.authorizations.append(params)
        code = secrets.token_urlsafe(24)
        self.codes[code] = AuthorizationCode(
            code=code,
            scopes=params.scopes or [],
            expires_at=time.time() + 300,
            client_id=client.client_id or "",
            code_challenge=params.code_challenge,
            redirect_uri=params.redirect_uri,
            redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly,
            resource=params.resource,
            subject=self.subject,
        )
        return construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state)

    async def load_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: str
    ) -> AuthorizationCode | None:
        return self.codes.get(authorization_code)

    def _issue(self, client_id: str, scopes: list[str], subject: str | None) -> OAuthToken:
        access, refresh = f"at-{secrets.token_urlsafe(16)}", f"rt-{secrets.token_urlsafe(16)}"
        self.access[access] = AccessToken(
            token=access,
            client_id=client_id,
            scopes=scopes,
            expires_at=int(time.time()) + self.ttl,
            subject=subject,
        )
        self.refresh[refresh] = RefreshToken(
            token=refresh, client_id=client_id, scopes=scopes, subject=subject
        )
        return OAuthToken(
            access_token=access,
            expires_in=self.ttl,
            refresh_token=refresh,
            scope=" ".join(scopes) or None,
        )

    async def exchange_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: AuthorizationCode
    ) -> OAuthToken:
        self.codes.pop(authorization_code.code, None)
        self.grants.append("authorization_code")
        return self._issue(
            client.client_id or "", authorization_code.scopes, authorization_code.subject
        )

    async def load_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: str
    ) -> RefreshToken | None:
        if self.refuse_refresh:
            return None
        return self.refresh.get(refresh_token)

    async def exchange_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: RefreshToken, scopes: list[str]
    ) -> OAuthToken:
        self.refresh.pop(refresh_token.token, None)  # rotated
        self.grants.append("refresh_token")
        return self._issue(client.client_id or "", refresh_token.scopes, refresh_token.subject)

    async def load_access_token(self, token: str) -> AccessToken | None:
        found = self.access.get(token)
        if found is None or (found.expires_at and found.expires_at < time.time()):
            return None
        return found

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        self.access.pop(token.token, None)
        self.refresh.pop(token.token, None)

    def expire(self) -> None:
        """Every access token issued so far expires now (refresh tokens still work)."""
        self.access.clear()

    def revoke(self) -> None:
        """Every token issued so far is revoked, and refreshes are refused."""
        self.access.clear()
        self.refresh.clear()
        self.refuse_refresh = True


@dataclass
class Call:
    tool: str
    subject: str | None
    token: str


class OAuthTestServer:
    def __init__(self, *, ttl: int = 3600, registration: bool = True) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        base = f"http://127.0.0.1:{self.port}"
        self.url = f"{base}/mcp"
        self.provider = Provider(ttl=ttl)
        self.calls: list[Call] = []
        server = MCPServer(
            "sage-oauth-test",
            auth_server_provider=self.provider,
            auth=AuthSettings(
                issuer_url=base,
                resource_server_url=self.url,
                client_registration_options=ClientRegistrationOptions(enabled=registration),
                validate_token_resource=False,
            ),
        )

        @server.tool()
        async def whoami(ctx: Context) -> str:
            """Who the bearer token belongs to."""
            token = dict(ctx.headers or {}).get("authorization", "").removeprefix("Bearer ")
            found = self.provider.access.get(token)
            subject = found.subject if found else None
            self.calls.append(Call("whoami", subject, token))
            return f"you are {subject}"

        app: Any = server.streamable_http_app()
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="mcp-oauth")

    def start(self) -> OAuthTestServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the OAuth MCP test server did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
