"""The built-in ``python_script`` job kind: a Python script in a resource-limited subprocess.

Enabled only when the operator sets ``SAGE_CODE_TOOLS=1``; otherwise the kind is not
registered and ``submit`` answers ``job.kind_unsupported``.

What it gives: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), open files and
a wall-clock limit; a minimal environment (no inherited variables, so no secrets from the
host's environment); a fresh temporary working directory; its own process group, killed as a
whole on cancel or timeout; stdout and stderr streamed as job output.

What it does NOT give: this is **resource isolation, not a security sandbox**. The script
runs as the worker's user, can read whatever that user can read, and can use the network.
Enable it only for trusted users, or run Celery job workers in a container/VM boundary.

Payload: ``{"script": str, "args": [str], "timeout_seconds": float, "cpu_seconds": int,
"memory_mb": int}``; limits default to 60 s wall, 30 s CPU, 512 MiB and are capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agents.jobs.base import Emit, JobCompletion, JobSpec, invalid_argument

DEFAULT_TIMEOUT_SECONDS = 60.0
MAX_TIMEOUT_SECONDS = 3600.0
DEFAULT_CPU_SECONDS = 30
MAX_CPU_SECONDS = 3600
DEFAULT_MEMORY_MB = 512
MAX_MEMORY_MB = 8192
MAX_SCRIPT_CHARS = 1_000_000
_READ_SIZE = 65536

# Runs inside the child before the user's script: limits are set by the child on itself,
# so the parent never needs preexec_fn (unsafe in a threaded Celery worker).
_BOOTSTRAP = """
import resource, runpy, sys
cpu, mem = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
path = sys.argv[3]
sys.argv = [path] + sys.argv[4:]
runpy.run_path(path, run_name="__main__")
"""


def _bounded(payload: Mapping[str, Any], name: str, default: float, cap: float) -> float:
    value = payload.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise invalid_argument(f"{name} must be a positive number")
    return min(float(value), cap)


def _minimal_env(workdir: str) -> dict[str, str]:
    # Nothing inherited: the worker's environment holds database URLs and API keys.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    # The child leads its own group (process_group=0), so its pid is the group id and
    # grandchildren it forked die with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


async def _pump(reader: asyncio.StreamReader | None, stream: str, emit: Emit) -> None:
    if reader is None:
        return
    while True:
        data = await reader.read(_READ_SIZE)
        if not data:
            return
        await emit(stream, data)


async def python_script_runner(
    spec: JobSpec, emit: Emit, cancel_event: asyncio.Event
) -> JobCompletion:
    """Run ``payload["script"]``; returns its exit code, raises ``TimeoutError`` past the wall."""
    payload = spec.payload
    script = payload.get("script")
    if not isinstance(script, str) or not script.strip():
        raise invalid_argument("payload.script must be a non-empty string")
    if len(script) > MAX_SCRIPT_CHARS:
        raise invalid_argument(f"payload.script exceeds {MAX_SCRIPT_CHARS} characters")
    args = payload.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise invalid_argument("payload.args must be a list of strings")
    timeout = _bounded(payload, "timeout_seconds", DEFAULT_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS)
    cpu = int(_bounded(payload, "cpu_seconds", DEFAULT_CPU_SECONDS, MAX_CPU_SECONDS))
    memory = int(_bounded(payload, "memory_mb", DEFAULT_MEMORY_MB, MAX_MEMORY_MB)) * 1024 * 1024

    with tempfile.TemporaryDirectory(prefix="sage-job-") as workdir:
        path = os.path.join(workdir, "script.py")
        await asyncio.to_thread(Path(path).write_text, script, encoding="utf-8")
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            _BOOTSTRAP,
            str(cpu),
            str(memory),
            path,
            *args,
            cwd=workdir,
            env=_minimal_env(workdir),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            process_group=0,
        )
        pumps = asyncio.gather(
            _pump(proc.stdout, "stdout", emit), _pump(proc.stderr, "stderr", emit)
        )
        try:
            async with asyncio.timeout(timeout):
                await pumps
                exit_code = await proc.wait()
        except TimeoutError:
            raise TimeoutError(
                f"python_script exceeded its {timeout:g} s wall-clock limit"
            ) from None
        finally:
            # Runs on success, timeout and cancellation alike: never leave a process behind.
            _kill_group(proc)
            pumps.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pumps
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    await asyncio.shield(proc.wait())
    return JobCompletion(exit_code=exit_code, usage={"cpu_seconds_limit": cpu})
