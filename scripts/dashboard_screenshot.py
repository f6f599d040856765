"""Regenerate the README's dashboard screenshot from a live system: ``make screenshot``.

Starts a throwaway PostgreSQL (or uses ``--dsn``), four ``pgqueue worker`` processes, producers
with a changing rate and a few failure modes, and the dashboard; one worker is frozen with
SIGSTOP shortly before the end, so its heartbeat is late and its leases run down. After
``--seconds`` (enough to fill the two-minute charts) headless Chromium takes the screenshot.
Nothing in the picture is planted: every figure is what the dashboard read at that moment.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/img/dashboard.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import uvicorn
from playwright.async_api import async_playwright

import pgqueue
from pgqueue.dashboard.app import create_app
from pgqueue.embedded import EmbeddedPostgres, free_port

CHROMIUM = os.environ.get("PGQUEUE_CHROMIUM", "/usr/bin/chromium")
ROOT = Path(__file__).resolve().parent.parent
APP_SPEC = "scripts.dashboard_screenshot:app"
STALL_SECONDS = 22.0

app = pgqueue.App("postgresql://configured-in-main")


@app.task(queue="emails")
async def send_email(to: str, template: str) -> None:
    await asyncio.sleep(random.uniform(0.02, 0.25))
    if random.random() < 0.02:
        raise ConnectionResetError(f"SMTP connection to mx.{to.split('@')[1]} reset by peer")


@app.task(queue="reports", max_attempts=3, timeout=60)
def build_report(account: int, month: str) -> dict[str, int]:
    time.sleep(random.uniform(1.5, 9.0))
    return {"rows": query_warehouse(account, month)}


def query_warehouse(account: int, month: str) -> int:
    if random.random() < 0.3:
        raise RuntimeError(f"warehouse query for {month} timed out after 30 s (account {account})")
    return account * 17


@app.task(queue="billing", max_attempts=4)
async def charge_card(invoice: str, cents: int) -> None:
    await asyncio.sleep(random.uniform(0.05, 0.4))
    if cents % 97 == 0:
        raise pgqueue.Fail(f"card declined for invoice {invoice}: insufficient funds")
    if random.random() < 0.08:
        raise pgqueue.Retry(after=20, reason="payment provider rate limit (429)")


@app.task(queue="webhooks", max_attempts=5)
async def deliver_webhook(url: str, event: str) -> None:
    await asyncio.sleep(random.uniform(0.03, 0.3))
    if "partner-b" in url and random.random() < 0.3:
        raise TimeoutError(f"POST {url} did not answer within 10 s")


@app.periodic(cron="*/10 * * * * *", name="sync-inventory")
@app.task(queue="maintenance")
async def sync_inventory() -> None:
    await asyncio.sleep(0.3)


@app.periodic(cron="*/5 * * * *", name="expire-sessions")
@app.task(queue="maintenance")
def expire_sessions() -> None:
    time.sleep(0.1)


@app.periodic(cron="0 3 * * *", name="nightly-digest")
@app.task(queue="emails")
async def nightly_digest() -> None:
    await asyncio.sleep(0.1)


async def produce(started: float) -> None:
    """A daily-looking rhythm in two minutes: a swell of traffic and one bulk import."""
    accounts = iter(range(1000, 10_000))
    burst_done = False
    while True:
        t = time.monotonic() - started
        swell = 1.0 + 0.8 * math.sin(t / 14.0)
        for _ in range(max(1, round(6 * swell))):
            await send_email.enqueue_async(
                to=f"user{random.randint(1, 9999)}@example.{random.choice(['com', 'org'])}",
                template=random.choice(["welcome", "receipt", "password-reset"]),
            )
        if random.random() < 0.5 * swell:
            await charge_card.enqueue_async(
                invoice=f"INV-{random.randint(10_000, 99_999)}", cents=random.randint(100, 9_999)
            )
        for _ in range(random.randint(1, 3)):
            partner = random.choice(["partner-a", "partner-b", "partner-c"])
            await deliver_webhook.enqueue_async(
                url=f"https://{partner}.example.net/hooks", event="order.paid"
            )
        if random.random() < 0.15:
            await build_report.enqueue_async(account=next(accounts), month="2025-11")
        if not burst_done and t > 45:
            burst_done = True
            await app.enqueue_many_async(
                [
                    ("send_email", {"to": f"list{i}@example.com", "template": "newsletter"})
                    for i in range(900)
                ]
            )
        await asyncio.sleep(0.25)


@contextlib.contextmanager
def workers(dsn: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Real ``pgqueue worker`` processes, as in production (each its own pid and heartbeat)."""
    specs = [
        ["--concurrency", "12"],
        ["--concurrency", "8", "--queues", "emails,webhooks,billing"],
        ["--concurrency", "4", "--queues", "reports,maintenance"],
        ["--concurrency", "4", "--queues", "reports"],  # the one that stalls
    ]
    env = {**os.environ, "PGQUEUE_DSN": dsn, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pgqueue.cli",
                "worker",
                "--app",
                APP_SPEC,
                "--log-level",
                "ERROR",
                "--grace-period",
                "2",
                *spec,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for spec in specs
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
        uvicorn.Config(create_app(dsn), host="127.0.0.1", port=port, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    producer = asyncio.create_task(produce(time.monotonic()))
    try:
        with workers(dsn) as procs:
            print(f"running 4 workers and producers for {seconds:.0f} s (charts cover two minutes)")
            # One worker is frozen (SIGSTOP) near the end, as a stuck process would be: its
            # heartbeat goes late and its leases count down while the others carry on.
            await asyncio.sleep(max(seconds - STALL_SECONDS, 0))
            await freeze_while_busy(dsn, procs[-1])
            await asyncio.sleep(min(STALL_SECONDS, seconds))
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a worker exited early: run it by hand to see why")
            await screenshot(f"http://127.0.0.1:{port}/", out, width, height, full_page)
        print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
    finally:
        producer.cancel()
        server.should_exit = True
        await serving
        await app.aclose()


async def freeze_while_busy(dsn: str, proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP the worker once it holds a lease (at most 20 s later), so the picture shows
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
    async with async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        page = await browser.new_page(viewport={"width": width, "height": height})
        await page.goto(url)
        await page.locator("#conn[data-state='live']").wait_for(timeout=20_000)
        await page.wait_for_timeout(1500)  # a couple of pushes: the feed and charts settle
        # An open error shows that a job's whole traceback is readable.
        summary = page.locator("#problems details summary", has_text="RuntimeError").first
        if await summary.count():
            await summary.click()
            await page.locator("#problems details[open] pre").first.wait_for()
        await page.evaluate("window.scrollTo(0, 0)")
        await page.screenshot(path=str(out), full_page=full_page)
        await browser.close()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a database to use (default: a throwaway cluster)")
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
        app.dsn = dsn
        app.migrate()
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(main(dsn, args.seconds, args.out, args.width, args.height, args.full_page))
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    cli()
