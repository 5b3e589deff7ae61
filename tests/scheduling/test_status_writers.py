"""Only the Run state machine (``scheduling.runs``) writes ``Run.status``.

The scan reads the source tree's syntax (``ast``), not its text, for the ways Django code
writes a column: ``.update(status=…)`` or ``.update(**{… "status" …})`` on a query of
``Run``; ``Run(status=…)`` and ``Run.objects.create(status=…)``; ``run.status = …`` on a
``Run`` that the same function saves; ``bulk_update`` of ``"status"``; and raw SQL
``UPDATE <run table> … SET … status``. Migrations are allowed: they shape the table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The app code; tests arrange rows by hand and are not scanned.
SCANNED = ("agents", "pooling", "sageproject", "sagehost", "scheduling", "benchmarks")
ALLOWED = ("scheduling/runs/",)
# Relations that lead to runs: ``session.runs``, ``user.runs``, ``run.children``.
RUN_RELATIONS = {"runs", "children"}
RAW_UPDATE = re.compile(r"\bUPDATE\s+(?P<table>\S+)[^;]*?\bSET\b[^;]*?\bstatus\b", re.I | re.S)


def _root(node: ast.AST) -> tuple[ast.AST, set[str]]:
    """The start of a chain ``a.b(…).c[…]`` and the attribute names along it."""
    attrs: set[str] = set()
    while True:
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Attribute):
            attrs.add(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return node, attrs


class _Scope:
    """One function's (or the module's) assignments, by name."""

    def __init__(self, body: ast.AST, parent: _Scope | None = None) -> None:
        self.parent = parent
        self.values: dict[str, list[ast.AST]] = {}
        self.saved: set[str] = set()
        for node in ast.walk(body):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.values.setdefault(target.id, []).append(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.values.setdefault(node.target.id, []).append(node.annotation)
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(
                node.target, ast.Name
            ):
                self.values.setdefault(node.target.id, []).append(node.iter)
            elif isinstance(node, ast.arg) and node.annotation is not None:
                self.values.setdefault(node.arg, []).append(node.annotation)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "save"
                and isinstance(node.func.value, ast.Name)
            ):
                self.saved.add(node.func.value.id)

    def lookup(self, name: str) -> list[ast.AST]:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.values:
                return scope.values[name]
            scope = scope.parent
        return []


def _is_run(node: ast.AST, scope: _Scope, depth: int = 0) -> bool:
    """Whether ``node`` is (a query of) ``Run`` rows, as far as the source says."""
    root, attrs = _root(node)
    if attrs & RUN_RELATIONS:
        return True
    if isinstance(root, ast.Constant) and root.value == "Run":  # an annotation
        return True
    if not isinstance(root, ast.Name):
        return False
    if root.id == "Run":
        return True
    if depth >= 3:
        return False
    return any(_is_run(value, scope, depth + 1) for value in scope.lookup(root.id))


def _dict_has_status(node: ast.AST, scope: _Scope, depth: int = 0) -> bool:
    if isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None and _dict_has_status(value, scope, depth):
                return True
            if isinstance(key, ast.Constant) and key.value == "status":
                return True
        return False
    if isinstance(node, ast.Name) and depth < 3:
        return any(_dict_has_status(v, scope, depth + 1) for v in scope.lookup(node.id))
    return False


def _writes_status(call: ast.Call, scope: _Scope) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "status":
            return True
        if keyword.arg is None and _dict_has_status(keyword.value, scope):
            return True
        if keyword.arg == "defaults" and _dict_has_status(keyword.value, scope):
            return True
    return False


def _sql_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            part.value if isinstance(part, ast.Constant) else "{" + ast.unparse(part.value) + "}"
            for part in node.values
        )
    return None


def status_writes(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every write of ``Run.status`` found in ``source``."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    module = _Scope(tree)

    def visit(node: ast.AST, scope: _Scope) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = _Scope(child, scope)
            check(child, inner)
            visit(child, inner)

    def check(node: ast.AST, scope: _Scope) -> None:
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                if (
                    func.attr in ("update", "create", "get_or_create", "update_or_create")
                    and _writes_status(node, scope)
                    and _is_run(func.value, scope)
                ):
                    found.append((node.lineno, f".{func.attr}() with status on Run rows"))
                if func.attr == "bulk_update" and _is_run(func.value, scope):
                    fields = node.args[1] if len(node.args) > 1 else None
                    for keyword in node.keywords:
                        if keyword.arg == "fields":
                            fields = keyword.value
                    if fields is not None and "'status'" in ast.unparse(fields):
                        found.append((node.lineno, "bulk_update() of Run.status"))
            elif isinstance(func, ast.Name) and func.id == "Run" and _writes_status(node, scope):
                found.append((node.lineno, "Run(status=…)"))
            elif (
                isinstance(func, ast.Name)
                and func.id == "setattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "status"
                and _is_run(node.args[0], scope)
            ):
                found.append((node.lineno, "setattr(run, 'status', …)"))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == "status"
                    and isinstance(target.value, ast.Name)
                    and target.value.id in scope.saved
                    and (_is_run(target.value, scope) or "run" in target.value.id.lower())
                ):
                    found.append((node.lineno, f"{target.value.id}.status = … then save()"))
        text = _sql_text(node)
        if text is not None:
            for match in RAW_UPDATE.finditer(text):
                if "run" in match.group("table").lower():
                    found.append((node.lineno, "raw SQL UPDATE … SET status on the run table"))

    visit(tree, module)
    return sorted(set(found))


def _sources() -> list[Path]:
    paths = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "/migrations/" in relative or relative.startswith(ALLOWED):
                continue
            paths.append(path)
    return paths


def test_it_finds_no_writer_of_run_status_outside_the_state_machine():
    writers = [
        f"{path.relative_to(ROOT).as_posix()}:{line}: {what}"
        for path in _sources()
        for line, what in status_writes(path.read_text())
    ]
    assert not writers, "Run.status is written outside scheduling.runs:\n" + "\n".join(writers)


def test_it_scans_the_apps():
    scanned = {path.relative_to(ROOT).as_posix() for path in _sources()}
    assert {"scheduling/db_scheduler.py", "agents/services/runs.py"} <= scanned
    assert not any(path.startswith("scheduling/runs/") for path in scanned)


@pytest.mark.parametrize(
    "source",
    [
        "Run.objects.filter(pk=1).update(status='queued')",
        "rows = Run.objects.filter(pk=1)\nrows.update(status='queued')",
        "def f(session):\n    session.runs.filter(ready=True).update(status='failed')",
        "values = {'status': 'queued'}\nRun.objects.filter(pk=1).update(**values)",
        "Run.objects.filter(pk=1).update(**{'status': 'queued', 'ready': True})",
        "def f(pk):\n    run = Run.objects.get(pk=pk)\n    run.status = 'failed'\n    run.save()",
        "def f(run: Run):\n    run.status = 'failed'\n    run.save(update_fields=['status'])",
        "Run.objects.bulk_update(rows, ['status'])",
        "Run.objects.create(session=s, status='running')",
        "Run(session=s, status='running').save()",
        'sql = f"UPDATE {run_table} SET status = %s WHERE id = %s"',
        'cursor.execute("UPDATE scheduling_run SET ready = 1, status = %s")',
    ],
)
def test_it_finds_a_planted_writer(source):
    assert status_writes(source)


@pytest.mark.parametrize(
    "source",
    [
        "Run.objects.filter(status='queued').update(ready=True)",
        "JobRecord.objects.filter(pk=1).update(status='done')",
        "def f(record):\n    record.status = 'done'\n    record.save()",
        "Run.objects.filter(status='queued').count()",
        'sql = f"UPDATE {table} SET pending = pending + 1 WHERE status = %s"',
    ],
)
def test_it_leaves_reads_and_other_models_alone(source):
    assert status_writes(source) == []
