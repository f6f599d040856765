"""``run_until_idle``: a real worker, in-process, until nothing is left to do.

The worker is the normal runtime (claims with leases, the heartbeat, the batched fenced acks,
workflows' releases, the scheduler), so what a test sees is what production does. It is idle
when the database has no running job and no due waiting job in the served queues *and* the
worker holds no job: the database is asked first, then the worker, so an ack that committed
between the two is still in the worker's hands and keeps the drain going until it was recorded.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg

from .. import db
from ..errors import PgQueueError
from ..jobs import Status
from ..sql import named
from .runs import Run, Runs

if TYPE_CHECKING:
    from ..app import App
    from ..worker.executor import Outcome
    from ..worker.runtime import Worker
    from ..worker.state import ClaimedJob

#: How often the drain looks whether the worker is idle (seconds).
CHECK_INTERVAL = 0.02
#: Pending jobs named in a NotIdleError's message.
SHOWN = 10


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A job that kept ``run_until_idle`` from being idle."""

    id: int
    task: str
    queue: str
    status: Status
    attempts: int
    run_at: datetime

    def __str__(self) -> str:
        return f"#{self.id} {self.task} (queue {self.queue!r}, {self.status}, attempts {self.attempts})"


class NotIdleError(PgQueueError, TimeoutError):
    """``run_until_idle`` ran out of time: ``pending`` holds jobs still running or due (the
    first few), ``runs`` what ran before the worker was stopped."""

    def __init__(self, message: str, pending: list[PendingJob], runs: Runs) -> None:
        super().__init__(message)
        self.pending = pending
        self.runs = runs


def run_until_idle(
    app: App,
    queues: list[str] | None = None,
    *,
    timeout: float = 30.0,
    retries: bool = True,
    **worker_options: Any,
) -> Runs:
    """Run a real worker for ``app`` in this thread until no job of ``queues`` (default: every
    queue) is running or due, then stop it; returns every attempt that ended, in order.

    ``retries=True`` (the default) makes a failed attempt's retry due at once instead of after
    its backoff, so each job ends ``succeeded``, ``dead`` or ``cancelled``, however the backoff's
    jitter fell; with False a retry runs in this drain only if it comes due before the drain
    ends (so a failing job may show one attempt or more). Jobs enqueued with a later ``run_at``
    (``delay=``) are not due, and jobs of paused queues are left waiting.

    The worker runs one job at a time (``concurrency=1``: the runs come in claim order) unless
    ``worker_options`` say otherwise; they are ``app.worker``'s. Raises ``NotIdleError`` after
    ``timeout`` seconds, naming what was still pending (the worker is stopped at once then:
    running async handlers are cancelled, sync ones abandoned in their threads).

    From async code (a running event loop), ``await run_until_idle_async(...)`` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "run_until_idle() blocks, and this thread runs an event loop: "
            "use `await run_until_idle_async(...)`"
        )
    with asyncio.Runner() as runner:
        return runner.run(
            run_until_idle_async(app, queues, timeout=timeout, retries=retries, **worker_options)
        )


async def run_until_idle_async(
    app: App,
    queues: list[str] | None = None,
    *,
    timeout: float = 30.0,
    retries: bool = True,
    **worker_options: Any,
) -> Runs:
    """``run_until_idle`` for async code: the worker runs on the caller's event loop."""
    worker_options.setdefault("install_signal_handlers", False)
    worker_options.setdefault("concurrency", 1)
    # NOTIFY wakes the worker; the poll is the fallback, kept short as a test's jobs are few.
    worker_options.setdefault("poll_interval", 0.1)
    worker = app.worker(queues=queues, **worker_options)
    recorded: list[tuple[ClaimedJob, Outcome]] = []
    worker.on_outcome = lambda job, outcome: recorded.append((job, outcome))
    deadline = time.monotonic() + timeout
    running = asyncio.create_task(worker.run(), name="pgqueue-testing-worker")
    statements = named("pgqueue.testing", "testing.sql", app.schema)
    served = None if worker.queues is None else list(worker.queues)
    pending: tuple[list[PendingJob], int] = ([], 0)
    # The worker's cluster: with routes, that of its queues (pgqueue.routing).
    app = worker.app
    try:
        conn = await db.connect_async(app.dsn, **app.connect_options)
        async with conn:
            while not worker.started.is_set() and time.monotonic() <= deadline:
                if running.done():
                    running.result()  # the worker could not start: its error
                await asyncio.sleep(CHECK_INTERVAL)
            while time.monotonic() <= deadline:
                if running.done():
                    running.result()  # the worker stopped on its own: its error
                # Pending first, then the retries made due, then the worker's hands: an ack
                # that commits a retry between any two of these is caught by the next one (a
                # retry skipped after the look at pending jobs keeps the drain going).
                pending = await _pending(conn, statements["pending_jobs"], served, retries)
                skipped = False
                if retries:
                    cur = await conn.execute(statements["skip_retry_delays"], {"queues": served})
                    if await cur.fetchall():
                        skipped = True
                        worker.fetcher.notify()
                state = worker.state
                idle = not pending[1] and not skipped
                if idle and worker.started.is_set() and state and not state.held:
                    return await _finish(app, worker, running, recorded)
                await asyncio.sleep(CHECK_INTERVAL)
            pending = await _pending(conn, statements["pending_jobs"], served, retries)
    except BaseException:
        worker.grace_period = 0.0
        await _stop(worker, running)
        raise
    # A test that ran out of time should not wait out its handlers too.
    worker.grace_period = 0.0
    runs = await _finish(app, worker, running, recorded)
    raise NotIdleError(_message(timeout, *pending, runs), pending[0], runs)


async def _stop(worker: Worker, running: asyncio.Task[None]) -> None:
    if worker.state is None:  # still connecting: nothing to stop gracefully yet
        running.cancel()
    else:
        worker.stop()
    await asyncio.gather(running, return_exceptions=True)


async def _pending(
    conn: psycopg.AsyncConnection[Any], statement: bytes, queues: list[str] | None, retries: bool
) -> tuple[list[PendingJob], int]:
    """The first few jobs that keep the drain going, and how many there are."""
    cur = await conn.execute(statement, {"queues": queues, "limit": SHOWN, "retries": retries})
    rows = await cur.fetchall()
    jobs = [
        PendingJob(int(r[0]), str(r[1]), str(r[2]), Status(r[3]), int(r[4]), r[5]) for r in rows
    ]
    return jobs, int(rows[0][6]) if rows else 0


async def _finish(
    app: App,
    worker: Worker,
    running: asyncio.Task[None],
    recorded: list[tuple[ClaimedJob, Outcome]],
) -> Runs:
    """Stop the worker (raising its error, if it failed) and return what ran."""
    worker.stop()
    await running
    runs = Runs()
    stored: dict[int, Any] = {}
    if any(o.written is not None and o.status is Status.SUCCEEDED for _, o in recorded):
        # The handler's own transaction stored these results with its ack: read them back.
        conn = await db.connect_async(app.dsn, **app.connect_options)
        async with conn:
            for _, outcome in recorded:
                if outcome.written is not None:
                    cur = await conn.execute(app.q.get_job, {"id": outcome.job_id})
                    row: Any = await cur.fetchone()
                    stored[outcome.job_id] = None if row is None else row[13]
    for job, outcome in recorded:
        if outcome.result is not None:
            result = json.loads(outcome.result)
        else:
            result = stored.get(outcome.job_id)
        runs.append(
            Run(job.id, job.task, job.args, job.attempt, outcome.status, result, outcome.error)
        )
    return runs


def _message(timeout: float, jobs: list[PendingJob], total: int, runs: Runs) -> str:
    shown = "; ".join(str(job) for job in jobs)
    more = f"; and {total - len(jobs)} more" if total > len(jobs) else ""
    return (
        f"not idle after {timeout:g} s: {total} job(s) still running or due: {shown}{more} "
        f"({len(runs)} attempt(s) ended before the worker was stopped)"
    )
