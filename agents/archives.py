"""Archives: the terminal record of every run, readable with no worker involved.

``archive_records`` writes (or refreshes) archive rows; ``scheduling.runs`` calls it in
the same transaction as every terminal transition (``agents.apps`` registers it at
start-up), so a finished run and its archive commit together. The sweep functions archive
what a crash between the two left behind (the worker runs one at start-up, and the
management service before it releases an Application). ``archive_read`` is the one read
of an archived result.
"""

from __future__ import annotations

from typing import Any

import orjson
from django.db import connections
from django.db.models import Q

from agents.applications import ARCHIVE_BATCH, ApplicationKey, key_runs
from agents.models import ManagedAgentRecord
from agents.services.runs import check_read_permission
from sageproject.errors import NotFoundError
from scheduling import runs
from scheduling.models import TERMINAL_STATUSES, Event, Run, Session
from scheduling.runs import ArchiveRecord


def archive_records(records: list[ArchiveRecord], using: str = "default") -> None:
    """Write (or refresh) the archive rows of terminal runs in one statement (registered
    with ``scheduling.runs`` as the archiver of every terminal transition)."""
    rows = [
        ManagedAgentRecord(
            run_id=r.run_id,
            owner_id=r.owner_id,
            package_ref=r.package_ref,
            package_name=r.package_name,
            agent_id=r.agent_id,
            status=r.status,
            result=r.result,
            error=r.error,
            flow_outputs=r.flow_outputs,
        )
        for r in records
    ]
    update = ["owner", "package_ref", "package_name", "agent_id", "status", "result", "error"]
    # MySQL's upsert names no conflict target (ON DUPLICATE KEY UPDATE); the others must.
    target = (
        {"unique_fields": ["run"]}
        if connections[using].features.supports_update_conflicts_with_target
        else {}
    )
    for with_outputs in (False, True):
        part = [row for row in rows if (row.flow_outputs is not None) is with_outputs]
        if part:
            ManagedAgentRecord.objects.using(using).bulk_create(
                part,
                update_conflicts=True,
                update_fields=[*update, "flow_outputs"] if with_outputs else update,
                **target,
            )


def archive_statement(connection: Any) -> str:
    """PostgreSQL: `archive_records` as one statement (registered with ``scheduling.runs``
    beside it, for the session store's pipelined group commit). It takes five arrays — run
    ids, statuses, and results, errors and flow outputs as JSON text (outputs NULL: the
    row's are kept) — and reads owner, package and agent from the run and session rows."""
    quote = connection.ops.quote_name
    meta = ManagedAgentRecord._meta
    table = quote(meta.db_table)

    def column(name: str) -> str:
        return quote(meta.get_field(name).column)

    run_table, session_table = quote(Run._meta.db_table), quote(Session._meta.db_table)
    names = ["run", "owner", "package_ref", "package_name", "agent_id", "status", "result"]
    names += ["error", "flow_outputs", "archived_at"]
    kept = [name for name in names if name not in ("run", "archived_at", "flow_outputs")]
    updates = ", ".join(f"{column(name)} = EXCLUDED.{column(name)}" for name in kept)
    outputs = column("flow_outputs")
    return (
        f"INSERT INTO {table} ({', '.join(column(name) for name in names)})"
        f" SELECT r.id, r.owner_id, s.package_ref, s.package_name, s.agent_id, f.status,"
        f" f.result::jsonb, f.error::jsonb, f.outputs::jsonb, STATEMENT_TIMESTAMP()"
        f" FROM UNNEST(%s::uuid[], %s::varchar[], %s::text[], %s::text[], %s::text[])"
        f" AS f(id, status, result, error, outputs)"
        f" JOIN {run_table} r ON r.id = f.id JOIN {session_table} s ON s.id = r.session_id"
        f" ON CONFLICT ({column('run')}) DO UPDATE SET {updates},"
        f" {outputs} = COALESCE(EXCLUDED.{outputs}, {table}.{outputs})"
    )


def archive_terminal(run: Run, flow_outputs: dict[str, Any] | None = None) -> ManagedAgentRecord:
    """Write (or refresh) the terminal archive of one finished run (from its row)."""
    runs.archive([run.pk], flow_outputs={run.pk: flow_outputs})
    return ManagedAgentRecord.objects.get(run_id=run.pk)


def archive_read(*, user, run_id: Any) -> ManagedAgentRecord:
    """An archived result, checked against ownership first (another user's → 404), then
    the caller's current read permission (revoked → 403)."""
    record = ManagedAgentRecord.objects.visible_to(user).filter(run_id=run_id).first()
    if record is None:
        raise NotFoundError("archive.not_found", "no archived result for that run")
    check_read_permission(user)
    return record


def flow_outputs_from_events(run_id: Any) -> dict[str, Any] | None:
    """The top-level ``flow.completed`` outputs of a run, read from its last events."""
    rows = (
        Event.objects.filter(run_id=run_id, type="flow.completed")
        .order_by("-seq")
        .values_list("data", flat=True)[:32]
    )
    for data in rows:
        payload = orjson.loads(data)
        if payload.get("path") == "" and "outputs" in payload:
            return payload["outputs"]
    return None


def _archive_batch(query, batch: int) -> int:
    run_ids = list(
        Run.objects.filter(query, status__in=TERMINAL_STATUSES, archive__isnull=True)
        .order_by("created_at")
        .values_list("pk", flat=True)[:batch]
    )
    runs.archive(run_ids, flow_outputs={pk: flow_outputs_from_events(pk) for pk in run_ids})
    return len(run_ids)


def archive_unarchived_sync(key: ApplicationKey, batch: int = ARCHIVE_BATCH) -> int:
    """Archive up to ``batch`` unarchived terminal runs of ``key``; returns how many."""
    return _archive_batch(key_runs(key), batch)


def sweep_unarchived_sync(batch: int = ARCHIVE_BATCH) -> int:
    """Archive every unarchived terminal run (a crash between finish and archive), in
    batches of ``batch``; returns how many were archived."""
    total = 0
    while True:
        count = _archive_batch(Q(), batch)
        total += count
        if count < batch:
            return total
