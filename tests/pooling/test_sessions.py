"""Tests for pooling.sessions: TTL by kind, memory-pressure eviction with real kernels."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import psutil
import pytest

from pooling.interpreters import InterpreterLimits, KernelClient
from pooling.sessions import DEFAULT_TTL, LiveSession, SessionPool, cgroup_limit
from tests.pooling.helpers import cancel

MIB = 1024 * 1024
LIMITS = InterpreterLimits(cpu_seconds=5, memory_bytes=512 * MIB, wall_seconds=10.0)
Build = Callable[..., Awaitable[LiveSession]]


@pytest.fixture
async def kernels() -> AsyncIterator[list[KernelClient]]:
    started: list[KernelClient] = []
    yield started
    for kernel in started:
        await kernel.disconnect()


@pytest.fixture
def live(kernels: list[KernelClient]) -> Build:
    """Build a LiveSession around a real, connected kernel."""

    async def build(
        key: str, *, kind: str = "deep", agent: str = "alice", **flags: object
    ) -> LiveSession:
        kernel = KernelClient(limits=LIMITS)
        await kernel.connect()
        kernels.append(kernel)
        return LiveSession(
            key=key, agent=agent, kind=kind, client=kernel, session_id=f"s-{key}",
            resumed=False, **flags,  # type: ignore[arg-type]
        )

    return build


def idle_session(key: str, kind: str = "deep", **flags: object) -> LiveSession:
    """A session with no kernel, for pure ordering and bookkeeping checks."""
    return LiveSession(
        key=key, agent="alice", kind=kind, client=None, session_id=None, resumed=False,
        **flags,  # type: ignore[arg-type]
    )


def write_limit(tmp_path: Path, text: str, name: str = "memory.max") -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    return path


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_it_reads_the_cgroup_v2_limit(tmp_path: Path) -> None:
    v2 = write_limit(tmp_path, str(512 * MIB))
    assert cgroup_limit(v2, tmp_path / "absent") == 512 * MIB


def test_it_treats_max_as_no_limit(tmp_path: Path) -> None:
    v2 = write_limit(tmp_path, "max")
    v1 = write_limit(tmp_path, str(256 * MIB), "memory.limit_in_bytes")
    assert cgroup_limit(v2, v1) is None


def test_it_falls_back_to_cgroup_v1(tmp_path: Path) -> None:
    v1 = write_limit(tmp_path, str(256 * MIB), "memory.limit_in_bytes")
    assert cgroup_limit(tmp_path / "absent", v1) == 256 * MIB


def test_it_treats_an_absurd_v1_limit_as_none(tmp_path: Path) -> None:
    v1 = write_limit(tmp_path, "9223372036854771712", "memory.limit_in_bytes")
    assert cgroup_limit(tmp_path / "absent", v1) is None


def test_it_gives_idle_ttls_by_kind_with_unknown_as_deep() -> None:
    pool = SessionPool(rss_limit=0)
    assert [pool.ttl_for(k) for k in ("master", "branch", "deep", "job", "fork")] == [
        None, 7200.0, 1800.0, 0.0, 0.0,
    ]
    assert pool.ttl_for("mystery") == DEFAULT_TTL["deep"]


def test_it_orders_victims_by_kind_then_least_recently_used() -> None:
    pool = SessionPool(rss_limit=0)
    for i, (key, kind) in enumerate(
        [("m", "master"), ("b", "branch"), ("d2", "deep"), ("d1", "deep"), ("j", "job"),
         ("f", "fork"), ("x", "mystery")]
    ):
        session = idle_session(key, kind)
        session.last_used = {"d1": 1.0, "d2": 2.0, "x": 1.5}.get(key, 100.0 + i)
        pool.add(session)
    assert [s.key for s in pool.victims()] == ["j", "f", "d1", "x", "d2", "b", "m"]


async def test_it_never_offers_pinned_dirty_busy_or_question_pending_sessions() -> None:
    pool = SessionPool(rss_limit=0)
    pool.add(idle_session("pinned", "fork", pinned=True))
    pool.add(idle_session("dirty", "fork", dirty=True))
    pool.add(idle_session("turn", "fork", running_turn="turn-1"))
    pool.add(idle_session("asking", "fork", pending_question=True))
    locked = idle_session("locked", "fork")
    pool.add(locked)
    pool.add(idle_session("free", "master"))
    async with locked.lock:  # a held lock is what marks a session busy mid-turn
        assert [s.key for s in pool.victims()] == ["free"]


def test_it_rekeys_and_returns_the_displaced_session() -> None:
    pool = SessionPool(rss_limit=0)
    old, other = idle_session("old"), idle_session("new")
    pool.add(old)
    pool.add(other)
    assert pool.rekey("old", "new") is other
    assert pool.get("new") is old and old.key == "new"
    assert pool.get("old") is None


async def test_it_evicts_one_victim_at_a_time_under_a_fake_cgroup_limit(
    live: Build, tmp_path: Path
) -> None:
    fork = await live("fork", kind="fork")
    deep = await live("deep", kind="deep")
    branch = await live("branch", kind="branch")
    result = await deep.client.run("ballast = b'x' * (64 * 1024 * 1024)")
    assert result.ok
    probe = SessionPool(rss_limit=0)
    for session in (fork, deep, branch):
        probe.add(session)
    small, big, total = probe.rss_of(branch), probe.rss_of(deep), probe.rss()
    # Over until both the fork (first in order) and the big deep kernel are gone.
    limit_bytes = int((small + small // 2) / 0.8)
    assert total > 0.8 * limit_bytes and big > 64 * MIB
    pool = SessionPool(rss_limit=cgroup_limit(write_limit(tmp_path, str(limit_bytes)), "/none"))
    for session in (fork, deep, branch):
        pool.add(session)
    evicted_pids = [fork.pid, deep.pid]
    assert await pool.make_room() == 2
    assert [s.key for s in pool.sessions()] == ["branch"]
    assert pool.was_evicted("fork") and pool.was_evicted("deep")
    assert not pool.was_evicted("deep")  # the notice is consumed once
    assert all(gone(pid) for pid in evicted_pids if pid is not None)
    assert not pool.over_limit()


async def test_it_stops_evicting_after_the_first_victim_relieves_pressure(
    live: Build, tmp_path: Path
) -> None:
    fork = await live("fork", kind="fork")
    deep = await live("deep", kind="deep")
    await fork.client.run("ballast = b'x' * (64 * 1024 * 1024)")
    probe = SessionPool(rss_limit=0)
    probe.add(deep)
    limit_bytes = int(probe.rss() * 1.5 / 0.8)
    pool = SessionPool(rss_limit=limit_bytes)
    pool.add(fork)
    pool.add(deep)
    assert pool.over_limit()
    assert await pool.make_room() == 1
    assert [s.key for s in pool.sessions()] == ["deep"]


async def test_it_keeps_protected_sessions_over_the_limit_and_logs(
    live: Build, caplog: pytest.LogCaptureFixture
) -> None:
    pool = SessionPool(rss_limit=1)  # one byte: permanently over the limit
    sessions = [
        await live("pinned", kind="fork", pinned=True),
        await live("dirty", kind="fork", dirty=True),
        await live("turn", kind="fork", running_turn="turn-7"),
        await live("asking", kind="fork", pending_question=True),
        await live("locked", kind="fork"),
    ]
    for session in sessions:
        pool.add(session)
    async with sessions[-1].lock:
        with caplog.at_level(logging.WARNING, logger="pooling.sessions"):
            assert await pool.make_room() == 0
    assert len(pool) == 5
    assert "nothing is evictable" in caplog.text
    for session in sessions:
        assert (await session.client.run("1")).ok


async def test_it_uses_max_live_where_there_is_no_limit(live: Build) -> None:
    pool = SessionPool(rss_limit=0, max_live=2)
    first = await live("first", kind="branch")
    second = await live("second", kind="branch")
    pool.add(first)
    pool.add(second)
    second.touch()
    first_pid = first.pid
    assert pool.over_limit()
    assert await pool.make_room() == 1
    assert [s.key for s in pool.sessions()] == ["second"]
    assert first_pid is not None and gone(first_pid)


async def test_it_reaps_idle_sessions_by_kind_ttl(live: Build) -> None:
    pool = SessionPool(rss_limit=0, max_live=100)
    for key, kind in [("m", "master"), ("b", "branch"), ("d", "deep"), ("f", "fork")]:
        session = await live(key, kind=kind)
        session.last_used = 0.0
        pool.add(session)
    assert await pool.reap_once(now=1000.0) == 1  # only the fork (TTL 0)
    assert await pool.reap_once(now=1801.0) == 1  # the deep one
    assert await pool.reap_once(now=7201.0) == 1  # the branch one
    assert await pool.reap_once(now=10**9) == 0  # master never
    assert [s.key for s in pool.sessions()] == ["m"]
    assert pool.was_evicted("d")


async def test_it_does_not_reap_a_busy_session(live: Build) -> None:
    pool = SessionPool(rss_limit=0)
    session = await live("f", kind="fork", running_turn="turn-1")
    session.last_used = 0.0
    pool.add(session)
    assert await pool.reap_once(now=1000.0) == 0
    assert pool.get("f") is session


async def test_it_closes_the_whole_process_tree_so_nothing_is_orphaned(
    live: Build,
) -> None:
    session = await live("tree", kind="deep")
    spawn = (
        "import subprocess\n"
        "a = subprocess.Popen(['sleep', '60'])\n"
        "b = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "print(a.pid, b.pid)"
    )
    result = await session.client.run(spawn)
    assert result.ok, result.error
    pids = [session.pid, *map(int, result.stdout.split())]
    pool = SessionPool(rss_limit=0)
    pool.add(session)
    assert await pool.close("tree")
    assert all(gone(pid) for pid in pids if pid is not None)


async def test_it_logs_a_failed_disconnect_and_still_kills_the_kernel(
    live: Build, caplog: pytest.LogCaptureFixture
) -> None:
    session = await live("broken", kind="deep")
    pid = session.pid
    real = session.client

    class Broken:
        pid = real.pid

        async def disconnect(self) -> None:
            raise RuntimeError("socket already gone")

    session.client = Broken()
    pool = SessionPool(rss_limit=0)
    pool.add(session)
    with caplog.at_level(logging.WARNING, logger="pooling.sessions"):
        assert await pool.close("broken")
    assert "disconnect failed" in caplog.text
    assert pid is not None
    await real.disconnect()  # reaps the zombie the kill left behind
    assert gone(pid)


async def test_it_closes_all_sessions_of_one_agent(live: Build) -> None:
    pool = SessionPool(rss_limit=0)
    pool.add(await live("a1", agent="alice"))
    pool.add(await live("a2", agent="alice"))
    pool.add(await live("b1", agent="bob"))
    assert await pool.close_all(agent="alice") == 2
    assert [s.key for s in pool.sessions()] == ["b1"]
    assert await pool.close_all() == 1
    assert len(pool) == 0


async def test_it_keeps_reaping_after_its_own_errors(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pool = SessionPool(rss_limit=0, reap_interval=0.001)
    calls = 0
    recovered = asyncio.Event()

    async def flaky_reap(*, now: float | None = None) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("psutil hiccup")
        recovered.set()
        return 0

    monkeypatch.setattr(pool, "reap_once", flaky_reap)
    with caplog.at_level(logging.ERROR, logger="pooling.sessions"):
        task = asyncio.create_task(pool.reap_loop())
        await asyncio.wait_for(recovered.wait(), timeout=10)
        await cancel(task)
    assert "reaper failed" in caplog.text


async def test_it_snapshots_each_session_with_pid_and_rss(live: Build) -> None:
    pool = SessionPool(rss_limit=0)
    session = await live("snap", kind="branch", dirty=True)
    session.turns = 3
    pool.add(session)
    snap = pool.snapshot()
    (row,) = snap["sessions"]
    assert row["key"] == "snap" and row["kind"] == "branch" and row["agent"] == "alice"
    assert row["pid"] == session.pid and row["rss"] > 0
    assert row["turns"] == 3 and row["dirty"] is True and row["busy"] is False
    assert snap["live"] == 1 and snap["rss"] == row["rss"]
