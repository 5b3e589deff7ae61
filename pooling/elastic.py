"""An elastic pool of warm states that grows with real demand and gives memory back.

A *state* is anything expensive to boot and cheap to reuse (a warm interpreter subprocess).
The pool is sized from three live inputs (seed 003):

* the **ceiling** ``max_size`` (e.g. the sum of a tool source's ``max_concurrent``) caps
  growth and sets the growth step ``clamp(ceil(max/8), 1, 8)``; it is a ceiling, never a
  preallocation;
* the **in-use count** sets the shrink step ``clamp(ceil(excess/(1+in_use)), 1, excess)``
  with ``excess = created - max(resident, in_use + idle_headroom)``: an idle pool collapses to
  its floor in one round, a busy one gives up one state per round;
* **how many states exist** decides how much room is left to grow and what can be reclaimed.

Growth rules. A miss (no idle state, room below the ceiling, no boot in flight) boots exactly
one state for its caller. Callers arriving while a boot is in flight, or at the ceiling, queue
as *waiters*. Batch prewarm fires only on genuine contention — callers queued while every
existing state is checked out — and boots one state per queued caller not already covered by
a prewarm boot, with at most ``grow_step`` boots in flight and never past the ceiling: never
more than the callers actually waiting. Two overlapping requests therefore create exactly two
states, while a genuinely queued burst ramps in one jump of up to ``grow_step``.

Shrink rules. One janitor task (:class:`Janitor`) calls :meth:`ElasticPool.reclaim_once` on
every registered pool every 30 s. A round reclaims only after ``shrink_grace_rounds``
consecutive rounds without growth; the grace counter is reset by *growth* (a miss that had to
boot), never by ordinary checkouts, so steady sequential traffic cannot pin a burst's leftover
states forever.

This module is Django-free and single-event-loop: bookkeeping happens between awaits, so it
needs no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sageproject.errors import UnavailableError

logger = logging.getLogger(__name__)

# The admin chart shows the last hour; growth samples are extra, so cap hard as well.
HISTORY_SECONDS = 3600.0
HISTORY_MAX_SAMPLES = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    """A point-in-time view of one elastic pool, for the status API and the admin."""

    created: int
    idle: int
    in_use: int
    waiting: int
    max: int
    resident: int
    grow_step: int
    shrink_step: int
    peak_in_use: int

    def as_dict(self) -> dict[str, int]:
        """The stats as a plain dict (JSON-ready)."""
        return {name: getattr(self, name) for name in self.__slots__}


def grow_step_for(max_size: int) -> int:
    """The batch size a ceiling allows: ``clamp(ceil(max/8), 1, 8)``."""
    return max(1, min(8, math.ceil(max_size / 8)))


def spares_for(max_size: int) -> int:
    """Spares a :class:`SpareFactory` keeps ahead while a pool grows: ``min(3, grow_step)``.

    A pool that creeps up one state at a time needs one spare; one that can grow in batches
    sees misses in clusters, and ``bench_elastic`` on a 2-core host showed clusters of up to
    three misses inside one boot time.
    """
    return min(3, grow_step_for(max_size))


def shrink_step_for(*, created: int, in_use: int, resident: int, idle_headroom: int) -> int:
    """States one janitor round may reclaim (0 when there is no excess)."""
    excess = created - max(resident, in_use + idle_headroom)
    if excess <= 0:
        return 0
    return max(1, min(excess, math.ceil(excess / (1 + in_use))))


class ElasticPool[T]:
    """A pool of states booted by ``factory()`` and closed by ``closer(state)``.

    ``max_size`` is the ceiling (>= 1), ``resident`` the floor the janitor never reclaims
    below. ``janitor_interval`` is the period of the janitor that will drive this pool (it
    sizes the history ring). Invalid sizes raise ``ValueError``.
    """

    def __init__(
        self,
        factory: Callable[[], Awaitable[T]],
        closer: Callable[[T], Awaitable[object]],
        *,
        max_size: int,
        resident: int = 1,
        janitor_interval: float = 30.0,
        shrink_grace_rounds: int = 2,
        idle_headroom: int = 1,
        on_close: Callable[[], Awaitable[object]] | None = None,
        on_idle: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        if resident < 0:
            raise ValueError("resident must not be negative")
        if shrink_grace_rounds < 0 or idle_headroom < 0:
            raise ValueError("shrink_grace_rounds and idle_headroom must not be negative")
        if janitor_interval <= 0:
            raise ValueError("janitor_interval must be positive")
        self._factory = factory
        self._closer = closer
        # Called once at the end of close(): a factory holding states of its own (a
        # :class:`SpareFactory`) closes them here.
        self._on_close = on_close
        # Awaited by every janitor round once the pool saw no checkout at all for
        # ``shrink_grace_rounds`` rounds: a SpareFactory lets its extra spares go here.
        self._on_idle = on_idle
        self._checkouts = 0  # since the last janitor round
        self._idle_rounds = 0
        self._max = max_size
        self._resident = resident
        self.janitor_interval = janitor_interval
        self._grace_rounds = shrink_grace_rounds
        self._headroom = idle_headroom
        # Idle states: release/checkout use the right end (hot states stay hot), the janitor
        # reclaims from the left end (the coldest).
        self._idle: deque[T] = deque()
        self._waiters: deque[asyncio.Future[T]] = deque()
        # ``created`` counts every state that exists or is being booted, so the ceiling holds
        # while boots are in flight.
        self._created = 0
        self._in_use = 0
        self._booting = 0  # every boot in flight
        self._prewarming = 0  # boots in flight whose state goes to the queue
        self._peak_in_use = 0
        self._quiet_rounds = 0
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._history: deque[tuple[float, int, int]] = deque(maxlen=HISTORY_MAX_SAMPLES)

    # -- public surface ---------------------------------------------------------------

    @property
    def grow_step(self) -> int:
        return grow_step_for(self._max)

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.asynccontextmanager
    async def checkout(self) -> AsyncIterator[T]:
        """Hold one state for the body of an ``async with``; it is returned on exit.

        Reuses an idle state, boots one for a miss, or waits for one. Raises
        ``UnavailableError`` (``server.elastic_pool_closed``) once the pool is closed, and
        whatever the factory raised when the boot made for this caller failed.
        """
        state = await self._acquire()
        try:
            yield state
        finally:
            self._release(state)

    def stats(self) -> PoolStats:
        """The current :class:`PoolStats`."""
        return PoolStats(
            created=self._created,
            idle=len(self._idle),
            in_use=self._in_use,
            waiting=sum(1 for waiter in self._waiters if not waiter.done()),
            max=self._max,
            resident=self._resident,
            grow_step=self.grow_step,
            shrink_step=self._shrink_step(),
            peak_in_use=self._peak_in_use,
        )

    def history(self) -> list[tuple[float, int, int]]:
        """``(unix timestamp, created, in_use)`` samples of the last hour, oldest first.

        A sample is taken at every janitor round and on every growth.
        """
        self._trim_history(time.time())
        return list(self._history)

    async def reclaim_once(self) -> int:
        """Run one janitor round; return how many idle states it closed.

        Reclaims only after ``shrink_grace_rounds`` consecutive rounds without growth, and
        then at most the shrink step, never below ``max(resident, in_use + idle_headroom)``.
        Closer failures are logged, not raised.
        """
        if self._closed:
            return 0
        self._quiet_rounds += 1
        victims: list[T] = []
        if self._quiet_rounds >= self._grace_rounds:
            step = min(self._shrink_step(), len(self._idle))
            for _ in range(step):
                victims.append(self._idle.popleft())
                # ``created`` drops before the close awaits, so stats never show a ghost.
                self._created -= 1
        self._sample()
        for state in victims:
            await self._close_state(state)
        idle = self._checkouts == 0 and self._in_use == 0
        self._idle_rounds = self._idle_rounds + 1 if idle else 0
        self._checkouts = 0
        if self._on_idle is not None and self._idle_rounds >= self._grace_rounds:
            try:
                await self._on_idle()
            except Exception as exc:
                logger.warning("elastic pool: the quiet hook failed: %r", exc)
        return len(victims)

    def set_max(self, n: int) -> None:
        """Change the ceiling to ``n`` (>= 1, else ``ValueError``).

        Lowering it closes idle states above the new ceiling at once (in the background) and
        makes states returned while the pool is above the ceiling close instead of parking.
        Raising it lets queued callers grow the pool.
        """
        if n < 1:
            raise ValueError("max_size must be at least 1")
        self._max = n
        while self._created > self._max and self._idle:
            self._created -= 1
            self._spawn(self._close_state(self._idle.popleft()))
        self._maybe_prewarm()

    async def close(self) -> None:
        """Close the pool: fail waiters, close idle states, wait for in-flight work.

        States still checked out are closed when their holders return them. Idempotent.
        """
        if not self._closed:
            self._closed = True
            error = self._closed_error()
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(error)
            idle = list(self._idle)
            self._idle.clear()
            self._created -= len(idle)
            for state in idle:
                await self._close_state(state)
        # Background boots deliver into a closed pool, which closes what they produced.
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            await on_close()

    # -- acquisition --------------------------------------------------------------------

    async def _acquire(self) -> T:
        if self._closed:
            raise self._closed_error()
        if self._idle:
            return self._take(self._idle.pop())
        if self._created < self._max and self._booting == 0:
            return await self._boot_for_caller()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[T] = loop.create_future()
        self._waiters.append(waiter)
        self._maybe_prewarm()
        try:
            state = await waiter
        except BaseException:
            # Cancelled (or failed) while queued: if a state was handed over in the same
            # instant, give it back so it is not leaked.
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._in_use -= 1
                self._park_or_close(waiter.result())
            raise
        return state

    async def _boot_for_caller(self) -> T:
        self._created += 1
        self._booting += 1
        self._note_growth()
        # Shielded: a caller cancelled mid-boot must not cancel a boot other waiters may get.
        boot = asyncio.ensure_future(self._factory())
        try:
            state = await asyncio.shield(boot)
        except asyncio.CancelledError:
            # The state now goes to the queue, so it covers a waiter like a prewarm boot.
            self._prewarming += 1
            self._spawn(self._finish_orphan_boot(boot))
            raise
        except BaseException:
            self._booting -= 1
            self._created -= 1
            self._maybe_prewarm()
            raise
        self._booting -= 1
        if self._closed:
            self._created -= 1
            await self._close_state(state)
            raise self._closed_error()
        taken = self._take(state)
        self._maybe_prewarm()
        return taken

    async def _finish_orphan_boot(self, boot: asyncio.Future[T]) -> None:
        """Complete a boot whose caller was cancelled; the state goes to the next waiter."""
        try:
            state = await boot
        except BaseException as exc:
            self._queued_boot_failed(exc, "boot failed after its caller left")
            return
        self._queued_boot_done(state)

    def _maybe_prewarm(self) -> None:
        """Boot states for queued callers that no prewarm boot covers yet.

        Genuine contention only: the queue is non-empty precisely because every existing state
        is checked out. The batch never exceeds the uncovered waiters, ``grow_step`` boots in
        flight, nor the ceiling.
        """
        if self._closed:
            return
        self._drop_dead_waiters()
        waiting = sum(1 for waiter in self._waiters if not waiter.done())
        batch = min(
            waiting - self._prewarming,
            self.grow_step - self._booting,
            self._max - self._created,
        )
        if batch <= 0:
            return
        self._created += batch
        self._booting += batch
        self._prewarming += batch
        self._note_growth()
        for _ in range(batch):
            self._spawn(self._prewarm_one())

    async def _prewarm_one(self) -> None:
        try:
            state = await self._factory()
        except Exception as exc:
            self._queued_boot_failed(exc, "prewarm boot failed")
            return
        self._queued_boot_done(state)

    def _queued_boot_done(self, state: T) -> None:
        """A boot for the queue (a prewarm, or an orphaned caller's) produced ``state``."""
        self._booting -= 1
        self._prewarming -= 1
        self._deliver(state)
        self._maybe_prewarm()

    def _queued_boot_failed(self, exc: BaseException, what: str) -> None:
        """A boot for the queue failed: its place is free again and the first waiter,
        which it was for, gets the failure rather than waiting forever."""
        self._booting -= 1
        self._prewarming -= 1
        self._created -= 1
        logger.warning("elastic pool: %s: %r", what, exc)
        self._fail_first_waiter(exc)
        self._maybe_prewarm()

    # -- release --------------------------------------------------------------------------

    def _release(self, state: T) -> None:
        self._in_use -= 1
        self._park_or_close(state)

    def _park_or_close(self, state: T) -> None:
        if self._closed or self._created > self._max:
            # Above a lowered ceiling (or shut down): give the memory back now.
            self._created -= 1
            self._spawn(self._close_state(state))
            self._maybe_prewarm()
            return
        self._deliver(state)

    def _deliver(self, state: T) -> None:
        """Hand a ready state to the first live waiter, else park it idle."""
        if self._closed or self._created > self._max:
            self._created -= 1
            self._spawn(self._close_state(state))
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._take(state)
                waiter.set_result(state)
                return
        self._idle.append(state)

    # -- helpers ----------------------------------------------------------------------------

    def _take(self, state: T) -> T:
        self._checkouts += 1
        self._in_use += 1
        self._peak_in_use = max(self._peak_in_use, self._in_use)
        return state

    def _note_growth(self) -> None:
        # Growth is the real signal that capacity is short: it restarts the grace period.
        self._quiet_rounds = 0
        self._sample()

    def _shrink_step(self) -> int:
        return shrink_step_for(
            created=self._created,
            in_use=self._in_use,
            resident=min(self._resident, self._max),
            idle_headroom=self._headroom,
        )

    def _sample(self) -> None:
        now = time.time()
        self._history.append((now, self._created, self._in_use))
        self._trim_history(now)

    def _trim_history(self, now: float) -> None:
        while self._history and self._history[0][0] < now - HISTORY_SECONDS:
            self._history.popleft()

    def _drop_dead_waiters(self) -> None:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()

    def _fail_first_waiter(self, exc: BaseException) -> None:
        self._drop_dead_waiters()
        if self._waiters:
            error = exc if isinstance(exc, Exception) else self._closed_error()
            self._waiters.popleft().set_exception(error)

    async def _close_state(self, state: T) -> None:
        try:
            await self._closer(state)
        except Exception as exc:
            logger.warning("elastic pool: closing a state failed: %r", exc)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _closed_error() -> UnavailableError:
        return UnavailableError("server.elastic_pool_closed", "the elastic pool is closed")


class SpareFactory[T]:
    """Wraps a factory so that ``spares`` states boot ahead of demand.

    A call takes the oldest spare (booted, or still booting: then it waits only for the rest
    of a boot that started earlier) and boots afresh only when there is none. Spares are
    topped up only while no caller is waiting for a boot, so on a small machine the refills
    never steal CPU from the boots callers are actually waiting for.

    While the pool is used the factory keeps ``spares`` spares; :meth:`trim` (the pool's
    ``on_idle`` hook: no checkout at all for the grace rounds) lets all but ``rest`` of them
    go, and the next call raises the target again. Spares serve the onset of a burst, which
    follows steady traffic that does not grow the pool, so only true idleness trims them.

    The pool's growth policy is untouched: it still asks for exactly the states it decided
    to grow by. The spares are extra resident states (:attr:`held`), closed by :meth:`close`
    (pass it as the pool's ``on_close``).
    """

    def __init__(
        self,
        factory: Callable[[], Awaitable[T]],
        closer: Callable[[T], Awaitable[object]],
        *,
        spares: int = 1,
        rest: int | None = None,
    ) -> None:
        if spares < 0 or (rest is not None and rest < 0):
            raise ValueError("spares and rest must not be negative")
        self._factory = factory
        self._closer = closer
        self.spares = spares
        self.rest = min(spares, 1 if rest is None else rest)
        self._resting = False
        self._pipeline: deque[asyncio.Future[T]] = deque()
        self._waiting = 0  # callers waiting for a boot that is not done yet
        self._orphans: set[asyncio.Task[object]] = set()
        self._closed = False

    @property
    def held(self) -> int:
        """Spare states held right now, booted or still booting."""
        return len(self._pipeline)

    async def __call__(self) -> T:
        """Return a booted state: the oldest spare, else a fresh boot.

        Raises ``UnavailableError`` (``server.elastic_pool_closed``) after :meth:`close`,
        and whatever the boot of the returned state raised.
        """
        if self._closed:
            raise ElasticPool._closed_error()
        self._resting = False  # the pool is growing: keep the full set of spares
        boot = self._pipeline.popleft() if self._pipeline else self._start()
        if boot.done():
            self._top_up()
            return boot.result()
        self._waiting += 1
        try:
            return await asyncio.shield(boot)
        except asyncio.CancelledError:
            # The caller left; the boot goes on and its state becomes the next spare.
            if not self._closed:
                self._pipeline.appendleft(boot)
            else:
                boot.add_done_callback(self._close_orphan)
            raise
        finally:
            self._waiting -= 1
            self._top_up()

    async def close(self) -> None:
        """Close every spare (waiting for boots in flight); later calls raise. Idempotent."""
        self._closed = True
        pipeline = list(self._pipeline)
        self._pipeline.clear()
        for boot in pipeline:
            try:
                state = await boot
            except Exception as exc:
                logger.warning("spare factory: a spare boot failed: %r", exc)
                continue
            try:
                await self._closer(state)
            except Exception as exc:
                logger.warning("spare factory: closing a spare failed: %r", exc)
        while self._orphans:
            await asyncio.gather(*list(self._orphans), return_exceptions=True)

    async def trim(self) -> int:
        """Close booted spares beyond ``rest`` until the next call; return how many.

        Spares still booting are kept (closing them would waste the boot).
        """
        self._resting = True
        victims: list[asyncio.Future[T]] = []
        for boot in reversed(self._pipeline):
            if len(self._pipeline) - len(victims) <= self.rest:
                break
            if boot.done():
                victims.append(boot)
        for boot in victims:
            self._pipeline.remove(boot)
        closed = 0
        for boot in victims:
            if boot.cancelled() or boot.exception() is not None:
                continue
            try:
                await self._closer(boot.result())
                closed += 1
            except Exception as exc:
                logger.warning("spare factory: closing a spare failed: %r", exc)
        return closed

    def _top_up(self) -> None:
        # Only while nobody waits for a boot: a refill then costs no caller any latency.
        target = self.rest if self._resting else self.spares
        while not self._closed and self._waiting == 0 and len(self._pipeline) < target:
            self._pipeline.append(self._start())

    def _start(self) -> asyncio.Future[T]:
        boot = asyncio.ensure_future(self._factory())
        # A failed spare nobody took yet must not log "exception was never retrieved".
        boot.add_done_callback(_observe)
        return boot

    def _close_orphan(self, boot: asyncio.Future[T]) -> None:
        if boot.cancelled() or boot.exception() is not None:
            return
        task = asyncio.ensure_future(self._closer(boot.result()))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)


def pool_with_spares[T](
    factory: Callable[[], Awaitable[T]],
    closer: Callable[[T], Awaitable[object]],
    *,
    spares: int,
    **options: Any,
) -> tuple[ElasticPool[T], SpareFactory[T] | None]:
    """An :class:`ElasticPool` of ``factory``'s states (``options`` are its sizes:
    ``max_size``, ``resident``, ``janitor_interval``, ...) and its :class:`SpareFactory`.

    With ``spares`` > 0 the pool boots through a SpareFactory keeping that many states
    booted ahead of demand: it trims them when the pool sits idle and closes them with the
    pool (its ``held`` counts them). With ``spares`` <= 0 the pool boots on demand only and
    there is no SpareFactory (``None``).
    """
    if spares <= 0:
        return ElasticPool(factory, closer, **options), None
    spare = SpareFactory(factory, closer, spares=spares)
    pool = ElasticPool(spare, closer, on_close=spare.close, on_idle=spare.trim, **options)
    return pool, spare


def _observe(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class Janitor:
    """One task for all elastic pools of a worker, running a reclaim round every interval."""

    def __init__(self, interval: float = 30.0) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.interval = interval
        self._pools: list[ElasticPool[Any]] = []
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0

    def register(self, pool: ElasticPool[Any]) -> None:
        """Add ``pool`` to the rounds (idempotent)."""
        if pool not in self._pools:
            self._pools.append(pool)

    def unregister(self, pool: ElasticPool[Any]) -> None:
        """Remove ``pool`` from the rounds (no error if absent)."""
        with contextlib.suppress(ValueError):
            self._pools.remove(pool)

    def start(self) -> None:
        """Start the janitor task on the running loop (no-op if already running)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="elastic-janitor")

    async def stop(self) -> None:
        """Cancel the janitor task and wait for it to end."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run_round(self) -> int:
        """Run one reclaim round over every pool; return the states closed in total.

        A pool's error is logged and does not stop the round for the others.
        """
        closed = 0
        for pool in list(self._pools):
            try:
                closed += await pool.reclaim_once()
            except Exception:
                logger.exception("elastic janitor: reclaim failed for a pool; continuing")
        self.rounds += 1
        return closed

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.run_round()
