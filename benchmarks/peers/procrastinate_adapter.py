"""Procrastinate under `pgqueue bench` (runs in the peers' venv; see pgqueue/bench/driver.py).

Its own connector (psycopg 3 pool), its schema as `apply_schema_async` creates it, an async task,
and a worker with the given concurrency. For the steady-state run it deletes succeeded jobs
(`delete_jobs="successful"`), its documented way to keep the table small.
"""

from __future__ import annotations

import asyncio
import contextlib
from importlib import metadata

import pgqueue_bench_driver as driver
from procrastinate import App, PsycopgConnector

FILL_FINISHED = """
INSERT INTO procrastinate_jobs (queue_name, task_name, args, status, attempts)
SELECT 'default', 'noop', jsonb_build_object('seq', -g), 'succeeded', 1
FROM generate_series(1, %(count)s) AS g
"""


class ProcrastinateAdapter:
    name = "procrastinate"
    version = metadata.version("procrastinate")
    remaining_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"

    def __init__(self) -> None:
        self.on_start = lambda seq: None
        self.sleep = 0.0

    async def open(self, dsn: str) -> None:
        self.app = App(connector=PsycopgConnector(conninfo=dsn, min_size=1, max_size=8))

        @self.app.task(name="noop")
        async def noop(seq: int) -> None:
            self.on_start(seq)
            if self.sleep:
                await asyncio.sleep(self.sleep)

        self.noop = noop
        await self.app.open_async()

    async def close(self) -> None:
        await self.app.close_async()

    async def install(self) -> None:
        await self.app.schema_manager.apply_schema_async()

    async def enqueue_one(self, seq: int) -> None:
        await self.noop.defer_async(seq=seq)

    async def enqueue_many(self, seqs: range) -> None:
        await self.noop.batch_defer_async(*({"seq": s} for s in seqs))

    async def fill_finished(self, count: int) -> None:
        await self.app.connector.execute_query_async(FILL_FINISHED, count=count)

    async def work(self, options: driver.WorkOptions, on_start) -> None:  # type: ignore[no-untyped-def]
        self.on_start = on_start
        self.sleep = options.sleep
        running = asyncio.create_task(
            self.app.run_worker_async(
                concurrency=options.concurrency,
                wait=True,
                listen_notify=options.listen,
                fetch_job_polling_interval=options.poll,
                install_signal_handlers=False,
                delete_jobs="successful" if options.config.get("keep_small") else "never",
            )
        )
        await options.stop.wait()
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


if __name__ == "__main__":
    driver.main(ProcrastinateAdapter())
