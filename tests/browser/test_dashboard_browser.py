"""The dashboard in headless Chromium: panels, empty states, live updates, XSS, read-only.

Skipped only when Debian's chromium is missing (CI installs it with apt-get).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

from pgqueue import __version__
from tests.browser.conftest import CHROMIUM, Served, _open, _refresh
from tests.conftest import Server
from tests.dashboard_data import XSS, plant
from tests.helpers import wait_until

if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"chromium not found at {CHROMIUM}: apt-get install -y chromium", allow_module_level=True
    )

from playwright.sync_api import Browser, Page, expect


def test_empty_database_shows_every_empty_state(page: Page, base_url: str) -> None:
    _open(page, base_url)
    expect(page.locator("h1")).to_have_text(f"pgqueue v{__version__}")
    expect(page.locator(".badge")).to_have_text("read-only")
    for text in ["No jobs yet", "No workers running", "Waiting for jobs…",
                 "Nothing is running right now", "Nothing here", "No schedules"]:  # fmt: skip
        expect(page.get_by_text(text, exact=True)).to_be_visible()
    expect(page.locator("#t-waiting")).to_have_text("0")
    expect(page.locator("#conn")).to_have_attribute("data-state", "live")
    expect(page.locator("#banner")).to_be_hidden()
    for tile in ("#t-throughput", "#t-pickup", "#t-run", "#t-retries", "#t-failed"):
        expect(page.locator(tile)).not_to_have_text("")
    how = page.locator("#p-how")
    for text in ["SKIP LOCKED claiming", "Leases and crash recovery", "LISTEN / NOTIFY",
                 "Retries and dead letters", "1 · INSERT", "2 · NOTIFY", "3 · SKIP LOCKED",
                 "4 · heartbeat"]:  # fmt: skip
        expect(how.get_by_text(text, exact=True)).to_be_visible()
    expect(how.locator("figcaption")).to_have_text(
        "Solid arrows are SQL statements, dashed arrows are LISTEN/NOTIFY wake-ups."
    )
    # The test user is a superuser: the page says the role can write.
    expect(page.locator("#writable")).to_be_visible()
    expect(page.locator("#writable-text")).to_have_text("It is a superuser.")


def test_how_it_works_says_the_trigger_notifies_only_while_a_worker_waits(
    page: Page, base_url: str
) -> None:
    """It said "on every insert"; since migration 0004 the trigger notifies only while some
    worker waits for work (docs/concepts/wakeups.md)."""
    _open(page, base_url)
    section = page.locator("#p-how section", has_text="LISTEN / NOTIFY")
    expect(section).to_contain_text("While some worker waits for work")
    expect(section).not_to_contain_text("every insert")
    expect(page.locator("#dg-desc")).not_to_contain_text("every insert")


def test_panels_render_data_and_change_without_reload(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)
    _open(page, base_url)
    expect(page.locator("#t-waiting")).to_have_text("7")
    expect(page.locator("#t-running")).to_have_text("2")
    expect(page.locator("#t-failed")).to_have_text("1")
    expect(page.locator("#workers li")).to_have_count(2)
    expect(page.locator("#workers li.late")).to_have_count(1)
    expect(page.locator("#workers li.late")).to_contain_text("web-2")
    expect(page.locator("#workers li.late .pill.late")).to_have_text("late")
    expect(page.locator("#workers li:not(.late) .pill")).to_have_count(0)
    expect(page.locator("#running tr")).to_have_count(2)
    expect(page.locator("#problems tr[data-job]")).to_have_count(2)
    expect(page.locator("#schedules tr")).to_have_count(2)
    expect(page.locator("#schedules")).to_contain_text("*/15 * * * *")
    expect(page.locator("#feed li.empty")).to_have_count(0)
    expect(page.locator("#chart-throughput canvas")).to_have_count(1)
    expect(page.locator("#chart-depth canvas")).to_have_count(1)
    expect(page.locator("#depth-empty")).to_be_hidden()

    # Live rates on the diagram's arrows (60 planted seconds of 11 finished attempts each).
    expect(page.locator("#rate-claim")).to_have_text(re.compile(r"^\d+(\.\d+)? jobs/s$"))
    expect(page.locator("#rate-heartbeat")).to_have_text("1 live worker")
    expect(page.locator("#t-pickup .p95")).to_contain_text("ms")

    # The full error is one click away.
    page.locator("#problems details summary").first.click()
    expect(page.locator("#problems details pre").first).to_contain_text("END-OF-TRACEBACK")

    # Lease left counts down between snapshots.
    lease = page.locator("#running td.lease").first
    before = lease.inner_text()
    wait_until(lambda: lease.inner_text() != before)

    # New jobs show up in place: the marker survives, so the page never reloaded.
    page.evaluate("window.__marker = 42")
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task) SELECT 'emails', 'late_arrival'"
        " FROM generate_series(1, 3)"
    )
    expect(page.locator("#t-waiting")).to_have_text("10")
    expect(page.locator("#feed")).to_contain_text("late_arrival")
    assert page.evaluate("window.__marker") == 42


def test_planted_xss_payloads_show_as_text_and_never_run(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn, xss=True)
    _open(page, base_url)
    expect(page.locator("#problems")).to_contain_text(XSS[:20])
    expect(page.locator("#schedules")).to_contain_text(XSS)
    expect(page.locator("#depth-legend")).to_contain_text(XSS)
    expect(page.locator("#feed")).to_contain_text("build_report<img")
    page.locator("#problems details summary").first.click()
    expect(page.locator("#problems details pre").first).to_contain_text("END-OF-TRACEBACK")
    assert page.evaluate("window.__xss") is None
    assert page.evaluate("document.querySelectorAll('main img, main script').length") == 0


def test_writes_are_refused_and_the_csp_is_strict(page: Page, base_url: str) -> None:
    response = page.goto(base_url)
    assert response is not None
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp
    for method in ("post", "put", "delete", "patch"):
        assert getattr(page.request, method)(base_url + "/").status == 405
    assert page.request.post(base_url + "/api/snapshot").status == 405


def test_every_open_tab_gets_the_same_refresh_and_costs_nothing(
    browser: Browser, served: Served
) -> None:
    """Ten tabs, one refresh per interval: the database work does not grow with the tabs."""
    refresher, tabs = served.refresher, 10
    # One context per tab: Chromium allows six connections per host and profile, and every
    # tab holds its event stream open.
    contexts = [browser.new_context() for _ in range(tabs)]
    try:
        pages = [context.new_page() for context in contexts]
        for page in pages:
            _open(page, served.url)
        wait_until(lambda: refresher.broadcaster.listeners == tabs)
        uses, refreshes, started = refresher.database.uses, refresher.refreshes, time.monotonic()
        target = refreshes + 4
        wait_until(lambda: all(_refresh(page) >= target for page in pages), 20)
        elapsed = time.monotonic() - started
        new_refreshes = refresher.refreshes - refreshes
        new_uses = refresher.database.uses - uses
        # Every database session the dashboard opened was a refresh (one may be in flight),
        # and refreshes kept to the interval however many tabs listened.
        assert abs(new_uses - new_refreshes) <= 1, (new_uses, new_refreshes)
        assert new_refreshes <= elapsed / refresher.interval + 2, (new_refreshes, elapsed)
        metrics = pages[0].request.get(served.url + "/metrics").text()
        assert f"pgqueue_dashboard_open_pages {tabs}.0" in metrics
    finally:
        for context in contexts:
            context.close()
    wait_until(lambda: refresher.broadcaster.listeners == 0)


def test_the_page_rides_out_a_database_outage_without_reloading(
    page: Page, base_url: str, conn: psycopg.Connection[Any], dsn: str, pg_server: Server
) -> None:
    """The dashboard's backend is killed and no new connection is allowed for a while."""
    _open(page, base_url)
    page.evaluate("window.__marker = 7")
    database = sql.Identifier(str(conninfo.conninfo_to_dict(dsn)["dbname"]))
    admin = psycopg.connect(pg_server.admin_dsn, autocommit=True)
    admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(database))
    try:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'pgqueue-dashboard' AND datname = current_database()"
        )
        expect(page.locator("#conn")).to_have_attribute("data-state", "reconnecting")
        expect(page.locator("#banner")).to_be_visible()
        expect(page.locator("#banner-text")).to_contain_text("not currently accepting connections")
        expect(page.locator("body")).to_have_class("stale")
    finally:
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(database))
        admin.close()
    conn.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('emails', 'after_outage')")
    expect(page.locator("#conn")).to_have_attribute("data-state", "live")
    expect(page.locator("#banner")).to_be_hidden()
    expect(page.locator("#feed")).to_contain_text("after_outage")
    assert page.evaluate("window.__marker") == 7


def test_a_paused_queue_wears_a_badge_wherever_it_is_named(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)
    conn.execute(
        "INSERT INTO pgqueue_queues (name, paused) VALUES ('emails', true), ('nightly', true)"
    )
    _open(page, base_url)
    legend = page.locator("#depth-legend")
    expect(legend.locator(".qname", has_text="emails").locator(".pill.paused")).to_have_text(
        "paused"
    )
    expect(legend.locator(".qname", has_text="reports").locator(".pill")).to_have_count(0)
    # Paused with nothing waiting: no line on the chart, but still named, with its badge.
    expect(legend.locator(".qname.idle")).to_have_text("nightly paused")
    expect(page.locator("#running .pill.paused")).to_have_count(2)  # both run in 'emails'
    expect(page.locator("#problems .pill.paused")).to_have_count(2)  # dead and retrying
    expect(page.locator("#schedules tr", has_text="digest").locator(".pill.paused")).to_have_count(
        1
    )
    expect(page.locator("#workers")).to_contain_text("emails (paused)")

    # Resumed: the badges go at the next refresh, without a reload.
    page.evaluate("window.__marker = 7")
    conn.execute("UPDATE pgqueue_queues SET paused = false WHERE name = 'emails'")
    expect(page.locator("#running .pill.paused")).to_have_count(0)
    expect(legend.locator(".pill.paused")).to_have_count(1)
    expect(page.locator("#workers")).not_to_contain_text("(paused)")
    assert page.evaluate("window.__marker") == 7


def test_a_running_jobs_progress_shows_as_a_bar_and_moves_without_reload(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)
    first, second = [
        r[0]
        for r in conn.execute(
            "SELECT id FROM pgqueue_jobs WHERE status = 'running' ORDER BY claimed_at, id"
        ).fetchall()
    ]
    conn.execute(
        'UPDATE pgqueue_jobs SET progress = \'{"current": 30, "total": 120, "note": "rows"}\''
        " WHERE id = %s",
        (first,),
    )
    conn.execute("UPDATE pgqueue_jobs SET progress = '{\"current\": 7}' WHERE id = %s", (second,))
    _open(page, base_url)
    rows = page.locator("#running tr")
    bar = rows.nth(0).locator(".progress progress")
    expect(bar).to_have_attribute("max", "120")
    expect(bar).to_have_attribute("value", "30")
    expect(rows.nth(0).locator(".progress-label")).to_have_text("25% · rows")
    expect(rows.nth(1).locator(".progress progress")).to_have_count(0)
    expect(rows.nth(1).locator(".progress-label")).to_have_text("7")
    page.evaluate("window.__marker = 7")
    conn.execute(
        'UPDATE pgqueue_jobs SET progress = \'{"current": 90, "total": 120}\' WHERE id = %s',
        (first,),
    )
    expect(rows.nth(0).locator(".progress-label")).to_have_text("75%")
    assert page.evaluate("window.__marker") == 7


def test_running_and_problem_jobs_show_how_many_jobs_they_wait_for_and_wait_for_them(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)
    (running,) = conn.execute(
        "SELECT id FROM pgqueue_jobs WHERE status = 'running' ORDER BY claimed_at, id LIMIT 1"
    ).fetchone() or (None,)
    (dead,) = conn.execute(
        "SELECT id FROM pgqueue_jobs WHERE status = 'dead' ORDER BY finished_at DESC LIMIT 1"
    ).fetchone() or (None,)
    conn.execute(
        "INSERT INTO pgqueue_job_deps (parent_id, child_id, position) VALUES"
        " (%(r)s, 900001, 1), (%(r)s, 900002, 1), (%(d)s, %(r)s, 1), (%(d)s, 900003, 1)",
        {"r": running, "d": dead},
    )
    conn.execute(
        "UPDATE pgqueue_jobs SET has_children = true WHERE id IN (%s, %s)", (running, dead)
    )
    _open(page, base_url)
    expect(page.locator("#running tr").nth(0).locator(".family")).to_have_text(
        "after 1 job · 2 jobs wait"
    )
    expect(page.locator(f"#problems tr[data-job='{dead}'] .family")).to_have_text("2 jobs wait")
