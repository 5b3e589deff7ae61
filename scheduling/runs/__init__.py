"""The Run state machine: the only code that changes a run's status.

```
            admit                 claim                    finish
  (new) ─────────► queued ──────────────► running ───────────────► completed | failed |
                    ▲  ▲                   │  │  │                  cancelled | interrupted
        resume      │  │ requeue (shutdown,│  │  │ suspend
   (reply "retry")  │  │ lease lost: reap) │  │  ▼
                    │  └───────────────────┘  │ suspended ──► cancelled (cancel) |
                    └─────────────────────────┼──────────┘    interrupted (newer run)
                                              └─ reap: cancelled (cancel requested) |
                                                 failed (crash budget used up)
```

Every transition is one conditional ``UPDATE … WHERE`` on the state it expects — for a
leased run also its owner, token and an unexpired lease (measured by the database's clock)
— in one transaction with everything the transition writes:

- **admit** (`admit`): the row, queued; ``ready`` when it is its session's oldest unfinished
  run. Pending limits, the idempotency key and the session's multitask rule are checked in
  the same transaction.
- **claim** (`claim`): the best ready queued run under the global and per-user limits,
  with a fresh fencing token and a lease whose expiry is the database's time at grant plus
  the lease length.
- **renew** (`renew`), **requeue** (`requeue`: graceful shutdown, the crash budget is not
  used), **reap** (`reap`: dead leases — requeued as a crash, or ended: a requested cancel
  finishes as ``cancelled``, a used-up crash budget as ``failed``, each with its terminal
  event and archive).
- **start** (`Start`), **suspend** (`Suspend`) and **finish** (`Finish`) are written by the
  worker's session store in the same transaction as the events they come with (the
  terminal event, the status, the result and the archive row commit together).
- **cancel** (`cancel`) and **resume** (`resume`) for the web side.

When a run leaves the unfinished states its session's next queued run becomes ``ready``
(`sessions.promote_next`), so a session executes one run at a time, in submission order.

The modules, one concern each: `clock` (the database's time), `fences` (what a leased
write must hold), `sessions` (a session's events and turn), `archive` (the archive hook),
`admission`, `claims` (the fair pick and the lease), `transitions` (every other
transition), `selectors` (reads by status for other modules) and `statements` (every
hand-written SQL statement, by name). This package re-exports what other modules use.
"""

from __future__ import annotations

from typing import Any

from scheduling.runs import archive as _archive_module
from scheduling.runs.admission import (
    ADMIT_ATTEMPTS,
    Credential,
    CredentialRefused,
    admit,
    check_credential,
    is_deadlock,
    restore,
    session_busy_error,
)
from scheduling.runs.archive import Archiver, ArchiveRecord, ArchiveStatement, archive, set_archiver
from scheduling.runs.claims import CLAIM_IDLE_TIMEOUT_MS, CLAIMED_FIELDS, Grant, claim, next_due
from scheduling.runs.clock import (
    SQLITE_NOW,
    Clock,
    DbNow,
    db_now,
    later_expr,
    now_expr,
    register_sqlite_clock,
)
from scheduling.runs.clock import now_sql as _now_sql
from scheduling.runs.fences import Fence, check_fence, held, lock_fences
from scheduling.runs.sessions import (
    TERMINAL_EVENTS,
    append_event,
    append_unleased_event,
    remove_run_events,
    terminal_payload,
)
from scheduling.runs.statements import (
    MAX_CLAIM_TENANTS,
    division_by_zero,
    guarded,
    rearm_idle_timeout,
)
from scheduling.runs.transitions import (
    Finish,
    Outcome,
    Start,
    Suspend,
    cancel,
    cancel_leased,
    cancel_queued,
    finish,
    reap,
    renew,
    requeue,
    resume,
    submit,
    worker_restarted_error,
)

__all__ = [
    "ADMIT_ATTEMPTS",
    "CLAIMED_FIELDS",
    "CLAIM_IDLE_TIMEOUT_MS",
    "MAX_CLAIM_TENANTS",
    "SQLITE_NOW",
    "TERMINAL_EVENTS",
    "ArchiveRecord",
    "ArchiveStatement",
    "Archiver",
    "Clock",
    "Credential",
    "CredentialRefused",
    "DbNow",
    "Fence",
    "Finish",
    "Grant",
    "Outcome",
    "Start",
    "Suspend",
    "_now_sql",
    "admit",
    "append_event",
    "append_unleased_event",
    "archive",
    "cancel",
    "cancel_leased",
    "cancel_queued",
    "check_credential",
    "check_fence",
    "claim",
    "db_now",
    "division_by_zero",
    "finish",
    "guarded",
    "held",
    "is_deadlock",
    "later_expr",
    "lock_fences",
    "next_due",
    "now_expr",
    "reap",
    "rearm_idle_timeout",
    "register_sqlite_clock",
    "remove_run_events",
    "renew",
    "requeue",
    "restore",
    "resume",
    "session_busy_error",
    "set_archiver",
    "submit",
    "terminal_payload",
    "worker_restarted_error",
]


def __getattr__(name: str) -> Any:
    # The registered archiver lives in `archive`, which `set_archiver` rebinds: read it
    # there, not from a copy taken at import (tests save and restore it).
    if name in ("_archiver", "_archive_statement"):
        return getattr(_archive_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
