"""The admin's pages for people, in a real browser: Playwright driving Debian's headless
Chromium at 1400 by 900 pixels against a live server, with data a real worker made.

A worker executes a run that calls tools (one of them fails) and starts a background job,
a run the provider rate-limits (suspended, retried, suspended again) and a run the provider
fails; a second worker's snapshot and an hour of capacity samples sit beside them. The
test visits the run pages, a session page, the capacity page and each list, asserts on
what an operator sees (the tool's name and arguments, the error's code and category, the
charts, one line per list row) and saves a full-page screenshot of each page under
``$SAGE_TEST_ARTIFACTS/admin/`` (default ``.local/test-artifacts/admin/``).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from agents import services
from agents.models import JobRecord
from agents.services import packages
from scheduling import samples
from scheduling.models import CapacitySample, Run, RunStatus, WorkerSnapshot
from tests.conftest import demo_manifest, scripted_model
from tests.e2e.conftest import wait_for
from tests.e2e.test_browser import chromium  # noqa: F401  (the headless Chromium fixture)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

VIEWPORT = {"width": 1400, "height": 900}
REPORT = (
    "Quarterly figures: revenue 7,006,652; costs 4,120,000; margin 41.2%. "
    "Regions: north 38%, south 27%, east 21%, west 14%. "
) * 6

# Per list: the rows' one-line cells that must never wrap, and how wide the table may be.
NO_WRAP_JS = """
() => {
  const problems = [];
  const table = document.querySelector('#result_list');
  if (!table) return ['no #result_list'];
  for (const td of table.querySelectorAll('tbody td, tbody th')) {
    const cs = getComputedStyle(td);
    const line = parseFloat(cs.lineHeight) || parseFloat(cs.fontSize) * 1.2;
    const content = td.clientHeight - parseFloat(cs.paddingTop) - parseFloat(cs.paddingBottom);
    if (content > line * 1.75) {
      problems.push(`${td.className}: ${Math.round(content)}px high, line ${line}px`);
    }
  }
  for (const el of table.querySelectorAll('.sage-id, .sage-time')) {
    if (el.getClientRects().length > 1) problems.push(`wrapped: ${el.textContent}`);
  }
  const box = table.closest('.results') || table.parentElement;
  if (box.scrollWidth > box.clientWidth + 1) {
    const widths = [...table.querySelectorAll('thead th')].map(
      (th) => `${th.className || 'th'} ${Math.round(th.getBoundingClientRect().width)}`);
    problems.push(`${box.scrollWidth}px of rows in ${box.clientWidth}px: ${widths.join(', ')}`);
  }
  return problems;
}
"""


def artifacts() -> Path:
    root = os.environ.get("SAGE_TEST_ARTIFACTS") or str(
        Path(django_settings.BASE_DIR) / ".local" / "test-artifacts"
    )
    path = Path(root) / "admin"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _history(now) -> None:
    """An hour of capacity samples: a morning ramp of queued and active runs."""
    rows = []
    for i in range(240):
        moment = now - timedelta(seconds=3600 - i * samples.SAMPLE_SECONDS)
        if 150 <= i < 162:
            continue  # twelve periods with no worker sampling: the lines break there
        wave = math.sin(i / 240 * math.pi)
        chat_active = round(5 * wave + 1.5 * math.sin(i / 9))
        chat_active = max(0, min(8, chat_active))
        chat_pending = max(0, round(14 * wave**3 + 3 * math.sin(i / 5)))
        managed_active = max(0, round(2 * wave))
        managed_pending = max(0, round(4 * wave**2 - 1))
        per_queue = {
            "chat": {"active": chat_active, "pending": chat_pending},
            "managed": {"active": managed_active, "pending": managed_pending},
        }
        rows.append(
            CapacitySample(
                slot=samples.slot_of(moment),
                time=moment,
                queued=chat_pending + managed_pending,
                active=chat_active + managed_active,
                per_queue=per_queue,
            )
        )
    CapacitySample.objects.bulk_create(rows, ignore_conflicts=True)


def _second_worker(now, capacity: dict) -> None:
    """A second worker on another host, busier than the first."""
    other = dict(capacity)
    executor = dict(capacity["executor"])
    executor["model_calls"] = {**executor["model_calls"], "active": 3, "waiting": 1}
    executor["model_clients"] = {**executor["model_clients"], "clients": 5, "active_leases": 3}
    management = {
        **executor["management"],
        "applications": 2,
        "leased_applications": 1,
        "resident": [],
    }
    executor["management"] = management
    other["executor"] = executor
    other["runs"] = {**capacity["runs"], "active": 3, "completed": 118}
    other["scheduler"] = {**capacity["scheduler"], "claims": 121}
    WorkerSnapshot.objects.create(
        worker_id="sage-2:4187:b81f0c",
        host="sage-2",
        pid=4187,
        started_at=now - timedelta(hours=5),
        heartbeat_at=now,
        capacity=other,
    )


@pytest.fixture
def admin_data(alice, bob, scripted_record, start_worker):
    """Runs in every state an operator meets, made by a real worker."""
    scripted_model(
        "analyst",
        {
            "text": "I'll work that out with the calculator.",
            "tool_calls": [
                {"name": "calculator", "arguments": {"expression": "1234 * 5678"}},
                {"name": "calculator", "arguments": {"expression": "7006652 / 0"}},
            ],
        },
        {
            "text": "",
            "tool_calls": [
                {"name": "run_job", "arguments": {"kind": "echo", "input": {"chunks": [REPORT]}}}
            ],
        },
        {
            "text": "1234 * 5678 = 7,006,652. Dividing by zero is undefined, so I skipped that "
            "step; the quarterly report is being written by a background job."
        },
    )
    scripted_model("busy-provider", error={"status": 429, "body": "{}", "retry_after": 30})
    scripted_model("broken-provider", error={"status": 502, "body": "<html>Bad gateway</html>"})
    made = {}
    for name, model, owner, tools in (
        ("finance-analyst", "analyst", alice, ["calculator", "run_job", "job_status"]),
        ("support-desk", "busy-provider", bob, ["clock"]),
        ("travel-planner", "broken-provider", alice, ["clock"]),
    ):
        packages.package_save(
            owner=owner, manifest=demo_manifest(name=name, model=model, tools=tools)
        )
        session = services.session_create(owner=owner, package=name, agent="assistant")
        made[name] = session
    inputs = {
        "finance-analyst": "What is 1234 * 5678? Also divide it by zero, and write the "
        "quarterly report as a background job.",
        "support-desk": "My order #4411 never arrived. Can you check where it is?",
        "travel-planner": "Plan a three-day trip to Lisbon in May.",
    }
    runs = {
        name: services.run_submit(owner=made[name].owner, session_id=made[name].pk, input=text)[0]
        for name, text in inputs.items()
    }
    start_worker()
    wait_for(
        lambda: Run.objects.filter(pk=runs["support-desk"].pk, status=RunStatus.SUSPENDED).exists(),
        message="the rate-limited run to suspend",
    )
    services.run_reply(run=Run.objects.get(pk=runs["support-desk"].pk), decision="retry")
    wait_for(
        lambda: Run.objects.filter(
            pk=runs["support-desk"].pk, attempts=2, status=RunStatus.SUSPENDED
        ).exists(),
        message="the retried run to suspend again",
    )
    # Behind the suspended run, its session's next run waits its turn.
    services.run_submit(
        owner=bob, session_id=made["support-desk"].pk, input="Hello? Any news about order #4411?"
    )
    wait_for(
        lambda: (
            Run.objects.filter(pk=runs["travel-planner"].pk, status=RunStatus.FAILED).exists()
            and Run.objects.filter(
                pk=runs["finance-analyst"].pk, status=RunStatus.COMPLETED
            ).exists()
        ),
        message="the failed and the completed run",
    )
    wait_for(
        lambda: JobRecord.objects.filter(state="completed").exists(), message="the background job"
    )
    wait_for(
        lambda: WorkerSnapshot.objects.filter(capacity__runs__completed__gte=2).exists(),
        message="a snapshot counting the finished runs",
    )
    now = timezone.now()
    _history(now)
    _second_worker(now, WorkerSnapshot.objects.get().capacity)
    return {"runs": runs, "sessions": made}


def _login(page, base: str) -> None:
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", "staff")
    page.fill("#id_password", "staff-password")
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")


def _shot(page, name: str) -> Path:
    path = artifacts() / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def test_operators_read_runs_sessions_capacity_and_lists(
    chromium,  # noqa: F811
    live_server,
    staff,
    admin_data,
):
    from playwright.sync_api import expect

    runs = admin_data["runs"]
    base = live_server.url
    browser = chromium()
    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(15_000)
    _login(page, base)
    shots = []

    # A completed run: the conversation, each tool call with its arguments and result.
    page.goto(f"{base}/admin/scheduling/run/{runs['finance-analyst'].pk}/change/")
    expect(page.locator(".sage-run-head .sage-badge")).to_have_text("completed")
    expect(page.locator(".sage-bubble-user")).to_contain_text("What is 1234 * 5678?")
    tools = page.locator(".sage-tool")
    expect(tools).to_have_count(3)
    expect(tools.nth(0)).to_contain_text("calculator")
    expect(tools.nth(0)).to_contain_text('"expression": "1234 * 5678"')
    expect(tools.nth(0).locator(".sage-kv").nth(1)).to_contain_text("7006652")
    expect(tools.nth(1)).to_contain_text("failed")
    expect(tools.nth(1)).to_contain_text("division by zero")
    # The job's long arguments are collapsed behind their first line until asked for.
    long_args = tools.nth(2).locator("details.sage-value")
    expect(long_args).to_have_count(1)
    expect(long_args.locator("pre")).not_to_be_visible()
    expect(page.locator(".sage-tl-job").first).to_contain_text("echo")
    expect(page.locator(".sage-end")).to_contain_text("Completed")
    shots.append(_shot(page, "run-completed"))

    # A suspended run: both attempts, the interaction and the operator's cancel button.
    page.goto(f"{base}/admin/scheduling/run/{runs['support-desk'].pk}/change/")
    expect(page.locator(".sage-run-head .sage-badge").first).to_have_text("suspended")
    expect(page.locator(".sage-interaction")).to_have_count(2)
    expect(page.locator(".sage-interaction").first).to_contain_text("upstream.rate_limited")
    expect(page.locator(".sage-tl-marker", has_text="Attempt 2 started")).to_contain_text(
        "resumed after a reply"
    )
    expect(page.locator("button.sage-danger-button")).to_have_text("Cancel run")
    shots.append(_shot(page, "run-suspended"))

    # A failed run: its error with code and category, on the card and in the timeline.
    page.goto(f"{base}/admin/scheduling/run/{runs['travel-planner'].pk}/change/")
    expect(page.locator(".sage-error-box")).to_contain_text("upstream.error")
    expect(page.locator(".sage-error-box")).to_contain_text("UPSTREAM")
    expect(page.locator(".sage-end-error")).to_contain_text("the provider failed")
    shots.append(_shot(page, "run-failed"))

    # A session: its runs, newest first, and the whole conversation.
    session = admin_data["sessions"]["support-desk"]
    page.goto(f"{base}/admin/scheduling/session/{session.pk}/change/")
    rows = page.locator("table.sage-runs tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_contain_text("queued")
    expect(rows.nth(1)).to_contain_text("suspended")
    expect(page.locator(".sage-tl-run")).to_have_count(1)
    expect(page.locator(".sage-bubble-user").first).to_contain_text("order #4411")
    shots.append(_shot(page, "session"))

    # Capacity: the cards and the two charts of the last hour, drawn on the server.
    page.goto(f"{base}/admin/capacity/")
    cards = page.locator(".sage-capacity-cards > .sage-card h3")
    expect(cards).to_have_text(
        ["Runs", "Model calls", "Model clients", "Applications", "Jobs", "Code tools", "Workers"]
    )
    expect(page.locator("#card-workers .sage-workers tbody tr")).to_have_count(2)
    for chart in ("queue-depth", "active-runs"):
        line = page.locator(f'[data-chart="{chart}"] svg path.sage-line').first
        assert len(line.get_attribute("d")) > 500, chart  # an hour of samples, one path
    expect(page.locator("#card-model-calls .sage-big").first).to_contain_text("3 / 16")
    expect(page.locator("#card-workers")).to_contain_text("event commits / transactions")
    shots.append(_shot(page, "capacity"))

    # Lists: one line per row at 1400 px — no wrapped id or time — and nothing off-screen.
    problems = {}
    for name, url in (
        ("list-runs", "/admin/scheduling/run/"),
        ("list-sessions", "/admin/scheduling/session/"),
        ("list-events", "/admin/scheduling/event/"),
        ("list-packages", "/admin/agents/agentpackage/"),
        ("list-archives", "/admin/agents/managedagentrecord/"),
        ("list-jobs", "/admin/agents/jobrecord/"),
        ("list-model-records", "/admin/pooling/modelrecord/"),
    ):
        page.goto(f"{base}{url}")
        expect(page.locator("#result_list tbody tr").first).to_be_visible()
        shots.append(_shot(page, name))
        problems[name] = page.evaluate(NO_WRAP_JS)
    expect(page.locator("#result_list")).to_contain_text("shared")  # the model records
    assert problems == {name: [] for name in problems}

    browser.close()
    assert all(path.stat().st_size > 10_000 for path in shots)
