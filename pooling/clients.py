"""A bounded pool of model SDK clients shared by Runs.

The worker owns the clients; Runs borrow them through leases. One client exists per
(user, model record, protocol, base URL, model name, credential): changing any of those
changes the key, so new Runs get a new client while Runs already streaming finish on the
old one. There is no timed expiry; an idle client stays until it is evicted
(least-recently-borrowed first, only when nobody holds a lease on it) or the pool closes.

The pool's rules (coalesced builds, eviction, a full pool refusing at once, shutdown) are
`pooling.keyed.KeyedPool`'s; this module names the key and the model pool's errors.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pooling.keyed import Closer, Factory, KeyedPool, Lease

__all__ = ["ModelClientPool", "ModelLease", "pool_key"]


def _secret_plaintext(value: Any) -> Any:
    # Accept a plain string or a SecretStr-like object; the plaintext only ever enters
    # the digest below, never a log line or a snapshot.
    getter = getattr(value, "get_secret_value", None)
    return getter() if callable(getter) else value


def pool_key(user_id: Any, record: Any) -> str:
    """Return the pool key of ``user_id`` borrowing ``record``: a SHA-256 hex digest.

    The digest covers the user, the record id, protocol, base URL, model name and the
    credential in plaintext (compact JSON, ``ensure_ascii=False``), so a changed credential
    yields a new key while the key itself reveals nothing about the secret.
    """
    payload = json.dumps(
        [
            user_id,
            record.id,
            record.protocol,
            record.base_url,
            record.model,
            _secret_plaintext(getattr(record, "api_key", None)),
        ],
        ensure_ascii=False,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class ModelLease(Lease):
    """A borrowed client. ``provider`` is the shared client; close the lease when done.

    ``close()`` is idempotent and synchronous underneath, so it always completes even when
    the caller is being cancelled. ``async with lease:`` closes it on exit.
    """

    __slots__ = ()


class ModelClientPool(KeyedPool):
    """At most ``max_clients`` model clients, shared by key, borrowed through leases."""

    lease_class = ModelLease
    label = "model client"
    full_code = "server.model_pool_full"
    full_message = "all model client slots are in use"
    closed_code = "server.model_pool_closed"
    closed_message = "the model client pool is closed"
    cleanup_code = "server.model_pool_cleanup_failed"
    cleanup_message = "model client pool cleanup failed"
    size_name = "max_clients"

    def __init__(self, factory: Factory, closer: Closer, *, max_clients: int = 64) -> None:
        """``factory(record_copy)`` builds a client, ``closer(client)`` closes one.

        Raises ``ValueError`` when ``max_clients < 1``.
        """
        if isinstance(max_clients, bool) or not isinstance(max_clients, int) or max_clients < 1:
            raise ValueError("max_model_clients must be positive")
        super().__init__(factory, closer, max_entries=max_clients)

    @property
    def max_clients(self) -> int:
        return self.max_entries

    async def acquire(self, user_id: Any, record: Any) -> ModelLease:
        """Borrow the client for ``user_id`` and ``record``, building it on first use.

        Returns a ``ModelLease``. Raises ``UnavailableError`` ``server.model_pool_closed``
        after ``close()``, ``UnavailableError`` ``server.model_pool_cleanup_failed`` once
        any client failed to close, ``RateLimitedError`` ``server.model_pool_full`` when
        every slot is leased (immediately; nobody queues), and whatever the factory raised
        when the build failed (the failure is not cached).
        """
        lease = await self.acquire_key(pool_key(user_id, record), record)
        assert isinstance(lease, ModelLease)
        return lease

    async def snapshot(self) -> dict[str, Any]:
        """Return ``{"clients", "closing_clients", "active_leases", "max_clients",
        "constructions"}`` (counts only; no keys, no secrets)."""
        figures = await super().snapshot()
        return {
            "clients": figures["entries"],
            "closing_clients": figures["closing"],
            "active_leases": figures["active_leases"],
            "max_clients": figures["max_entries"],
            "constructions": figures["constructions"],
        }
