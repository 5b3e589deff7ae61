"""OAuth connections to remote MCP servers: the worker's half and the callback's half.

The worker (`mcp_oauth_begin`) discovers the server's authorization server, registers
our client there once (shared by every user, `McpOAuthClient`), and stores a pending
authorization (`McpOAuthPending`: user, run, encrypted PKCE verifier, the state's digest,
ten minutes); the run suspends with the authorization URL. The browser comes back to
``/mcp/oauth/callback`` (`mcp_oauth_callback`): the state finds the row (single use),
the code is exchanged, the tokens are saved as the user's ``oauth`` connection and the
run is resumed with ``retry``. The worker's credential read (`mcp_oauth_credentials`)
refreshes an expired access token first, one refresh per (user, server) at a time; a
refused refresh revokes the connection, so the run asks the user again.

Tokens are encrypted with the connection's secret; none is ever returned or logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from mcp.shared.auth import OAuthClientInformationFull

from agents.mcp import oauth
from agents.mcp.transport import normalize_server_url
from agents.models import McpConnection, McpConnectionKind, McpOAuthClient, McpOAuthPending
from agents.services.mcp import mcp_credentials_sync, server_key
from pooling.providers.errors import redact
from sageproject.db import db_call
from sageproject.errors import ConflictError, UpstreamError, ValidationError
from scheduling.models import Run, RunStatus

logger = logging.getLogger("sage.mcp")

DEFAULT_REDIRECT_URL = "http://localhost:8000/mcp/oauth/callback"


def redirect_uri() -> str:
    """Where authorization servers send the browser back (``SAGE_MCP_OAUTH_REDIRECT_URL``:
    this host's public ``/mcp/oauth/callback``)."""
    return getattr(settings, "SAGE_MCP_OAUTH_REDIRECT_URL", "") or DEFAULT_REDIRECT_URL


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _client_key(issuer: str, redirect: str) -> str:
    return _digest(f"{issuer}\n{redirect}")


def _state_invalid() -> ValidationError:
    return ValidationError(
        "mcp.oauth_state_invalid",
        "this authorization link is unknown, expired or already used: start again from the run",
    )


# --- database steps (sync; the worker calls them through db_call) --------------------


def _client_read(key: str) -> OAuthClientInformationFull | None:
    row = McpOAuthClient.objects.filter(key=key).first()
    if row is None or not row.info:
        return None
    return OAuthClientInformationFull.model_validate(row.info)


def _client_write(key: str, issuer: str, info: OAuthClientInformationFull) -> None:
    try:
        with transaction.atomic():
            row = McpOAuthClient(key=key, issuer=issuer)
            row.info = info.model_dump(mode="json", exclude_none=True)
            row.save()
    except IntegrityError:  # another worker registered first: theirs is as good
        pass


def _pending_write(
    owner_id: int, run_id: Any, server_url: str, state: str, flow: dict[str, Any]
) -> None:
    now = timezone.now()
    McpOAuthPending.objects.filter(expires_at__lt=now).delete()  # the expired ones go
    row = McpOAuthPending(
        owner_id=owner_id,
        run_id=run_id,
        server_url=server_url,
        state_hash=_digest(state),
        expires_at=now + timedelta(seconds=oauth.PENDING_SECONDS),
    )
    row.flow = flow
    row.save()


def _oauth_secret(owner_id: int, url: str) -> dict[str, Any] | None:
    row = McpConnection.objects.live().filter(owner_id=owner_id, server_key=server_key(url)).first()
    if row is None or row.kind != McpConnectionKind.OAUTH:
        return None
    return row.secret


def _tokens_write(owner_id: int, url: str, secret: dict[str, Any]) -> None:
    """Save ``owner_id``'s OAuth connection to ``url`` (the live one updated, or a new one)."""
    key = server_key(url)
    for _ in range(2):
        try:
            with transaction.atomic():
                row = (
                    McpConnection.objects.select_for_update()
                    .filter(owner_id=owner_id, server_key=key, active=True)
                    .first()
                )
                if row is None:
                    row = McpConnection(owner_id=owner_id, server_url=url, server_key=key)
                row.kind = McpConnectionKind.OAUTH
                row.secret = secret
                row.save()
                return
        except IntegrityError:
            continue


def _oauth_revoke(owner_id: int, url: str, access_token: str) -> dict[str, Any] | None:
    """Revoke the OAuth connection whose access token is ``access_token`` (a refused
    refresh): the next run asks the user to authorize again. Returns the secret saved
    meanwhile instead (another worker refreshed first, the user authorized again)."""
    with transaction.atomic():
        row = (
            McpConnection.objects.select_for_update()
            .filter(owner_id=owner_id, server_key=server_key(url), active=True)
            .first()
        )
        if row is None or row.kind != McpConnectionKind.OAUTH:
            return None
        if row.secret.get("access_token") != access_token:
            return row.secret
        row.active = None
        row.revoked_at = timezone.now()
        row.secret = {}
        row.save(update_fields=["active", "revoked_at", "encrypted_secret", "updated_at"])
    return None


def _secret(tokens: oauth.Tokens, flow: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "access_token": tokens.access_token,
        "refresh_token": tokens.refresh_token,
        "expires_at": tokens.expires_at,
        "scope": tokens.scope,
        "server": flow["server"],
        "client": flow["client"],
        "redirect_uri": flow["redirect_uri"],
    }


def _tokens_of(secret: Mapping[str, Any]) -> oauth.Tokens:
    return oauth.Tokens(
        access_token=secret.get("access_token") or "",
        refresh_token=secret.get("refresh_token"),
        expires_at=secret.get("expires_at"),
        scope=secret.get("scope"),
    )


def _log_failure(what: str, url: str, exc: oauth.OAuthError, secrets: list[str]) -> None:
    body = redact(exc.body, [s for s in secrets if s]) if exc.body else ""
    logger.warning("MCP OAuth %s for %s failed: %s %s", what, url, exc.reason, body[:2048])


# --- the worker's half ---------------------------------------------------------------


async def mcp_oauth_begin(owner_id: int, run_id: Any, server_url: str) -> str | None:
    """Start an authorization of ``owner_id`` for ``server_url`` on behalf of run
    ``run_id``; returns the URL the user opens, or None when the server does not use
    OAuth (or its metadata is unusable: the run still asks for a connection)."""
    url = normalize_server_url(server_url)
    redirect = redirect_uri()
    try:
        server = await oauth.discover(url)
        if server is None:
            return None
        key = _client_key(server.issuer, redirect)
        client = await db_call(_client_read, key)
        if client is None:
            client = await oauth.register(server, redirect)
            await db_call(_client_write, key, server.issuer, client)
            client = await db_call(_client_read, key) or client
        started = oauth.authorization(server, client, redirect)
    except oauth.OAuthError as exc:
        _log_failure("discovery", url, exc, [])
        return None
    flow = {
        "verifier": started.verifier,
        "server": server.to_json(),
        "client": key,
        "redirect_uri": redirect,
    }
    await db_call(_pending_write, owner_id, run_id, url, started.state, flow)
    return started.url


# One refresh per (user, server) at a time in this worker: the others wait for its tokens.
# Keyed by event loop too: an asyncio lock belongs to the loop that first waits on it.
_refreshing: dict[tuple[int, int, str], asyncio.Lock] = {}


async def _refresh(owner_id: int, url: str, stale: str | None) -> dict[str, Any] | None:
    """Refresh ``owner_id``'s tokens for ``url`` unless another task already replaced
    ``stale`` (then theirs). Returns the new secret, or None (refused: revoked). One
    lock per worker; across workers, a refresh refused because another rotated the
    token first takes the other's tokens."""
    loop = id(asyncio.get_running_loop())
    lock = _refreshing.setdefault((loop, owner_id, url), asyncio.Lock())
    async with lock:
        secret = await db_call(_oauth_secret, owner_id, url)
        if secret is None:
            return None
        tokens = _tokens_of(secret)
        if tokens.access_token != stale:
            return secret  # refreshed while this task waited: one refresh, not one each
        client = await db_call(_client_read, secret.get("client", ""))
        if client is None or not tokens.refresh_token:
            return await db_call(_oauth_revoke, owner_id, url, tokens.access_token)
        server = oauth.Server.from_json(secret["server"])
        try:
            fresh = await oauth.refresh(server, client, secret["redirect_uri"], tokens)
        except oauth.OAuthError as exc:
            _log_failure("refresh", url, exc, [tokens.access_token, tokens.refresh_token or ""])
            if exc.status is None:  # the AS could not be reached: try again later
                raise UpstreamError(
                    "mcp.oauth_refresh_failed",
                    "the MCP server's authorization server could not be reached",
                    retryable=True,
                ) from None
            # A rotated refresh token another worker used first is refused too: theirs.
            return await db_call(_oauth_revoke, owner_id, url, tokens.access_token)
        secret = _secret(fresh, secret)
        await db_call(_tokens_write, owner_id, url, secret)
        return secret


async def mcp_oauth_credentials(owner_id: int, server_url: str) -> dict[str, str] | None:
    """The worker's credential read: the connection's headers, an OAuth one's access
    token refreshed first when it is (about to be) expired; None: not connected."""
    url = normalize_server_url(server_url)
    headers = await db_call(mcp_credentials_sync, owner_id, url)
    if headers is None:
        return None
    secret = await db_call(_oauth_secret, owner_id, url)
    if secret is None or not _tokens_of(secret).expired():
        return headers
    fresh = await _refresh(owner_id, url, secret.get("access_token"))
    return {"Authorization": f"Bearer {fresh['access_token']}"} if fresh else None


async def mcp_oauth_refused(owner_id: int, server_url: str, headers: Mapping[str, str]) -> bool:
    """The server answered 401 to ``headers``: refresh an OAuth connection's tokens.
    True when new ones are saved (the caller tries again), False otherwise."""
    url = normalize_server_url(server_url)
    secret = await db_call(_oauth_secret, owner_id, url)
    if secret is None:
        return False
    sent = str(headers.get("Authorization", "")).removeprefix("Bearer ")
    if secret.get("access_token") != sent:
        return True  # replaced since (a refresh, a new authorization): use the new one
    return await _refresh(owner_id, url, sent) is not None


# --- the callback's half -------------------------------------------------------------


def _take_pending(state: str, user: Any) -> McpOAuthPending:
    """The pending authorization of ``state``, deleted (single use). A signed-in
    ``user`` must be its owner (another user's is left alone). Raises
    ``mcp.oauth_state_invalid``."""
    if not state or len(state) > 500:
        raise _state_invalid()
    with transaction.atomic():
        row = McpOAuthPending.objects.select_for_update().filter(state_hash=_digest(state)).first()
        if row is None or (user is not None and row.owner_id != user.pk):
            raise _state_invalid()
        row.delete()
    if row.expires_at <= timezone.now():
        raise _state_invalid()
    return row


def _resume(run_id: Any, server_url: str) -> bool:
    """Reply ``retry`` to the run's ``mcp_auth`` interaction for ``server_url``, when it
    still waits on it."""
    from agents.services.runs import run_reply

    run = Run.objects.filter(pk=run_id).first() if run_id else None
    interaction = (run.interaction or {}) if run else {}
    if (
        run is None
        or run.status != RunStatus.SUSPENDED
        or interaction.get("type") != "mcp_auth"
        or interaction.get("url") != server_url
    ):
        return False
    try:
        run_reply(run=run, decision="retry", interaction_id=interaction.get("id"))
    except ConflictError:
        return False
    return True


def mcp_oauth_callback(
    *, code: str, state: str, error: str = "", user: Any = None
) -> dict[str, Any]:
    """Finish the authorization of ``state``: exchange ``code``, save the tokens as the
    user's connection, resume the run. Returns ``{"server_url", "run", "resumed"}``.
    The browser often carries no credentials: the unguessable, single-use state binds
    the request; when it does carry a signed-in ``user``, the state must be theirs.

    Raises ``mcp.oauth_state_invalid`` (400: unknown, expired or used state),
    ``mcp.oauth_denied`` (400: the user or the server refused) and
    ``mcp.oauth_exchange_failed`` (502).
    """
    pending = _take_pending(state, user)
    if error or not code:
        raise ValidationError(
            "mcp.oauth_denied", "the authorization was refused; start again from the run"
        )
    flow = pending.flow
    client = _client_read(flow.get("client", ""))
    if client is None:
        raise _state_invalid()
    server = oauth.Server.from_json(flow["server"])
    try:
        tokens = async_to_sync(oauth.exchange)(
            server, client, flow["redirect_uri"], code=code, verifier=flow["verifier"]
        )
    except oauth.OAuthError as exc:
        _log_failure("code exchange", pending.server_url, exc, [code, flow["verifier"]])
        raise UpstreamError(
            "mcp.oauth_exchange_failed",
            "the authorization server did not accept the authorization; start again",
        ) from None
    _tokens_write(pending.owner_id, pending.server_url, _secret(tokens, flow))
    resumed = _resume(pending.run_id, pending.server_url)
    logger.info(
        "MCP OAuth connection saved for user %s and %s (run resumed: %s)",
        pending.owner_id,
        pending.server_url,
        resumed,
    )
    return {"server_url": pending.server_url, "run": pending.run_id, "resumed": resumed}


__all__ = [
    "mcp_oauth_begin",
    "mcp_oauth_callback",
    "mcp_oauth_credentials",
    "mcp_oauth_refused",
    "redirect_uri",
]
