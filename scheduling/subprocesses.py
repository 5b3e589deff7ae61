"""Subprocesses of the host's own tools: the end-to-end benchmark's web, worker and model
processes, the fault tests' workers and the torture checks' live host (Django-free).

A `Subprocess` runs in its own session, from the project's root, with its output (stdout and
stderr) in a log file, and is stopped by its pid: SIGTERM, then SIGKILL at a deadline.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Subprocess:
    """One subprocess in its own session; stdout and stderr go to ``log`` (truncated)."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it ended (negative: the signal), else None."""
        return self.proc.poll()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        """Everything it has written so far ("" before its log exists)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of its output."""
        return self.output()[-chars:]

    def stop(self, grace: float = 20.0) -> int:
        """SIGTERM (a graceful stop), SIGKILL after ``grace`` seconds; returns the exit
        status."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)
