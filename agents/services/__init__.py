"""The one door for writes and workflows on packages, sessions, runs and reclamations.

Views, admin actions, management commands and the worker call these functions; none of
them re-implements their checks. One module per concept — ``packages`` (save, resolve,
validate, fork, activate, readiness), ``sessions`` (LangGraph threads too), ``runs``
(admission, cancel, reply, rollback, read permission), ``reclamations`` (operator
release requests) — and the names callers use most, re-exported here. Archives have
their own module (``agents.archives``).
"""

from agents.services.reclamations import reclamation_create, wait_for_answer
from agents.services.runs import (
    MAX_USER_PRIORITY,
    READ_REVOKED_GROUP,
    check_priority,
    check_read_permission,
    check_rollback,
    run_cancel,
    run_reply,
    run_submit,
    session_rollback,
)
from agents.services.sessions import (
    session_create,
    session_import,
    thread_bind,
    thread_create,
    thread_delete,
    thread_metadata_update,
)

__all__ = [
    "MAX_USER_PRIORITY",
    "READ_REVOKED_GROUP",
    "check_priority",
    "check_read_permission",
    "check_rollback",
    "reclamation_create",
    "run_cancel",
    "run_reply",
    "run_submit",
    "session_create",
    "session_import",
    "session_rollback",
    "thread_bind",
    "thread_create",
    "thread_delete",
    "thread_metadata_update",
    "wait_for_answer",
]
