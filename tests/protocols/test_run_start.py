"""Where a protocol stream starts following a run (`agents.protocols.common.run_start`):
never after the run's own events, even when the run ends between its two reads."""

from __future__ import annotations

import pytest
from django.db import connection

from agents import services
from agents.protocols.common import run_start
from scheduling.models import Event, Session

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


def _finish(run) -> None:
    """What a worker commits for a run that fails at once: three events and the prefix."""
    Event.objects.bulk_create(
        Event(session_id=run.session_id, seq=seq, run_id=run.pk, type=kind)
        for seq, kind in ((1, "run.started"), (2, "message.completed"), (3, "run.failed"))
    )
    Session.objects.filter(pk=run.session_id).update(persisted_events=3)


def test_a_run_that_ends_between_the_reads_is_still_followed_from_its_start(
    alice, make_session
):
    run, _ = services.run_submit(owner=alice, session_id=make_session(alice).pk, input="go")
    reads = []

    def the_run_ends_after_the_first_read(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if not reads:
            reads.append(sql)
            _finish(run)
        return result

    with connection.execute_wrapper(the_run_ends_after_the_first_read):
        after = run_start(run)
    assert after == 0  # before seq 1, the run's first event: a stream sees its end


def test_a_run_with_events_starts_before_the_first_and_one_without_at_the_prefix(
    alice, make_session
):
    session = make_session(alice)
    first, _ = services.run_submit(owner=alice, session_id=session.pk, input="one")
    assert run_start(first) == 0
    _finish(first)
    second, _ = services.run_submit(owner=alice, session_id=session.pk, input="two")
    assert run_start(first) == 0
    assert run_start(second) == 3
