"""docs/SETTINGS.md is generated from `sageproject.config`, and names every setting the
code reads: a new variable without a declaration there fails here."""

from __future__ import annotations

import re
from pathlib import Path

from sageproject import config

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "SETTINGS.md"
# Where the host's own code and tooling live (tests are searched too: a SAGE_* name read
# only by the tests must be listed below).
SOURCES = (
    "sageproject",
    "sagehost",
    "scheduling",
    "agents",
    "pooling",
    "benchmarks",
    "tests",
    ".ci",
)
SOURCE_FILES = ("manage.py", "Makefile")

# SAGE_* names that are not the host's settings, each with why.
NOT_SETTINGS = {
    # Django's settings attribute holding the loaded configuration, not a variable.
    "SAGE_CONFIG",
    # Test-only: read by the test suite, its runner or the torture command.
    "SAGE_TEST_DB_NAME",  # the test database's name on a server (settings.py, tests)
    "SAGE_TEST_PG_BINDIR",  # PostgreSQL's binaries for the tests' own clusters
    "SAGE_TEST_POSTGRES_URL",  # tests.runner's PostgreSQL
    "SAGE_TEST_MYSQL_URL",  # tests.runner's MySQL
    "SAGE_TEST_REDIS_URL",  # the job tests' Redis
    "SAGE_TEST_ARTIFACTS",  # where the admin page tests save their screenshots
    "SAGE_TEST_SECRET",  # a variable a job must not see (tests/agents/test_jobs_memory.py)
    "SAGE_TORTURE",  # full-size torture and fault tests
    "SAGE_CHAOS_SEED",  # replays a chaos run's seed
    "SAGE_SCHEMATHESIS_SEED",  # the schema fuzzing's seed
    "SAGE_SCHEMATHESIS_EXAMPLES",  # ... its examples per operation
    "SAGE_SCHEMATHESIS_PHASES",  # ... its phases
    "SAGE_FLOOD_CONNECTIONS",  # the submission flood's connections
    "SAGE_ALLOW_SQLITE_ONLY",  # lets the export round trip pass with one database
    # Tooling: the extra requirements `make test` has .ci/bootstrap install.
    "SAGE_BOOTSTRAP_EXTRAS",
}

_NAME = re.compile(r"(?<![A-Za-z0-9_])SAGE_[A-Z0-9_]*[A-Z0-9]")


def _documented() -> set[str]:
    names = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"[A-Z][A-Z0-9_]+", line.split("|")[1]))
    return names


def _names_in_the_code() -> set[str]:
    files = [ROOT / name for name in SOURCE_FILES]
    for folder in SOURCES:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file()]
    names: set[str] = set()
    for path in files:
        if path.suffix in {".pyc", ".sqlite3"} or "__pycache__" in path.parts:
            continue
        try:
            names.update(_NAME.findall(path.read_text()))
        except UnicodeDecodeError:
            continue
    return names


def test_the_settings_doc_is_the_one_generated_from_the_declarations():
    # Regenerate: python -m sageproject.config --markdown > docs/SETTINGS.md
    assert DOC.read_text() == config.settings_table()


def test_the_settings_doc_names_every_setting_the_code_reads():
    missing = _names_in_the_code() - _documented() - NOT_SETTINGS
    assert missing == set(), "declare them in sageproject/config.py (or list a test-only one)"


def test_the_settings_doc_lists_every_check_id():
    text = DOC.read_text()
    ids = [limit.check_id for limit in config.LIMITS]
    ids += [boolean.check_id for boolean in config.BOOLEANS]
    ids += [check_id for _, (check_id, _) in config.CROSS_RULES.items()]
    ids += [i for described in config.DESCRIBED for i in described.check_ids]
    declared = {v for k, v in vars(config).items() if k.startswith("CHECK_")}
    assert declared <= set(ids)
    assert [i for i in ids if f"`{i}`" not in text] == []


def test_every_test_only_name_is_still_used():
    # A stale entry would hide a setting of the same name added later.
    assert NOT_SETTINGS <= _names_in_the_code()
