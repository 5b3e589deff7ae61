"""``make test``: the whole suite on SQLite, then the storage tests on each server database
(on PostgreSQL with the reduced torture checks of ``tests/torture``).

PostgreSQL and MySQL/MariaDB are used when reachable; with CI=true they are required and
an unreachable one fails the run. pytest's exit code 5 (no tests ran) counts as failure.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
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


def run(label: str, url: str, args: list[str]) -> tuple[int, str]:
    env = {**os.environ, "DATABASE_URL": url, "SAGE_TEST_DB_NAME": f"test_sage_{os.getpid()}"}
    if url.startswith("sqlite"):
        env.pop("SAGE_TEST_DB_NAME")
    print(f"\n=== {label}: pytest {' '.join(args)}", flush=True)
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tail = ""
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(line)
        tail = line.strip() or tail
    code = process.wait()
    elapsed = time.monotonic() - started
    summary = re.sub(r"^=+\s*|\s*=+$", "", tail)
    print(f"=== {label}: exit {code} in {elapsed:.0f}s — {summary}", flush=True)
    return code, summary


def main() -> int:
    extra = sys.argv[1:]
    results: list[tuple[str, int, str]] = []
    code, summary = run("SQLite", "sqlite:///:memory:", ["-q", *extra])
    results.append(("SQLite (whole suite)", code, summary))
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
        code, summary = run(label, url, ["-q", "-m", marker, *extra])
        results.append((f"{label} ({marker.replace(' or ', ' + ')} tests)", code, summary))
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
    print(f"total: {totals['passed']} passed, {totals['failed']} failed, "
          f"{totals['skipped']} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
