from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sageproject import config

ROOT = Path(__file__).resolve().parent.parent


def test_it_uses_the_documented_defaults():
    loaded = config.load({})
    assert loaded.errors == []
    assert loaded["SAGE_SERVER_MAX_MODEL_CLIENTS"] == 64
    assert loaded["SAGE_SERVER_MAX_CONCURRENT_RUNS"] == 8
    assert loaded["SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER"] == 2
    assert loaded["SAGE_SERVER_MAX_PENDING_RUNS"] == 1024
    assert loaded["SAGE_MAX_CONCURRENT_MODEL_CALLS"] == 8
    assert loaded["SAGE_AUTO_RELEASE_IDLE_SECONDS"] == 300
    assert loaded["SAGE_CODE_TOOLS"] is False
    assert loaded.database["ENGINE"] == "django.db.backends.sqlite3"


@pytest.mark.parametrize("value", ["0", "-3", "abc", "1.5"])
def test_it_rejects_a_bad_limit_with_one_line_naming_the_variable(value):
    loaded = config.load({"SAGE_SERVER_MAX_CONCURRENT_RUNS": value})
    assert len(loaded.errors) == 1
    assert loaded.errors[0].startswith("SAGE_SERVER_MAX_CONCURRENT_RUNS must be an integer")


def test_it_accepts_none_for_auto_release():
    loaded = config.load({"SAGE_AUTO_RELEASE_IDLE_SECONDS": "none"})
    assert loaded.errors == []
    assert loaded["SAGE_AUTO_RELEASE_IDLE_SECONDS"] is None


def test_it_rejects_a_per_user_limit_above_the_global_one():
    loaded = config.load(
        {"SAGE_SERVER_MAX_CONCURRENT_RUNS": "2", "SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER": "3"}
    )
    assert any("PER_USER" in e for e in loaded.errors)


def test_it_rejects_an_unknown_database_scheme():
    loaded = config.load({"DATABASE_URL": "oracle://x/y"})
    assert len(loaded.errors) == 1
    assert loaded.errors[0].startswith("DATABASE_URL must start with sqlite://")


def test_it_parses_server_database_urls():
    pg = config.parse_database_url("postgres://u:p%40ss@db.example:5433/sage", base_dir="/x")
    assert (pg["ENGINE"], pg["NAME"], pg["USER"], pg["PASSWORD"], pg["HOST"], pg["PORT"]) == (
        "django.db.backends.postgresql",
        "sage",
        "u",
        "p@ss",
        "db.example",
        "5433",
    )
    assert pg["OPTIONS"]["pool"]["max_size"] == 20
    assert "idle_in_transaction_session_timeout" in pg["OPTIONS"]["options"]
    my = config.parse_database_url("mysql://root@127.0.0.1:3306/test", base_dir="/x")
    assert my["OPTIONS"]["charset"] == "utf8mb4"
    lite = config.parse_database_url("sqlite:///db.sqlite3", base_dir="/base")
    assert lite["NAME"] == "/base/db.sqlite3"
    assert lite["OPTIONS"]["transaction_mode"] == "IMMEDIATE"
    assert "journal_mode=WAL" in lite["OPTIONS"]["init_command"]


@pytest.mark.parametrize("command", [["migrate"], ["runworker"], ["check"]])
def test_it_stops_start_up_with_one_clear_line(command):
    env = {**os.environ, "SAGE_SERVER_MAX_CONCURRENT_RUNS": "0"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "manage.py: configuration error: SAGE_SERVER_MAX_CONCURRENT_RUNS must be an integer "
        "≥ 1 (got '0')"
    ]


def test_it_stops_the_web_server_with_one_clear_line():
    env = {**os.environ, "SAGE_MAX_CONCURRENT_MODEL_CALLS": "abc"}
    result = subprocess.run(
        [sys.executable, "-c", "import sageproject.asgi"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "sage-web: configuration error: SAGE_MAX_CONCURRENT_MODEL_CALLS must be an integer ≥ 1 "
        "(got 'abc')"
    )


def test_it_reports_the_problem_as_a_system_check(settings):
    from sageproject.checks import check_sage_configuration

    settings.SAGE_CONFIG = config.load({"SAGE_LEASE_SECONDS": "x"})
    errors = check_sage_configuration(None)
    assert [e.id for e in errors] == ["sageproject.E001"]
    assert "SAGE_LEASE_SECONDS" in errors[0].msg
