"""The LangGraph server API under ``/lg/`` (a client is given ``http://HOST:PORT/lg``): the
subset the official SDK (``langgraph_sdk``) and agent-chat-ui use, as a thin layer over
the services every door calls (`agents.services`) — the same ownership (another user's
thread or run is 404), limits (429 ``scheduler.queue_full`` with ``Retry-After``),
idempotency (an ``Idempotency-Key`` header on a run) and read permission; no engine of its
own. Auth: ``X-Api-Key: <our API token>`` (or ``Authorization: Token <key>``). Errors keep
our envelope with the status codes the SDK expects (404, 409 ``session.busy`` for
``multitask_strategy="reject"``, 429).

**Mapping.** An *assistant* is an agent or flow of a package version the user may use
(`agents.protocols.common.assistants`): its ``graph_id`` is ``<package>/<agent>`` and its
``assistant_id`` a UUID derived from that; either, or ``<package>`` alone (the entrypoint),
names it. A *thread* is a Session of the user's own (every session, whichever door made
it). LangGraph threads have no assistant until their first run, so ``POST /threads``
creates a session bound to nothing (an empty package), which its first run binds to the
run's assistant (a thread keeps that assistant: another answers 409
``thread.assistant_conflict``); metadata given at creation or by ``PATCH`` is kept in
`agents.models.ThreadMetadata`, and ``graph_id``/``assistant_id`` are added once bound. A
*run* is a Run: its input is the text of the human messages of ``input.messages``
(content as text or ``{"type": "text"}`` parts). The thread's state, checkpoints, history
and a run's Server-Sent Events are built from durable events
(`agents.protocols.messages`). A suspended run's interaction is the thread's interrupt;
``command={"resume": ...}`` answers it through ``run_reply`` and the "new" run is that
run, resumed. ``multitask_strategy`` (default ``reject``, as LangGraph's) is the session's
multitask rule.

**Checkpoints.** A run given the thread's head checkpoint (agent-chat-ui sends it on every
submit) runs as usual; one given an earlier checkpoint replaces the turns after it — the
later runs (finished) are rolled back, their events removed, as ``rollback`` does — and,
without input, runs the turn's human message again (regenerate). Sessions are linear: the
replaced turns do not stay as a branch.

Left out: assistants' create / update / delete / versions (assistants are packages:
publish a package instead); ``threads.update_state`` / ``copy`` / ``prune``, thread
streams (``/threads/{id}/stream``); crons; the store; ``stream_mode`` ``custom``,
``debug``, ``tasks`` and ``checkpoints`` (accepted, nothing to send);
``interrupt_before`` / ``interrupt_after``, ``config``, ``context``, ``webhook``,
``after_seconds``, ``on_completion``, ``durability`` (accepted and ignored); a run's own
``metadata`` is not stored.

**Modules.** ``base`` (the door: auth, CORS, reading a body), ``assistants``, ``state``
(the user's threads, their state, checkpoints and history), ``threads``, ``runs``, and
``streams`` (a run's events and the answers that wait for it); ``urls`` has the routes.
Every write goes through `agents.services`.
"""

from agents.protocols.langgraph.urls import urlpatterns

__all__ = ["urlpatterns"]
