"""The Queues now table in Chromium: counts, badges, why nothing runs, and the ?queue= filter of
the Running jobs and Problems panels."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest

from tests.browser.conftest import CHROMIUM, _open
from tests.dashboard_data import WORKER_OK, plant

if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"chromium not found at {CHROMIUM}: apt-get install -y chromium", allow_module_level=True
    )

from playwright.sync_api import Page, expect

#: Any cell text, for figures that move with the clock.
_ANY = re.compile(r".*")


def _plant_two_queues(conn: psycopg.Connection[Any]) -> None:
    """plant()'s 'emails' (2 running, 1 dead, 1 retrying) and 'reports' with one of each."""
    plant(conn)
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, lease_token, lease_expires_at,"
        " worker_id, claimed_at) VALUES ('reports', 'build_report', 'running', 1,"
        " gen_random_uuid(), now() + interval '10 minutes', %s, now() - interval '1 second')",
        (WORKER_OK,),
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, max_attempts, last_error,"
        " finished_at) VALUES ('reports', 'build_report', 'dead', 3, 3, 'KeyError: month',"
        " now() - interval '10 seconds')"
    )
    conn.execute(
        "INSERT INTO pgqueue_queues (name, paused, concurrency_limit, rate_limit, rate_period)"
        " VALUES ('reports', true, NULL, NULL, NULL), ('emails', false, 10, 100, 60)"
    )


def _query(page: Page) -> dict[str, list[str]]:
    return parse_qs(urlsplit(page.url).query)


def test_the_queues_table_shows_counts_and_badges_and_a_row_filters_the_lists(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    _plant_two_queues(conn)
    _open(page, base_url)
    emails = page.locator("#queues tr[data-queue='emails']")
    expect(emails.locator("td")).to_have_text(
        ["emails limit 10 rate 100 / 1m 00s", "5", "2", "1", "1", _ANY, _ANY, _ANY, _ANY, ""]
    )
    expect(emails.locator(".pill.limited")).to_have_text(["limit 10", "rate 100 / 1m 00s"])
    expect(emails.locator(".pill.paused")).to_have_count(0)
    reports = page.locator("#queues tr[data-queue='reports']")
    expect(reports.locator(".pill.paused")).to_have_text("paused")
    expect(reports.locator("td").nth(2)).to_have_text("1")  # running
    expect(reports.locator("td").nth(4)).to_have_text("1")  # dead
    expect(page.locator("#running tr")).to_have_count(3)
    expect(page.locator("#problems tr[data-job]")).to_have_count(3)
    expect(page.locator("#p-running .filter")).to_be_hidden()

    page.evaluate("window.__marker = 1")
    reports.locator("td").nth(3).click()  # anywhere on the row
    expect(page.locator("#running tr")).to_have_count(1)
    expect(page.locator("#running")).to_contain_text("build_report")
    expect(page.locator("#problems tr[data-job]")).to_have_count(1)
    expect(page.locator("#problems")).to_contain_text("KeyError: month")
    expect(page.locator("#problem-counts")).to_have_text("· 1 dead · 0 retrying")
    expect(page.locator("#p-running .filter")).to_contain_text("queue reports")
    expect(page.locator("#p-problems .filter")).to_be_visible()
    expect(reports).to_have_class("selected")
    assert _query(page) == {"queue": ["reports"]}
    # It stays filtered across refreshes, without a reload.
    refresh = int(page.locator("body").get_attribute("data-refresh") or 0)
    expect(page.locator("body")).not_to_have_attribute("data-refresh", str(refresh))
    expect(page.locator("#running tr")).to_have_count(1)
    assert page.evaluate("window.__marker") == 1

    page.locator("#p-running .filter-clear").click()
    expect(page.locator("#running tr")).to_have_count(3)
    expect(page.locator("#p-running .filter")).to_be_hidden()
    assert _query(page) == {}
    assert page.evaluate("window.__marker") == 1


def test_a_bookmarked_queue_url_opens_filtered(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    _plant_two_queues(conn)
    _open(page, base_url + "/?queue=emails")
    expect(page.locator("#running tr")).to_have_count(2)
    expect(page.locator("#running")).not_to_contain_text("build_report")
    expect(page.locator("#problems tr[data-job]")).to_have_count(2)  # dead and retrying
    expect(page.locator("#problem-counts")).to_have_text("· 1 dead · 1 retrying")
    expect(page.locator("#p-problems .filter")).to_contain_text("queue emails")
    expect(page.locator("#queues tr.selected")).to_have_attribute("data-queue", "emails")
    # Back to every queue with the browser's Back button after choosing another queue.
    page.locator("#queues tr[data-queue='reports'] a.queue-link").click()
    expect(page.locator("#running tr")).to_have_count(1)
    page.go_back()
    expect(page.locator("#running tr")).to_have_count(2)
    assert _query(page) == {"queue": ["emails"]}


def test_a_queue_with_waiting_jobs_and_nothing_running_says_why(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    # A heartbeat ahead of the clock keeps the worker live however slowly the test runs.
    conn.execute(
        "INSERT INTO pgqueue_workers (id, host, pid, queues, concurrency, last_heartbeat_at)"
        " VALUES (gen_random_uuid(), 'h', 1, ARRAY['later', 'capped', 'other'], 4,"
        " now() + interval '10 minutes')"
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, run_at) VALUES ('orphan', 't', now()),"
        " ('later', 't', now() + interval '3 minutes'), ('capped', 't', now())"
    )
    conn.execute("INSERT INTO pgqueue_queues (name, concurrency_limit) VALUES ('capped', 0)")
    _open(page, base_url)
    why = page.locator("#queues td.queue-why")
    expect(page.locator("#queues tr[data-queue='orphan'] td.queue-why")).to_have_text(
        "No live worker serves it (they serve: capped, later, other)."
    )
    expect(page.locator("#queues tr[data-queue='orphan'] td.none")).to_have_text("none")
    later = page.locator("#queues tr[data-queue='later']")
    expect(later.locator("td.queue-why")).to_contain_text(
        "All its jobs are due later: the next in 2m"
    )
    expect(later.locator("td").nth(7)).to_contain_text("next in 2m")
    capped = page.locator("#queues tr[data-queue='capped']")
    expect(capped.locator("td.queue-why")).to_contain_text("concurrency limit of 0")
    expect(capped.locator(".pill.limited")).to_have_text("limit 0")
    expect(why).to_have_count(3)
