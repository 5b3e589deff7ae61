"""``AgentManagementService``: the worker's resident Applications.

An *Application* is one agent of one package version prepared for runs: the parsed
manifest, the resolved instructions, the tools, the model record view of the agent and of
every member a run can reach (flows: ``models_to_initialise``) and the flow definitions.
Applications are cached by ``(owner, ref, agent)`` so a run does not re-read and re-parse
its package every time, and the cache is bounded (``SAGE_SERVER_MAX_MANAGED_APPLICATIONS``).

The service lives in the worker and is owned by ``RunExecutor``. It never holds anything
that must survive a restart: runs, events, packages and archives are in the database, so
releasing an Application loses nothing and the same version rebuilds on demand. What it
protects is *work in flight*: an Application is released only when nothing uses it and the
database shows no unfinished run (queued, running, suspended, or a child run) for its key.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from django.db.models import Count, Q

from agents.flows import models_to_initialise, reachable_agents, reachable_nodes
from agents.models import AgentPackage
from agents.services.packages import package_manifest
from agents.tools import ToolRegistry
from pooling.models import ModelRecord
from sageproject.errors import NotFoundError, RateLimitedError, SageError, UnavailableError
from scheduling.models import UNFINISHED_STATUSES, Run

logger = logging.getLogger("sage.management")

# Archive batches before a release and in the start-up sweep.
ARCHIVE_BATCH = 100

READY = "ready"
RELEASING = "releasing"
# A close failed: the instance stays counted until a later close succeeds.
DRAINING = "draining"


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplicationKey:
    """Which Application: one agent (or flow) of one package version of one owner."""

    owner_id: int
    ref: str
    agent_id: str

    def label(self) -> str:
        return f"{self.owner_id}:{self.ref[:12]}:{self.agent_id}"


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedAgent:
    """One agent of an Application, ready for the engine: instructions, tools, model view."""

    agent_id: str
    instructions: str
    tools: tuple[Any, ...]
    max_steps: int
    # ``ModelRecordView`` below (decrypted once, in a thread).
    record: Any
    # Tools whose calls wait for the user's approval (the manifest's ``approval``).
    approval: frozenset[str] = frozenset()
    # The manifest's ``mcp_servers`` entries: their tools are listed per run, with the
    # run's user's credentials (`agents.mcp.runtime`).
    mcp_servers: tuple[Any, ...] = ()


@dataclass(slots=True, kw_only=True)
class Application:
    """A prepared package agent. ``agents`` holds the selected agent and its reachable
    members only; ``flow`` is set when the session's agent id names a flow."""

    key: ApplicationKey
    package_name: str
    manifest: Any
    agents: dict[str, PreparedAgent]
    flow: str | None = None
    flows: dict[str, Any] = field(default_factory=dict)
    # Mutable bookkeeping (event-loop only).
    usage: int = 0
    state: str = READY
    last_used: float = 0.0
    built_at: float = 0.0
    unfinished: int | None = None
    close_error: str | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)
    closer: Callable[[], Awaitable[None]] | None = None

    @property
    def entry(self) -> PreparedAgent | None:
        """The selected agent (``None`` for a flow Application)."""
        return self.agents.get(self.key.agent_id)

    async def aclose(self) -> None:
        """Drop the prepared data (and run the builder's closer, if it gave one)."""
        if self.closer is not None:
            await self.closer()
        self.agents = {}


Builder = Callable[[ApplicationKey], Awaitable[Application]]
# (keys) → unfinished runs of each (a key with none may be left out); raising means
# "unknown", which refuses the release.
Probe = Callable[[Collection[ApplicationKey]], Awaitable[Mapping[ApplicationKey, int]]]
# (key, batch) → how many terminal runs were archived.
Archiver = Callable[[ApplicationKey, int], Awaitable[int]]


def _capacity_error(limit: int) -> RateLimitedError:
    return RateLimitedError(
        "management.capacity",
        f"managed application capacity reached ({limit}); instances are active, leased or "
        "too recent to release",
        resumable=True,
        details={"limit": limit, "retry_after": 5},
    )


class AgentManagementService:
    """Resident Applications of one worker process.

    ``builder`` prepares an Application (default: from the database, see
    ``build_application_sync``); ``probe`` counts the unfinished runs of several keys at once;
    ``archiver`` archives a key's unarchived terminal runs. All three are coroutines so
    tests can count, block and fail them.
    """

    def __init__(
        self,
        *,
        builder: Builder,
        probe: Probe,
        archiver: Archiver,
        max_applications: int = 32,
        max_concurrent_builds: int = 4,
        auto_release_idle_seconds: float | None = 300,
        model_budget: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_applications < 1:
            raise ValueError("max_applications must be at least 1")
        if max_concurrent_builds < 1:
            raise ValueError("max_concurrent_builds must be at least 1")
        if auto_release_idle_seconds is not None and (
            not math.isfinite(auto_release_idle_seconds) or auto_release_idle_seconds < 0
        ):
            raise ValueError("automatic idle age must be finite and nonnegative")
        self.max_applications = max_applications
        self.max_concurrent_builds = max_concurrent_builds
        self.auto_release_idle_seconds = auto_release_idle_seconds
        self.model_budget = model_budget
        self._builder = builder
        self._probe = probe
        self._archiver = archiver
        self._clock = clock
        self._apps: dict[ApplicationKey, Application] = {}
        self._builds: dict[ApplicationKey, asyncio.Task[Application]] = {}
        # Build waiters by key: each holds a usage count once the build lands.
        self._waiters: dict[ApplicationKey, set[object]] = {}
        self._build_slots = asyncio.Semaphore(max_concurrent_builds)
        # Admission of new builds and releases: the capacity count and the release decision
        # must not interleave, or two requests could both take the last slot.
        self._admission = asyncio.Lock()
        self._inflight = 0
        self._closing = False
        self._closed = False
        # Set when a shutdown left instances that failed to close: no new work until a
        # later ``close()`` succeeds.
        self._draining = False
        self.builds_started = 0
        self.releases = 0

    # --- applications --------------------------------------------------------------

    @asynccontextmanager
    async def application(
        self, owner_id: int, ref: str, agent_id: str
    ) -> AsyncIterator[Application]:
        """Hold the Application of ``(owner_id, ref, agent_id)`` for the block.

        Builds it when it is not resident (concurrent callers share one build; a cancelled
        caller never cancels it). The usage count taken here is returned on exit, also on
        cancellation. Raises ``management.capacity`` (429, resumable) when the cache is full
        and no instance is safe to release, ``management.closed`` when the service is
        closing, and whatever the builder raises (``package.not_found`` …).
        """
        self._check_open()
        key = ApplicationKey(owner_id=owner_id, ref=ref, agent_id=agent_id)
        self._inflight += 1
        try:
            app = await self._lease(key)
            try:
                yield app
            finally:
                app.usage -= 1
                app.last_used = self._clock()
        finally:
            self._inflight -= 1

    def _check_open(self) -> None:
        if self._closing or self._closed or self._draining:
            raise UnavailableError(
                "management.closed", "agent management service is closing or closed"
            )

    async def _lease(self, key: ApplicationKey) -> Application:
        while True:
            app = self._apps.get(key)
            if app is not None:
                if app.state == READY:
                    app.usage += 1
                    app.last_used = self._clock()
                    return app
                if app.state == RELEASING:
                    await app.released.wait()
                    continue
                # DRAINING: a previous close failed; retry it, then build afresh.
                async with self._admission:
                    if self._apps.get(key) is app and app.state == DRAINING:
                        await self._close_app(app)
                        if app.state == DRAINING:
                            raise UnavailableError(
                                "management.draining",
                                f"the previous instance of {key.label()} failed to close; "
                                "try again later",
                                retryable=True,
                            )
                continue
            build = self._builds.get(key)
            if build is None:
                async with self._admission:
                    if key in self._apps:
                        continue
                    build = self._builds.get(key)
                    if build is None:
                        await self._make_room()
                        self._check_open()
                        build = asyncio.create_task(self._build(key), name=f"build-{key.label()}")
                        self._builds[key] = build
            return await self._wait_build(key, build)

    async def _wait_build(
        self, key: ApplicationKey, build: asyncio.Task[Application]
    ) -> Application:
        token = object()
        self._waiters.setdefault(key, set()).add(token)
        try:
            # Shielded: cancelling this waiter must not cancel a build others share.
            app = await asyncio.shield(build)
        except BaseException:
            waiters = self._waiters.get(key)
            if waiters is not None and token in waiters:
                waiters.discard(token)  # the build has not landed: nothing was counted
            elif build.done() and not build.cancelled() and build.exception() is None:
                landed = build.result()
                landed.usage -= 1  # the build counted this waiter; give the count back
                landed.last_used = self._clock()
            raise
        return app

    async def _build(self, key: ApplicationKey) -> Application:
        try:
            async with self._build_slots:
                self.builds_started += 1
                app = await self._builder(key)
        except BaseException:
            self._builds.pop(key, None)
            self._waiters.pop(key, None)
            raise
        # Building → ready in one step (no await): the capacity count never sees a gap.
        now = self._clock()
        app.built_at = now
        app.last_used = now
        app.usage += len(self._waiters.pop(key, ()))
        self._builds.pop(key, None)
        self._apps[key] = app
        return app

    async def _make_room(self) -> None:
        """Called under ``_admission``: ensure a slot for one more build or raise."""
        if len(self._apps) + len(self._builds) < self.max_applications:
            return
        if self.auto_release_idle_seconds is not None:
            await self._release_locked(
                min_idle_seconds=self.auto_release_idle_seconds, limit=1, refs=None
            )
        if len(self._apps) + len(self._builds) >= self.max_applications:
            raise _capacity_error(self.max_applications)

    # --- validation ------------------------------------------------------------------

    async def validate(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """Run a validation coroutine ``fn(*args, **kwargs)`` holding one build slot.

        Validation and builds share the slots (at most ``max_concurrent_builds`` at once).
        Returns what ``fn`` returns; raises what it raises, or ``management.closed``.
        """
        self._check_open()
        self._inflight += 1
        try:
            async with self._build_slots:
                return await fn(*args, **kwargs)
        finally:
            self._inflight -= 1

    # --- release -----------------------------------------------------------------------

    async def release_idle(
        self,
        *,
        min_idle_seconds: float = 300,
        limit: int = 1,
        refs: Collection[str] | None = None,
    ) -> dict[str, Any]:
        """Release up to ``limit`` safe Applications, oldest use first.

        Safe means: no usage count, idle at least ``min_idle_seconds``, and the database
        shows no unfinished run of its key (a failed probe refuses). Terminal runs are
        archived first (batches of ``ARCHIVE_BATCH``); a failed archive keeps the instance;
        a failed close leaves it draining. ``refs`` restricts candidates to those package
        refs. Returns ``{"released", "busy", "released_keys", "refused": [{"application",
        "reason"}], "failed": [...]}``. Raises ``ValueError`` for bad arguments and
        ``management.closed`` when closing.
        """
        if not math.isfinite(min_idle_seconds) or min_idle_seconds < 0:
            raise ValueError("min_idle_seconds must be finite and nonnegative")
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._check_open()
        async with self._admission:
            return await self._release_locked(
                min_idle_seconds=min_idle_seconds, limit=limit, refs=refs
            )

    async def _release_locked(
        self, *, min_idle_seconds: float, limit: int, refs: Collection[str] | None
    ) -> dict[str, Any]:
        now = self._clock()
        released: list[str] = []
        refused: list[dict[str, str]] = []
        failed: list[dict[str, str]] = []
        candidates = sorted(
            (a for a in self._apps.values() if refs is None or a.key.ref in refs),
            key=lambda a: a.last_used,
        )
        for app in candidates:
            if len(released) >= limit:
                break
            label = app.key.label()
            if app.state != READY:
                refused.append({"application": label, "reason": f"instance is {app.state}"})
                continue
            if app.usage:
                refused.append({"application": label, "reason": f"in use ({app.usage})"})
                continue
            idle = now - app.last_used
            if idle < min_idle_seconds:
                refused.append(
                    {"application": label, "reason": f"idle {idle:.0f}s < {min_idle_seconds:g}s"}
                )
                continue
            try:
                unfinished = (await self._probe([app.key])).get(app.key, 0)
            except Exception as exc:  # fail closed: unknown means unsafe
                logger.warning("unfinished-run probe for %s failed: %s", label, exc)
                refused.append({"application": label, "reason": f"probe failed: {exc}"})
                continue
            app.unfinished = unfinished
            if unfinished:
                refused.append({"application": label, "reason": f"{unfinished} unfinished run(s)"})
                continue
            # The probe awaited: a run may have leased the instance meanwhile.
            if app.usage or app.state != READY:
                refused.append({"application": label, "reason": "leased during the check"})
                continue
            app.state = RELEASING
            try:
                await self._archive_all(app.key)
            except Exception as exc:
                # Automatic and operator releases close only after a successful archive.
                app.state = READY
                app.released.set()
                app.released = asyncio.Event()
                refused.append({"application": label, "reason": f"archive failed: {exc}"})
                continue
            await self._close_app(app)
            if app.state == DRAINING:
                failed.append({"application": label, "reason": app.close_error or "close failed"})
            else:
                released.append(label)
        busy = any(a.usage for a in self._apps.values()) or bool(self._builds)
        return {
            "released": len(released),
            "released_keys": released,
            "busy": busy,
            "refused": refused,
            "failed": failed,
        }

    async def _archive_all(self, key: ApplicationKey) -> int:
        total = 0
        while True:
            count = await self._archiver(key, ARCHIVE_BATCH)
            total += count
            if count < ARCHIVE_BATCH:
                return total

    async def _close_app(self, app: Application) -> None:
        """Close ``app``; on success drop it from the cache, else leave it draining."""
        try:
            await app.aclose()
        except Exception as exc:
            app.state = DRAINING
            app.close_error = f"failed to close {app.key.label()}: {type(exc).__name__}: {exc}"
            logger.warning("%s", app.close_error)
            # Wake callers waiting on the release: they see the draining state and retry.
            app.released.set()
            app.released = asyncio.Event()
            return
        if self._apps.get(app.key) is app:
            del self._apps[app.key]
        self.releases += 1
        app.state = "released"
        app.released.set()

    # --- diagnostics -----------------------------------------------------------------

    async def refresh_unfinished(self) -> None:
        """Re-probe the resident keys' unfinished runs for ``capacity()`` (best effort, one
        probe for all of them)."""
        apps = list(self._apps.values())
        if not apps:
            return
        try:
            counts = await self._probe([app.key for app in apps])
        except Exception:
            counts = None
        for app in apps:
            app.unfinished = None if counts is None else counts.get(app.key, 0)

    def capacity(self) -> dict[str, Any]:
        """Applications resident, building and leased against the limit, operations in flight,
        the automatic idle age, plus ``resident``: one row per Application."""
        now = self._clock()
        resident = []
        for app in sorted(self._apps.values(), key=lambda a: a.last_used):
            resident.append(
                {
                    "owner": app.key.owner_id,
                    "package": app.package_name,
                    "ref": app.key.ref,
                    "agent": app.key.agent_id,
                    "state": app.state,
                    "idle_seconds": round(now - app.last_used, 1),
                    "usage": app.usage,
                    "unfinished_runs": app.unfinished,
                    "safe_to_release": app.state == READY
                    and app.usage == 0
                    and app.unfinished == 0,
                }
            )
        return {
            "applications": len(self._apps),
            "building": len(self._builds),
            "limit": self.max_applications,
            "inflight_operations": self._inflight,
            "leased_applications": sum(1 for a in self._apps.values() if a.usage),
            "automatic_idle_age": self.auto_release_idle_seconds,
            "draining": sum(1 for a in self._apps.values() if a.state == DRAINING),
            "closing": self._closing or self._draining,
            "validation_cleanup_pending": 0,
            "builds_started": self.builds_started,
            "releases": self.releases,
            "model_calls": self.model_budget.snapshot() if self.model_budget is not None else None,
            "resident": resident,
        }

    # --- shutdown ----------------------------------------------------------------------

    async def close(self) -> None:
        """Archive and close every Application; wait for pending builds first.

        A failed close keeps that Application (draining) and raises an ``ExceptionGroup``
        after every other instance was handled; a later ``close()`` retries it.
        """
        if self._closed:
            return
        self._closing = True
        try:
            builds = list(self._builds.values())
            if builds:
                await asyncio.shield(asyncio.gather(*builds, return_exceptions=True))
            errors: list[Exception] = []
            for app in list(self._apps.values()):
                try:
                    await self._archive_all(app.key)
                except Exception as exc:
                    # Shutdown still releases; the start-up sweep archives what is left.
                    logger.warning("archive before shutdown of %s failed: %s", app.key.label(), exc)
                await self._close_app(app)
                if app.state == DRAINING:
                    errors.append(SageError("management.close_failed", app.close_error or ""))
            if errors:
                self._draining = True
                raise ExceptionGroup("managed application shutdown failures", errors)
            self._draining = False
            self._closed = True
        finally:
            self._closing = False


# --- building an Application from the database (sync, run in threads) --------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRecordView:
    """What the model pool needs of a record, decrypted once in a thread."""

    id: int
    protocol: str
    base_url: str
    model: str
    api_key: str = field(repr=False)
    options: dict[str, Any]
    # The record's ``updated_at``: a changed record (a rotated key) is re-read
    # (see ``RunExecutor._current_agents``).
    stamp: Any = None


def find_model_record(owner_id: int, name: str) -> ModelRecord:
    """The record a run of ``owner_id`` uses for ``name``: the owner's own, else the
    shared one; raises ``server.model_not_configured``."""
    record = ModelRecord.objects.for_run(owner_id, name)
    if record is None:
        raise NotFoundError("server.model_not_configured", f"no model record named {name!r}")
    return record


def record_view(record: ModelRecord) -> ModelRecordView:
    return ModelRecordView(
        id=record.pk,
        protocol=record.protocol,
        base_url=record.base_url,
        model=record.model or record.name,
        api_key=record.api_key,
        options=dict(record.options or {}),
        stamp=record.updated_at,
    )


def build_application_sync(key: ApplicationKey, tools: ToolRegistry) -> Application:
    """Prepare the Application of ``key`` from the database.

    Only the selected agent (or, for a flow, the flow's reachable agents) and its reachable
    members get a model record view. Raises ``package.not_found``,
    ``package.agent_not_found`` or ``server.model_not_configured``.
    """
    # The user's own version, or one shared with them (unpublished since: gone for them).
    package = AgentPackage.objects.usable_by(key.owner_id).filter(ref=key.ref).first()
    if package is None:
        raise NotFoundError("package.not_found", "the session's package version is gone")
    manifest = package_manifest(package)
    flows = manifest.flows
    flow_id = key.agent_id if key.agent_id in flows else None
    if flow_id is not None:
        names = reachable_agents(manifest.data["agents"], reachable_nodes(flows, flow_id), None)
    else:
        names = models_to_initialise(manifest, key.agent_id)
    agents: dict[str, PreparedAgent] = {}
    for agent_id in names:
        definition = manifest.agent(agent_id)
        record = find_model_record(key.owner_id, definition["model"])
        agents[agent_id] = PreparedAgent(
            agent_id=agent_id,
            instructions=manifest.instructions(agent_id),
            tools=tuple(
                tool for name in definition["tools"] if (tool := tools.get(name)) is not None
            ),
            max_steps=int(definition["max_steps"]),
            record=record_view(record),
            approval=frozenset(definition.get("approval", ())),
            mcp_servers=tuple(definition.get("mcp_servers", ())),
        )
    return Application(
        key=key,
        package_name=package.name,
        manifest=manifest,
        agents=agents,
        flow=flow_id,
        flows=flows,
    )


def fresh_records_sync(views: dict[str, ModelRecordView]) -> dict[str, ModelRecordView]:
    """Views of the records that changed since ``views`` were taken (by agent id)."""
    ids = {view.id for view in views.values()}
    stamps = dict(ModelRecord.objects.filter(pk__in=ids).values_list("pk", "updated_at"))
    changed = {view.id for view in views.values() if stamps.get(view.id) != view.stamp}
    if not changed:
        return {}
    fresh = {
        record.pk: record_view(record) for record in ModelRecord.objects.filter(pk__in=changed)
    }
    return {agent_id: fresh[view.id] for agent_id, view in views.items() if view.id in fresh}


def key_runs(key: ApplicationKey) -> Q:
    """Runs of a key: its sessions' runs and the child runs of those."""
    session = Q(
        session__owner_id=key.owner_id,
        session__package_ref=key.ref,
        session__agent_id=key.agent_id,
    )
    parent = Q(
        parent__session__owner_id=key.owner_id,
        parent__session__package_ref=key.ref,
        parent__session__agent_id=key.agent_id,
    )
    return session | parent


def unfinished_runs_sync(keys: Collection[ApplicationKey]) -> dict[ApplicationKey, int]:
    """Queued, running or suspended runs of each key's sessions, child runs counted under
    their parent's key too (once where both are the same key); keys with none are left out.

    Two grouped queries whatever the number of keys: runs by their own session's key, and
    child runs by their parent's session's key."""
    keys = set(keys)
    owners = {key.owner_id for key in keys}
    unfinished = Run.objects.filter(status__in=UNFINISHED_STATUSES)
    counts: dict[ApplicationKey, int] = {}

    def add(key: ApplicationKey, n: int) -> None:
        if key in keys:
            counts[key] = counts.get(key, 0) + n

    own = ("session__owner_id", "session__package_ref", "session__agent_id")
    for owner, ref, agent, n in (
        unfinished.filter(session__owner_id__in=owners)
        .values_list(*own)
        .annotate(n=Count("pk"))
        .order_by()
    ):
        add(ApplicationKey(owner_id=owner, ref=ref, agent_id=agent), n)
    parent = ("parent__session__owner_id", "parent__session__package_ref")
    for owner, ref, agent, *mine, n in (
        unfinished.filter(parent__session__owner_id__in=owners)
        .values_list(*parent, "parent__session__agent_id", *own)
        .annotate(n=Count("pk"))
        .order_by()
    ):
        key = ApplicationKey(owner_id=owner, ref=ref, agent_id=agent)
        if key != ApplicationKey(owner_id=mine[0], ref=mine[1], agent_id=mine[2]):
            add(key, n)
    return counts
