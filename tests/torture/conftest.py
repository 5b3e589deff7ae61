"""The torture checks' fixtures and their one-line report.

- ``live_host`` (package scope): the web process and a worker on the test database
  (`tests.torture.host.LiveHost`), stopped after the last check. The checks are
  transactional tests (their rows are committed, so the host's processes see them, and
  flushed after each check); each check sets up the users and objects it needs.
- ``figures`` (function): a dict a check fills with its figures. After each check one line
  is printed — ``torture <check> <PASS|FAIL|SKIP> <database> <figures>`` — and the figures
  go into the JUnit XML report (``check`` and ``figures`` properties), which
  ``python -m tests.torture`` reads for its summary table.

``SAGE_TORTURE=1`` runs the full size (see `size`); otherwise the reduced form of
``make test``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.torture.host import LiveHost

FULL = os.environ.get("SAGE_TORTURE") == "1"
_config: pytest.Config | None = None


def size(full: Any, reduced: Any) -> Any:
    """``full`` under ``SAGE_TORTURE=1``, else ``reduced``."""
    return full if FULL else reduced


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


@pytest.fixture(scope="package")
def live_host(django_db_setup, tmp_path_factory) -> Iterator[LiveHost]:
    host = LiveHost(tmp_path_factory.mktemp("torture-host"))
    try:
        host.start()
        yield host
    finally:
        host.stop()


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> dict[str, Any]:
    request.node.torture_figures = {}
    return request.node.torture_figures


def check_name(item: pytest.Item) -> str:
    name = getattr(item.module, "CHECK", item.name)
    callspec = getattr(item, "callspec", None)
    return f"{name}[{callspec.id}]" if callspec is not None else name


def database_label() -> str:
    from django.db import connection

    return {"postgresql": "PostgreSQL", "mysql": "MySQL", "sqlite": "SQLite"}.get(
        connection.vendor, connection.vendor
    )


def format_figures(values: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={v if isinstance(v, int | float | str) else json.dumps(v)}" for k, v in values.items()
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.when == "call" or (report.when == "setup" and not report.passed):
        values = getattr(item, "torture_figures", {})
        properties = [("check", check_name(item)), ("figures", json.dumps(values, default=str))]
        report.user_properties.extend(properties)
        item.user_properties.extend(properties)  # the JUnit XML takes the item's
    return report


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    properties = dict(report.user_properties)
    if report.when == "teardown" or "check" not in properties or _config is None:
        return
    reporter = _config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    result = "PASS" if report.passed else ("SKIP" if report.skipped else "FAIL")
    values = json.loads(properties["figures"])
    line = f"torture {properties['check']:38} {result:4} {database_label():10} "
    if getattr(getattr(reporter, "_tw", None), "width_of_current_line", 0):
        reporter.write("\n")  # after pytest's progress letters (-q)
    reporter.write_line(line + format_figures(values))
