"""``python -m tests.torture`` (``make torture``): every torture check, then one table.

For each database — SQLite (a file), then PostgreSQL and MySQL/MariaDB when reachable
(required with ``CI=true``) — one pytest run of:

- the torture checks (``tests/torture``: schemathesis, the cross-user matrix, the
  credential canary, the upstream fault catalogue, the submission flood) on SQLite and
  PostgreSQL;
- the fault tests (``tests/scheduling/test_lifecycle_faults.py``: kill -9 at every commit
  boundary and the chaos run; ``tests/scheduling/test_database_outages.py``: a frozen
  claim and PostgreSQL restarted under load on a cluster of its own) on every database;
- the simulated hosts (``tests/hosts/test_hosts.py``: three worker hosts, 300 runs of 10
  users, a host's link cut for longer than its lease; jobs on Celery hosts, one killed
  mid-job) — on a PostgreSQL cluster of their own, so in the SQLite run only.

Full size by default (``SAGE_TORTURE=1``: 10,000 submissions, 100 schemathesis examples
per operation with the stateful phase, 20 kills over 400 runs); ``--reduced`` runs the
form ``make test`` runs. Each check prints one line (name, result, database, figures) as
it ends; the table at the end has one row per check and a column per database. The exit
status is 1 when any check failed or any pytest run failed without a count.

    python -m tests.torture                       # full: SQLite, PostgreSQL, MySQL
    python -m tests.torture --reduced --databases sqlite
    python -m tests.torture -- -k flood           # extra pytest arguments after --
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from tests.runner import CI, SERVERS, reachable

CHECKS = ["tests/torture"]
FAULT_TESTS = [
    "tests/scheduling/test_lifecycle_faults.py",
    "tests/scheduling/test_database_outages.py",
    # Not storage tests: their own cluster, whatever the database; run with SQLite's.
    "tests/hosts/test_hosts.py",
]
DATABASES = {"sqlite": ("SQLite", "sqlite:///:memory:"), **{
    label.lower(): (label, url) for label, url in SERVERS
}}  # fmt: skip
CHECK_DATABASES = {"sqlite", "postgresql"}


@dataclass(frozen=True, slots=True)
class Row:
    database: str
    check: str
    result: str  # PASS, FAIL, SKIP
    seconds: float
    figures: dict


def _short(name: str, limit: int = 48) -> str:
    """A fault test's name for the table: ``faults:`` and its words cut at ``limit``, its
    parameter kept."""
    words, bracket, param = name.partition("[")
    if len(words) > limit:
        words = words[: limit - 1] + "…"
    return "faults:" + words + bracket + param


def _rows(database: str, report: Path) -> list[Row]:
    """One row per test of a JUnit XML report (its ``check`` and ``figures`` properties
    where the torture conftest set them)."""
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        if case.find("failure") is not None or case.find("error") is not None:
            result = "FAIL"
        elif case.find("skipped") is not None:
            result = "SKIP"
        else:
            result = "PASS"
        name = properties.get("check") or _short(case.get("name", "?").removeprefix("test_"))
        figures = json.loads(properties.get("figures") or "{}")
        rows.append(Row(database, name, result, float(case.get("time") or 0), figures))
    return rows


def _run(
    label: str, url: str, targets: list[str], extra: list[str], reduced: bool
) -> tuple[int, list[Row], float]:
    report = Path(tempfile.mkdtemp(prefix="torture-")) / "report.xml"
    env = {**os.environ, "DATABASE_URL": url}
    env.pop("SAGE_TORTURE", None)
    if not reduced:
        env["SAGE_TORTURE"] = "1"
    if url.startswith("sqlite"):
        env.pop("SAGE_TEST_DB_NAME", None)
    else:
        env["SAGE_TEST_DB_NAME"] = f"t_tort_{uuid.uuid4().hex[:10]}"
    marker = "storage or torture" if CHECKS[0] in targets else "storage"
    select = [] if url.startswith("sqlite") else ["-m", marker]
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += [*select]
    argv += [f"--junitxml={report}", *targets, *extra]
    print(f"\n=== torture on {label}: {' '.join(argv[3:])}", flush=True)
    began = time.monotonic()
    code = subprocess.run(argv, env=env, check=False).returncode
    elapsed = time.monotonic() - began
    rows = _rows(label, report) if report.exists() else []
    for row in rows:
        if row.check.startswith("faults:"):  # the torture checks printed their own line
            print(f"torture {row.check:38} {row.result:4} {label:10} seconds={row.seconds:.0f}")
    print(f"=== torture on {label}: exit {code} in {elapsed:.0f}s", flush=True)
    return code, rows, elapsed


def _table(rows: list[Row], labels: list[str]) -> str:
    checks = list(dict.fromkeys(row.check for row in rows))
    cell = {(row.check, row.database): f"{row.result} {row.seconds:.0f}s" for row in rows}
    width = max([len(c) for c in checks] + [5]) + 2
    lines = ["check".ljust(width) + "".join(label.ljust(16) for label in labels)]
    for check in checks:
        lines.append(
            check.ljust(width) + "".join(cell.get((check, lb), "-").ljust(16) for lb in labels)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.torture", description=__doc__)
    parser.add_argument("--reduced", action="store_true", help="the form make test runs")
    parser.add_argument(
        "--databases",
        default=",".join(DATABASES),
        help="comma-separated: sqlite, postgresql, mysql (default: all reachable)",
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    options = parser.parse_args(argv)
    began = time.monotonic()
    rows: list[Row] = []
    broken: list[str] = []
    labels: list[str] = []
    for name in [n.strip().lower() for n in options.databases.split(",") if n.strip()]:
        if name not in DATABASES:
            parser.error(f"unknown database {name!r}; expected one of {', '.join(DATABASES)}")
        label, url = DATABASES[name]
        if not url.startswith("sqlite") and not reachable(url):
            message = f"{label} is not reachable at {url}"
            print(f"=== {message}" + (" (required under CI=true)" if CI else "; skipped"))
            if CI:
                broken.append(message)
            continue
        targets = (CHECKS if name in CHECK_DATABASES else []) + FAULT_TESTS
        code, found, _elapsed = _run(label, url, targets, options.pytest_args, options.reduced)
        labels.append(label)
        rows.extend(found)
        if code != 0 and not any(row.result == "FAIL" for row in found):
            broken.append(f"{label}: pytest exited {code} without a failed check")
    failed = [row for row in rows if row.result == "FAIL"]
    size = "reduced" if options.reduced else "full"
    print(f"\n=== torture summary ({size}, {time.monotonic() - began:.0f}s)")
    print(_table(rows, labels))
    for problem in broken:
        print(f"BROKEN: {problem}")
    passed = sum(1 for row in rows if row.result == "PASS")
    skipped = sum(1 for row in rows if row.result == "SKIP")
    print(f"torture: {passed} passed, {len(failed) + len(broken)} failed, {skipped} skipped")
    return 1 if failed or broken or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
