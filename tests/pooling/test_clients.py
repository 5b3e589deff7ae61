"""ModelClientPool: keys, shared builds, leases, capacity, eviction and shutdown."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from dataclasses import dataclass, replace
from typing import Any

import pytest

from pooling.clients import ModelClientPool, ModelLease, pool_key
from sageproject.errors import ErrorCategory, SageError
from tests.pooling.helpers import cancel
from tests.waiting import turns_until


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    id: int
    protocol: str = "openai"
    base_url: str = "http://127.0.0.1:9/v1"
    model: str = "gpt-test"
    api_key: Any = "sk-secret-alice"


class Secret:
    """A SecretStr look-alike: the plaintext is only reachable on purpose."""

    def __init__(self, value: str) -> None:
        self._value = value

    def get_secret_value(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"


class FakeClient:
    def __init__(self, record: Any, serial: int) -> None:
        self.record = record
        self.serial = serial
        self.closed = False


class Clients:
    """Factory and closer for the pool, with gates to hold builds and closes open."""

    def __init__(self) -> None:
        self.built: list[FakeClient] = []
        self.closed: list[FakeClient] = []
        self.events: list[str] = []
        self.build_gate: asyncio.Event | None = None
        self.build_started = asyncio.Event()
        self.close_gate: asyncio.Event | None = None
        self.close_started = asyncio.Event()
        self.fail_builds = 0
        self.fail_closes_for: set[int] = set()

    async def factory(self, record: Any) -> FakeClient:
        self.build_started.set()
        if self.build_gate is not None:
            await self.build_gate.wait()
        if self.fail_builds:
            self.fail_builds -= 1
            raise ConnectionError("cannot build client")
        client = FakeClient(record, len(self.built))
        self.built.append(client)
        self.events.append(f"built {record.id}")
        return client

    async def closer(self, client: FakeClient) -> None:
        self.close_started.set()
        if self.close_gate is not None:
            await self.close_gate.wait()
        if client.record.id in self.fail_closes_for:
            self.events.append(f"close failed {client.record.id}")
            raise OSError(f"cannot close client {client.record.id}")
        client.closed = True
        self.closed.append(client)
        self.events.append(f"closed {client.record.id}")


@pytest.fixture
def clients() -> Clients:
    return Clients()


def make_pool(clients: Clients, max_clients: int = 4) -> ModelClientPool:
    return ModelClientPool(clients.factory, clients.closer, max_clients=max_clients)


async def evicting_acquire(pool: ModelClientPool, clients: Clients) -> asyncio.Task[ModelLease]:
    """Fill a pool of one client with alice's (idle) record 1, then start bob's acquire of
    record 2 with the eviction's close held at the gate; returns bob's acquire as a task once
    the close started."""
    async with await pool.acquire("alice", Record(id=1)):
        pass
    clients.close_gate = asyncio.Event()
    newcomer = asyncio.create_task(pool.acquire("bob", Record(id=2)))
    await clients.close_started.wait()
    return newcomer


async def abandon_a_build(pool: ModelClientPool, clients: Clients) -> None:
    """Acquire alice's record 1 with its build held at the gate, and cancel the caller once
    the build started: the build goes on with nobody waiting for it."""
    clients.build_gate = asyncio.Event()
    doomed = asyncio.create_task(pool.acquire("alice", Record(id=1)))
    await clients.build_started.wait()
    await cancel(doomed)


# -- keys ------------------------------------------------------------------------------------


def test_it_keys_by_the_digest_of_user_record_and_credential() -> None:
    record = Record(id=7)
    expected = hashlib.sha256(
        json.dumps(
            ["alice", 7, "openai", "http://127.0.0.1:9/v1", "gpt-test", "sk-secret-alice"],
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()
    ).hexdigest()
    assert pool_key("alice", record) == expected


def test_it_never_puts_a_secret_in_a_key() -> None:
    keys = [
        pool_key("alice", Record(id=1)),
        pool_key("bob", Record(id=1, api_key=Secret("sk-secret-bob"))),
    ]
    for key in keys:
        assert "secret" not in key
        assert len(key) == 64


def test_it_separates_users_credentials_and_model_fields() -> None:
    base = Record(id=1)
    keys = {
        pool_key("alice", base),
        pool_key("bob", base),
        pool_key("alice", replace(base, api_key="sk-secret-rotated")),
        pool_key("alice", replace(base, id=2)),
        pool_key("alice", replace(base, protocol="anthropic")),
        pool_key("alice", replace(base, base_url="http://127.0.0.1:10/v1")),
        pool_key("alice", replace(base, model="gpt-other")),
    }
    assert len(keys) == 7


def test_it_keys_a_secret_object_like_its_plaintext() -> None:
    plain = Record(id=1, api_key="sk-secret-alice")
    wrapped = Record(id=1, api_key=Secret("sk-secret-alice"))
    assert pool_key("alice", plain) == pool_key("alice", wrapped)


@pytest.mark.parametrize("max_clients", [0, -1, True, 1.5])
def test_it_rejects_a_non_positive_max_clients(clients: Clients, max_clients: Any) -> None:
    with pytest.raises(ValueError, match="max_model_clients must be positive"):
        ModelClientPool(clients.factory, clients.closer, max_clients=max_clients)


# -- leases and sharing ------------------------------------------------------------------------


async def test_it_reuses_one_client_for_the_same_key(clients: Clients) -> None:
    pool = make_pool(clients)
    first = await pool.acquire("alice", Record(id=1))
    second = await pool.acquire("alice", Record(id=1))
    assert first.provider is second.provider
    assert (await pool.snapshot())["constructions"] == 1
    assert (await pool.snapshot())["active_leases"] == 2
    await first.close()
    await second.close()
    assert (await pool.snapshot())["active_leases"] == 0


async def test_it_builds_separate_clients_for_different_users(clients: Clients) -> None:
    pool = make_pool(clients)
    alice = await pool.acquire("alice", Record(id=1))
    bob = await pool.acquire("bob", Record(id=1))
    assert alice.provider is not bob.provider
    assert (await pool.snapshot())["clients"] == 2


async def test_it_gives_the_factory_a_copy_of_the_record(clients: Clients) -> None:
    pool = make_pool(clients)
    record = Record(id=1)
    lease = await pool.acquire("alice", record)
    assert lease.provider.record == record
    assert lease.provider.record is not record


async def test_it_closes_a_lease_only_once(clients: Clients) -> None:
    pool = make_pool(clients)
    lease = await pool.acquire("alice", Record(id=1))
    await pool.acquire("alice", Record(id=1))
    await lease.close()
    await lease.close()
    assert lease.closed
    assert (await pool.snapshot())["active_leases"] == 1


async def test_it_releases_a_lease_used_as_a_context_manager(clients: Clients) -> None:
    pool = make_pool(clients)
    with pytest.raises(RuntimeError):
        async with await pool.acquire("alice", Record(id=1)) as lease:
            assert isinstance(lease, ModelLease)
            assert (await pool.snapshot())["active_leases"] == 1
            raise RuntimeError("run failed")
    assert (await pool.snapshot())["active_leases"] == 0


async def test_it_builds_once_for_fifty_concurrent_cold_acquires(clients: Clients) -> None:
    pool = make_pool(clients)
    clients.build_gate = asyncio.Event()
    tasks = [asyncio.create_task(pool.acquire("alice", Record(id=1))) for _ in range(50)]
    await clients.build_started.wait()
    await turns_until(lambda: pool._active_leases == 50)
    clients.build_gate.set()
    leases = await asyncio.gather(*tasks)
    assert {id(lease.provider) for lease in leases} == {id(clients.built[0])}
    snapshot = await pool.snapshot()
    assert snapshot["constructions"] == 1
    assert snapshot["active_leases"] == 50


async def test_it_keeps_building_for_others_when_one_waiter_is_cancelled(
    clients: Clients,
) -> None:
    pool = make_pool(clients)
    clients.build_gate = asyncio.Event()
    doomed = asyncio.create_task(pool.acquire("alice", Record(id=1)))
    patient = asyncio.create_task(pool.acquire("alice", Record(id=1)))
    await clients.build_started.wait()
    await turns_until(lambda: pool._active_leases == 2)
    await cancel(doomed)
    assert (await pool.snapshot())["active_leases"] == 1
    clients.build_gate.set()
    lease = await patient
    assert lease.provider is clients.built[0]
    assert (await pool.snapshot())["constructions"] == 1


async def test_it_caches_a_build_whose_only_waiter_was_cancelled(clients: Clients) -> None:
    pool = make_pool(clients)
    await abandon_a_build(pool, clients)
    clients.build_gate.set()
    lease = await pool.acquire("alice", Record(id=1))
    assert lease.provider is clients.built[0]
    assert (await pool.snapshot())["constructions"] == 1


async def test_it_does_not_cache_a_failed_build(clients: Clients) -> None:
    pool = make_pool(clients)
    clients.fail_builds = 1
    with pytest.raises(ConnectionError):
        await pool.acquire("alice", Record(id=1))
    snapshot = await pool.snapshot()
    assert snapshot["clients"] == 0
    assert snapshot["active_leases"] == 0
    lease = await pool.acquire("alice", Record(id=1))
    assert lease.provider is clients.built[0]
    assert (await pool.snapshot())["constructions"] == 2


async def test_it_fails_every_waiter_of_a_failed_shared_build(clients: Clients) -> None:
    pool = make_pool(clients)
    clients.build_gate = asyncio.Event()
    clients.fail_builds = 1
    tasks = [asyncio.create_task(pool.acquire("alice", Record(id=1))) for _ in range(3)]
    await turns_until(lambda: pool._active_leases == 3)
    clients.build_gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(result, ConnectionError) for result in results)
    snapshot = await pool.snapshot()
    assert (snapshot["clients"], snapshot["active_leases"], snapshot["constructions"]) == (0, 0, 1)


# -- capacity and eviction ---------------------------------------------------------------------


async def test_it_refuses_at_once_when_every_client_is_leased(clients: Clients) -> None:
    pool = make_pool(clients, max_clients=2)
    await pool.acquire("alice", Record(id=1))
    await pool.acquire("bob", Record(id=1))
    with pytest.raises(SageError) as caught:
        await pool.acquire("carol", Record(id=1))
    error = caught.value
    assert error.code == "server.model_pool_full"
    assert error.category is ErrorCategory.RATE_LIMITED
    assert error.retryable and error.resumable
    snapshot = await pool.snapshot()
    assert (snapshot["clients"], snapshot["constructions"]) == (2, 2)


async def test_it_evicts_the_least_recently_borrowed_idle_client(clients: Clients) -> None:
    pool = make_pool(clients, max_clients=2)
    async with await pool.acquire("alice", Record(id=1)):
        pass
    async with await pool.acquire("bob", Record(id=2)):
        pass
    async with await pool.acquire("alice", Record(id=1)):
        pass  # alice is now the most recently borrowed
    async with await pool.acquire("carol", Record(id=3)):
        pass
    assert [client.record.id for client in clients.closed] == [2]
    assert (await pool.snapshot())["clients"] == 2


async def test_it_never_evicts_a_leased_client(clients: Clients) -> None:
    pool = make_pool(clients, max_clients=2)
    held = await pool.acquire("alice", Record(id=1))
    async with await pool.acquire("bob", Record(id=2)):
        pass
    async with await pool.acquire("carol", Record(id=3)):
        pass
    assert [client.record.id for client in clients.closed] == [2]
    assert not held.provider.closed


async def test_it_builds_the_new_client_only_after_the_evicted_one_has_closed(
    clients: Clients,
) -> None:
    pool = make_pool(clients, max_clients=1)
    newcomer = await evicting_acquire(pool, clients)
    snapshot = await pool.snapshot()
    assert (snapshot["clients"], snapshot["closing_clients"]) == (0, 1)
    assert clients.events == ["built 1"]
    clients.close_gate.set()
    lease = await newcomer
    assert clients.events == ["built 1", "closed 1", "built 2"]
    assert lease.provider.record.id == 2
    assert (await pool.snapshot())["closing_clients"] == 0


async def test_it_counts_closing_clients_toward_capacity(clients: Clients) -> None:
    pool = make_pool(clients, max_clients=1)
    newcomer = await evicting_acquire(pool, clients)
    with pytest.raises(SageError) as caught:
        await pool.acquire("carol", Record(id=3))
    assert caught.value.code == "server.model_pool_full"
    clients.close_gate.set()
    await newcomer


async def test_it_stops_admission_after_an_eviction_fails_to_close(clients: Clients) -> None:
    pool = make_pool(clients, max_clients=1)
    async with await pool.acquire("alice", Record(id=1)):
        pass
    clients.fail_closes_for = {1}
    with pytest.raises(SageError) as caught:
        await pool.acquire("bob", Record(id=2))
    assert caught.value.code == "server.model_pool_cleanup_failed"
    assert isinstance(caught.value.__cause__, OSError)
    with pytest.raises(SageError) as again:
        await pool.acquire("alice", Record(id=1))
    assert again.value.code == "server.model_pool_cleanup_failed"
    assert (await pool.snapshot())["constructions"] == 1


async def test_it_keeps_idle_clients_without_timed_expiry(clients: Clients) -> None:
    pool = make_pool(clients)
    async with await pool.acquire("alice", Record(id=1)):
        pass
    for _ in range(100):
        await asyncio.sleep(0)
    async with await pool.acquire("alice", Record(id=1)) as lease:
        assert lease.provider is clients.built[0]
    assert clients.closed == []


# -- shutdown ----------------------------------------------------------------------------------


async def test_it_refuses_acquires_after_close(clients: Clients) -> None:
    pool = make_pool(clients)
    await pool.close()
    with pytest.raises(SageError) as caught:
        await pool.acquire("alice", Record(id=1))
    assert caught.value.code == "server.model_pool_closed"
    assert caught.value.category is ErrorCategory.UNAVAILABLE


async def test_it_waits_for_leases_before_closing_clients(clients: Clients) -> None:
    pool = make_pool(clients)
    lease = await pool.acquire("alice", Record(id=1))
    closing = asyncio.create_task(pool.close())
    await turns_until(lambda: pool.closed)
    for _ in range(20):
        await asyncio.sleep(0)
    assert not closing.done()
    assert clients.closed == []
    await lease.close()
    await closing
    assert [client.record.id for client in clients.closed] == [1]
    snapshot = await pool.snapshot()
    assert (snapshot["clients"], snapshot["closing_clients"]) == (0, 0)


async def test_it_finishes_closing_when_the_caller_is_cancelled(clients: Clients) -> None:
    pool = make_pool(clients)
    async with await pool.acquire("alice", Record(id=1)):
        pass
    clients.close_gate = asyncio.Event()
    caller = asyncio.create_task(pool.close())
    await clients.close_started.wait()
    await cancel(caller)
    later = asyncio.create_task(pool.close())
    clients.close_gate.set()
    await later
    assert [client.record.id for client in clients.closed] == [1]


async def test_it_attempts_every_client_and_reports_every_close_failure(
    clients: Clients,
) -> None:
    pool = make_pool(clients)
    for record_id in (1, 2, 3):
        async with await pool.acquire("alice", Record(id=record_id)):
            pass
    clients.fail_closes_for = {1, 3}
    with pytest.raises(SageError) as caught:
        await pool.close()
    error = caught.value
    assert error.code == "server.model_pool_cleanup_failed"
    assert error.category is ErrorCategory.UNAVAILABLE
    group = error.__cause__
    assert isinstance(group, ExceptionGroup)
    assert sorted(str(exc) for exc in group.exceptions) == [
        "cannot close client 1",
        "cannot close client 3",
    ]
    assert [client.record.id for client in clients.closed] == [2]


async def test_it_gives_a_later_close_the_same_failure(clients: Clients) -> None:
    pool = make_pool(clients)
    async with await pool.acquire("alice", Record(id=1)):
        pass
    clients.fail_closes_for = {1}
    with pytest.raises(SageError):
        await pool.close()
    with pytest.raises(SageError) as again:
        await pool.close()
    assert again.value.code == "server.model_pool_cleanup_failed"
    assert clients.events.count("close failed 1") == 1


async def test_it_closes_a_client_whose_build_finished_after_its_waiters_left(
    clients: Clients,
) -> None:
    pool = make_pool(clients)
    await abandon_a_build(pool, clients)
    closing = asyncio.create_task(pool.close())
    await turns_until(lambda: pool.closed)
    clients.build_gate.set()
    # A lease leaked by the cancelled waiter would make close() wait forever.
    async with asyncio.timeout(5):
        await closing
    assert [client.record.id for client in clients.closed] == [1]


async def test_it_never_shows_a_secret_in_a_snapshot_or_repr(clients: Clients) -> None:
    pool = make_pool(clients)
    lease = await pool.acquire("alice", Record(id=1))
    text = json.dumps(await pool.snapshot()) + repr(pool) + repr(lease)
    assert "secret" not in text
    assert set(await pool.snapshot()) == {
        "clients",
        "closing_clients",
        "active_leases",
        "max_clients",
        "constructions",
    }


# -- stress ------------------------------------------------------------------------------------


async def test_it_stays_consistent_over_waves_of_cancelled_and_failing_runs(
    clients: Clients,
) -> None:
    rng = random.Random(20261129)
    users = [f"user{i}" for i in range(8)]
    records = [Record(id=1), Record(id=2, api_key="sk-secret-other")]
    pool = make_pool(clients, max_clients=len(users) * len(records))
    keys: set[str] = set()
    # Builds take a few loop turns so cancellations land during shared builds too.
    original_factory = clients.factory

    async def slow_factory(record: Any) -> FakeClient:
        for _ in range(rng.randint(0, 3)):
            await asyncio.sleep(0)
        return await original_factory(record)

    pool._factory = slow_factory

    async def run(user: str, record: Record) -> None:
        async with await pool.acquire(user, record) as lease:
            assert not lease.provider.closed
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            if rng.random() < 0.2:
                raise RuntimeError("run failed")

    for _wave in range(40):
        tasks = []
        for _ in range(32):
            user, record = rng.choice(users), rng.choice(records)
            keys.add(pool_key(user, record))
            tasks.append(asyncio.create_task(run(user, record)))
        for _ in range(rng.randint(0, 2)):
            await asyncio.sleep(0)
        for task in rng.sample(tasks, 6):
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(
            r is None or isinstance(r, RuntimeError | asyncio.CancelledError) for r in results
        )
        assert (await pool.snapshot())["active_leases"] == 0
    snapshot = await pool.snapshot()
    assert snapshot["constructions"] == len(keys)
    assert snapshot["clients"] == len(keys)
    await pool.close()
    assert len(clients.closed) == len(keys)
