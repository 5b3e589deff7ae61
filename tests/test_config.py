from __future__ import annotations

import os
import re
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
    assert loaded["SAGE_JOB_RUNTIME"] == "memory"
    assert loaded["SAGE_JOB_RUNNER_MODULES"] == ()
    assert loaded["SAGE_JOBS_REDIS_URL"] is None
    assert loaded.database["ENGINE"] == "django.db.backends.sqlite3"


def messages(loaded: config.Config) -> list[str]:
    return [problem.message for problem in loaded.errors]


@pytest.mark.parametrize("value", ["0", "-3", "abc", "1.5"])
def test_it_rejects_a_bad_limit_with_one_line_naming_the_variable(value):
    loaded = config.load({"SAGE_SERVER_MAX_CONCURRENT_RUNS": value})
    assert len(loaded.errors) == 1
    assert messages(loaded)[0].startswith("SAGE_SERVER_MAX_CONCURRENT_RUNS must be an integer")


def test_it_accepts_none_for_auto_release():
    loaded = config.load({"SAGE_AUTO_RELEASE_IDLE_SECONDS": "none"})
    assert loaded.errors == []
    assert loaded["SAGE_AUTO_RELEASE_IDLE_SECONDS"] is None


def test_it_rejects_a_per_user_limit_above_the_global_one():
    loaded = config.load(
        {"SAGE_SERVER_MAX_CONCURRENT_RUNS": "2", "SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER": "3"}
    )
    assert any("PER_USER" in e for e in messages(loaded))


def test_it_rejects_an_unknown_database_scheme():
    loaded = config.load({"DATABASE_URL": "oracle://x/y"})
    assert len(loaded.errors) == 1
    assert messages(loaded)[0].startswith("DATABASE_URL must start with sqlite://")


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
    # Only the statements executed with prepare=True are prepared; prepared=0 turns them off.
    assert pg["OPTIONS"]["prepare_threshold"] == config.PREPARE_EXPLICIT_ONLY
    assert "plan_cache_mode=force_generic_plan" in pg["OPTIONS"]["options"]
    off = config.parse_database_url("postgres://u@db/sage?prepared=0", base_dir="/x")
    assert off["OPTIONS"]["prepare_threshold"] is None
    assert "plan_cache_mode" not in off["OPTIONS"]["options"]
    assert "prepared" not in off["OPTIONS"]
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
        [sys.executable, "-c", "import sagehost.asgi"],
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
    assert [e.id for e in errors] == ["sageproject.E011"]
    assert "SAGE_LEASE_SECONDS" in errors[0].msg


# --- background jobs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "runtime"),
    [
        ({}, "memory"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/13"}, "celery"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/13", "SAGE_JOB_RUNTIME": " Memory "}, "memory"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/13", "SAGE_JOB_RUNTIME": "celery"}, "celery"),
    ],
)
def test_it_picks_the_job_runtime_celery_by_default_when_redis_is_set(environ, runtime):
    loaded = config.load(environ)
    assert loaded.errors == []
    assert loaded["SAGE_JOB_RUNTIME"] == runtime


@pytest.mark.parametrize(
    ("environ", "problem"),
    [
        (
            {"SAGE_JOB_RUNTIME": "kubernetes", "REDIS_URL": "redis://127.0.0.1:6379/13"},
            config.Problem(
                "sageproject.E050",
                "SAGE_JOB_RUNTIME must be one of memory, celery (got 'kubernetes')",
            ),
        ),
        (
            {"SAGE_JOB_RUNTIME": "celery"},
            config.Problem(
                "sageproject.E051", "SAGE_JOB_RUNTIME=celery needs REDIS_URL (the Celery broker)"
            ),
        ),
        (
            {"SAGE_JOB_RUNNER_MODULES": "ok.module, not-a-module"},
            config.Problem(
                "sageproject.E052",
                "SAGE_JOB_RUNNER_MODULES must be comma-separated Python module names "
                "(got 'ok.module, not-a-module')",
            ),
        ),
        (
            {"SAGE_JOBS_REDIS_URL": "http://cache"},
            config.Problem(
                "sageproject.E053",
                "SAGE_JOBS_REDIS_URL must start with redis://, rediss:// or unix:// "
                "(got 'http://cache')",
            ),
        ),
        (
            {"SAGE_CODE_TOOLS": "maybe"},
            config.Problem(
                "sageproject.E021",
                "SAGE_CODE_TOOLS must be 1/0, true/false, yes/no or on/off (got 'maybe')",
            ),
        ),
    ],
)
def test_it_rejects_a_bad_job_setting_with_its_own_check(environ, problem):
    assert config.load(environ).errors == [problem]


def test_it_reads_the_job_runner_modules_and_the_jobs_redis():
    loaded = config.load(
        {
            "SAGE_JOB_RUNNER_MODULES": " reports.jobs ,, billing ",
            "SAGE_JOBS_REDIS_URL": "redis://jobs:6379/2",
        }
    )
    assert loaded.errors == []
    assert loaded["SAGE_JOB_RUNNER_MODULES"] == ("reports.jobs", "billing")
    assert loaded["SAGE_JOBS_REDIS_URL"] == "redis://jobs:6379/2"


def test_it_stops_a_job_worker_with_one_clear_line():
    env = {**os.environ, "SAGE_JOB_RUNNER_MODULES": "not-a-module"}
    code = "import agents.jobs.tasks as t; t._stop_on_configuration_errors()"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "sage-jobs: configuration error: SAGE_JOB_RUNNER_MODULES must be comma-separated "
        "Python module names (got 'not-a-module')"
    )


# --- system check ids --------------------------------------------------------------------


def rule_ids() -> list[str]:
    """Every rule's check id: each integer's, each boolean's and the named rules'."""
    named = [value for name, value in vars(config).items() if name.startswith("CHECK_")]
    return [s.check_id for s in (*config.LIMITS, *config.BOOLEANS)] + named


def test_each_rule_has_its_own_check_id():
    ids = rule_ids()
    assert len(ids) == len(set(ids))
    assert all(re.fullmatch(r"sageproject\.E0\d\d", check_id) for check_id in ids)


def test_each_check_id_keeps_its_number_whatever_else_is_wrong():
    # By position these would be E001 and E002; by rule they stay the rule's own.
    loaded = config.load({"SAGE_STORE_WRITERS": "65", "REDIS_URL": "http://x"})
    assert [p.check_id for p in loaded.errors] == ["sageproject.E015", "sageproject.E041"]
    alone = config.load({"REDIS_URL": "http://x"})
    assert [p.check_id for p in alone.errors] == ["sageproject.E041"]


def test_the_operations_guide_lists_every_check_id():
    guide = (ROOT / "docs" / "OPERATIONS.md").read_text()
    section = guide.split("## System checks", 1)[1].split("\n## ", 1)[0]
    assert [i for i in rule_ids() if f"`{i}`" not in section] == []


def test_the_local_directory_is_the_projects_dot_local_unless_set(tmp_path):
    assert config.load({}, base_dir="/srv/sage").values["SAGE_LOCAL_DIR"] == "/srv/sage/.local"
    relative = config.load({"SAGE_LOCAL_DIR": "var/sage"}, base_dir="/srv/sage")
    assert relative.values["SAGE_LOCAL_DIR"] == "/srv/sage/var/sage"
    absolute = config.load({"SAGE_LOCAL_DIR": str(tmp_path)}, base_dir="/srv/sage")
    assert absolute.values["SAGE_LOCAL_DIR"] == str(tmp_path)
    assert not absolute.errors


def test_the_wake_up_and_live_sockets_live_under_sage_local_dir(tmp_path):
    # A process's view, from the environment on: the web and worker processes of one host
    # meet at these sockets, and two hosts (or two test runs) must not.
    code = (
        "import django; django.setup(); "
        "from scheduling import live, wakeups; "
        "print(wakeups.socket_dir()); print(live.live_dir())"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "sageproject.settings",
        "SAGE_LOCAL_DIR": str(tmp_path),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(tmp_path / "wakeup"), str(tmp_path / "live")]


def test_the_held_pipeline_is_on_unless_turned_off():
    assert config.load({})["SAGE_PG_HELD_PIPELINE"] is True
    assert config.load({"SAGE_PG_HELD_PIPELINE": "off"})["SAGE_PG_HELD_PIPELINE"] is False
    assert config.load({"SAGE_PG_HELD_PIPELINE": "maybe"}).errors == [
        config.Problem(
            "sageproject.E024",
            "SAGE_PG_HELD_PIPELINE must be 1/0, true/false, yes/no or on/off (got 'maybe')",
        )
    ]


def test_it_reads_the_mcp_allowed_hosts():
    loaded = config.load({"SAGE_MCP_ALLOWED_HOSTS": " 127.0.0.1, mcp.internal:8080,[::1]:9000 "})
    assert loaded.errors == []
    assert loaded["SAGE_MCP_ALLOWED_HOSTS"] == ("127.0.0.1", "mcp.internal:8080", "[::1]:9000")
    assert config.load({})["SAGE_MCP_ALLOWED_HOSTS"] == ()


@pytest.mark.parametrize("value", ["http://mcp.internal", "mcp.internal:0", "bad host", "[::1"])
def test_it_rejects_an_allowed_host_that_is_not_a_host(value):
    loaded = config.load({"SAGE_MCP_ALLOWED_HOSTS": f"127.0.0.1,{value}"})
    assert [p.check_id for p in loaded.errors] == ["sageproject.E080"]
    assert messages(loaded)[0].startswith("SAGE_MCP_ALLOWED_HOSTS must list host names")
    # A half-read list could allow less (or more) than the operator believes: none.
    assert loaded["SAGE_MCP_ALLOWED_HOSTS"] == ()
