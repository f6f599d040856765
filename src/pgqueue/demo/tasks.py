"""The demo's tasks: one of each thing the dashboard shows.

Worker processes load this module with ``--app pgqueue.demo.tasks:app``. Delays are short and
the backoff is fast so that retries, dead jobs and the schedule all show up within a minute;
a real app would keep the defaults (1 s base, 1 h cap).
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pgqueue

#: The demo's own schema when it runs in a database you gave it (see ``runner``).
SCHEMA = os.environ.get("PGQUEUE_DEMO_SCHEMA", "public")

app = pgqueue.App(schema=SCHEMA, backoff=pgqueue.Backoff(base=0.5, cap=8.0))


@app.task(queue="emails")
async def send_email(to: str, template: str) -> None:
    """Fast and async: tens of milliseconds. Password resets are enqueued with a higher
    priority than newsletters, so they overtake a newsletter backlog."""
    await asyncio.sleep(random.uniform(0.01, 0.12))


@app.task(queue="images", timeout=60)
def resize_image(image_id: int, sizes: list[int]) -> dict[str, int]:
    """Slow and sync (runs in the worker's thread pool): one to four seconds."""
    time.sleep(random.uniform(1.0, 4.0))
    return {"image_id": image_id, "variants": len(sizes)}


@app.task(queue="reports", max_attempts=4)
def build_report(report_id: int) -> int:
    """Fails a third of the time with an ordinary exception: retried with backoff, and dead
    after four failed attempts (about one report in eighty)."""
    time.sleep(random.uniform(0.05, 0.3))
    if random.random() < 0.33:
        raise TimeoutError(f"warehouse query for report {report_id} timed out")
    return report_id


@app.task(queue="webhooks", max_attempts=5)
async def deliver_webhook(ctx: pgqueue.JobContext, url: str) -> None:
    """The partner answers 429 to every other first attempt: ``Retry`` asks for exactly the
    delay its Retry-After header gave, instead of the backoff formula."""
    await asyncio.sleep(random.uniform(0.02, 0.1))
    if ctx.attempt == 1 and random.random() < 0.5:
        raise pgqueue.Retry(after=3, reason=f"429 Too Many Requests from {url}: Retry-After 3")


@app.task(queue="billing", priority=5, max_attempts=3)
async def charge_card(order_id: int, amount_cents: int) -> None:
    """A declined card is not worth retrying: ``Fail`` sends the job straight to dead."""
    await asyncio.sleep(random.uniform(0.05, 0.2))
    if amount_cents % 7 == 0:
        raise pgqueue.Fail(f"card declined for order {order_id} (do not retry)")


@app.periodic(cron="*/10 * * * * *", name="purge-expired-sessions")
@app.task(queue="maintenance")
def purge_expired_sessions() -> int:
    """A periodic schedule: every ten seconds (a leading seconds field), exactly once per tick
    however many workers run."""
    time.sleep(0.05)
    return random.randint(0, 40)
