"""pgqueue under ``pgqueue bench``: the library calls behind each role of ``driver``.

Run as ``python -m pgqueue.bench.adapter ROLE ...``. Only public API is used (``App``,
``enqueue_async``, ``enqueue_many_async``, ``worker``), with the worker's defaults unless the
runner's ``--config`` says otherwise; the depth fill alone writes rows directly, as there is no
API to create a million finished jobs.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import psycopg

import pgqueue

from . import driver

# Finished rows as the worker leaves them: succeeded, lease cleared, finished a while ago (but
# inside the default retention, so pruning does not remove them during the run).
FILL_FINISHED = """
INSERT INTO pgqueue_jobs (queue, task, args, status, attempts, run_at, created_at,
                          claimed_at, started_at, finished_at)
SELECT 'default', 'noop', jsonb_build_object('seq', -g), 'succeeded', 1,
       now() - interval '1 hour', now() - interval '1 hour', now() - interval '1 hour',
       now() - interval '1 hour', now() - interval '1 hour' + g * interval '1 ms'
FROM generate_series(1, %(count)s) AS g
"""


#: The task of the "limits" workload's per-key drain: the no-op task, one job per key at a time
#: over ``LIMIT_KEYS`` keys (``seq`` modulo the count, so consecutive jobs have different keys).
#: Its workers declare it when their ``--config`` says ``limit_keys``; the runner enqueues its
#: jobs through an ``App`` that declares it the same way (``declare_keyed``).
KEYED_TASK = "noop_keyed"
LIMIT_KEYS = 1_000


def limit_key(args: Mapping[str, Any]) -> object:
    return int(args["seq"]) % LIMIT_KEYS


def declare_keyed(app: pgqueue.App, run: Callable[[int], Awaitable[None]]) -> None:
    @app.task(name=KEYED_TASK, limit=1, limit_key=limit_key)
    async def noop_keyed(seq: int) -> None:
        await run(seq)


class PgqueueAdapter:
    name = "pgqueue"
    version = pgqueue.__version__
    # Each count matches a partial index's predicate: cheap however many finished rows exist.
    remaining_sql = (
        "SELECT (SELECT count(*) FROM pgqueue_jobs WHERE status IN ('queued', 'retrying'))"
        " + (SELECT count(*) FROM pgqueue_jobs WHERE status = 'running')"
    )

    def __init__(self) -> None:
        self.app = pgqueue.App()
        self.on_start: Callable[[int], None] = lambda seq: None
        self.sleep = 0.0

        # The "unique jobs" variant: the same jobs, each with a key of its own (never a duplicate).
        unique = os.environ.get("PGQUEUE_BENCH_UNIQUE") == "1"

        @self.app.task(unique=True if unique else None)
        async def noop(seq: int) -> None:
            await self.run(seq)

        self.noop = noop

    async def run(self, seq: int) -> None:
        self.on_start(seq)
        if self.sleep:
            await asyncio.sleep(self.sleep)

    async def open(self, dsn: str) -> None:
        self.app.dsn = dsn

    async def close(self) -> None:
        await self.app.aclose()
        self.app.close()

    async def install(self) -> None:
        self.app.migrate()

    async def enqueue_one(self, seq: int) -> None:
        await self.noop.enqueue_async(seq=seq)

    async def enqueue_many(self, seqs: range) -> None:
        await self.app.enqueue_many_async([("noop", {"seq": seq}) for seq in seqs])

    async def fill_finished(self, count: int) -> None:
        async with await psycopg.AsyncConnection.connect(self.app.dsn, autocommit=True) as conn:
            await conn.execute(FILL_FINISHED, {"count": count})

    async def work(self, options: driver.WorkOptions, on_start: Callable[[int], None]) -> None:
        if os.environ.get("PGQUEUE_BENCH_FROM_START") == "1":
            # The "claims from the start" variant: never start where the last claim ended.
            from ..worker import fetcher

            fetcher.SLOW_CLAIM = float("inf")
        self.on_start = on_start
        self.sleep = options.sleep
        config: dict[str, Any] = {
            "concurrency": options.concurrency,
            "listen": options.listen,
            "poll_interval": options.poll,
            "install_signal_handlers": False,
        }
        if options.config.get("keep_small"):
            config["retention"] = 10.0  # succeeded jobs are pruned after 10 s
        if options.config.get("limit_keys"):
            declare_keyed(self.app, self.run)
        worker = self.app.worker(**config)
        running = asyncio.create_task(worker.run())
        stop = asyncio.create_task(options.stop.wait())
        await asyncio.wait({running, stop}, return_when=asyncio.FIRST_COMPLETED)
        worker.stop()
        await running
        stop.cancel()


def _run(main: Any) -> Any:
    """The loop ``pgqueue worker`` uses (uvloop when installed)."""
    from ..worker.runtime import loop_factory

    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        return runner.run(main)


if __name__ == "__main__":
    driver.main(PgqueueAdapter(), _run)
