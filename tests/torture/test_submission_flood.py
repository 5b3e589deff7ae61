"""A submission flood against the host's pending limit.

Thousands of ``POST /api/v1/runs/`` (10,000 at full size, 1,000 reduced) from three users
over many sessions, concurrently, through the host's two web processes, with no
worker claiming (it is stopped: a claim gives a place back and the count would be
meaningless). The host must admit exactly ``PENDING_HOST`` runs and refuse every other
submission with 429 and the error envelope (``scheduler.queue_full``, ``Retry-After``); no
user may hold more than ``PENDING_PER_USER``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.conftest import demo_manifest, scripted_model
from tests.torture.conftest import size
from tests.torture.host import PENDING_HOST, PENDING_PER_USER, LiveHost, make_user

CHECK = "flood"
pytestmark = [pytest.mark.torture, pytest.mark.django_db(transaction=True)]

SUBMISSIONS = size(10_000, 1_000)
SESSIONS_PER_USER = 8
CONNECTIONS = int(os.environ.get("SAGE_FLOOD_CONNECTIONS", "12"))


@pytest.fixture
def flood_targets(live_host: LiveHost) -> list[tuple[str, str]]:
    """(token, session id) pairs: three users, ``SESSIONS_PER_USER`` sessions each."""
    from agents import services
    from agents.services import packages

    live_host.stop_worker()
    scripted_model("scripted")
    targets = []
    for name in ("alice", "bob", "carol"):
        user, token = make_user(f"flood-{name}")
        packages.package_create(owner=user, manifest=demo_manifest(name="flood"))
        for _ in range(SESSIONS_PER_USER):
            session = services.session_create(owner=user, package="flood", agent="assistant")
            targets.append((token, str(session.pk)))
    return targets


async def _flood(base_url: str, targets: list[tuple[str, str]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    gate = asyncio.Semaphore(CONNECTIONS)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def post(i: int) -> httpx.Response:
            token, session = targets[i % len(targets)]
            async with gate:
                return await client.post(
                    "/api/v1/runs/",
                    json={"session": session, "input": f"flood {i}"},
                    headers={"Authorization": f"Token {token}"},
                )

        return await asyncio.gather(*(post(i) for i in range(SUBMISSIONS)))


def _is_queue_full_envelope(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        error.get("code") == "scheduler.queue_full"
        and error.get("category") == "RATE_LIMITED"
        and error.get("retryable") is True
        and isinstance(error.get("message"), str)
        and isinstance(error.get("details"), dict)
        and response.headers.get("Retry-After", "").isdigit()
    )


def test_a_flood_admits_exactly_the_pending_limit(
    flood_targets: list[tuple[str, str]], live_host: LiveHost, figures: dict[str, Any]
) -> None:
    from scheduling.models import Run, RunStatus

    assert SUBMISSIONS > PENDING_HOST  # otherwise the limit is never reached
    began = time.monotonic()
    answers = asyncio.run(_flood(live_host.base_url, flood_targets))
    elapsed = time.monotonic() - began
    statuses = Counter(r.status_code for r in answers)
    refused = [r for r in answers if r.status_code == 429]
    not_enveloped = sum(1 for r in refused if not _is_queue_full_envelope(r))
    queued = Counter(
        Run.objects.filter(status=RunStatus.QUEUED, parent__isnull=True).values_list(
            "owner_id", flat=True
        )
    )
    figures.update(
        submissions=SUBMISSIONS,
        limit=PENDING_HOST,
        admitted=statuses.get(202, 0),
        refused_429=len(refused),
        other={str(k): v for k, v in statuses.items() if k not in (202, 429)},
        not_enveloped=not_enveloped,
        queued_rows=sum(queued.values()),
        max_per_user=max(queued.values(), default=0),
        req_per_s=round(SUBMISSIONS / elapsed),
    )
    assert statuses == {202: PENDING_HOST, 429: SUBMISSIONS - PENDING_HOST}, statuses
    assert not_enveloped == 0, [r.text for r in refused if not _is_queue_full_envelope(r)][:3]
    assert sum(queued.values()) == PENDING_HOST
    assert max(queued.values()) <= PENDING_PER_USER
