"""One real-browser walk through the operator admin: Playwright driving Debian's headless
Chromium against a live server, with the worker running in-process.

An operator logs in, opens the readiness report of a package whose skill was removed and
sees the missing skill, then asks for idle Applications to be released and sees the
worker's answer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agents import services
from agents.services import packages
from tests.conftest import CI, demo_manifest
from tests.e2e.conftest import all_terminal, wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def chromium(monkeypatch):
    """A launcher for headless Chromium; call it once the database is set up."""
    if not os.path.exists(CHROMIUM):
        reason = f"Chromium is not installed at {CHROMIUM} (apt-get install -y chromium)"
        if CI:
            pytest.fail(f"{reason}; required under CI=true")
        pytest.skip(reason)
    sync_api = pytest.importorskip("playwright.sync_api")
    # Playwright's sync API keeps an event loop in this thread; the ORM calls made by
    # fixture teardown here (flushing the test database) are still synchronous ones.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    started: list = []

    def launch():
        playwright = sync_api.sync_playwright().start()
        started.append(playwright)
        return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)

    yield launch
    for playwright in started:
        playwright.stop()


def test_it_lets_an_operator_see_a_missing_skill_and_release_idle_applications(
    chromium, live_server, staff, alice, scripted_record, start_worker, settings, tmp_path: Path
):
    from playwright.sync_api import expect

    settings.SAGE_SKILL_DIRS = [str(tmp_path)]  # an empty skills directory: "refunds" is gone
    packages.package_save(owner=alice, manifest=demo_manifest(name="support", skills=["refunds"]))
    session = services.session_create(owner=alice, package="support", agent="assistant")
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="hello")
    start_worker()
    wait_for(lambda: all_terminal([run.pk]), message="the run that makes an Application resident")

    browser = chromium()
    page = browser.new_page()
    page.set_default_timeout(20_000)
    page.goto(f"{live_server.url}/admin/login/")
    page.fill("#id_username", "staff")
    page.fill("#id_password", "staff-password")
    page.click("input[type=submit]")
    expect(page.locator("#site-name")).to_contain_text("Sage Host")

    # The readiness report lists the missing skill, in red, per agent.
    page.goto(f"{live_server.url}/admin/agents/readinessreport/")
    expect(page.locator("#result_list")).to_contain_text("skills refunds")
    page.locator("#result_list tbody tr a").first.click()
    table = page.locator("table.readiness-table")
    expect(table).to_contain_text("Missing skills")
    expect(table.locator("tbody tr").first).to_contain_text("assistant")
    expect(table.locator("tbody tr").first).to_contain_text("refunds")
    expect(table.locator("tbody tr").first).to_contain_text("not ready")

    # Release idle (safe): the intermediate form, then the worker's answer.
    page.goto(f"{live_server.url}/admin/agents/reclamationrequest/")
    page.click("text=Release idle (safe)…")
    page.fill("#id_min_idle_seconds", "0")
    page.fill("#id_limit", "4")
    page.click("#release-idle-form input[type=submit]")
    answer = page.locator("p.reclamation-answer")
    # The page refreshes itself every 2 s until the worker has answered.
    expect(answer).to_contain_text("Done:", timeout=30_000)
    expect(answer).to_contain_text("released 1 Application")
    browser.close()
