"""The job detail page and the job search in headless Chromium: what a user clicks through.

The fixtures are the main page's (tests/browser/conftest.py: a served dashboard; a tab that
fails the test on any console error, CSP violation or dialog).
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
from playwright.sync_api import Locator, Page, expect

import pgqueue
from tests.browser.conftest import _open
from tests.dashboard_data import XSS, plant

Conn = psycopg.Connection[Any]


def _follow(page: Page, link: Locator, url: str) -> None:
    """Click a link of a live panel and land on ``url``: once (a refresh keeps the rows it shows,
    so a click is never lost to a redraw)."""
    link.click()
    expect(page).to_have_url(url)


def _one(conn: Conn, query: str) -> int:
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def test_a_succeeded_job_shows_its_result_and_times(
    page: Page, base_url: str, conn: Conn, app: pgqueue.App
) -> None:
    job = app.enqueue("report", {"month": "2026-11"}, meta={"by": "ops"}, allow_unknown=True)
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'succeeded', attempts = 1,"
        " claimed_at = now() - interval '3 seconds', started_at = now() - interval '2 seconds',"
        " finished_at = now() - interval '1 second', result = %s WHERE id = %s",
        ('{"rows": 1234, "file": "nov.csv"}', job),
    )
    page.goto(f"{base_url}/jobs/{job}")
    expect(page).to_have_title(f"Job #{job} · report · pgqueue")
    expect(page.locator("#job-status")).to_have_text("succeeded")
    expect(page.locator("#job-result pre")).to_contain_text('"rows": 1234')
    expect(page.locator("#job-args pre")).to_contain_text('"month": "2026-11"')
    expect(page.locator("#job-meta pre")).to_contain_text('"by": "ops"')
    expect(page.locator("#job-times")).to_contain_text("Finished")
    expect(page.locator("#job-times tr", has_text="Finished")).to_contain_text("s ago")
    expect(page.locator("#job-why")).to_have_count(0)
    expect(page.locator("#job-history tr.attempt")).to_have_count(1)
    expect(page.locator("#job-history tr.attempt")).to_contain_text("succeeded")


def test_earlier_attempts_are_listed_with_their_errors_folded_and_inert(
    page: Page, base_url: str, conn: Conn, app: pgqueue.App
) -> None:
    job = app.enqueue("report", {}, allow_unknown=True)
    conn.execute(
        "INSERT INTO pgqueue_attempts (job_id, attempt, worker_id, claimed_at, started_at,"
        " finished_at, outcome, error) VALUES"
        " (%(id)s, 1, gen_random_uuid(), now() - interval '9 s', now() - interval '9 s',"
        "  now() - interval '8 s', 'retrying', %(error)s),"
        " (%(id)s, 2, gen_random_uuid(), now() - interval '6 s', NULL, now() - interval '5 s',"
        "  'lease expired', 'LeaseExpired: worker gone')",
        {"id": job, "error": "Traceback (most recent call last):\nValueError: " + XSS},
    )
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'succeeded', attempts = 3, claimed_at = now(),"
        " started_at = now(), finished_at = now() WHERE id = %s",
        (job,),
    )
    page.goto(f"{base_url}/jobs/{job}")
    rows = page.locator("#job-history tr.attempt")
    expect(rows).to_have_count(3)
    expect(rows.nth(0)).to_contain_text("retrying")
    expect(rows.nth(1)).to_contain_text("lease expired")
    expect(rows.nth(2)).to_contain_text("succeeded")
    error = rows.nth(0).locator("pre.attempt-error")
    expect(error).to_be_hidden()
    rows.nth(0).locator("summary").click()
    expect(error).to_contain_text("ValueError: " + XSS)
    assert page.evaluate("window.__xss") is None
    assert page.evaluate("document.querySelectorAll('main img, main script').length") == 0


def test_a_dead_jobs_traceback_is_shown_as_text_and_never_runs(
    page: Page, base_url: str, conn: Conn
) -> None:
    plant(conn, xss=True)
    dead = _one(conn, "SELECT id FROM pgqueue_jobs WHERE status = 'dead'")
    page.goto(f"{base_url}/jobs/{dead}")
    traceback = page.locator("#job-traceback")
    expect(traceback).to_contain_text("SMTPError: mailbox unavailable" + XSS)
    expect(traceback).to_contain_text("END-OF-TRACEBACK")
    expect(page.locator("#job-error h2")).to_contain_text("Error · of attempt 5")
    assert page.evaluate("window.__xss") is None
    assert page.evaluate("document.querySelectorAll('main img, main script').length") == 0
    # The task name and arguments carry the payload too (the planted report job).
    report = _one(conn, "SELECT id FROM pgqueue_jobs WHERE task LIKE 'build_report%'")
    page.goto(f"{base_url}/jobs/{report}")
    expect(page.locator("#job-task")).to_have_text("build_report" + XSS)
    expect(page.locator("#job-args pre")).to_contain_text("window.__xss")
    assert page.evaluate("window.__xss") is None
    assert page.evaluate("document.querySelectorAll('main img, main script').length") == 0


def test_a_blocked_child_shows_its_parent_and_why_it_waits(
    page: Page, base_url: str, conn: Conn, app: pgqueue.App
) -> None:
    plant(conn)  # a live worker serving every queue
    parent = app.enqueue("extract", {}, queue="emails", allow_unknown=True)
    child = app.enqueue("load", {}, queue="emails", after=[parent], allow_unknown=True)
    page.goto(f"{base_url}/jobs/{child}")
    expect(page.locator("#job-status")).to_have_text("blocked")
    expect(page.locator("#why-answer")).to_have_text(
        "It runs after other jobs: 1 parent not finished yet."
    )
    expect(page.locator("#why-parents li")).to_have_text(f"#{parent} extract queued")
    expect(page.locator("#job-parents")).to_contain_text("Runs after · 1 job")
    # The parent's link opens the parent, which lists the child.
    page.locator("#why-parents a").click()
    expect(page).to_have_url(f"{base_url}/jobs/{parent}")
    expect(page.locator("#job-children li")).to_have_text(f"#{child} load blocked")
    expect(page.locator("#why-answer")).to_have_text(
        "Nothing holds it back: it should start any moment."
    )


def test_the_search_box_opens_a_job_from_the_dashboard_and_from_a_job(
    page: Page, base_url: str, conn: Conn
) -> None:
    plant(conn)
    dead = _one(conn, "SELECT id FROM pgqueue_jobs WHERE status = 'dead'")
    retrying = _one(conn, "SELECT id FROM pgqueue_jobs WHERE status = 'retrying'")
    _open(page, base_url)
    page.locator("#job-search-id").fill(f"#{dead}")
    page.locator("#job-search-id").press("Enter")
    expect(page).to_have_url(f"{base_url}/jobs/{dead}")
    expect(page.locator("#job-summary h2")).to_contain_text(f"Job #{dead}")
    page.locator("#job-search-id").fill(str(retrying))
    page.get_by_role("button", name="Open").click()
    expect(page).to_have_url(f"{base_url}/jobs/{retrying}")
    expect(page.locator("#why-answer")).to_have_text(
        re.compile(r"^Its retry is due in \d+(\.\d)? s\.$")
    )
    page.locator(".crumbs a").click()
    expect(page).to_have_url(f"{base_url}/")


def test_the_search_box_works_without_javascript(browser: Any, base_url: str, conn: Conn) -> None:
    plant(conn)
    dead = _one(conn, "SELECT id FROM pgqueue_jobs WHERE status = 'dead'")
    context = browser.new_context(java_script_enabled=False)
    try:
        tab = context.new_page()
        tab.goto(base_url)
        tab.locator("#job-search-id").fill(str(dead))
        tab.locator("#job-search-id").press("Enter")
        expect(tab).to_have_url(f"{base_url}/jobs/{dead}")
        expect(tab.locator("#job-status")).to_have_text("dead")
    finally:
        context.close()


def test_job_ids_on_the_running_problems_and_feed_panels_open_the_job(
    page: Page, base_url: str, conn: Conn
) -> None:
    plant(conn)
    running = _one(
        conn, "SELECT id FROM pgqueue_jobs WHERE status = 'running' ORDER BY claimed_at, id LIMIT 1"
    )
    dead = _one(conn, "SELECT id FROM pgqueue_jobs WHERE status = 'dead'")
    _open(page, base_url)
    link = page.locator("#running tr").first.locator("a.job-link")
    expect(link).to_have_text(f"#{running}")
    _follow(page, link, f"{base_url}/jobs/{running}")
    expect(page.locator("#job-worker")).to_contain_text("web-1 pid 101")
    expect(page.locator("#job-worker .pill")).to_have_text("alive")
    page.go_back()
    _follow(
        page, page.locator(f"#problems tr[data-job='{dead}'] a.job-link"), f"{base_url}/jobs/{dead}"
    )
    expect(page.locator("#job-traceback")).to_contain_text("END-OF-TRACEBACK")
    page.go_back()
    feed_link = page.locator("#feed a.job-link").first
    expect(feed_link).to_have_attribute("href", re.compile(r"^jobs/\d+$"))
