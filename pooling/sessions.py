"""A memory-aware pool of live session kernels (``python_session``), per seed 004.

The pool owns two decisions:

1. **Idle closing by conversation kind** (:data:`DEFAULT_TTL`): ``master`` never, ``branch``
   after 7200 s, ``deep`` after 1800 s, ``job`` and ``fork`` as soon as they are idle; an
   unknown kind uses the ``deep`` value.
2. **Eviction under memory pressure**: the RSS of every kernel's whole process tree
   (psutil), summed, against the cgroup memory limit with 0.8 headroom; where there is no
   limit, the pool is over it when it holds ``max_live`` sessions or more. Victims go one at
   a time, re-measuring after each: ``fork`` and ``job`` first, then ``deep``, ``branch``,
   ``master``; least recently used within a kind. A pinned, dirty, busy or question-pending
   session is never a victim.

Closing disconnects the client with a bounded wait and then kills whatever is left of the
kernel's process tree, so nothing is orphaned. Sessions closed by the pool itself (TTL or
pressure) are remembered so the tool can tell the agent, once, that its variables were lost
(:meth:`SessionPool.was_evicted`).

Django-free; one event loop; bookkeeping happens between awaits, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import psutil

logger = logging.getLogger(__name__)

# Idle seconds before a session of a kind is closed; None = never (a pinned kind).
DEFAULT_TTL: Mapping[str, float | None] = MappingProxyType(
    {"master": None, "branch": 7200.0, "deep": 1800.0, "job": 0.0, "fork": 0.0}
)
# Eviction order by kind: cheapest to lose first. Unknown kinds rank with ``deep``.
KIND_ORDER: Mapping[str, int] = MappingProxyType(
    {"fork": 0, "job": 0, "deep": 1, "branch": 2, "master": 3}
)
HEADROOM = 0.8
CGROUP_V2_PATH = Path("/sys/fs/cgroup/memory.max")
CGROUP_V1_PATH = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
# v1 reports "no limit" as a huge page-aligned number (~2**63); anything past this is none.
_ABSURD_LIMIT = 1 << 60
DISCONNECT_SECONDS = 10.0


def cgroup_limit(
    v2_path: Path | str = CGROUP_V2_PATH, v1_path: Path | str = CGROUP_V1_PATH
) -> int | None:
    """The cgroup memory limit in bytes, or ``None`` when there is none.

    Reads cgroup v2 ``memory.max`` first, then v1 ``memory.limit_in_bytes``; ``"max"``, an
    absurdly large number, a missing or unreadable file all mean no limit. Never raises.
    """
    for path in (Path(v2_path), Path(v1_path)):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            logger.warning("session pool: unreadable cgroup limit %r in %s", text, path)
            continue
        return value if 0 < value < _ABSURD_LIMIT else None
    return None


class SessionClient(Protocol):
    """The agent-client shape a live session wraps (``KernelClient`` is one)."""

    async def connect(self) -> None: ...
    async def query(self, *args: Any, **kwargs: Any) -> Any: ...
    def receive_response(self) -> Any: ...
    async def interrupt(self) -> None: ...
    async def disconnect(self) -> None: ...


@dataclass(slots=True, eq=False)
class LiveSession:
    """One live session: its client plus the flags that decide whether it may be closed.

    ``busy`` = its lock is held or a turn is running; ``evictable`` = not pinned, not dirty
    (its durable mirror has an unrepaired gap), not busy and no question pending.
    """

    key: str
    agent: str
    kind: str
    client: Any
    session_id: str | None
    resumed: bool
    pinned: bool = False
    dirty: bool = False
    running_turn: Any = None
    pending_question: bool = False
    interrupt_requested: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    created_at: float = field(default_factory=time.monotonic)
    turns: int = 0
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def busy(self) -> bool:
        return self.lock.locked() or self.running_turn is not None

    @property
    def evictable(self) -> bool:
        return not (self.pinned or self.dirty or self.busy or self.pending_question)

    @property
    def pid(self) -> int | None:
        pid = getattr(self.client, "pid", None)
        return pid if isinstance(pid, int) else None

    def touch(self) -> None:
        """Mark the session as used now (it moves to the back of the LRU order)."""
        self.last_used = time.monotonic()


def tree_rss(pid: int | None) -> int:
    """RSS in bytes of ``pid`` and all its descendants; 0 if it is gone."""
    if pid is None:
        return 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


class SessionPool:
    """Live sessions keyed by string, closed by idle TTL and evicted under memory pressure.

    ``rss_limit``: bytes; ``None`` reads :func:`cgroup_limit` once at construction; ``0``
    means explicitly no limit (``max_live`` applies). ``ttl`` maps kind to idle seconds.
    """

    def __init__(
        self,
        *,
        rss_limit: int | None = None,
        max_live: int = 8,
        ttl: Mapping[str, float | None] = DEFAULT_TTL,
        reap_interval: float = 60.0,
    ) -> None:
        if max_live < 1:
            raise ValueError("max_live must be at least 1")
        if reap_interval <= 0:
            raise ValueError("reap_interval must be positive")
        self.rss_limit: int | None = cgroup_limit() if rss_limit is None else (rss_limit or None)
        self.max_live = max_live
        self.ttl = dict(ttl)
        self.reap_interval = reap_interval
        self._sessions: dict[str, LiveSession] = {}
        self._evicted: set[str] = set()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, key: object) -> bool:
        return key in self._sessions

    # -- registry -------------------------------------------------------------------------

    def add(self, session: LiveSession) -> LiveSession | None:
        """Register ``session`` under its key; return a *different* session it displaced.

        The caller closes what is returned (the pool does not await here). Adding clears any
        pending eviction notice for the key: the new kernel is what the agent now has.
        """
        previous = self._sessions.get(session.key)
        self._sessions[session.key] = session
        self._evicted.discard(session.key)
        return previous if previous is not session else None

    def get(self, key: str) -> LiveSession | None:
        """The session under ``key`` or ``None``; does not touch ``last_used``."""
        return self._sessions.get(key)

    def pop(self, key: str) -> LiveSession | None:
        """Remove and return the session under ``key`` without closing it (or ``None``)."""
        return self._sessions.pop(key, None)

    def rekey(self, old: str, new: str) -> LiveSession | None:
        """Move the session at ``old`` to ``new``; return a different session that held ``new``.

        The caller closes the returned session. Does nothing (returns ``None``) when ``old``
        is not registered or equals ``new``.
        """
        if old == new or old not in self._sessions:
            return None
        session = self._sessions.pop(old)
        displaced = self._sessions.get(new)
        session.key = new
        self._sessions[new] = session
        return displaced if displaced is not session else None

    def sessions(self) -> list[LiveSession]:
        """All live sessions (a copy)."""
        return list(self._sessions.values())

    def was_evicted(self, key: str) -> bool:
        """True once if the pool itself closed ``key``'s kernel (TTL or memory pressure).

        The notice is consumed: the tool calls this when it finds no live session for a key,
        tells the agent its variables were lost, and starts a fresh kernel.
        """
        if key in self._evicted:
            self._evicted.discard(key)
            return True
        return False

    # -- policy -----------------------------------------------------------------------------

    def ttl_for(self, kind: str) -> float | None:
        """Idle seconds before a session of ``kind`` is closed; ``None`` = never."""
        if kind in self.ttl:
            return self.ttl[kind]
        return self.ttl.get("deep", DEFAULT_TTL["deep"])

    def rss_of(self, session: LiveSession) -> int:
        """RSS in bytes of the session's kernel process and its descendants."""
        return tree_rss(session.pid)

    def rss(self) -> int:
        """RSS in bytes summed over every live kernel's process tree."""
        return sum(self.rss_of(session) for session in self._sessions.values())

    def over_limit(self) -> bool:
        """True when RSS exceeds 0.8 of the limit, or (no limit) ``max_live`` sessions are held."""
        if self.rss_limit:
            return self.rss() > HEADROOM * self.rss_limit
        return len(self._sessions) >= self.max_live

    def victims(self) -> list[LiveSession]:
        """Evictable sessions in eviction order: fork/job, deep, branch, master; then LRU."""
        default_rank = KIND_ORDER["deep"]
        candidates = [s for s in self._sessions.values() if s.evictable]
        candidates.sort(key=lambda s: (KIND_ORDER.get(s.kind, default_rank), s.last_used))
        return candidates

    # -- closing ----------------------------------------------------------------------------

    async def make_room(self) -> int:
        """Evict one victim at a time, re-measuring after each, until under the limit.

        Returns the number evicted. When nothing is evictable it logs a warning and stops.
        """
        evicted = 0
        while self.over_limit():
            victims = self.victims()
            if not victims:
                logger.warning(
                    "session pool over its memory limit but nothing is evictable "
                    "(%d live sessions)", len(self._sessions)
                )
                break
            victim = victims[0]
            await self.close(victim.key, evicted=True)
            evicted += 1
        return evicted

    async def reap_once(self, *, now: float | None = None) -> int:
        """Close every evictable session idle longer than its kind's TTL; return the count."""
        clock = time.monotonic() if now is None else now
        expired = []
        for session in list(self._sessions.values()):
            ttl = self.ttl_for(session.kind)
            if ttl is None or not session.evictable:
                continue
            if clock - session.last_used > ttl:
                expired.append(session.key)
        closed = 0
        for key in expired:
            # Re-check: an earlier close awaited, and the session may have been taken since.
            session = self._sessions.get(key)
            if session is not None and session.evictable:
                closed += await self.close(key, evicted=True)
        return closed

    async def reap_loop(self) -> None:
        """Forever: sleep ``reap_interval``, ``reap_once``, ``make_room``; survive errors.

        Ends only by cancellation.
        """
        while True:
            await asyncio.sleep(self.reap_interval)
            try:
                await self.reap_once()
                await self.make_room()
            except Exception:
                logger.exception("session pool reaper failed; retrying next interval")

    async def close(self, key: str, *, evicted: bool = False) -> bool:
        """Remove ``key`` and close its client; return whether a session was there.

        The client's ``disconnect`` gets a bounded wait; a failure is logged, never raised.
        Then any process left in the kernel's tree is killed, so nothing is orphaned.
        ``evicted=True`` records an eviction notice for :meth:`was_evicted`.
        """
        session = self._sessions.pop(key, None)
        if session is None:
            return False
        if evicted:
            self._evicted.add(key)
            self.evictions += 1
        await close_session(session)
        return True

    async def close_all(self, agent: str | None = None) -> int:
        """Close every session (or only ``agent``'s); return how many were closed."""
        keys = [k for k, s in self._sessions.items() if agent is None or s.agent == agent]
        for key in keys:
            await self.close(key)
        return len(keys)

    # -- reporting --------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view: limits, totals and one row per session."""
        now = time.monotonic()
        rows = []
        for session in self._sessions.values():
            rows.append(
                {
                    "key": session.key,
                    "agent": session.agent,
                    "kind": session.kind,
                    "session_id": session.session_id,
                    "pid": session.pid,
                    "rss": self.rss_of(session),
                    "idle_seconds": round(now - session.last_used, 3),
                    "age_seconds": round(now - session.created_at, 3),
                    "turns": session.turns,
                    "busy": session.busy,
                    "running_turn": (
                        None if session.running_turn is None else str(session.running_turn)
                    ),
                    "pending_question": session.pending_question,
                    "pinned": session.pinned,
                    "dirty": session.dirty,
                }
            )
        return {
            "live": len(rows),
            "max_live": self.max_live,
            "rss_limit": self.rss_limit,
            "rss": sum(row["rss"] for row in rows),
            "over_limit": self.over_limit(),
            "evictions": self.evictions,
            "sessions": rows,
        }


async def close_session(session: LiveSession, *, wait_seconds: float = DISCONNECT_SECONDS) -> None:
    """Disconnect ``session.client`` (bounded, logged on failure) and kill its leftovers."""
    pid = session.pid
    leftovers: list[psutil.Process] = []
    if pid is not None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            leftovers = [root, *root.children(recursive=True)]
    try:
        await asyncio.wait_for(session.client.disconnect(), wait_seconds)
    except Exception as exc:
        logger.warning("session %s: disconnect failed: %r", session.key, exc)
    alive = [proc for proc in leftovers if _running(proc)]
    if alive:
        logger.warning("session %s: killing %d leftover processes", session.key, len(alive))
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        await asyncio.to_thread(psutil.wait_procs, alive, wait_seconds)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
