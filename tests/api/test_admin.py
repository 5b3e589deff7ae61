from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils import timezone

from agents import services
from pooling.models import ModelRecord, Protocol
from scheduling.models import Run, RunStatus, WorkerSnapshot

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client, staff):
    client.force_login(staff)
    return client


def test_it_lists_every_model_in_the_admin(staff_client, alice, make_session):
    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="x")
    for name in ("scheduling_run", "scheduling_session", "scheduling_event",
                 "scheduling_workersnapshot", "pooling_modelrecord", "agents_agentpackage",
                 "agents_managedagentrecord", "agents_readinessreport",
                 "agents_reclamationrequest"):
        response = staff_client.get(reverse(f"admin:{name}_changelist"))
        assert response.status_code == 200, name
    response = staff_client.get(reverse("admin:scheduling_run_change", args=[run.pk]))
    assert response.status_code == 200
    assert b"lease_token" in response.content or b"Lease token" in response.content


def test_it_never_shows_model_credentials(staff_client):
    record = ModelRecord(name="gpt", protocol=Protocol.OPENAI, model="gpt")
    record.api_key = "sk-very-secret"
    record.save()
    for url in (reverse("admin:pooling_modelrecord_changelist"),
                reverse("admin:pooling_modelrecord_change", args=[record.pk])):
        content = staff_client.get(url).content.decode()
        assert "sk-very-secret" not in content
        assert record.encrypted_credentials not in content


def test_it_keeps_credentials_when_the_form_leaves_them_empty(staff_client):
    record = ModelRecord(name="gpt", protocol=Protocol.OPENAI, model="gpt")
    record.api_key = "sk-keep"
    record.save()
    url = reverse("admin:pooling_modelrecord_change", args=[record.pk])
    response = staff_client.post(url, {"name": "gpt", "protocol": "openai", "base_url": "",
                                       "model": "gpt-2", "options": "{}", "api_key": ""})
    assert response.status_code == 302
    record.refresh_from_db()
    assert (record.model, record.api_key) == ("gpt-2", "sk-keep")


def test_it_cancels_runs_from_the_admin(staff_client, alice, make_session):
    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="x")
    response = staff_client.post(reverse("admin:scheduling_run_changelist"),
                                 {"action": "cancel_runs", "_selected_action": [str(run.pk)]})
    assert response.status_code == 302
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED


def test_it_shows_the_capacity_page(staff_client):
    now = timezone.now()
    WorkerSnapshot.objects.create(
        worker_id="w1", host="h", pid=1, started_at=now, heartbeat_at=now,
        capacity={"runs": {"active": 3, "max_concurrent": 8},
                  "executor": {"model_calls": {"limit": 8, "active": 2},
                               "code_tools": {"enabled": True, "pools": {"python": {
                                   "created": 4, "in_use": 2, "max": 8,
                                   "history": [[0, 1, 0], [60, 4, 2]]}}}},
                  "store": {"commits": 120, "transactions": 45, "rejected": 2},
                  "scheduler": {"leases_lost": 4,
                                "live": {"channel": "socket", "sent": 9100, "dropped": 37,
                                         "congested": 1}}},
    )
    response = staff_client.get(reverse("admin:capacity"))
    assert response.status_code == 200
    content = response.content.decode()
    # Every figure stays listed under "All figures"; the cards sum the live workers.
    assert "runs.max_concurrent" in content
    assert "executor.model_calls.active" in content
    assert 'id="card-model-calls"' in content
    # The session store's group commit: commits per transaction, and what it refused.
    assert "120 / 45" in content and "event commits refused" in content
    # Live deltas: sent and dropped, and web processes' sockets found stuck full.
    assert "live deltas sent / dropped" in content and "9100 / 37" in content
    assert "web processes stuck (live socket full)" in content
    # Leases a worker lost (cut off from the database past its lease), summed.
    assert re.search(r"leases lost</[^>]+>\s*<[^>]+>4<", content)
    # The pool's history is drawn as a chart of its own, on the server.
    assert 'data-chart="code-tools-python-interpreters"' in content
    assert '<path class="sage-line"' in content
    assert staff_client.get(reverse("admin:index")).content.count(b"Capacity") >= 1


def test_it_keeps_non_staff_out_of_the_admin(client, alice):
    client.force_login(alice)
    response = client.get(reverse("admin:capacity"))
    assert response.status_code == 302


def test_it_names_the_owners_of_resident_applications(staff_client, alice):
    now = timezone.now()
    WorkerSnapshot.objects.create(
        worker_id="w2", host="h", pid=2, started_at=now, heartbeat_at=now,
        capacity={"executor": {"management": {"resident": [
            {"owner": alice.pk, "package": "demo", "ref": "ab" * 32, "agent": "assistant",
             "state": "ready", "idle_seconds": 3.0, "usage": 0, "unfinished_runs": 0,
             "safe_to_release": True},
        ]}}},
    )
    content = staff_client.get(reverse("admin:capacity")).content.decode()
    assert "<td>alice</td>" in content


# --- pages for people: run timeline, session, capacity cards and charts, readable lists ---


def _conversation(owner, make_session, *, status=RunStatus.COMPLETED):
    """A run with a conversation written through the state machine's event append: a user
    message carrying markup, a tool call with its result, a failed tool call, an answer."""
    from scheduling import runs

    session = make_session(owner)
    run, _ = services.run_submit(owner=owner, session_id=session.pk,
                                 input="<script>alert('x')</script> sum it")
    runs.cancel(run.pk)  # no longer queued: events may be appended without a lease
    for etype, payload in [
        ("message.completed", {"role": "user", "content": "<script>alert('x')</script> sum it"}),
        ("message.completed", {"role": "assistant", "content": "Adding.", "step": 1,
                               "tool_calls": [{"id": "c1", "name": "calculator"}]}),
        ("tool.call.started", {"id": "c1", "name": "calculator",
                               "arguments": {"expression": "<b>2+3</b>"}}),
        ("tool.call.started", {"id": "c2", "name": "clock", "arguments": {"zone": "x" * 900}}),
        ("tool.call.succeeded", {"id": "c1", "name": "calculator", "output": "5"}),
        ("tool.call.failed", {"id": "c2", "name": "clock", "error": "unknown zone"}),
        ("message.completed", {"role": "assistant", "content": "It is 5.", "step": 2}),
    ]:
        runs.append_unleased_event(session.pk, run.pk, etype, payload)
    Run.objects.filter(pk=run.pk).update(status=status, error={
        "code": "upstream.error", "category": "UPSTREAM", "message": "the provider failed",
        "retryable": True, "resumable": False} if status == RunStatus.FAILED else None)
    return session, Run.objects.get(pk=run.pk)


def test_the_run_page_draws_the_conversation_escaped(staff_client, alice, make_session):
    _, run = _conversation(alice, make_session, status=RunStatus.FAILED)
    content = staff_client.get(reverse("admin:scheduling_run_change", args=[run.pk])).content
    page = content.decode()
    # Markup from the conversation is text, never HTML.
    assert "<script>alert" not in page and "<b>2+3</b>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; sum it" in page
    # One card per tool call: arguments, then its result or its error.
    assert page.count('class="sage-card-tl sage-tool ') == 2
    assert "sage-tool-succeeded" in page and "sage-tool-failed" in page
    assert "&quot;expression&quot;: &quot;&lt;b&gt;2+3&lt;/b&gt;&quot;" in page
    assert "unknown zone" in page
    # The long argument is collapsed behind its first line.
    assert page.count('<details class="sage-value">') == 1
    # The error with its code and category; the run's facts.
    assert "upstream.error" in page and "UPSTREAM" in page
    assert "Attempts and lease" in page and "lease token" in page
    assert "Cancel run" not in page  # a finished run has nothing to cancel
    # Every field stays on the page, folded away after the timeline.
    folded = page.index('<details class="sage-all-fields"><summary>All fields</summary>')
    assert page.index('class="sage-timeline"') < folded < page.index('class="form-row field-id"')


def test_the_run_page_cancels_an_unfinished_run(staff_client, alice, make_session):
    session = make_session(alice)
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="x")
    page = staff_client.get(reverse("admin:scheduling_run_change", args=[run.pk])).content
    assert b"Cancel run" in page
    cancel = reverse("admin:scheduling_run_cancel", args=[run.pk])
    assert staff_client.get(cancel).status_code == 302  # a GET changes nothing
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
    response = staff_client.post(cancel)
    assert response.status_code == 302
    assert response["Location"] == reverse("admin:scheduling_run_change", args=[run.pk])
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED


def test_the_session_page_lists_its_runs_and_whole_conversation(
    staff_client, alice, make_session
):
    session, run = _conversation(alice, make_session)
    later, _ = services.run_submit(owner=alice, session_id=session.pk, input="and then?")
    page = staff_client.get(reverse("admin:scheduling_session_change", args=[session.pk]))
    text = page.content.decode()
    assert text.count('<a class="sage-id" href="/admin/scheduling/run/') >= 2
    assert f'title="{later.pk}"' in text and f'title="{run.pk}"' in text
    assert 'class="sage-tl-run"' in text  # the conversation, grouped by run
    assert "It is 5." in text and 'name="title"' in text  # the title stays editable
    assert text.index("<summary>All fields (the title is editable)</summary>") < text.index(
        'name="title"'
    )


def test_lists_show_short_ids_with_the_whole_id_in_the_tooltip(staff_client, alice, make_session):
    session, run = _conversation(alice, make_session)
    for name, shown in (("scheduling_run", run.pk), ("scheduling_session", session.pk),
                        ("scheduling_event", run.pk)):
        text = staff_client.get(reverse(f"admin:{name}_changelist")).content.decode()
        assert f'title="{shown}">{str(shown)[:8]}</' in text, name
    events = staff_client.get(reverse("admin:scheduling_event_changelist")).content.decode()
    assert "calculator → 5" in events and "clock failed: unknown zone" in events
    # A session without a title reads as its first input (decoded, escaped).
    sessions = staff_client.get(reverse("admin:scheduling_session_changelist")).content.decode()
    assert ">&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; sum it</span>" in sessions
    assert f'?session__id__exact={session.pk}">1</a>' in sessions  # its runs, linked


def test_the_capacity_page_charts_the_last_hour_of_samples(staff_client):
    from datetime import timedelta

    from scheduling import samples
    from scheduling.models import CapacitySample

    empty = staff_client.get(reverse("admin:capacity")).content.decode()
    assert empty.count("no samples in the last hour") == 2
    now = timezone.now()
    for minutes, queued in ((50, 4), (30, 9), (2, 1), (90, 60)):  # 90 min ago: off the chart
        moment = now - timedelta(minutes=minutes)
        CapacitySample.objects.create(
            slot=samples.slot_of(moment), time=moment, queued=queued, active=2,
            per_queue={"chat": {"active": 2, "pending": queued}},
        )
    page = staff_client.get(reverse("admin:capacity")).content.decode()
    assert "no samples in the last hour" not in page
    assert 'data-chart="queue-depth"' in page and 'data-chart="active-runs"' in page
    assert "now · peak 9" in page  # the sample of 90 minutes ago is not drawn
    assert "limit 8" in page  # the active-runs chart's dashed line


def test_charts_break_their_lines_where_no_sample_was_taken():
    from sageproject.charts import line_chart, nice_step

    assert [nice_step(v) for v in (0, 0.3, 1, 3, 7, 12, 45)] == [1, 0.5, 1, 5, 10, 20, 50]
    chart = line_chart(
        [{"name": "queued", "points": [(-600, 1), (-585, 2), (-300, 3), (-285, 4)]}],
        span=3600, gap=45,
    )
    assert chart["lines"][0]["d"].count("M") == 2  # two runs of samples, two segments
    assert (chart["lines"][0]["last"], chart["lines"][0]["peak"]) == ("4", "4")
    assert [t["label"] for t in chart["y_ticks"]] == ["0", "1", "2", "3", "4"]
    assert [t["label"] for t in chart["x_ticks"]] == ["-60 min", "-45 min", "-30 min",
                                                      "-15 min", "now"]
    assert line_chart([{"name": "q", "points": []}])["empty"] is True
