"""Tests for pooling.interpreters: real warm subprocesses, their limits and their cleanup."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import psutil
import pytest

from pooling.interpreters import (
    InterpreterLimits,
    KernelClient,
    WarmInterpreter,
    interpreter_pool,
)
from sageproject.errors import SageError

MIB = 1024 * 1024
LIMITS = InterpreterLimits(cpu_seconds=1, memory_bytes=256 * MIB, wall_seconds=10.0)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
async def interp() -> AsyncIterator[WarmInterpreter]:
    interp = await WarmInterpreter.boot(limits=LIMITS)
    yield interp
    await interp.close()


@pytest.fixture
async def kernel() -> AsyncIterator[KernelClient]:
    kernel = KernelClient(limits=LIMITS)
    await kernel.connect()
    yield kernel
    await kernel.disconnect()


async def test_it_runs_a_snippet_and_echoes_the_last_expression(interp: WarmInterpreter) -> None:
    result = await interp.run("print('hello')\n6 * 7")
    assert result.ok and not result.killed
    assert result.stdout == "hello\n42\n"
    assert result.duration_ms >= 0


async def test_it_reports_an_exception_and_keeps_the_process(interp: WarmInterpreter) -> None:
    pid = interp.pid
    result = await interp.run("raise ValueError('boom')")
    assert not result.ok and not result.killed
    assert "ValueError: boom" in result.error
    assert 'File "<snippet>"' in result.error and "<string>" not in result.error
    assert interp.pid == pid


async def test_it_starts_each_snippet_in_a_fresh_namespace(interp: WarmInterpreter) -> None:
    await interp.run("secret_of_alice = 1")
    result = await interp.run("'secret_of_alice' in globals()")
    assert result.stdout == "False\n"


async def test_it_kills_and_replaces_a_cpu_bound_infinite_loop(interp: WarmInterpreter) -> None:
    old_pid = interp.pid
    assert old_pid is not None
    result = await interp.run("while True:\n    pass")
    assert result.killed and not result.ok
    assert "CPU time limit" in result.error
    assert interp.pid != old_pid and gone(old_pid)
    assert interp.replacements == 1
    assert (await interp.run("'still warm'")).stdout == "'still warm'\n"


@pytest.mark.timing
async def test_it_kills_and_replaces_a_snippet_past_the_wall_clock(
    interp: WarmInterpreter,
) -> None:
    old_pid = interp.pid
    result = await interp.run("import time\ntime.sleep(30)", timeout=0.2)
    assert result.killed and "wall-clock" in result.error
    assert interp.pid != old_pid
    assert (await interp.run("1")).ok


async def test_it_enforces_the_memory_limit(interp: WarmInterpreter) -> None:
    result = await interp.run("block = b'x' * (400 * 1024 * 1024)")
    assert not result.ok and "MemoryError" in result.error
    assert (await interp.run("'after'")).ok


async def test_it_hides_the_parents_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-alice-secret")
    interp = await WarmInterpreter.boot(limits=LIMITS)
    try:
        result = await interp.run("import os\nsorted(os.environ)")
        leak = await interp.run("import os\nos.environ.get('OPENAI_API_KEY')")
    finally:
        await interp.close()
    assert result.stdout == "['LANG', 'PATH']\n"
    assert leak.stdout == ""  # None is not echoed


async def test_it_caps_the_output(interp: WarmInterpreter) -> None:
    result = await interp.run("print('a' * 200_000)")
    assert result.ok and result.truncated
    assert len(result.stdout) == LIMITS.output_bytes


async def test_it_keeps_the_protocol_safe_from_raw_fd_writes(interp: WarmInterpreter) -> None:
    result = await interp.run("import os\nos.write(1, b'{\"ok\": false}\\n')\n'fine'")
    assert result.ok and result.stdout == "'fine'\n"


async def test_it_runs_in_its_own_process_group(interp: WarmInterpreter) -> None:
    assert interp.pid is not None
    assert os.getpgid(interp.pid) == interp.pid != os.getpgid(0)


async def test_it_leaves_no_process_behind_on_close() -> None:
    interp = await WarmInterpreter.boot(limits=LIMITS)
    result = await interp.run(
        "import subprocess\n"
        "subprocess.Popen(['sleep', '60']).pid, "
        "subprocess.Popen(['sleep', '60'], start_new_session=True).pid"
    )
    assert result.ok, result.error
    pids = [interp.pid, *(int(p) for p in result.stdout.strip("()\n").split(", "))]
    # Children of a finished snippet keep running until the state is closed.
    await interp.close()
    assert all(gone(pid) for pid in pids if pid is not None)


async def test_it_keeps_a_kernel_namespace_across_calls(kernel: KernelClient) -> None:
    await kernel.run("total = 40")
    await kernel.query("total += 2\ntotal")
    results = [result async for result in kernel.receive_response()]
    assert [r.stdout for r in results] == ["42\n"]


async def test_it_interrupts_a_kernel_snippet_and_keeps_its_variables(
    kernel: KernelClient,
) -> None:
    await kernel.run("kept = 'yes'\nstarted = False")
    run = asyncio.create_task(
        kernel.run("import time\nwhile True:\n    time.sleep(0.01)", timeout=10.0)
    )
    # The snippet's start is not observable from outside; interrupt until it lands.
    while not run.done():
        await kernel.interrupt()
        await asyncio.wait([run], timeout=0.05)
    result = run.result()
    assert not result.ok and "KeyboardInterrupt" in result.error
    assert (await kernel.run("kept")).stdout == "'yes'\n"


@pytest.mark.timing
async def test_it_reports_a_lost_kernel_after_a_limit_breach(kernel: KernelClient) -> None:
    await kernel.run("x = 1")
    result = await kernel.run("import time\ntime.sleep(30)", timeout=0.2)
    assert result.killed
    with pytest.raises(SageError) as info:
        await kernel.query("x")
    assert info.value.code == "tool.interpreter_lost"
    await kernel.connect()
    assert "NameError" in (await kernel.run("x")).error


async def test_it_serves_snippets_from_an_elastic_interpreter_pool() -> None:
    pool = interpreter_pool(max_size=4, limits=LIMITS)
    async with pool.checkout() as first:
        pid = first.pid
        assert (await first.run("2 + 2")).stdout == "4\n"
    async with pool.checkout() as again:
        assert again.pid == pid
    await pool.close()
    assert pool.stats().created == 0
    assert pid is not None and gone(pid)


async def test_it_kills_and_replaces_a_snippet_that_forges_protocol_output(
    interp: WarmInterpreter,
) -> None:
    old_pid = interp.pid
    forge = (
        "import os\n"
        "for fd in range(3, 16):\n"
        "    try:\n"
        "        os.write(fd, b'forged response\\n')\n"
        "    except OSError:\n"
        "        pass"
    )
    result = await interp.run(forge)
    assert result.killed and "protocol" in result.error
    assert interp.pid != old_pid
    assert (await interp.run("'ok'")).stdout == "'ok'\n"


async def test_it_replaces_a_process_that_died_while_parked(interp: WarmInterpreter) -> None:
    old_pid = interp.pid
    assert old_pid is not None
    os.killpg(old_pid, 9)
    for _ in range(500):  # bounded wait for the kernel to deliver the kill
        if gone(old_pid):
            break
        await asyncio.sleep(0.01)
    result = await interp.run("'fresh'")
    assert result.stdout == "'fresh'\n"
    assert interp.pid != old_pid and interp.replacements == 1


async def test_it_ends_reclaimed_interpreter_processes() -> None:
    pool = interpreter_pool(max_size=8, limits=LIMITS)
    release = asyncio.Event()
    pids: list[int | None] = []
    all_in = asyncio.Event()

    async def hold() -> None:
        async with pool.checkout() as interp:
            pids.append(interp.pid)
            if len(pids) == 3:
                all_in.set()
            await release.wait()

    holders = [asyncio.create_task(hold()) for _ in range(3)]
    await all_in.wait()
    release.set()
    await asyncio.gather(*holders)
    await pool.reclaim_once()
    assert await pool.reclaim_once() == 2
    assert pool.stats().created == 1
    assert sum(gone(pid) for pid in pids if pid is not None) == 2
    await pool.close()
    assert all(gone(pid) for pid in pids if pid is not None)
