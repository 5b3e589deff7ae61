"""`pooling.keyed.KeyedPool`: what it adds to the model client pool's rules (which
tests/pooling/test_clients.py covers through `ModelClientPool`)."""

from __future__ import annotations

import pytest

from pooling.keyed import KeyedPool
from sageproject.errors import RateLimitedError
from tests.waiting import turns_until


class Values:
    def __init__(self) -> None:
        self.built: list[str] = []
        self.closed: list[str] = []

    async def build(self, arg: str) -> str:
        self.built.append(arg)
        return f"{arg}#{len(self.built)}"

    async def close(self, value: str) -> None:
        self.closed.append(value)


async def test_a_discarded_value_is_rebuilt_for_the_next_borrower() -> None:
    values = Values()
    pool = KeyedPool(values.build, values.close, max_entries=2)
    first = await pool.acquire_key("k", "a")
    first.discard()
    second = await pool.acquire_key("k", "a")
    assert (first.provider, second.provider) == ("a#1", "a#2")
    # The discarded one closes when its last lease does, not before.
    assert values.closed == []
    await first.close()
    await second.close()
    await pool.close()
    assert values.closed == ["a#1", "a#2"]


async def test_a_discarded_value_still_leased_holds_its_slot() -> None:
    values = Values()
    pool = KeyedPool(values.build, values.close, max_entries=1)
    lease = await pool.acquire_key("k", "a")
    lease.discard()
    with pytest.raises(RateLimitedError) as full:
        await pool.acquire_key("other", "b")
    assert full.value.code == "server.pool_full" and full.value.retryable
    await lease.close()
    # Its close counts toward capacity until it is done (as an evicted value's does).
    await turns_until(lambda: values.closed == ["a#1"] and not pool._retiring)
    again = await pool.acquire_key("other", "b")
    assert again.provider == "b#2"
    await again.close()
    await pool.close()
    assert values.closed == ["a#1", "b#2"]


async def test_it_names_its_figures_generically() -> None:
    values = Values()
    pool = KeyedPool(values.build, values.close, max_entries=3)
    async with await pool.acquire_key("k", "a"):
        assert await pool.snapshot() == {
            "entries": 1,
            "closing": 0,
            "active_leases": 1,
            "max_entries": 3,
            "constructions": 1,
        }
    await pool.close()
