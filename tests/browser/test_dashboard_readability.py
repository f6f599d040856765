"""The dashboard read by a person: empty states inside their panels, stable queue colours, live
values under the cursor, small queues beside big ones, both kinds of problems, a phone's width.

Each test pins a defect of issue 21 ("Defects seen"). Fixtures come from the main browser module
(skipped with it when Chromium is missing).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from playwright.sync_api import Browser, FloatRect, Page, expect

from tests.browser.conftest import _open, _refresh
from tests.dashboard_data import WORKER_OK, plant
from tests.helpers import wait_until

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1440, "height": 1000}


@contextmanager
def tab(browser: Browser, url: str, viewport: dict[str, int]) -> Iterator[Page]:
    context = browser.new_context(viewport=viewport)  # type: ignore[arg-type]
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        _open(page, url)
        yield page
        assert errors == [], errors
    finally:
        context.close()


def _box(page: Page, selector: str) -> FloatRect:
    box = page.locator(selector).bounding_box()
    assert box is not None, selector
    return box


def _inside(inner: FloatRect, outer: FloatRect) -> bool:
    return (
        inner["x"] >= outer["x"] - 0.5
        and inner["y"] >= outer["y"] - 0.5
        and inner["x"] + inner["width"] <= outer["x"] + outer["width"] + 0.5
        and inner["y"] + inner["height"] <= outer["y"] + outer["height"] + 0.5
    )


def _legend_colour(page: Page, queue: str) -> str:
    """The colour key drawn next to a queue's name in the Queues legend."""
    colour: str = page.evaluate(
        """(queue) => {
            const name = [...document.querySelectorAll("#depth-legend .qname")]
                .find((n) => n.firstChild && n.firstChild.textContent === queue);
            return name ? getComputedStyle(name.previousElementSibling).backgroundColor : "";
        }""",
        queue,
    )
    return colour


def test_the_empty_queues_message_sits_inside_its_panel_at_both_widths(
    browser: Browser, base_url: str
) -> None:
    """It was pulled 120 px up (over the tiles at 1440 px, under the Throughput chart at 390)."""
    for viewport in (DESKTOP, PHONE):
        with tab(browser, base_url, viewport) as page:
            expect(page.locator("#depth-empty")).to_be_visible()
            empty, panel = _box(page, "#depth-empty"), _box(page, "#p-depth")
            assert _inside(empty, panel), (viewport, empty, panel)
            tiles = _box(page, ".tiles")
            assert empty["y"] > tiles["y"] + tiles["height"], (viewport, empty, tiles)


def test_a_queue_keeps_its_colour_when_other_queues_come_and_go(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task) SELECT q, 't'"
        " FROM unnest(ARRAY['reports', 'webhooks']) q, generate_series(1, 3)"
    )
    _open(page, base_url)
    expect(page.locator("#depth-legend")).to_contain_text("webhooks")
    before = {q: _legend_colour(page, q) for q in ("reports", "webhooks")}
    assert all(before.values()), before
    # A queue that sorts first appears: the others' places in the list move, their colours not.
    conn.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('aardvark', 't')")
    expect(page.locator("#depth-legend")).to_contain_text("aardvark")
    assert {q: _legend_colour(page, q) for q in ("reports", "webhooks")} == before


def test_the_queues_chart_shows_the_real_depth_with_no_worker_running(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    """Jobs wait and no worker ever sampled: the latest figure is the count, and the seconds
    before the dashboard looked are unknown (they were drawn as 0, then a jump)."""
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task) SELECT 'emails', 't' FROM generate_series(1, 5)"
    )
    _open(page, base_url)
    legend = page.locator("#depth-legend")
    expect(legend.locator(".val")).to_have_text(["5"])
    expect(page.locator("#depth-at")).to_have_text("jobs waiting now")
    plot = _box(page, "#chart-depth .u-over")
    page.mouse.move(plot["x"] + plot["width"] * 0.2, plot["y"] + plot["height"] / 2)
    expect(legend.locator(".val")).to_have_text(["\u2013"])  # an en dash: nobody knows, not 0
    expect(page.locator("#depth-at")).to_have_text(re.compile(r"^jobs waiting at \d\d:\d\d:\d\d$"))


def test_hovering_a_chart_shows_the_values_under_the_cursor_with_units(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)  # 60 planted seconds of 10 succeeded + 1 retried, depth samples 3-92 s ago
    _open(page, base_url)
    expect(page.locator("#tp-at")).to_have_text(re.compile(r"^jobs/s at \d\d:\d\d:\d\d$"))
    plot = _box(page, "#chart-throughput .u-over")
    # Two thirds across: about 40 s ago, inside the planted minute.
    page.mouse.move(plot["x"] + plot["width"] * 0.67, plot["y"] + plot["height"] / 2)
    expect(page.locator("#tp-ok")).to_have_text("10.0")
    expect(page.locator("#tp-bad")).to_have_text(re.compile(r"^1\.00$|^2\.00$"))
    depth = _box(page, "#chart-depth .u-over")
    page.mouse.move(depth["x"] + depth["width"] * 0.67, depth["y"] + depth["height"] / 2)
    value = page.locator("#depth-legend .item", has_text="emails").locator(".val")
    expect(value).to_have_text(re.compile(r"^2\d$"))  # planted: 20 + g % 7, plus one retrying
    expect(page.locator("#depth-at")).to_have_text(re.compile(r"^jobs waiting at "))


def _height_above_axis(page: Page, rgb: str) -> float:
    """How high the topmost pixel of a colour is drawn, as a fraction of the plot's height."""
    parts = [int(v) for v in re.findall(r"\d+", rgb)[:3]]
    found: float = page.evaluate(
        """([r, g, b]) => {
            const canvas = document.querySelector("#chart-depth canvas");
            const over = document.querySelector("#chart-depth .u-over").getBoundingClientRect();
            const box = canvas.getBoundingClientRect();
            const ratio = canvas.width / box.width;
            const px = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
            let top = null;
            for (let y = 0; y < canvas.height && top === null; y++) {
                for (let x = 0; x < canvas.width; x++) {
                    const i = (y * canvas.width + x) * 4;
                    if (Math.abs(px[i] - r) < 6 && Math.abs(px[i + 1] - g) < 6 && Math.abs(px[i + 2] - b) < 6 && px[i + 3] > 250) { top = y; break; }
                }
            }
            return top === null ? -1 : (over.bottom - (box.top + top / ratio)) / over.height;
        }""",
        parts,
    )
    return found


def test_a_small_queue_stays_readable_beside_a_big_one(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "INSERT INTO pgqueue_depth (bucket, queue, queued, retrying, running)"
        " SELECT date_trunc('second', now()) - make_interval(secs => g), q, n, 0, 0"
        " FROM generate_series(3, 90) g, (VALUES ('images', 3000), ('emails', 3)) v(q, n)"
    )
    _open(page, base_url)
    expect(page.locator("#depth-legend")).to_contain_text("emails")
    colour = _legend_colour(page, "emails")
    # Flat on the axis under the big queue's line before; now well clear of it (log scale).
    wait_until(lambda: _height_above_axis(page, colour) > 0.1, what="emails is readable")
    expect(page.locator("#depth-scale [data-scale=log]")).to_have_attribute("aria-pressed", "true")
    # The reader can pick the linear scale: the small queue lies on the axis again.
    page.locator("#depth-scale [data-scale=linear]").click()
    expect(page.locator("#depth-scale [data-scale=linear]")).to_have_attribute(
        "aria-pressed", "true"
    )
    wait_until(lambda: 0 <= _height_above_axis(page, colour) < 0.05, what="linear scale")


def test_problems_show_dead_and_retrying_jobs_and_never_cut_a_row(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    """17 dead and 6 retrying: the retrying ones were below the fold of a fixed-height box."""
    plant(conn)  # one dead, one retrying
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, max_attempts, last_error,"
        " finished_at) SELECT 'billing', 'charge', 'dead', 3, 3, 'declined',"
        " now() - make_interval(secs => g) FROM generate_series(1, 16) g"
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, last_error, run_at)"
        " SELECT 'hooks', 'deliver', 'retrying', 2, '503', now() + make_interval(mins => g)"
        " FROM generate_series(1, 5) g"
    )
    _open(page, base_url)
    expect(page.locator("#problem-counts")).to_have_text("· 17 dead · 6 retrying")
    page.locator("#p-problems").scroll_into_view_if_needed()
    cut = page.evaluate(
        """() => {
            const box = document.querySelector("#p-problems .scroll");
            if (box.scrollHeight > box.clientHeight + 1) return "the table scrolls inside its box";
            const panel = document.querySelector("#p-problems").getBoundingClientRect();
            const rows = [...document.querySelectorAll("#problems tr")];
            const out = rows.filter((tr) => { const r = tr.getBoundingClientRect();
                return r.top < panel.top || r.bottom > panel.bottom; });
            return out.length ? out.length + " rows outside the panel" : "";
        }"""
    )
    assert cut == ""
    expect(page.locator("#problems tr[data-job].retrying").first).to_be_in_viewport()
    expect(page.locator("#problems tr.group.dead")).to_have_text("Dead 17")
    expect(page.locator("#problems tr.group.retrying")).to_have_text("Retrying 6")
    # The rest of a group is one click away.
    expect(page.locator("#problems tr[data-job].dead")).to_have_count(5)
    page.locator("#problems tr.more-row", has_text="newest").get_by_role("button").click()
    expect(page.locator("#problems tr[data-job].dead")).to_have_count(17)


def test_the_workers_card_fits_its_workers_and_the_charts_line_up(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)  # two workers
    # Queue names long enough to wrap the Queues legend onto a second line.
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task) SELECT 'a-rather-long-queue-name-' || g, 't'"
        " FROM generate_series(1, 6) g"
    )
    _open(page, base_url)
    expect(page.locator("#workers li")).to_have_count(2)
    expect(page.locator("#depth-legend")).to_contain_text("a-rather-long-queue-name-6")
    panel, last = _box(page, "#p-workers"), _box(page, "#workers li:last-child")
    empty = panel["y"] + panel["height"] - (last["y"] + last["height"])
    assert empty < 40, f"{empty:.0f} px of empty card under the workers"
    wait_until(lambda: page.locator("#chart-depth .u-over").count() == 1)
    tp, depth = _box(page, "#chart-throughput .u-over"), _box(page, "#chart-depth .u-over")
    assert abs(tp["y"] - depth["y"]) <= 1 and abs(tp["height"] - depth["height"]) <= 1, (tp, depth)


def test_at_a_phone_width_nothing_overflows_and_everything_reads(
    browser: Browser, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)
    with tab(browser, base_url, PHONE) as page:
        expect(page.locator("#running tr")).to_have_count(2)
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        # The badge and the read time stay on one line each.
        for selector in ("#badge", "#conn-cost"):
            lines = page.evaluate(
                "(s) => { const n = document.querySelector(s);"
                " return Math.round(n.getBoundingClientRect().height"
                " / parseFloat(getComputedStyle(n).lineHeight || '16')); }",
                selector,
            )
            assert lines <= 1, selector
        # No tile sits alone on a row unless it spans the row.
        tiles = [_box(page, f".tiles > .tile:nth-child({i})") for i in range(1, 8)]
        row_width = _box(page, ".tiles")["width"]
        for top in {round(t["y"]) for t in tiles}:
            row = [t for t in tiles if round(t["y"]) == top]
            assert len(row) > 1 or row[0]["width"] > 0.9 * row_width, row
        # Wide tables say they scroll sideways.
        expect(page.locator("#p-running .scroll-hint")).to_be_visible()
        expect(page.locator("#p-running .scroll")).to_have_attribute("data-more", "right")
        # The diagram keeps a readable size (and scrolls); its text is about 10 px or more.
        svg = _box(page, "#p-how svg")
        assert svg["width"] * 13 / 964 >= 10, svg


LISTS = ("#workers li", "#queues tr", "#running tr", "#problems tr", "#schedules tr", "#feed li")


def test_a_refresh_keeps_the_rows_it_shows_and_changes_only_what_changed(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    """Every refresh rebuilt every list, pulling rows out from under the cursor (a test's click
    on a job link and a measure of the last worker's row were lost that way)."""
    plant(conn)
    _open(page, base_url)
    expect(page.locator("#running tr")).to_have_count(2)
    marked = page.evaluate(
        "(lists) => { let n = 0; for (const s of lists) for (const node of"
        " document.querySelectorAll(s)) { node.__kept = true; n++; } return n; }",
        list(LISTS),
    )
    assert marked >= 12
    before = _refresh(page)
    conn.execute("UPDATE pgqueue_workers SET concurrency = 9 WHERE id = %s", (WORKER_OK,))
    new = conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args, status, attempts, max_attempts, last_error,"
        " finished_at) VALUES ('emails', 'send_email', '{}', 'dead', 5, 5, 'RuntimeError: new',"
        " now()) RETURNING id"
    ).fetchone()
    assert new is not None
    wait_until(lambda: _refresh(page) >= before + 2)
    # The changed worker shows its new figure in the row that was there.
    expect(page.locator("#workers li", has_text="web-1")).to_contain_text("/ 9 leases")
    expect(page.locator("#problems tr[data-job].dead")).to_have_count(2)
    fresh = page.evaluate(
        "(lists) => lists.flatMap((s) => [...document.querySelectorAll(s)]"
        ".filter((n) => !n.__kept).map((n) => s + ': ' + n.textContent.slice(0, 60)))",
        list(LISTS),
    )
    # Only what tells of the new job is new: its Problems row and its events in the feed.
    assert fresh and all(f"#{new[0]}" in node for node in fresh), fresh
    assert any(node.startswith("#problems") for node in fresh), fresh


def test_a_click_on_a_job_link_survives_a_refresh_between_press_and_release(
    page: Page, base_url: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)
    _open(page, base_url)
    link = page.locator("#running a.job-link").first
    expect(link).to_be_visible()
    href = link.get_attribute("href")
    link.scroll_into_view_if_needed()
    box = link.bounding_box()
    assert box is not None and href
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    before = _refresh(page)
    wait_until(lambda: _refresh(page) > before)
    page.mouse.up()
    page.wait_for_url("**/" + href)
