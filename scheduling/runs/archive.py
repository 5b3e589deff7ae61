"""The archive hook: terminal runs write their archive row in their own transaction.

The archive row (``ManagedAgentRecord``) belongs to the agents app; it registers its
writer here at start-up (``AgentsConfig.ready``) so scheduling never imports agents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from django.db import DEFAULT_DB_ALIAS

from scheduling.models import Run


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchiveRecord:
    """What the archive of a terminal run holds (``flow_outputs`` None: left as it is)."""

    run_id: Any
    owner_id: Any
    package_ref: str
    package_name: str
    agent_id: str
    status: str
    result: Any
    error: Any
    flow_outputs: dict[str, Any] | None = None


Archiver = Callable[[list[ArchiveRecord], str], Any]
_archiver: Archiver | None = None

_ARCHIVE_FIELDS = (
    "pk",
    "owner_id",
    "session__package_ref",
    "session__package_name",
    "session__agent_id",
)


# ``statement(connection)``: the archiver's one SQL statement for PostgreSQL, taking five
# arrays (run ids, statuses, results, errors, flow outputs — the last three as JSON text,
# outputs NULL: left as they are) and reading the rest from the run and session rows. With
# it, the session store's pipelined group commit archives without a round trip of its own.
ArchiveStatement = Callable[[Any], str]
_archive_statement: ArchiveStatement | None = None


def set_archiver(fn: Archiver | None, statement: ArchiveStatement | None = None) -> None:
    """Register ``fn(records, using)``: writes (or refreshes) the archive rows of terminal
    runs, called inside the transaction that ends them; ``statement``: the same write as
    one PostgreSQL statement (see `ArchiveStatement`), optional."""
    global _archiver, _archive_statement
    _archiver = fn
    _archive_statement = statement


def archive_records(
    run_ids: list[Any], outcomes: dict[Any, tuple[str, Any, Any, Any]], using: str
) -> list[ArchiveRecord]:
    """Archive records of ``run_ids``; ``outcomes[run_id] = (status, result, error,
    flow_outputs)`` (read from the rows when missing). One query."""
    fields = (
        _ARCHIVE_FIELDS
        if len(outcomes) == len(run_ids)
        else (
            *_ARCHIVE_FIELDS,
            "status",
            "result",
            "error",
        )
    )
    records = []
    for row in Run.objects.using(using).filter(pk__in=run_ids).values(*fields):
        status, result, error, flow_outputs = outcomes.get(
            row["pk"], (row.get("status"), row.get("result"), row.get("error"), None)
        )
        records.append(
            ArchiveRecord(
                run_id=row["pk"],
                owner_id=row["owner_id"],
                package_ref=row["session__package_ref"],
                package_name=row["session__package_name"],
                agent_id=row["session__agent_id"],
                status=status,
                result=result,
                error=error,
                flow_outputs=flow_outputs,
            )
        )
    return records


def archive(
    run_ids: list[Any],
    *,
    flow_outputs: dict[Any, dict[str, Any] | None] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> None:
    """Write (or refresh) the archive rows of terminal runs from their rows, with their
    flow outputs (``{run_id: outputs}``, where known), in one query and one upsert."""
    if _archiver is None or not run_ids:
        return
    records = archive_records(run_ids, {}, using)
    if flow_outputs:
        outputs = {str(run_id): value for run_id, value in flow_outputs.items()}
        records = [replace(r, flow_outputs=outputs.get(str(r.run_id))) for r in records]
    _archiver(records, using)


def archive_one(run_id: Any, using: str, flow_outputs: dict[str, Any] | None = None) -> None:
    """`archive` of one run."""
    archive([run_id], flow_outputs={run_id: flow_outputs}, using=using)


def archiver() -> Archiver | None:
    """The registered archive writer (None: runs are not archived)."""
    return _archiver


def archive_statement() -> ArchiveStatement | None:
    """The registered writer's one-statement PostgreSQL form, if it has one."""
    return _archive_statement
