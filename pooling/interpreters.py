"""Warm Python interpreter subprocesses for the ``python`` and ``python_session`` tools.

**This is resource isolation, NOT a security sandbox.** A snippet runs as the same OS user as
the worker, can read any file that user can read, open network connections, spawn processes
and lift its own soft CPU limit. What this module does guarantee is bounded *resource* use
and a clean slate of *configuration*:

* each interpreter is a separate ``python -I -S`` process (isolated mode: no user site, no
  ``PYTHON*`` variables, no site-packages) in its own session and process group, so it can be
  killed as a whole, children included;
* its environment is built from scratch — ``PATH`` and ``LANG`` only — so no secret of the
  worker (``OPENAI_API_KEY``, database passwords) is inherited;
* CPU time (``RLIMIT_CPU``, re-armed before every snippet), address space (``RLIMIT_AS``) and
  wall-clock time (the parent kills the group on timeout) are limited, core dumps are off,
  and captured output is capped (64 KiB per stream by default);
* stdin/stdout of the process carry a length-prefixed protocol on private file descriptors
  (the snippet's own fds 0 and 1 point at ``/dev/null``); the parent validates every
  response and kills a child that breaks the protocol. The driver imports only built-ins so
  a boot costs little more than a bare interpreter start.

Operators enable the code tools explicitly (``SAGE_CODE_TOOLS=1``); host them on a machine
where the worker's user holds nothing you would not show the agent.

Two flavours share the mechanism: :class:`WarmInterpreter` (stateless: a fresh namespace per
snippet, killed-and-replaced on a limit breach, recycled after ``recycle_after`` snippets;
the states of an :class:`~pooling.elastic.ElasticPool`) and :class:`KernelClient` (stateful:
the namespace persists across calls; the ``client`` of a ``pooling.sessions.LiveSession``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import psutil

from pooling.elastic import ElasticPool, pool_with_spares
from sageproject.errors import ErrorCategory, SageError

DEFAULT_OUTPUT_BYTES = 64 * 1024
# Responses are one JSON line; escaping can blow 64 KiB of output up several times.
_READ_LIMIT = 8 * 1024 * 1024
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# The child side. Kept dependency-free (stdlib only) because it runs under ``-I -S``.
DRIVER = r"""
# ``_signal``, not ``signal``: the latter imports enum, functools and collections, which
# cost about a third of a boot for two constants.
import _ast, _signal, os, resource, sys, time

CPU, MEM, CAP, PERSIST = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
ONLY_AST = 0x400  # PyCF_ONLY_AST; avoids importing ``ast`` (a third of the boot time)


class Capped:
    def __init__(self):
        self.parts, self.size, self.truncated = [], 0, False

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError("write() argument must be str")
        room = CAP - self.size
        if room > 0:
            piece = text[:room]
            self.parts.append(piece)
            self.size += len(piece)
        if len(text) > max(room, 0):
            self.truncated = True
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False

    def value(self):
        return "".join(self.parts)


running = False


def on_sigint(signum, frame):
    # Interrupts only ever abort a running snippet, never the protocol loop: the first one
    # disarms itself, so another arriving while the snippet's error is written is ignored.
    global running
    if running:
        running = False
        raise KeyboardInterrupt


def describe(exc):
    import traceback  # lazily: only failing snippets pay for it

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<snippet>":
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb, limit=-8))


def run(code, namespace):
    tree = compile(code, "<snippet>", "exec", ONLY_AST)
    tail = None
    if tree.body and isinstance(tree.body[-1], _ast.Expr):
        tail = _ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<snippet>", "exec"), namespace)
    if tail is not None:
        value = eval(compile(tail, "<snippet>", "eval"), namespace)
        if value is not None:
            print(repr(value))


def main():
    global running
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if MEM:
        resource.setrlimit(resource.RLIMIT_AS, (MEM, MEM))
    _signal.signal(_signal.SIGINT, on_sigint)
    namespace = {"__name__": "__main__"}
    proto_out.write(b"ready %d\n" % os.getpid())
    proto_out.flush()
    while True:
        header = proto_in.readline()
        if not header:
            return
        code = proto_in.read(int(header)).decode("utf-8", "replace")
        if not PERSIST:
            namespace = {"__name__": "__main__"}
        out, err = Capped(), Capped()
        sys.stdout, sys.stderr = out, err
        ok, error = 1, ""
        if CPU:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(usage.ru_utime + usage.ru_stime) + 1 + CPU
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        try:
            running = True
            run(code, namespace)
        except SystemExit as exc:
            ok, error = 0, "SystemExit: %r" % (exc.code,)
        except BaseException as exc:
            ok, error = 0, describe(exc)
        finally:
            running = False
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        parts = [
            part.encode("utf-8", "replace")
            for part in (out.value(), err.value(), error[-CAP:])
        ]
        truncated = int(out.truncated or err.truncated)
        sizes = b" ".join(b"%d" % len(part) for part in parts)
        proto_out.write(b"%d %d %s\n" % (ok, truncated, sizes) + b"".join(parts))
        proto_out.flush()


main()
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class InterpreterLimits:
    """Per-snippet limits; 0 disables the CPU or memory limit."""

    cpu_seconds: int = 10
    memory_bytes: int = 512 * 1024 * 1024
    wall_seconds: float = 30.0
    output_bytes: int = DEFAULT_OUTPUT_BYTES
    boot_seconds: float = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class InterpreterResult:
    """What one snippet produced. ``killed`` means the process was killed by a limit."""

    stdout: str
    stderr: str
    error: str
    ok: bool
    duration_ms: float
    killed: bool = False
    truncated: bool = False


def minimal_env() -> dict[str, str]:
    """The whole environment a snippet sees: built from scratch, never inherited."""
    return {"PATH": _SAFE_PATH, "LANG": "C.UTF-8"}


class _ProtocolViolation(Exception):
    """The child wrote something that is not a well-formed response."""


class _DriverProcess:
    """One driver subprocess and the request/response plumbing around it."""

    def __init__(self, *, limits: InterpreterLimits, persistent: bool, cwd: str) -> None:
        self.limits = limits
        self.persistent = persistent
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: asyncio.StreamReader | None = None
        self._transport: asyncio.ReadTransport | None = None
        # One snippet at a time per process: the protocol is strictly request/response.
        self.lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def spawn(self) -> None:
        limits = self.limits
        argv = [
            sys.executable, "-I", "-S", "-c", DRIVER,
            str(limits.cpu_seconds), str(limits.memory_bytes), str(limits.output_bytes),
            "1" if self.persistent else "0",
        ]
        # fork+exec runs in a thread: done on the loop, a batch of boots stalls every other
        # coroutine of the worker for tens of milliseconds.
        self.proc = await asyncio.to_thread(
            subprocess.Popen,
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=minimal_env(),
            cwd=self.cwd,
            start_new_session=True,
        )
        try:
            loop = asyncio.get_running_loop()
            self.reader = asyncio.StreamReader(limit=_READ_LIMIT)
            reader = self.reader
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), self.proc.stdout
            )
            self._transport = transport
            line = await asyncio.wait_for(reader.readline(), limits.boot_seconds)
            if not line.startswith(b"ready "):
                raise SageError(
                    "tool.interpreter_boot_failed",
                    "the Python interpreter exited during start-up",
                    category=ErrorCategory.UNAVAILABLE,
                    retryable=True,
                )
        except BaseException:
            await self.kill()
            raise

    async def request(self, code: str, wall_seconds: float | None) -> InterpreterResult:
        """Run ``code``; on a wall-clock timeout or a dead process, kill the group."""
        proc, reader = self.proc, self.reader
        if proc is None or reader is None or proc.poll() is not None:
            raise SageError(
                "tool.interpreter_lost",
                "the Python interpreter is no longer running",
                category=ErrorCategory.RESOURCE_LOST,
            )
        wall = self.limits.wall_seconds if wall_seconds is None else wall_seconds
        started = time.monotonic()
        payload = code.encode("utf-8", "replace")
        try:
            async with asyncio.timeout(wall):
                # A blocking pipe write in a thread: the child reads promptly, and a large
                # snippet must not stall the loop while the pipe buffer drains.
                await asyncio.to_thread(_write_all, proc, b"%d\n" % len(payload) + payload)
                response = await self._read_response(reader)
        except TimeoutError:
            await self.kill()
            return self._killed(started, f"wall-clock limit of {wall:g}s exceeded; process killed")
        except (OSError, asyncio.IncompleteReadError):
            response = None
        except _ProtocolViolation:
            await self.kill()
            return self._killed(started, "the interpreter broke the protocol; process killed")
        except BaseException:
            # Cancelled mid-snippet: the process is in an unknown state, so it cannot be kept.
            await self.kill()
            raise
        if response is None:
            returncode = await self._reap()
            reason = (
                "CPU time limit exceeded; process killed"
                if returncode in (-signal.SIGXCPU, -signal.SIGKILL)
                else f"the interpreter exited unexpectedly (code {returncode})"
            )
            await self.kill()
            return self._killed(started, reason)
        ok, truncated, stdout, stderr, error = response
        cap = self.limits.output_bytes
        return InterpreterResult(
            stdout=_cap(stdout, cap),
            stderr=_cap(stderr, cap),
            error=_cap(error, cap),
            ok=ok,
            duration_ms=(time.monotonic() - started) * 1000.0,
            truncated=truncated,
        )

    async def _read_response(
        self, stdout: asyncio.StreamReader
    ) -> tuple[bool, bool, str, str, str] | None:
        """Parse ``ok truncated n1 n2 n3\\n`` + three UTF-8 payloads; ``None`` on EOF.

        The child runs untrusted code that can reach the protocol fd, so every field is
        validated and sizes are bounded; a malformed response raises ``_ProtocolViolation``.
        """
        try:
            header = await stdout.readline()
        except ValueError as exc:  # a header line past the stream limit
            raise _ProtocolViolation from exc
        if not header:
            return None
        bound = 4 * self.limits.output_bytes + 4096
        try:
            ok, truncated, *sizes = (int(field) for field in header.split())
        except ValueError as exc:
            raise _ProtocolViolation from exc
        if len(sizes) != 3 or any(not 0 <= size <= bound for size in sizes):
            raise _ProtocolViolation
        body = await stdout.readexactly(sum(sizes))
        texts = []
        offset = 0
        for size in sizes:
            texts.append(body[offset : offset + size].decode("utf-8", "replace"))
            offset += size
        return bool(ok), bool(truncated), texts[0], texts[1], texts[2]

    def interrupt(self) -> None:
        if self.proc is not None and self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)

    async def kill(self, wait_seconds: float = 5.0) -> None:
        """Kill the whole process group and any escaped descendants; wait a bounded time."""
        proc = self.proc
        if proc is None:
            return
        descendants: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            descendants = psutil.Process(proc.pid).children(recursive=True)
        # The group id equals the pid thanks to start_new_session=True.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for child in descendants:
            with contextlib.suppress(psutil.Error):
                child.kill()
        await self._reap(wait_seconds)
        if descendants:
            await asyncio.to_thread(psutil.wait_procs, descendants, wait_seconds)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()

    async def _reap(self, wait_seconds: float = 5.0) -> int | None:
        """Wait (bounded, off the loop) for the process to exit; its return code or None."""
        proc = self.proc
        assert proc is not None
        try:
            return await asyncio.to_thread(proc.wait, wait_seconds)
        except subprocess.TimeoutExpired:
            return None

    @staticmethod
    def _killed(started: float, reason: str) -> InterpreterResult:
        return InterpreterResult(
            stdout="",
            stderr="",
            error=reason,
            ok=False,
            duration_ms=(time.monotonic() - started) * 1000.0,
            killed=True,
        )


def _write_all(proc: subprocess.Popen[bytes], data: bytes) -> None:
    assert proc.stdin is not None
    proc.stdin.write(data)
    proc.stdin.flush()


def _cap(text: str, limit: int) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore")


class WarmInterpreter:
    """A pre-booted, stateless Python subprocess: one snippet at a time, fresh namespace each.

    A limit breach kills the process and a replacement is booted before ``run`` returns, so a
    state taken from the pool is always usable. Modules imported by one snippet stay imported
    for the next (that is what keeps it warm); ``recycle_after`` bounds how long such leftovers
    live.
    """

    def __init__(self, *, limits: InterpreterLimits, recycle_after: int, cwd: str) -> None:
        self._driver = _DriverProcess(limits=limits, persistent=False, cwd=cwd)
        self._recycle_after = recycle_after
        self._cwd = cwd
        self.runs = 0
        self.replacements = 0

    @classmethod
    async def boot(
        cls, *, limits: InterpreterLimits | None = None, recycle_after: int = 100
    ) -> WarmInterpreter:
        """Start an interpreter and wait until it is ready.

        Raises ``SageError`` (``tool.interpreter_boot_failed``) if it dies during start-up
        and ``TimeoutError`` if it is not ready within ``limits.boot_seconds``.
        """
        cwd = tempfile.mkdtemp(prefix="sage-py-")
        interp = cls(limits=limits or InterpreterLimits(), recycle_after=recycle_after, cwd=cwd)
        try:
            await interp._driver.spawn()
        except BaseException:
            shutil.rmtree(cwd, ignore_errors=True)
            raise
        return interp

    @property
    def pid(self) -> int | None:
        return self._driver.pid

    @property
    def limits(self) -> InterpreterLimits:
        return self._driver.limits

    # ``timeout`` is the child's wall-clock limit, enforced by killing it, not a cancel scope.
    async def run(self, code: str, *, timeout: float | None = None) -> InterpreterResult:  # noqa: ASYNC109
        """Run ``code`` in a fresh namespace and return its :class:`InterpreterResult`.

        ``timeout`` overrides the wall-clock limit. A killed run is reported with
        ``killed=True`` (not raised); the process is replaced before returning. Raises
        ``SageError`` ``tool.interpreter_boot_failed`` only if a replacement cannot start.
        """
        async with self._driver.lock:
            if not self._driver.alive:
                # Died while parked (OOM killer) or a replacement failed: boot afresh here.
                await self._replace(counted=True)
            result = await self._driver.request(code, timeout)
            self.runs += 1
            if result.killed or (self._recycle_after and self.runs % self._recycle_after == 0):
                await self._replace(counted=result.killed)
            return result

    async def close(self) -> None:
        """Kill the process group (bounded wait) and remove the working directory."""
        await self._driver.kill()
        shutil.rmtree(self._cwd, ignore_errors=True)

    async def _replace(self, *, counted: bool) -> None:
        await self._driver.kill()
        await self._driver.spawn()
        if counted:
            self.replacements += 1


async def close_interpreter(interp: WarmInterpreter) -> None:
    """The ``closer`` of an interpreter pool."""
    await interp.close()


def interpreter_pool(
    *,
    max_size: int,
    limits: InterpreterLimits | None = None,
    resident: int = 1,
    janitor_interval: float = 30.0,
    spares: int = 0,
) -> ElasticPool[WarmInterpreter]:
    """An :class:`ElasticPool` of warm interpreters for one tool source.

    ``spares`` > 0 wraps the boot in a :class:`~pooling.elastic.SpareFactory`: that many
    interpreters boot ahead of demand while the pool grows, so a miss rarely waits a whole
    boot; the janitor trims them to one when the pool sits idle; they close with the pool.
    """

    pool, _spares = pool_with_spares(
        partial(WarmInterpreter.boot, limits=limits),
        close_interpreter,
        spares=spares,
        max_size=max_size,
        resident=resident,
        janitor_interval=janitor_interval,
    )
    return pool


@dataclass(slots=True)
class _Pending:
    code: str
    timeout: float | None
    result: InterpreterResult | None = field(default=None)


class KernelClient:
    """A stateful Python kernel for ``python_session``: the namespace persists across calls.

    Follows the agent-client shape a ``LiveSession`` expects: ``await connect()``,
    ``await query(code)``, ``async for result in receive_response()`` (yields one
    :class:`InterpreterResult`), ``await interrupt()`` (``KeyboardInterrupt`` in the running
    snippet; the namespace survives), ``await disconnect()``; plus ``pid``. A limit breach
    kills the kernel: its variables are gone and the next ``query`` raises ``SageError``
    ``tool.interpreter_lost`` (RESOURCE_LOST) until ``connect()`` is called again.
    """

    def __init__(self, *, limits: InterpreterLimits | None = None) -> None:
        self._limits = limits or InterpreterLimits()
        self._cwd: str | None = None
        self._driver: _DriverProcess | None = None
        self._pending: _Pending | None = None

    @property
    def pid(self) -> int | None:
        return self._driver.pid if self._driver is not None else None

    @property
    def alive(self) -> bool:
        return self._driver is not None and self._driver.alive

    async def connect(self) -> None:
        """Start (or restart, with an empty namespace) the kernel process."""
        if self._driver is not None:
            await self._driver.kill()
        if self._cwd is None:
            self._cwd = tempfile.mkdtemp(prefix="sage-kernel-")
        self._driver = _DriverProcess(limits=self._limits, persistent=True, cwd=self._cwd)
        await self._driver.spawn()

    async def query(self, code: str, *, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Queue ``code`` for the next ``receive_response()``.

        Raises ``SageError`` ``tool.interpreter_lost`` when the kernel is not running.
        """
        if not self.alive:
            raise SageError(
                "tool.interpreter_lost",
                "the session's Python kernel is not running; its variables were lost",
                category=ErrorCategory.RESOURCE_LOST,
            )
        self._pending = _Pending(code=code, timeout=timeout)

    async def receive_response(self) -> AsyncIterator[InterpreterResult]:
        """Run the queued code and yield its single :class:`InterpreterResult`."""
        pending, self._pending = self._pending, None
        if pending is None or self._driver is None:
            return
        async with self._driver.lock:
            result = await self._driver.request(pending.code, pending.timeout)
        yield result

    async def run(self, code: str, *, timeout: float | None = None) -> InterpreterResult:  # noqa: ASYNC109
        """``query`` + ``receive_response`` in one call; returns the result."""
        await self.query(code, timeout=timeout)
        async for result in self.receive_response():
            return result
        raise SageError("tool.interpreter_lost", "the kernel produced no response",
                        category=ErrorCategory.RESOURCE_LOST)

    async def interrupt(self) -> None:
        """Send ``KeyboardInterrupt`` to the running snippet (no-op when idle)."""
        if self._driver is not None:
            self._driver.interrupt()

    async def disconnect(self) -> None:
        """Kill the kernel's whole process group (bounded wait); remove its directory."""
        if self._driver is not None:
            await self._driver.kill()
        if self._cwd is not None:
            shutil.rmtree(self._cwd, ignore_errors=True)
            self._cwd = None
