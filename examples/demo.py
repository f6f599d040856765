"""`make demo`: a throwaway PostgreSQL (or $PGQUEUE_DSN), demo tasks, producers and a worker,
with a live status line. Ctrl-C stops everything and removes the throwaway database."""

from __future__ import annotations

import asyncio
import os
import random

import pgqueue
from pgqueue.embedded import EmbeddedPostgres

app = pgqueue.App(os.environ.get("PGQUEUE_DSN") or "postgresql://unused", schema="public")


@app.task(queue="emails")
async def send_email(to: str) -> None:
    await asyncio.sleep(random.uniform(0.01, 0.2))


@app.task(queue="reports", max_attempts=3)
def build_report(n: int) -> int:
    if random.random() < 0.3:
        raise RuntimeError("upstream timed out")
    return n * 2


@app.task(queue="billing")
async def charge(amount: int) -> None:
    if amount > 90:
        raise pgqueue.Fail("card declined")
    if amount > 80:
        raise pgqueue.Retry(after=5, reason="rate limited")


@app.periodic(cron="*/5 * * * * *", name="heartbeat-report")
@app.task(queue="maintenance")
def tick() -> None:
    pass


async def produce() -> None:
    while True:
        await send_email.enqueue_async(to=f"user{random.randint(1, 999)}@example.com")
        await build_report.enqueue_async(n=random.randint(1, 100))
        await charge.enqueue_async(amount=random.randint(1, 100))
        await asyncio.sleep(0.2)


async def main() -> None:
    worker = app.worker(concurrency=20)
    producer = asyncio.create_task(produce())
    run = asyncio.create_task(worker.run())

    async def status() -> None:
        while True:
            await asyncio.sleep(1)
            c = worker.state.counters if worker.state else None
            if c:
                print(
                    f"\rclaimed {c.claimed}  succeeded {c.succeeded}  retried {c.retried}  "
                    f"dead {c.dead}  (Ctrl-C to stop)",
                    end="",
                    flush=True,
                )

    reporter = asyncio.create_task(status())
    try:
        await run
    finally:
        producer.cancel()
        reporter.cancel()
        await app.aclose()


if __name__ == "__main__":
    cluster = None
    if not os.environ.get("PGQUEUE_DSN"):
        cluster = EmbeddedPostgres().start()
        app.dsn = cluster.dsn
        print(f"started a throwaway PostgreSQL at {cluster.dsn}")
    try:
        app.migrate()
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        print("\nstopped")
        if cluster is not None:
            cluster.stop()
