"""``make test``: the whole suite on SQLite and, side by side, the storage tests on each
server database (on PostgreSQL with the reduced torture checks of ``tests/torture``).

PostgreSQL and MySQL/MariaDB are used when reachable; with CI=true they are required and
an unreachable one fails the run. pytest's exit code 5 (no tests ran) counts as failure.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any
from urllib.parse import urlsplit

CI = os.environ.get("CI", "").lower() == "true"
SERVERS = [
    (
        "PostgreSQL",
        os.environ.get("SAGE_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
    ),
    ("MySQL", os.environ.get("SAGE_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")),
]


def reachable(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=2):
            return True
    except OSError:
        return False


def start(label: str, url: str, args: list[str]) -> tuple[subprocess.Popen, Any]:
    """Start one database's pytest run; its output goes to a temporary file."""
    env = {**os.environ, "DATABASE_URL": url, "SAGE_TEST_DB_NAME": f"test_sage_{os.getpid()}"}
    if url.startswith("sqlite"):
        env.pop("SAGE_TEST_DB_NAME")
    # A local directory of its own: the runs side by side must not share the wake-up and
    # live sockets (a worker of one sends to every socket there, and a socket queues only
    # a few datagrams — another run's traffic filled it and its deltas were lost).
    local = tempfile.mkdtemp(prefix=f"sage-{label.split()[0].lower()}-")
    atexit.register(shutil.rmtree, local, True)
    env["SAGE_LOCAL_DIR"] = local
    print(f"=== {label}: pytest {' '.join(args)} (started)", flush=True)
    log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, log


def finish(label: str, process: subprocess.Popen, log: Any, started: float) -> tuple[int, str]:
    """Wait for a run, print its whole output in one piece, and return (exit code, the
    pytest summary line)."""
    code = process.wait()
    elapsed = time.monotonic() - started
    log.seek(0)
    output = log.read()
    log.close()
    print(f"\n=== {label}", flush=True)
    sys.stdout.write(output)
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    summary = re.sub(r"^=+\s*|\s*=+$", "", lines[-1] if lines else "")
    print(f"=== {label}: exit {code} in {elapsed:.0f}s — {summary}", flush=True)
    return code, summary


def main() -> int:
    extra = sys.argv[1:]
    results: list[tuple[str, int, str]] = []
    # The databases' runs go side by side (separate databases, separate processes): most of
    # a run is waiting on workers, servers and subprocesses, so together they take little
    # longer than the longest alone.
    phases = [("SQLite (whole suite)", "sqlite:///:memory:", ["-q", *extra])]
    for label, url in SERVERS:
        if not reachable(url):
            if CI:
                print(f"=== {label}: NOT reachable at {url} — required under CI=true", flush=True)
                results.append((label, 1, "unreachable"))
            else:
                print(
                    f"=== {label}: not reachable at {url}; its storage tests are SKIPPED "
                    "(CI=true makes this a failure)",
                    flush=True,
                )
            continue
        # PostgreSQL also runs the reduced torture checks (tests/torture; SQLite runs them
        # in the whole suite): hostile input and broken upstreams against a live host.
        marker = "storage or torture" if label == "PostgreSQL" else "storage"
        phases.append(
            (f"{label} ({marker.replace(' or ', ' + ')} tests)", url, ["-q", "-m", marker, *extra])
        )
    started = time.monotonic()
    running = [(label, *start(label, url, args)) for label, url, args in phases]
    for label, process, log in running:
        code, summary = finish(label, process, log, started)
        results.append((label, code, summary))
    print("\n=== summary")
    failed = False
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for label, code, summary in results:
        # Exit code 5 means pytest collected no tests: a suite that tests nothing fails.
        verdict = "ok" if code == 0 else ("NO TESTS RAN" if code == 5 else "FAILED")
        failed |= code != 0
        print(f"{label:32} {verdict:12} {summary}")
        for count, word in re.findall(r"(\d+) (passed|failed|skipped|error)", summary):
            totals["failed" if word == "error" else word] += int(count)
        if code != 0 and not re.search(r"\d+ (failed|error)", summary):
            totals["failed"] += 1  # a run that broke without a count still fails the total
    print(
        f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
