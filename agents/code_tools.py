"""The code tools ``python`` and ``python_session`` and the per-worker runtime that hosts them.

One :class:`CodeToolsRuntime` exists per worker (the ``RunExecutor`` creates it). It owns:

* one :class:`~pooling.elastic.ElasticPool` of warm interpreters per tool source (today the
  ``python`` tool is the only source), whose ceiling follows the worker's run concurrency;
* one :class:`~pooling.sessions.SessionPool` of live kernels for ``python_session`` (one
  kernel per conversation, closed when idle by session kind and evicted under memory
  pressure, cgroup-aware);
* ONE :class:`~pooling.elastic.Janitor` for every elastic pool of the worker, plus the session
  pool's reaper.

**Resource isolation, not a security sandbox**: snippets run as the worker's OS user with CPU,
memory, wall-clock and output limits and an environment built from scratch (see
``pooling.interpreters``). Both tools are off unless the operator sets ``SAGE_CODE_TOOLS=1``;
while off they are simply not registered, so a package declaring them reports them as missing
tools in its readiness report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Mapping
from functools import partial
from typing import Any

from agents.tools import Tool, ToolContext, ToolError, ToolHandler
from pooling.elastic import ElasticPool, Janitor, SpareFactory, pool_with_spares, spares_for
from pooling.interpreters import (
    InterpreterLimits,
    InterpreterResult,
    KernelClient,
    WarmInterpreter,
    close_interpreter,
)
from pooling.sessions import LiveSession, SessionPool, close_session
from sageproject.errors import SageError

logger = logging.getLogger("sage.code_tools")

PYTHON_TOOL = "python"
PYTHON_SESSION_TOOL = "python_session"
DEFAULT_SESSION_KIND = "master"
JANITOR_INTERVAL = 30.0
# A snippet longer than this is almost certainly data pasted as code; refuse it early.
MAX_CODE_CHARS = 100_000
# Per captured stream. Three streams stay below the engine's 16 000-character tool output
# cap, so the agent always sees the error section, not just a wall of stdout.
OUTPUT_BYTES = 4 * 1024
DEFAULT_LIMITS = InterpreterLimits(
    cpu_seconds=10, memory_bytes=512 * 1024 * 1024, wall_seconds=30.0, output_bytes=OUTPUT_BYTES
)

EVICTED_NOTICE = (
    "[notice] This session's Python kernel was closed by the host (idle or memory pressure) "
    "and a fresh one was started: every variable, import and definition from earlier calls "
    "was lost. Re-run any setup code you still need."
)
DIED_NOTICE = (
    "[notice] This session's Python kernel had stopped (it was killed by a limit or crashed) "
    "and a fresh one was started: every variable, import and definition from earlier calls "
    "was lost. Re-run any setup code you still need."
)
KILLED_NOTICE = (
    "[notice] The kernel was killed, so every variable of this session is lost; the next "
    "python_session call starts a fresh kernel."
)

_CODE_SCHEMA = {"type": "string", "description": "Python source to run."}


def _timeout_schema(limits: InterpreterLimits) -> dict[str, Any]:
    return {
        "type": "number",
        "description": f"Wall-clock seconds before the snippet is killed "
        f"(default and maximum {limits.wall_seconds:g}).",
        "exclusiveMinimum": 0,
        "maximum": limits.wall_seconds,
    }


def parse_arguments(args: Mapping[str, Any], limits: InterpreterLimits) -> tuple[str, float | None]:
    """Validate a code tool's arguments; return ``(code, timeout or None)``.

    Raises ``ToolError`` (a polite refusal the model sees) for a missing, empty, non-string
    or oversized ``code``, a ``timeout`` that is not a number in ``(0, wall limit]``, or any
    unknown argument.
    """
    unknown = sorted(set(args) - {"code", "timeout"})
    if unknown:
        raise ToolError(
            f"unknown argument(s) {', '.join(map(repr, unknown))}; "
            "pass 'code' and optionally 'timeout'"
        )
    code = args.get("code")
    if not isinstance(code, str) or not code.strip():
        raise ToolError("argument 'code' must be a non-empty string of Python source")
    if len(code) > MAX_CODE_CHARS:
        raise ToolError(f"argument 'code' is longer than {MAX_CODE_CHARS} characters")
    timeout = args.get("timeout")
    if timeout is None:
        return code, None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ToolError("argument 'timeout' must be a number of seconds")
    if not 0 < timeout <= limits.wall_seconds:
        raise ToolError(
            f"argument 'timeout' must be greater than 0 and at most {limits.wall_seconds:g}"
        )
    return code, float(timeout)


def format_result(result: InterpreterResult) -> str:
    """The text the agent sees: stdout, then labelled stderr and error sections.

    An empty, successful run says so explicitly, so the model never mistakes silence for a
    failure of the tool.
    """
    parts: list[str] = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.error:
        label = "[killed]" if result.killed else "[error]"
        parts.append(f"{label}\n" + result.error.rstrip("\n"))
    if result.truncated:
        parts.append(f"[output truncated to {OUTPUT_BYTES} bytes per stream]")
    if not parts:
        parts.append("(no output)")
    return "\n".join(parts)


def _stateless_description(limits: InterpreterLimits) -> str:
    return (
        "Run a Python snippet in a fresh interpreter and return what it printed. Nothing "
        "persists between calls (use python_session for that). The value of a final "
        "expression is printed. Standard library only; no network or files are guaranteed. "
        f"Limits: {limits.cpu_seconds} s CPU, {limits.wall_seconds:g} s wall clock, "
        f"{limits.memory_bytes // (1024 * 1024)} MiB memory."
    )


def _session_description(limits: InterpreterLimits) -> str:
    return (
        "Run Python in this conversation's own kernel: variables, imports and definitions "
        "persist across calls. The value of a final expression is printed. If the host had "
        "to restart the kernel, the output starts with a notice that earlier variables were "
        f"lost. Limits per call: {limits.cpu_seconds} s CPU, {limits.wall_seconds:g} s wall "
        f"clock, {limits.memory_bytes // (1024 * 1024)} MiB memory."
    )


def tool_definitions(
    limits: InterpreterLimits, python: ToolHandler, python_session: ToolHandler
) -> list[Tool]:
    """The ``python`` and ``python_session`` tool definitions bound to the given handlers."""
    parameters = {
        "type": "object",
        "properties": {"code": _CODE_SCHEMA, "timeout": _timeout_schema(limits)},
        "required": ["code"],
        "additionalProperties": False,
    }
    return [
        Tool(
            name=PYTHON_TOOL,
            description=_stateless_description(limits),
            parameters=parameters,
            handler=python,
        ),
        Tool(
            name=PYTHON_SESSION_TOOL,
            description=_session_description(limits),
            parameters=parameters,
            handler=python_session,
        ),
    ]


async def _worker_only(args: dict[str, Any], ctx: ToolContext) -> str:
    raise ToolError("the code tools run only inside a worker")


def code_tools_enabled() -> bool:
    """Whether the operator enabled the code tools and the code job kinds: ``SAGE_CODE_TOOLS``
    as ``sageproject.config`` read it into ``settings.SAGE`` (the one reading of a Django
    process; a Celery job worker reads the configuration itself, ``agents.jobs.tasks``)."""
    from django.conf import settings  # this module stays importable without Django

    return bool(settings.SAGE["SAGE_CODE_TOOLS"])


def discovery_tools(*, enabled: bool | None = None) -> list[Tool]:
    """The code tools as readiness discovery sees them, without a runtime or a process.

    ``enabled=None`` asks ``code_tools_enabled()``. Empty while disabled, so a package
    declaring them reports them missing; their handlers only refuse (``ToolError``): the web
    process lists them, the worker's :class:`CodeToolsRuntime` runs them.
    """
    if enabled is None:
        enabled = code_tools_enabled()
    if not enabled:
        return []
    return tool_definitions(DEFAULT_LIMITS, _worker_only, _worker_only)


class CodeToolsRuntime:
    """The worker's code tools, their interpreter pools and live session kernels.

    ``enabled=False`` makes :meth:`tools` empty and :meth:`start`/:meth:`close` no-ops.
    ``max_interpreters`` is the ceiling of the ``python`` tool's elastic pool (at least 1);
    ``spares`` interpreters boot ahead of demand (default ``spares_for(max_interpreters)``);
    ``session_pool`` defaults to a cgroup-aware :class:`SessionPool` holding at most
    ``max_interpreters`` kernels where no memory limit exists.
    """

    def __init__(
        self,
        *,
        enabled: bool,
        max_interpreters: int = 8,
        limits: InterpreterLimits = DEFAULT_LIMITS,
        session_pool: SessionPool | None = None,
        janitor_interval: float = JANITOR_INTERVAL,
        resident: int = 1,
        spares: int | None = None,
    ) -> None:
        if max_interpreters < 1:
            raise ValueError("max_interpreters must be at least 1")
        self.enabled = enabled
        self.limits = limits
        self.janitor = Janitor(interval=janitor_interval)
        # One elastic pool per tool source; the janitor drives them all.
        self.pools: dict[str, ElasticPool[WarmInterpreter]] = {}
        self._spares: dict[str, SpareFactory[WarmInterpreter]] = {}
        if enabled:
            self._add_pool(
                PYTHON_TOOL,
                max_interpreters,
                resident=resident,
                spares=spares_for(max_interpreters) if spares is None else spares,
                janitor_interval=janitor_interval,
            )
        # ``is None``, not ``or``: an empty SessionPool is falsy (it has ``__len__``).
        self.sessions = (
            SessionPool(max_live=max_interpreters) if session_pool is None else session_pool
        )
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        # Serialises kernel creation per conversation so two concurrent calls of one session
        # never boot two kernels (the second would displace the first mid-snippet).
        self._creating: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    def _add_pool(
        self, name: str, max_size: int, *, resident: int, spares: int, janitor_interval: float
    ) -> None:
        # Spares boot ahead of demand so a miss rarely waits a whole boot (bench_elastic's
        # p99); the janitor trims them to one once the pool sits idle. They are
        # resident interpreters too, shown as ``spares`` in capacity().
        pool, factory = pool_with_spares(
            partial(WarmInterpreter.boot, limits=self.limits),
            close_interpreter,
            spares=spares,
            max_size=max_size,
            resident=resident,
            janitor_interval=janitor_interval,
        )
        if factory is not None:
            self._spares[name] = factory
        self.pools[name] = pool
        self.janitor.register(pool)

    @classmethod
    def from_settings(cls) -> CodeToolsRuntime:
        """A runtime configured from ``settings.SAGE``.

        Enabled only when ``code_tools_enabled()``; the interpreter ceiling is
        ``SAGE_SERVER_MAX_CONCURRENT_RUNS`` x 1 (a run executes one tool call at a time).
        """
        from django.conf import settings  # the runtime itself stays importable without Django

        return cls(
            enabled=code_tools_enabled(),
            max_interpreters=max(1, int(settings.SAGE.get("SAGE_SERVER_MAX_CONCURRENT_RUNS", 8))),
        )

    # -- lifecycle --------------------------------------------------------------------------

    def tools(self) -> list[Tool]:
        """The tools to register: ``python`` and ``python_session``, or none when disabled."""
        if not self.enabled:
            return []
        return tool_definitions(self.limits, self.run_python, self.run_python_session)

    async def start(self) -> None:
        """Start the one janitor for every pool and the session reaper (idempotent)."""
        if not self.enabled or self._closed:
            return
        self.janitor.start()
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self.sessions.reap_loop(), name="session-reaper")

    async def close(self) -> None:
        """Stop the background tasks, close every pool and every kernel (idempotent).

        States still checked out are closed when their holders return them; call this after
        the worker's last run ended, and no interpreter or kernel process is left behind.
        """
        self._closed = True
        await self.janitor.stop()
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        for pool in self.pools.values():
            await pool.close()
        await self.sessions.close_all()

    def capacity(self) -> dict[str, Any]:
        """The worker-snapshot view: ``{"enabled", "pools": {name: {**PoolStats, "spares",
        "history"}}, "sessions": SessionPool.snapshot()}``; ``spares`` counts interpreters
        booted ahead of demand; ``history`` is ``[[t, created, in_use], ...]`` (last hour).
        """
        pools = {
            name: {
                **pool.stats().as_dict(),
                "spares": spare.held if (spare := self._spares.get(name)) else 0,
                "history": [
                    [round(t, 3), created, in_use] for t, created, in_use in pool.history()
                ],
            }
            for name, pool in self.pools.items()
        }
        return {"enabled": self.enabled, "pools": pools, "sessions": self.sessions.snapshot()}

    # -- the stateless tool -----------------------------------------------------------------

    async def run_python(self, args: dict[str, Any], ctx: ToolContext) -> str:
        """The ``python`` tool: run ``code`` in a warm interpreter; return its output text.

        Raises ``ToolError`` on bad arguments or when the code tools are shut down or the
        interpreter cannot start.
        """
        code, timeout = parse_arguments(args, self.limits)
        pool = self._pool(PYTHON_TOOL)
        try:
            async with pool.checkout() as interpreter:
                result = await interpreter.run(code, timeout=timeout)
        except ToolError:
            raise
        except SageError as exc:
            raise ToolError(f"the Python interpreter is unavailable: {exc.message}") from exc
        except TimeoutError as exc:  # a boot that never became ready
            raise ToolError("the Python interpreter did not start in time") from exc
        return format_result(result)

    def _pool(self, name: str) -> ElasticPool[WarmInterpreter]:
        pool = self.pools.get(name)
        if pool is None or self._closed or pool.closed:
            raise ToolError("the code tools are not available on this worker right now")
        return pool

    # -- the stateful tool ------------------------------------------------------------------

    async def run_python_session(self, args: dict[str, Any], ctx: ToolContext) -> str:
        """The ``python_session`` tool: run ``code`` in this session's own kernel.

        The session is ``ctx.session_id``; its kind is ``ctx.extras["session_kind"]``
        (default ``master``). A session whose kernel was evicted or died gets a fresh kernel
        and the output starts with a notice that its variables were lost. Raises
        ``ToolError`` on bad arguments, without a session, or when the kernel cannot start.
        """
        code, timeout = parse_arguments(args, self.limits)
        if not self.enabled or self._closed:
            raise ToolError("the code tools are not available on this worker right now")
        key = ctx.session_id
        if not key:
            raise ToolError("python_session needs a conversation session; use 'python' instead")
        kind = str(ctx.extras.get("session_kind") or DEFAULT_SESSION_KIND)
        agent = "" if ctx.owner_id is None else str(ctx.owner_id)
        session, notice = await self._locked_session(key, kind=kind, agent=agent)
        # The lock is held from here on: the session is busy, so never a victim.
        try:
            session.running_turn = ctx.run_id or PYTHON_SESSION_TOOL
            session.touch()
            try:
                result = await session.client.run(code, timeout=timeout)
            except SageError as exc:  # the kernel vanished between the check and the call
                result = InterpreterResult(
                    stdout="",
                    stderr="",
                    error=exc.message,
                    ok=False,
                    duration_ms=0.0,
                    killed=True,
                )
            session.turns += 1
            session.touch()
        finally:
            session.running_turn = None
            session.lock.release()
        text = format_result(result)
        if result.killed:
            # The agent is told right here, so the next call starts fresh without a notice.
            await self.sessions.close(key)
            text = f"{text}\n{KILLED_NOTICE}"
        return text if notice is None else f"{notice}\n{text}"

    async def _locked_session(
        self, key: str, *, kind: str, agent: str
    ) -> tuple[LiveSession, str | None]:
        """The live session for ``key`` with its lock held, plus a lost-variables notice.

        A fresh kernel is booted when there is none; the notice is set when the pool had
        evicted the previous kernel or it had died.
        """
        notice: str | None = None
        for _ in range(4):
            session = self.sessions.get(key)
            if session is None:
                creating = self._creating.get(key)
                if creating is None:
                    creating = self._creating[key] = asyncio.Lock()
                async with creating:
                    if self.sessions.get(key) is None:
                        if self.sessions.was_evicted(key):
                            notice = EVICTED_NOTICE
                        return await self._new_session(key, kind=kind, agent=agent), notice
                continue
            await session.lock.acquire()
            if self.sessions.get(key) is not session:
                # Closed while this call waited for the lock: start over (and notice why).
                session.lock.release()
                continue
            if not session.client.alive:
                # Killed while parked (the OOM killer, an operator): its variables are gone.
                session.lock.release()
                await self.sessions.close(key)
                notice = DIED_NOTICE
                continue
            return session, notice
        raise ToolError("the session's Python kernel keeps disappearing; try again later")

    async def _new_session(self, key: str, *, kind: str, agent: str) -> LiveSession:
        """Boot a kernel for ``key`` and register it, locked (busy, so never evicted)."""
        # Room first: where there is no memory limit the pool holds fewer than ``max_live``
        # kernels afterwards, so this one fits; under a cgroup limit victims go one by one.
        await self.sessions.make_room()
        kernel = KernelClient(limits=self.limits)
        try:
            await kernel.connect()
        except (SageError, TimeoutError) as exc:
            await kernel.disconnect()
            raise ToolError("the session's Python kernel could not start") from exc
        except BaseException:
            await kernel.disconnect()
            raise
        session = LiveSession(
            key=key, agent=agent, kind=kind, client=kernel, session_id=key, resumed=False
        )
        await session.lock.acquire()  # uncontended: a brand-new lock
        if self._closed:
            session.lock.release()
            await close_session(session)
            raise ToolError("the code tools are not available on this worker right now")
        displaced = self.sessions.add(session)
        if displaced is not None:
            await close_session(displaced)
        return session
