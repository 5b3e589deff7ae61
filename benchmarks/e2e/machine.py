"""What the machine was doing while a path ran: its steal time and speed (every line
carries them) and the CPU time of the processes a path drives (psutil, imported lazily:
a bench-only need)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from django.db import connections


def cpu_jiffies() -> tuple[int, int] | None:
    """The machine's stolen and total CPU time so far (Linux ``/proc/stat``, in clock
    ticks): steal is the time a virtual machine's CPUs waited for the hypervisor, which
    gave it to other machines. None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal (guest time is counted in user).
    ticks = [int(value) for value in fields[1:9]]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def cpu_speed(seconds: float = 0.2) -> float:
    """How fast one CPU runs Python now: millions of iterations per second of a fixed loop,
    for ``seconds``. The same machine gives about the same figure from run to run; a shared
    virtual machine whose host is busy can run at half of it without any steal."""
    count = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(10_000):
            count += 1
    return round(count / seconds / 1e6, 1)


def cpu_by_process(processes: list[Any]) -> dict[int, float]:
    """CPU time (user + system) used so far by each of ``processes`` (psutil), by process
    id; processes that are gone or not ours are left out."""
    import psutil

    used = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            used[process.pid] = times.user + times.system
    return used


def process_tree(pid: int) -> list[Any]:
    """The process ``pid`` and its descendants (psutil), or none once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def database_processes() -> list[Any]:
    """The database server's processes on this machine (psutil: PostgreSQL's postmaster
    and backends, MariaDB's server); none for SQLite (the database runs in its callers)
    or a server elsewhere."""
    import psutil

    names = {"postgresql": ("postgres",), "mysql": ("mariadbd", "mysqld")}.get(
        connections["default"].vendor, ()
    )
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] in names]


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two `cpu_by_process` readings (a process that began
    between them counts whole)."""
    return sum(used - before.get(pid, 0.0) for pid, used in after.items())
