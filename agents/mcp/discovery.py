"""Readiness's view of an MCP server: can it be reached with these credentials, and which
tools does it list? (Django-free; the caller reads the credentials.)

Readiness runs in synchronous code (a view, a save, the admin), so a discovery runs its
own event loop in a thread of its own, bounded by `DISCOVERY_TIMEOUT` (a save must not
wait out a slow server's full ``timeout_seconds``). Answers are cached for
`DISCOVERY_TTL` seconds per (server URL, credentials), by a digest: a burst of saves and
validations costs one listing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agents.mcp.client import McpSession, SessionSpec
from sageproject.errors import SageError

DISCOVERY_TTL = 30.0
DISCOVERY_TIMEOUT = 5.0
_MAX_CACHED = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class Discovery:
    """The tools a server listed, or why it could not be asked (``problem``)."""

    tools: tuple[str, ...] = ()
    problem: str | None = None


_cache: dict[str, tuple[float, Discovery]] = {}
_lock = threading.Lock()
_threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mcp-discovery")


def _key(url: str, headers: Mapping[str, str]) -> str:
    payload = json.dumps([url, sorted(headers.items())], separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


async def _list(spec: SessionSpec) -> Discovery:
    session = None
    try:
        session = await McpSession.open(spec)
        tools = await session.list_tools(ttl=0)
        return Discovery(tools=tuple(sorted(t.name for t in tools)))
    except SageError as exc:
        return Discovery(problem=f"{exc.code}: {exc.message}")
    finally:
        if session is not None:
            await session.close()


def discover(server: str, url: str, headers: Mapping[str, str], timeout: float) -> Discovery:
    """What ``url`` lists for these credentials (cached); never raises."""
    key = _key(url, headers)
    now = time.monotonic()
    with _lock:
        cached = _cache.get(key)
        if cached is not None and now - cached[0] < DISCOVERY_TTL:
            return cached[1]
    spec = SessionSpec(
        server=server, url=url, headers=dict(headers), timeout=min(timeout, DISCOVERY_TIMEOUT)
    )
    try:
        found = _threads.submit(asyncio.run, _list(spec)).result(DISCOVERY_TIMEOUT * 3)
    except Exception as exc:  # a stuck loop or thread: unverified, never a crash
        found = Discovery(problem=f"discovery failed: {type(exc).__name__}")
    with _lock:
        if len(_cache) >= _MAX_CACHED:
            _cache.clear()
        _cache[key] = (time.monotonic(), found)
    return found


def forget() -> None:
    """Drop every cached answer (tests; a saved connection takes effect at once)."""
    with _lock:
        _cache.clear()
