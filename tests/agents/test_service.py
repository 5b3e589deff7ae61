"""AgentManagementService: shared builds, usage counts, capacity, safe release, close.

Most tests drive the service with in-memory builders, probes and archivers (no database)
and a controllable clock; the last ones use the real database probe and archiver.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agents.applications import (
    ARCHIVE_BATCH,
    DRAINING,
    AgentManagementService,
    Application,
    ApplicationKey,
)
from sageproject.errors import SageError
from tests.conftest import FakeClock


class Harness:
    """Builder, probe and archiver doubles with counters and switches."""

    def __init__(self) -> None:
        self.builds: list[ApplicationKey] = []
        self.gate: asyncio.Event | None = None
        self.building = 0
        self.peak_building = 0
        self.unfinished: dict[str, int] = {}
        self.probe_error: Exception | None = None
        self.archive_batches: list[int] = []
        self.archive_sizes: list[int] = []
        self.archive_error: Exception | None = None
        self.close_errors: int = 0
        self.closed: list[ApplicationKey] = []
        self.progress = asyncio.Condition()

    async def wait_building(self, count: int) -> None:
        """Wait until ``count`` builds are running at once."""
        async with self.progress:
            await self.progress.wait_for(lambda: self.building >= count)

    async def builder(self, key: ApplicationKey) -> Application:
        self.builds.append(key)
        self.building += 1
        self.peak_building = max(self.peak_building, self.building)
        async with self.progress:
            self.progress.notify_all()
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.building -= 1
        app = Application(key=key, package_name="pkg", manifest=None, agents={})

        async def closer() -> None:
            if self.close_errors:
                self.close_errors -= 1
                raise OSError("disk said no")
            self.closed.append(key)

        app.closer = closer
        return app

    async def probe(self, keys: Any) -> dict[ApplicationKey, int]:
        if self.probe_error is not None:
            raise self.probe_error
        return {key: self.unfinished.get(key.agent_id, 0) for key in keys}

    async def archiver(self, key: ApplicationKey, batch: int) -> int:
        if self.archive_error is not None:
            raise self.archive_error
        self.archive_batches.append(batch)
        return self.archive_sizes.pop(0) if self.archive_sizes else 0

    def service(self, clock: FakeClock | None = None, **options: Any) -> AgentManagementService:
        return AgentManagementService(
            builder=self.builder,
            probe=self.probe,
            archiver=self.archiver,
            clock=clock or FakeClock(),
            **options,
        )


async def _hold(
    service: AgentManagementService, agent: str, owner: int = 1, ref: str = "ref"
) -> None:
    async with service.application(owner, ref, agent):
        pass


async def _hold_open(
    service: AgentManagementService, inside: asyncio.Event, leave: asyncio.Event
) -> None:
    """Hold agent "a"'s Application open: set ``inside`` once in, go when ``leave`` is set."""
    async with service.application(1, "ref", "a"):
        inside.set()
        await leave.wait()


async def _release_after_use(
    service: AgentManagementService, agent: str = "a", owner: int = 1, ref: str = "ref"
) -> dict[str, Any]:
    """Use one Application once, then release every idle one: returns the release result."""
    await _hold(service, agent, owner, ref)
    return await service.release_idle(min_idle_seconds=0)


async def test_it_shares_one_build_between_twelve_concurrent_requests() -> None:
    harness = Harness()
    harness.gate = asyncio.Event()
    service = harness.service()
    tasks = [asyncio.create_task(_hold(service, "a")) for _ in range(12)]
    await harness.wait_building(1)
    harness.gate.set()
    await asyncio.gather(*tasks)
    assert len(harness.builds) == 1
    assert service.capacity()["resident"][0]["usage"] == 0


async def test_it_keeps_a_shared_build_when_one_waiter_is_cancelled() -> None:
    harness = Harness()
    harness.gate = asyncio.Event()
    service = harness.service()
    first = asyncio.create_task(_hold(service, "a"))
    entered = asyncio.Event()
    release = asyncio.Event()
    other = asyncio.create_task(_hold_open(service, entered, release))
    await harness.wait_building(1)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    harness.gate.set()
    await entered.wait()
    assert service.capacity()["resident"][0]["usage"] == 1  # the cancelled waiter gave it back
    release.set()
    await other
    assert len(harness.builds) == 1
    assert service.capacity()["resident"][0]["usage"] == 0


async def test_it_returns_the_usage_count_when_the_holder_is_cancelled() -> None:
    harness = Harness()
    service = harness.service()
    inside = asyncio.Event()
    task = asyncio.create_task(_hold_open(service, inside, asyncio.Event()))  # held for good
    await inside.wait()
    assert service.capacity()["leased_applications"] == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert service.capacity()["leased_applications"] == 0
    assert service.capacity()["inflight_operations"] == 0


async def test_it_runs_at_most_four_builds_at_once() -> None:
    harness = Harness()
    harness.gate = asyncio.Event()
    service = harness.service()
    tasks = [asyncio.create_task(_hold(service, f"agent{i}")) for i in range(7)]
    await harness.wait_building(4)
    for _ in range(20):
        await asyncio.sleep(0)
    assert harness.building == 4
    harness.gate.set()
    await asyncio.gather(*tasks)
    assert harness.peak_building == 4
    assert len(harness.builds) == 7


async def test_it_shares_build_slots_with_validation() -> None:
    harness = Harness()
    harness.gate = asyncio.Event()
    service = harness.service(max_concurrent_builds=1)
    build = asyncio.create_task(_hold(service, "a"))
    await harness.wait_building(1)
    validated = asyncio.Event()

    async def check() -> str:
        validated.set()
        return "ok"

    validation = asyncio.create_task(service.validate(check))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not validated.is_set()  # waiting for the build's slot
    harness.gate.set()
    assert await validation == "ok"
    await build


async def test_it_refuses_release_while_a_read_holds_the_instance() -> None:
    harness = Harness()
    clock = FakeClock()
    service = harness.service(clock)
    inside = asyncio.Event()
    done = asyncio.Event()
    reader = asyncio.create_task(_hold_open(service, inside, done))
    await inside.wait()
    clock.now += 3600
    result = await service.release_idle(min_idle_seconds=0, limit=4)
    assert result["released"] == 0
    assert result["busy"] is True
    assert "in use" in result["refused"][0]["reason"]
    done.set()
    await reader


async def test_it_refuses_release_while_the_database_shows_unfinished_runs() -> None:
    harness = Harness()
    harness.unfinished["a"] = 2
    service = harness.service()
    result = await _release_after_use(service)
    assert result["released"] == 0
    assert result["refused"][0]["reason"] == "2 unfinished run(s)"
    assert service.capacity()["applications"] == 1


async def test_it_fails_closed_when_the_probe_fails() -> None:
    harness = Harness()
    harness.probe_error = RuntimeError("database is down")
    result = await _release_after_use(harness.service())
    assert result["released"] == 0
    assert "probe failed" in result["refused"][0]["reason"]


async def test_it_refuses_instances_not_idle_long_enough() -> None:
    harness = Harness()
    clock = FakeClock()
    service = harness.service(clock)
    await _hold(service, "a")
    clock.now += 100
    assert (await service.release_idle(min_idle_seconds=300))["released"] == 0
    clock.now += 200
    assert (await service.release_idle(min_idle_seconds=300))["released"] == 1


async def test_it_releases_the_oldest_idle_instances_first_up_to_the_limit() -> None:
    harness = Harness()
    clock = FakeClock()
    service = harness.service(clock)
    for agent in ("old", "middle", "new"):
        await _hold(service, agent)
        clock.now += 10
    result = await service.release_idle(min_idle_seconds=0, limit=2)
    assert result["released"] == 2
    assert [r["agent"] for r in service.capacity()["resident"]] == ["new"]


async def test_it_rebuilds_the_same_version_after_release() -> None:
    harness = Harness()
    service = harness.service()
    assert (await _release_after_use(service))["released"] == 1
    assert service.capacity()["applications"] == 0
    await _hold(service, "a")
    assert len(harness.builds) == 2
    assert harness.builds[0] == harness.builds[1]


async def test_it_archives_terminal_runs_in_batches_before_release() -> None:
    harness = Harness()
    harness.archive_sizes = [ARCHIVE_BATCH, ARCHIVE_BATCH, 7]
    assert (await _release_after_use(harness.service()))["released"] == 1
    assert harness.archive_batches == [ARCHIVE_BATCH] * 3


async def test_it_keeps_the_instance_when_archiving_fails() -> None:
    harness = Harness()
    harness.archive_error = RuntimeError("archive table locked")
    service = harness.service()
    result = await _release_after_use(service)
    assert result["released"] == 0
    assert "archive failed" in result["refused"][0]["reason"]
    assert service.capacity()["resident"][0]["state"] == "ready"


async def test_it_leaves_a_failed_close_draining_and_close_retries_it() -> None:
    harness = Harness()
    harness.close_errors = 1
    service = harness.service()
    result = await _release_after_use(service)
    assert result["released"] == 0
    assert result["failed"] and "disk said no" in result["failed"][0]["reason"]
    capacity = service.capacity()
    assert capacity["draining"] == 1 and capacity["applications"] == 1
    assert capacity["resident"][0]["state"] == DRAINING
    await service.close()
    assert harness.closed == [ApplicationKey(owner_id=1, ref="ref", agent_id="a")]
    assert service.capacity()["applications"] == 0


async def test_it_keeps_rejecting_work_after_a_failed_shutdown_until_close_succeeds() -> None:
    harness = Harness()
    harness.close_errors = 1
    service = harness.service()
    await _hold(service, "a")
    with pytest.raises(ExceptionGroup):
        await service.close()
    with pytest.raises(SageError) as refused:
        await _hold(service, "b")
    assert refused.value.code == "management.closed"
    await service.close()
    assert harness.closed


async def test_it_releases_a_safe_idle_instance_automatically_at_capacity() -> None:
    harness = Harness()
    clock = FakeClock()
    service = harness.service(clock, max_applications=32, auto_release_idle_seconds=300)
    for i in range(32):
        await _hold(service, f"agent{i}")
    clock.now += 301
    await _hold(service, "one-more")
    capacity = service.capacity()
    assert capacity["applications"] == 32
    residents = {r["agent"] for r in capacity["resident"]}
    assert "one-more" in residents and "agent0" not in residents


async def test_it_answers_management_capacity_when_no_instance_is_safe() -> None:
    harness = Harness()
    clock = FakeClock()
    service = harness.service(clock, max_applications=32, auto_release_idle_seconds=300)
    for i in range(32):
        harness.unfinished[f"agent{i}"] = 1  # every instance has unfinished work
        await _hold(service, f"agent{i}")
    clock.now += 301
    with pytest.raises(SageError) as refused:
        await _hold(service, "one-more")
    assert refused.value.code == "management.capacity"
    assert refused.value.http_status == 429
    assert refused.value.resumable is True
    assert service.capacity()["applications"] == 32  # nothing with unfinished work released


async def test_it_never_releases_automatically_when_disabled() -> None:
    harness = Harness()
    clock = FakeClock()
    service = harness.service(clock, max_applications=1, auto_release_idle_seconds=None)
    await _hold(service, "a")
    clock.now += 10_000
    with pytest.raises(SageError) as refused:
        await _hold(service, "b")
    assert refused.value.code == "management.capacity"


async def test_it_releases_immediately_when_the_automatic_age_is_zero() -> None:
    harness = Harness()
    service = harness.service(max_applications=1, auto_release_idle_seconds=0)
    await _hold(service, "a")
    await _hold(service, "b")
    assert [r["agent"] for r in service.capacity()["resident"]] == ["b"]


def test_it_validates_its_settings() -> None:
    harness = Harness()
    with pytest.raises(ValueError):
        harness.service(max_applications=0)
    with pytest.raises(ValueError):
        harness.service(max_concurrent_builds=0)
    with pytest.raises(ValueError, match="finite and nonnegative"):
        harness.service(auto_release_idle_seconds=-1)


async def test_it_validates_release_arguments() -> None:
    service = Harness().service()
    with pytest.raises(ValueError):
        await service.release_idle(min_idle_seconds=-1)
    with pytest.raises(ValueError):
        await service.release_idle(limit=0)
    with pytest.raises(ValueError):
        await service.release_idle(min_idle_seconds=float("inf"))


async def test_it_reports_resident_applications_in_capacity() -> None:
    harness = Harness()
    clock = FakeClock()
    service = harness.service(clock)
    await _hold(service, "a", owner=7)
    await service.refresh_unfinished()
    clock.now += 12
    capacity = service.capacity()
    assert capacity["limit"] == 32 and capacity["applications"] == 1
    assert capacity["automatic_idle_age"] == 300
    assert capacity["resident"] == [
        {
            "owner": 7,
            "package": "pkg",
            "ref": "ref",
            "agent": "a",
            "state": "ready",
            "idle_seconds": 12.0,
            "usage": 0,
            "unfinished_runs": 0,
            "safe_to_release": True,
        }
    ]


async def test_it_restricts_release_to_selected_refs() -> None:
    harness = Harness()
    service = harness.service()
    async with service.application(1, "ref-a", "x"):
        pass
    async with service.application(1, "ref-b", "x"):
        pass
    result = await service.release_idle(min_idle_seconds=0, limit=10, refs=["ref-b"])
    assert result["released"] == 1
    assert [r["ref"] for r in service.capacity()["resident"]] == ["ref-a"]


async def test_it_rejects_work_once_closed() -> None:
    service = Harness().service()
    await service.close()
    with pytest.raises(SageError) as refused:
        await _hold(service, "a")
    assert refused.value.code == "management.closed"


# --- with the database: the real unfinished-run probe and archiver ----------------------


def _rows(user, *, status: str, child_status: str | None = None):
    from agents import services
    from agents.services import packages
    from scheduling.models import Run, Session
    from tests.conftest import demo_manifest

    package, _ = packages.package_create(owner=user, manifest=demo_manifest(name="probe"))
    session = services.session_create(owner=user, package="probe", agent="assistant")
    run = Run.objects.create(session=session, owner=user, input="hi", status=status)
    if child_status is not None:
        other = Session.objects.create(
            owner=user, package_ref="other", package_name="other", agent_id="helper"
        )
        Run.objects.create(session=other, owner=user, input="sub", status=child_status, parent=run)
    return package, run


def _db_service():
    from agents.applications import unfinished_runs_sync
    from agents.archives import archive_unarchived_sync
    from sageproject.db import db_call

    harness = Harness()
    return AgentManagementService(
        builder=harness.builder,
        probe=lambda keys: db_call(unfinished_runs_sync, keys),
        archiver=lambda key, batch: db_call(archive_unarchived_sync, key, batch),
    )


async def _release_with_rows(user, **rows: Any) -> tuple[dict[str, Any], Any]:
    """Give ``user`` a package with runs (``_rows``), use its Application once with the real
    probe and archiver, then release idle ones: returns the release result and the run."""
    from asgiref.sync import sync_to_async

    package, run = await sync_to_async(_rows)(user, **rows)
    result = await _release_after_use(_db_service(), "assistant", user.pk, package.ref)
    return result, run


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "rows",
    [
        pytest.param({"status": "suspended"}, id="a_suspended_run"),
        pytest.param({"status": "completed", "child_status": "queued"}, id="a_queued_child_run"),
    ],
)
async def test_it_refuses_release_while_a_run_is_unfinished(
    alice, scripted_record, rows: dict[str, str]
) -> None:
    result, _ = await _release_with_rows(alice, **rows)
    assert result["released"] == 0
    assert result["refused"][0]["reason"] == "1 unfinished run(s)"


@pytest.mark.django_db(transaction=True)
async def test_it_archives_terminal_runs_before_releasing(alice, scripted_record) -> None:
    from asgiref.sync import sync_to_async

    from agents.models import ManagedAgentRecord

    result, run = await _release_with_rows(alice, status="completed")
    assert result["released"] == 1
    archived = await sync_to_async(ManagedAgentRecord.objects.filter(run_id=run.pk).exists)()
    assert archived


@pytest.mark.django_db
def test_the_probe_counts_several_keys_at_once_and_a_same_key_child_once(
    alice, bob, scripted_record
) -> None:
    from agents.applications import ApplicationKey, unfinished_runs_sync
    from scheduling.models import Run

    package, run = _rows(alice, status="running", child_status="queued")
    # A child run in a session of the parent's own key: one unfinished run, not two.
    Run.objects.create(session=run.session, owner=alice, input="own", status="queued", parent=run)
    Run.objects.create(session=run.session, owner=alice, input="done", status="completed")
    other, _ = _rows(bob, status="suspended")
    keys = [
        ApplicationKey(owner_id=alice.pk, ref=package.ref, agent_id="assistant"),
        ApplicationKey(owner_id=bob.pk, ref=other.ref, agent_id="assistant"),
        ApplicationKey(owner_id=bob.pk, ref=other.ref, agent_id="nobody"),
    ]
    assert unfinished_runs_sync(keys) == {keys[0]: 3, keys[1]: 1}
