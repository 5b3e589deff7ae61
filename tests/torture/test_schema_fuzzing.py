"""Schemathesis over the OpenAPI schema (``GET /api/schema/``) with ``--checks all``.

The ``schemathesis`` command runs against the live host as a normal user with an API token
that owns a package, a session and a finished run (so generated requests can reach real
objects), with a fixed seed (``SAGE_SCHEMATHESIS_SEED``): at full size its examples,
coverage, fuzzing and stateful phases with 100 examples per operation; reduced (``make
test``) the fuzzing phase with 5. Its JSON report gives the figures: server errors (ST101,
``not_a_server_error``), schema violations (ST102-ST111: status code, content type,
headers, body) and every other check's failures by code. The check passes only when
schemathesis found nothing at all and tested every operation of the schema.

Its settings file (``schemathesis.toml`` here, ``--config-file``) changes two things. For
``POST /packages/`` (a manifest's cross-field rules), ``POST /sessions/`` (the agent
must be one of the package's) and ``POST /packages/{id}/validate/`` (strict: what the host
lacks), ``positive_data_acceptance`` also takes 400 — schemathesis's
documented per-operation ``expected-statuses`` for a rejection the schema cannot express.
For the model-record operations, whose free-form ``options`` object can hold a key with
a NUL (which the JSON parser refuses and OpenAPI 3.0 cannot forbid in a key), the
generator leaves NUL out (``generation.allow-x00 = false``). Every other syntactic rule
is in the schema, which the other operations are held to exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import demo_manifest, scripted_model
from tests.torture.conftest import size
from tests.torture.host import LiveHost, make_user

CHECK = "schemathesis"
pytestmark = [pytest.mark.torture, pytest.mark.django_db(transaction=True)]

SEED = int(os.environ.get("SAGE_SCHEMATHESIS_SEED", "20261201"))
MAX_EXAMPLES = int(os.environ.get("SAGE_SCHEMATHESIS_EXAMPLES", size(100, 5)))
PHASES = os.environ.get(
    "SAGE_SCHEMATHESIS_PHASES",
    size("examples,coverage,fuzzing,stateful", "fuzzing"),
)
TIMEOUT = size(3600, 600)
# Per-operation settings (schemathesis.toml beside this file): the operations whose
# schema-valid input can break a rule no schema states, where 400 is an expected answer.
CONFIG = Path(__file__).with_name("schemathesis.toml")
# Schemathesis's failure codes: ST101 is a 5xx (``not_a_server_error``); ST102-ST111 are
# responses that break the schema (status code, content type, headers, body); the rest
# (ST2xx input handling, ST3xx resource life, ST4xx authorization, ST112 slowness) are
# reported by code.
SERVER_ERRORS = {"ST101"}
SCHEMA_VIOLATIONS = {f"ST{n}" for n in range(102, 112)}


def _failures_by_code(report: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for group in report.get("failures", []):
        code = str(group.get("code") or group.get("type"))
        counts[code] = counts.get(code, 0) + int(group.get("count", 1))
    return counts


def test_schemathesis_finds_no_server_error_or_schema_violation(
    live_host: LiveHost, figures: dict[str, Any], tmp_path: Path
) -> None:
    from agents import services
    from agents.services import packages

    live_host.ensure_worker()
    user, token = make_user("fuzz")
    scripted_model("scripted")
    packages.package_create(owner=user, manifest=demo_manifest(name="fuzz"))
    session = services.session_create(owner=user, package="fuzz", agent="assistant")
    with live_host.client(token) as api:
        run = api.post("/api/v1/runs/", json={"session": str(session.pk), "input": "hi"})
        assert run.status_code == 202, run.text
        live_host.wait_run(api, run.json()["id"])

    report_path = tmp_path / "schemathesis.json"
    argv = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file", str(CONFIG),
        "run",
        f"{live_host.base_url}/api/schema/",
        "--checks", "all",
        "--header", f"Authorization: Token {token}",
        "--phases", PHASES,
        "--max-examples", str(MAX_EXAMPLES),
        "--seed", str(SEED),
        "--workers", "2",
        "--request-timeout", "10",
        "--no-shrink",
        "--report", "json",
        "--report-json-path", str(report_path),
    ]  # fmt: skip
    log = tmp_path / "schemathesis.log"
    with log.open("wb") as out:
        # In the test's directory: schemathesis and hypothesis keep their databases
        # (.schemathesis/, .hypothesis/) in the working directory.
        process = subprocess.run(
            argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT, check=False
        )
    assert report_path.exists(), log.read_text(errors="replace")[-4000:]
    report = json.loads(report_path.read_text())
    by_check = _failures_by_code(report)
    server_errors = sum(v for k, v in by_check.items() if k in SERVER_ERRORS)
    violations = sum(v for k, v in by_check.items() if k in SCHEMA_VIOLATIONS)
    other = {
        f"{g.get('code')} {g.get('title')}": g.get("count")
        for g in report.get("failures", [])
        if g.get("code") not in SERVER_ERRORS | SCHEMA_VIOLATIONS
    }
    operations = report.get("operations", {})
    errors = report.get("errors", [])
    figures.update(
        operations=f"{operations.get('tested')}/{operations.get('selected')}",
        test_cases=report.get("test_cases", {}).get("generated"),
        server_errors=server_errors,
        schema_violations=violations,
        other_failures=other,
        errors=sum(int(e.get("count", 1)) for e in errors),
        seconds=round(float(report.get("running_time") or 0), 1),
    )
    if errors:
        figures["error_titles"] = [e.get("title") for e in errors][:3]
    if by_check:
        figures["failing_operations"] = sorted(
            {op for g in report.get("failures", []) for op in g.get("operations", [])}
        )[:6]
    print(log.read_text(errors="replace")[-8000:])  # schemathesis's own account, on failure

    # Controls: schemathesis ran and reached every operation.
    assert report.get("complete"), f"schemathesis did not finish (exit {process.returncode})"
    assert operations.get("tested") and operations.get("tested") == operations.get("selected")
    assert (report.get("test_cases") or {}).get("generated", 0) > 0
    assert not errors, errors
    assert not by_check, f"schemathesis failures by check: {by_check}"
