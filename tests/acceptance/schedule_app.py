"""The app that the schedule acceptance tests run as `pgqueue worker --app ...` subprocesses.

``PGQUEUE_TEST_CLOCK_OFFSET`` (seconds) skews this process's wall clock (``time.time`` and
``datetime.datetime.now``), as a worker on a badly synced host would see it;
``PGQUEUE_TEST_MISSED`` picks the missed-tick policy of the per-second schedule.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os
import time
from typing import Any

from psycopg_pool import AsyncConnectionPool

import pgqueue
from pgqueue.worker.runtime import Worker
from pgqueue.worker.scheduler import Scheduler

_OFFSET = float(os.environ.get("PGQUEUE_TEST_CLOCK_OFFSET", "0"))
if _OFFSET:
    _real_time = time.time

    def _skewed_time() -> float:
        return _real_time() + _OFFSET

    class _SkewedDatetime(_dt.datetime):
        @classmethod
        def now(cls, tz: _dt.tzinfo | None = None) -> _SkewedDatetime:
            return cls.fromtimestamp(_skewed_time(), tz)

    time.time = _skewed_time
    _dt.datetime = _SkewedDatetime  # type: ignore[misc]


class _SchedulingWorker(Worker):
    """Runs the scheduler beside the worker until the runtime wires it in itself (a second
    scheduler in one process is harmless: exactly-once does not depend on how many run)."""

    async def run(self) -> None:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            self.app.dsn, min_size=1, max_size=2, open=False, kwargs={"autocommit": True}
        )
        await pool.open()
        stop = asyncio.Event()
        scheduler = asyncio.create_task(Scheduler(self.app, interval=0.5).run(pool, stop))
        try:
            await super().run()
        finally:
            stop.set()
            await asyncio.wait_for(scheduler, 5)
            await pool.close()


class _App(pgqueue.App):
    def worker(self, **options: Any) -> Worker:
        return _SchedulingWorker(self, **options)


app = _App()


@app.periodic(
    cron="* * * * * *",
    name="every-second",
    missed="all" if os.environ.get("PGQUEUE_TEST_MISSED") == "all" else "latest",
    max_catchup=5,
)
@app.task
def beat() -> None:
    """Does nothing: the tests count the jobs, not their effects."""
