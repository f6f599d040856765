"""Regenerate the README's dashboard screenshot from a live system: ``make screenshot``.

It is ``pgqueue demo`` with a camera: a throwaway PostgreSQL (or ``--dsn``), the demo's tasks
and producers (``pgqueue.demo``), ``pgqueue worker`` processes and the dashboard. One more worker
serves the slow queue and is frozen with SIGSTOP shortly before the end, as a stuck process would
be: its heartbeat goes late and its leases run down while the others carry on. After
``--seconds`` (enough to fill the two-minute charts) headless Chromium takes the picture.
Nothing in it is planted: every figure is what the dashboard read at that moment.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/img/dashboard.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import uvicorn
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import Page, async_playwright, expect
from psycopg import conninfo, sql

from pgqueue.dashboard.app import create_app
from pgqueue.demo import tasks
from pgqueue.demo.runner import TASKS_APP, produce
from pgqueue.embedded import EmbeddedPostgres, free_port

CHROMIUM = os.environ.get("PGQUEUE_CHROMIUM", "/usr/bin/chromium")
ROOT = Path(__file__).resolve().parent.parent
#: How long the frozen worker has been silent in the picture (late after 15 s, lease 30 s).
STALL_SECONDS = 22.0
WORKERS = [
    ["--concurrency", "8"],
    ["--concurrency", "8"],
    ["--concurrency", "4", "--queues", "images,reports"],
    ["--concurrency", "4", "--queues", "images"],  # the one that gets frozen
]


@contextlib.contextmanager
def workers(dsn: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Real ``pgqueue worker`` processes, as in production (each its own pid and heartbeat)."""
    env = {**os.environ, "PGQUEUE_DSN": dsn, "PGQUEUE_DEMO_SCHEMA": "public"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pgqueue.cli",
                "worker",
                "--app",
                TASKS_APP,
                "--log-level",
                "ERROR",
                "--grace-period",
                "2",
                *spec,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for spec in WORKERS
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


async def main(
    dsn: str, seconds: float, out: Path, width: int, height: int, full_page: bool
) -> None:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(select_only_dsn(dsn)), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    serving = asyncio.create_task(server.serve())
    stop = asyncio.Event()
    producer = asyncio.create_task(produce(tasks, stop))
    try:
        with workers(dsn) as procs:
            print(f"running {len(procs)} workers and the demo's producers for {seconds:.0f} s")
            await asyncio.sleep(max(seconds - STALL_SECONDS, 0))
            await freeze_while_busy(dsn, procs[-1])
            await asyncio.sleep(min(STALL_SECONDS, seconds))
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a worker exited early: run `pgqueue demo` to see why")
            await screenshot(f"http://127.0.0.1:{port}/", out, width, height, full_page)
        print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
    finally:
        stop.set()
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await producer
        server.should_exit = True
        await serving
        await tasks.app.aclose()


def select_only_dsn(dsn: str) -> str:
    """The dashboard as docs/dashboard.md recommends: a role with SELECT only (else the page
    rightly warns that its role can write). Falls back to ``dsn`` where roles cannot be made."""
    role = "pgqueue_dashboard_screenshot"
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in (
                "DROP ROLE IF EXISTS {role}",
                "CREATE ROLE {role} LOGIN",
                "GRANT USAGE ON SCHEMA public TO {role}",
                "GRANT SELECT ON pgqueue_jobs, pgqueue_workers, pgqueue_schedules, pgqueue_stats,"
                " pgqueue_depth, pgqueue_queues, pgqueue_job_deps TO {role}",
            ):
                conn.execute(sql.SQL(statement).format(role=sql.Identifier(role)))
    except psycopg.Error as exc:
        print(f"dashboard as the given role ({exc.diag.message_primary or exc})")
        return dsn
    return conninfo.make_conninfo(dsn, user=role)


async def freeze_while_busy(dsn: str, proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP the worker once it holds a lease (waiting at most 20 s), so the picture shows
    leases running down under a late heartbeat."""
    deadline = time.monotonic() + 20
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            cur = await conn.execute(
                "SELECT count(*) FROM pgqueue_jobs j JOIN pgqueue_workers w ON w.id = j.worker_id"
                " WHERE w.pid = %s AND j.status = 'running'",
                (proc.pid,),
            )
            row = await cur.fetchone()
            if row and row[0]:
                break
            await asyncio.sleep(0.2)
    os.kill(proc.pid, signal.SIGSTOP)


async def screenshot(url: str, out: Path, width: int, height: int, full_page: bool) -> None:
    """Every wait is on something the page shows, with a deadline: never a fixed sleep."""
    async with async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        page = await browser.new_page(viewport={"width": width, "height": height})
        page.set_default_timeout(60_000)  # a loaded machine: four workers and producers run
        expect.set_options(timeout=60_000)
        await page.goto(url)
        await page.locator("#conn[data-state='live']").wait_for()
        first = int(await page.locator("body").get_attribute("data-refresh") or 0)
        # Two more pushes after the first: the feed's "new" flashes are over and the charts
        # have their data.
        for selector in ("#chart-throughput canvas", "#chart-depth canvas", "#workers li.late",
                         "#feed li:not(.empty)", "#problems tr[data-job]"):  # fmt: skip
            await page.locator(selector).first.wait_for()
        await page.locator(
            f"body:not([data-refresh='{first}']):not([data-refresh='{first + 1}'])"
        ).wait_for()
        await open_a_clean_error(page)
        await page.evaluate("window.scrollTo(0, 0)")
        await page.screenshot(path=str(out), full_page=full_page)
        await browser.close()


async def open_a_clean_error(page: Page) -> None:
    """Open one problem's whole error, to show it is readable: the first that names no file
    of this machine (a traceback would show a developer's paths), else none."""
    # Rows are rebuilt at every push and new problems come first: each job by its id.
    jobs = await page.locator("#problems tr[data-job]").evaluate_all(
        "(rows) => rows.map((row) => row.dataset.job)"
    )
    for job in jobs:
        row = page.locator(f"#problems tr[data-job='{job}']")
        pre = row.locator("details[open] pre")
        try:  # a row can leave the list meanwhile (newer problems push it out): the next one
            await row.locator("details summary").click(timeout=10_000)
            await pre.wait_for(timeout=10_000)
            await expect(pre).not_to_have_text(re.compile(r"^$|^loading…$"), timeout=10_000)
            if 'File "' not in await pre.inner_text(timeout=10_000):
                await pre.scroll_into_view_if_needed(timeout=10_000)
                return
            await row.locator("details summary").click(timeout=10_000)
            await row.locator("details:not([open])").wait_for(timeout=10_000)
        except PlaywrightError:
            continue


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="an empty database to use (default: a throwaway cluster)")
    parser.add_argument("--seconds", type=float, default=125.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--height", type=int, default=1800)
    parser.add_argument("--full-page", action="store_true", help="the whole page, not the top")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cluster = None if args.dsn else EmbeddedPostgres().start()
    try:
        dsn = args.dsn or (cluster.dsn if cluster else "")
        tasks.app.dsn = dsn
        tasks.app.migrate()
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(main(dsn, args.seconds, args.out, args.width, args.height, args.full_page))
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    cli()
