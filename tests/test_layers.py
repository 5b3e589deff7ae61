"""The layers contract (``[tool.importlinter]`` in ``pyproject.toml``): the tree keeps it,
and a wrong-way import planted in a copy of the tree breaks it.

``lint-imports`` runs in a subprocess, as ``make lint`` runs it; a broken contract fails
``make test`` here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sageproject", "pooling", "scheduling", "agents", "sagehost", "benchmarks")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on ``tree`` with its own ``pyproject.toml``."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", "--cache-dir", str(cache)],
        cwd=tree,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the packages and ``pyproject.toml``, to plant imports in."""
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy)
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return copy


def plant(tree: Path, module: str, line: str) -> None:
    """Append ``line`` (an import) to ``module``'s file in ``tree``."""
    path = tree / module.replace(".", "/")
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    path.write_text(path.read_text() + f"\n\n{line}\n")


def test_it_keeps_every_contract(tmp_path):
    result = lint_imports(ROOT, tmp_path / "cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        (
            "sageproject.db",
            "def planted():\n    from agents.models import JobRecord  # noqa",
            "sageproject is not allowed to import agents",
        ),
        (
            "scheduling.models",
            "from agents.services import run_submit  # noqa",
            "scheduling is not allowed to import agents",
        ),
        (
            "pooling.clients",
            "from scheduling import figures  # noqa",
            "pooling is not allowed to import scheduling",
        ),
        (
            "sagehost.views",
            "from benchmarks import shared  # noqa",
            "sagehost is not allowed to import benchmarks",
        ),
        (
            "pooling.budget",
            "import django  # noqa",
            "pooling.budget is not allowed to import django",
        ),
        (
            "sageproject.errors",
            "from django.conf import settings  # noqa",
            "sageproject.errors is not allowed to import django",
        ),
        (
            "agents.engine",
            "from sageproject.db import db_call  # noqa",
            "agents.engine is not allowed to import django",
        ),
    ],
)
def test_it_refuses_a_wrong_way_import(tree, tmp_path, module, line, broken):
    plant(tree, module, line)
    result = lint_imports(tree, tmp_path / "cache")
    assert result.returncode == 1, result.stdout + result.stderr
    assert broken in result.stdout
