"""What the protocol layers share (``agents/protocols/openai.py``, the LangGraph layer).

- **Assistants.** Every package version a user may use (``AgentPackage.objects.usable_by``;
  a name means what ``package_resolve`` says: their own version first, then a shared one)
  offers one assistant per agent and per flow, with the id ``<package>/<agent>``; the
  package name alone is its entrypoint.
- **Sessions opened with earlier turns** (`agents.services.session_import`): a client
  that sends a whole conversation gets a fresh session whose earlier turns are imported
  as durable events of no run; the last user message becomes the run's input.
- **Following one run** (`follow_run`): ``scheduling.live.follow`` narrowed to one run's
  durable events and live deltas, ending with its terminal event.
- **Answers that wait for a run** (`DeferredResponse`): computed on the event loop, never
  holding one of the web process's request threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpResponse, StreamingHttpResponse

from agents.models import AgentPackage
from agents.services.packages import package_resolve
from sageproject.errors import NotFoundError, ValidationError
from scheduling import live, runs
from scheduling.models import Event, Run, Session

# Separates a package name from an agent or flow id in an assistant id (names never hold it).
SEPARATOR = "/"
# The events that end a run, whatever its status.
TERMINAL_EVENTS = frozenset(runs.TERMINAL_EVENTS.values())
# How long one `follow_run` window lasts before the run's existence is checked (seconds).
FOLLOW_WINDOW = 300.0


def invalid(field: str, message: str) -> ValidationError:
    """``request.invalid`` (400) naming the field and what is wrong with it."""
    return ValidationError(
        "request.invalid", f"{field}: {message}", details={"fields": {field: [message]}}
    )


def idempotency_key(request: Any) -> str | None:
    """The request's ``Idempotency-Key`` header (None when absent); ``request.invalid``
    when it is longer than a run's key may be."""
    key = request.headers.get("Idempotency-Key") or None
    longest = Run._meta.get_field("idempotency_key").max_length
    if key is not None and len(key) > longest:
        raise invalid("Idempotency-Key", f"at most {longest} characters")
    return key


@dataclass(frozen=True, slots=True)
class Assistant:
    """One agent or flow of a package version a user may use, under its public id."""

    id: str
    package: AgentPackage
    agent: str

    @property
    def flow(self) -> bool:
        """Whether the assistant is a flow (its runs' answer is the flow's output)."""
        return self.agent in (self.package.manifest.get("flows") or {})


def _members(package: AgentPackage) -> list[str]:
    manifest = package.manifest
    return [*(manifest.get("agents") or {}), *(manifest.get("flows") or {})]


def package_assistants(package: AgentPackage) -> list[Assistant]:
    """A package version's assistants: its entrypoint under the package name, then every
    agent and flow as ``<package>/<id>``."""
    found = [Assistant(package.name, package, str(package.manifest.get("entrypoint")))]
    found += [Assistant(f"{package.name}{SEPARATOR}{m}", package, m) for m in _members(package)]
    return found


def assistants(user) -> list[Assistant]:
    """Every assistant ``user`` may use, by package name: for each name the version
    ``package_resolve`` means by it — the user's own before a shared one, the active
    version, else the newest — read in one query (this runs on every request that names
    an assistant by UUID or by agent id alone)."""
    newest_first = AgentPackage.objects.usable_by(user.pk).order_by("-created_at")
    chosen: dict[str, AgentPackage] = {}
    for package in sorted(newest_first, key=lambda p: (p.owner_id != user.pk, not p.active)):
        chosen.setdefault(package.name, package)
    return [found for name in sorted(chosen) for found in package_assistants(chosen[name])]


def assistant_resolve(user, assistant_id: str) -> Assistant:
    """The assistant ``<package>`` (its entrypoint) or ``<package>/<agent or flow>`` means
    for ``user``; ``assistant.not_found`` (404) when there is none."""
    name, sep, member = str(assistant_id).partition(SEPARATOR)
    try:
        package = package_resolve(owner=user, name_or_ref=name)
    except NotFoundError:
        package = None
    if package is not None:
        agent = member if sep else str(package.manifest.get("entrypoint"))
        if agent in _members(package):
            return Assistant(str(assistant_id), package, agent)
    raise NotFoundError("assistant.not_found", f"no assistant {assistant_id!r}")


def run_start(run: Run) -> int:
    """The seq after which ``run``'s durable events are: before its first event, or the
    session's durable prefix when it has none yet (its events come later).

    The prefix is read first: read after finding no event, it could already hold the whole
    run — a run that ends within moments of its submission commits its events between the
    two reads — and a stream following from there would wait forever for an end it missed.
    Read first, it is at most the seq before the run's first event."""
    prefix = Session.objects.filter(pk=run.session_id).values_list("persisted_events", flat=True)[0]
    first = (
        Event.objects.filter(session_id=run.session_id, run_id=run.pk)
        .order_by("seq")
        .values_list("seq", flat=True)
        .first()
    )
    return first - 1 if first is not None else prefix


def _run_exists(run_id: Any) -> bool:
    return Run.objects.filter(pk=run_id).exists()


async def follow_run(session_id: Any, run_id: Any, after: int) -> AsyncIterator[Any]:
    """One run as it happens (`scheduling.live.follow`): its durable ``Event`` rows after
    seq ``after`` (other runs' and imported ones skipped), its live `live.Delta`\\s, and
    `live.KeepAlive`/`live.Dropped`; ends after the run's terminal event (or when the run
    is gone). Close it (``contextlib.aclosing``) to stop early."""
    run = str(run_id)
    exists = sync_to_async(_run_exists, thread_sensitive=False)
    while True:
        async with contextlib.aclosing(live.follow(session_id, after, FOLLOW_WINDOW)) as items:
            async for item in items:
                if isinstance(item, live.Delta):
                    if item.run == run:
                        yield item
                elif isinstance(item, live.KeepAlive | live.Dropped):
                    yield item
                else:
                    after = item.seq
                    if str(item.run_id) == run:
                        yield item
                        if item.type in TERMINAL_EVENTS:
                            return
        if not await exists(run_id):
            return


class DeferredResponse(StreamingHttpResponse):
    """An answer that waits for something (a run's end) on the event loop, never on a
    request thread: ``compute`` (async, no arguments) returns the real ``HttpResponse``.

    `settle` computes it and takes its status, headers and body. The web process's
    handler awaits ``settle`` before it sends the status line when it supports that;
    otherwise the body is computed while it streams, under a 200 (the status line is
    already sent), so an error then arrives as a body only."""

    def __init__(self, compute: Callable[[], Awaitable[HttpResponse]]) -> None:
        self._compute = compute
        self._settled: bytes | None = None
        super().__init__(self._body(), content_type="application/json")

    async def settle(self) -> None:
        if self._settled is not None:
            return
        answer = await self._compute()
        self.status_code = answer.status_code
        for header, value in answer.items():
            self[header] = value
        self._settled = answer.content

    async def _body(self) -> AsyncIterator[bytes]:
        await self.settle()
        yield self._settled or b""
