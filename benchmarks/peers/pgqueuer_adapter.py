"""PgQueuer under `pgqueue bench` (runs in the peers' venv; see pgqueue/bench/driver.py).

Set up as its documentation recommends for throughput: asyncpg, `pgq autovac` settings (applied
after install), its default durable tables, uvloop as its own CLI and benchmark use. The batch size
comes from the runner's config (10 is PgQueuer's default; the runner also tries 100).

PgQueuer cannot switch LISTEN off, so its polling path listens on a channel nobody notifies:
jobs are then found only by its `dequeue_timeout` poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from datetime import timedelta

import asyncpg
import pgqueue_bench_driver as driver
import uvloop
from pgqueuer import AsyncpgDriver, AsyncpgPoolDriver, PgQueuer, Queries
from pgqueuer import __version__ as version
from pgqueuer.models import Channel, Job

FILL_FINISHED = """
INSERT INTO pgqueuer_log (created, job_id, status, priority, entrypoint, aggregated)
SELECT now() - interval '1 hour', g, 'successful', 0, 'noop', true
FROM generate_series(1, $1::int) AS g
"""


class PgQueuerAdapter:
    name = "pgqueuer"
    version = version
    # Finished jobs leave the table (their history goes to pgqueuer_log).
    remaining_sql = "SELECT count(*) FROM pgqueuer"

    async def open(self, dsn: str) -> None:
        self.dsn = dsn
        self.pool = await asyncpg.create_pool(dsn, min_size=1, max_size=8)
        self.queries = Queries(AsyncpgPoolDriver(self.pool))
        self.connection = None
        if os.environ.get("PGQUEUER_BENCH_ONE_CONNECTION") == "1":
            # As its README enqueues: Queries over one connection (AsyncpgDriver).
            self.connection = await asyncpg.connect(dsn)
            self.queries = Queries(AsyncpgDriver(self.connection))

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()
        await self.pool.close()

    async def install(self) -> None:
        await self.queries.install()
        await self.queries.optimize_autovacuum()

    async def enqueue_one(self, seq: int) -> None:
        await self.queries.enqueue("noop", str(seq).encode(), 0)

    async def enqueue_many(self, seqs: range) -> None:
        await self.queries.enqueue(
            ["noop"] * len(seqs), [str(s).encode() for s in seqs], [0] * len(seqs)
        )

    async def fill_finished(self, count: int) -> None:
        await self.pool.execute(FILL_FINISHED, count)

    async def work(self, options: driver.WorkOptions, on_start) -> None:  # type: ignore[no-untyped-def]
        connection = await asyncpg.connect(self.dsn)
        channel = None if options.listen else Channel("pgqueue_bench_no_notifications")
        pgq = PgQueuer.from_asyncpg_connection(connection, channel=channel)
        sleep = options.sleep

        @pgq.entrypoint("noop")
        async def noop(job: Job) -> None:
            on_start(int(job.payload or b"0"))
            if sleep:
                await asyncio.sleep(sleep)

        # PgQueuer requires max_concurrent_tasks >= 2 x batch size.
        batch = min(int(options.config.get("batch_size", 10)), max(options.concurrency // 2, 1))
        running = asyncio.create_task(
            pgq.run(
                batch_size=batch,
                max_concurrent_tasks=options.concurrency,
                dequeue_timeout=timedelta(seconds=options.poll),
            )
        )
        await options.stop.wait()
        pgq.shutdown.set()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await connection.close()


if __name__ == "__main__":
    driver.main(PgQueuerAdapter(), uvloop.run)
